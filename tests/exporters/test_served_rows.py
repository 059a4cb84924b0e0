"""exporters/served_rows.py on hand-checkable cases: which rows a served layer holds as sink, encoded and residual
at every length; the flush unit of K's and V's groups; a sliding layer's first row; the elementwise form the
evaluation uses equals the int form the cache and the ledger use."""
import pytest
import torch

from exporters.codec import CachePolicy, TensorPolicy
from exporters.served_rows import LayerRows, flush_unit, layer_rows, scale_group

TOKEN = TensorPolicy(format="uniform", bits=4, axis="token")
KIVI_KEY = TensorPolicy(format="uniform", bits=4, axis="channel", group_size=4)
VALUE_GROUPS = TensorPolicy(format="uniform", bits=4, axis="channel", group_size=6)
NUQ_KEY = TensorPolicy(format="nuq", bits=4, axis="channel")  # static per-channel ranges: no row groups


def test_scale_groups_and_the_flush_unit():
    assert [scale_group(p) for p in (TOKEN, KIVI_KEY, VALUE_GROUPS, NUQ_KEY, TensorPolicy())] == [1, 4, 6, 1, 1]
    assert flush_unit(KIVI_KEY, TOKEN) == 4      # KIVI: the key's group, as always
    assert flush_unit(TOKEN, VALUE_GROUPS) == 6  # per-channel value groups count too
    assert flush_unit(KIVI_KEY, VALUE_GROUPS) == 12
    assert flush_unit(TOKEN, TOKEN) == 1


def test_sink_encoded_and_residual_rows_at_every_length():
    """n_sink 2, residual 3, unit 4: after the 2 sink rows, rows wait until the buffer holds 3 + 4 = 7, then the
    oldest 4 are encoded (3..6 rows stay recent)."""
    rows = LayerRows(n_sink=2, residual=3, key_group=4)
    table = {t: (rows.sink_end(t), rows.encoded_end(t)) for t in range(0, 16)}
    assert table == {0: (0, 0), 1: (1, 1), 2: (2, 2), 3: (2, 2), 4: (2, 2), 5: (2, 2), 6: (2, 2), 7: (2, 2),
                     8: (2, 2), 9: (2, 6), 10: (2, 6), 11: (2, 6), 12: (2, 6), 13: (2, 10), 14: (2, 10), 15: (2, 10)}
    held = rows.held(13)
    assert (held.n_sink, held.n_encoded, held.n_residual, held.n_full_precision) == (2, 8, 3, 5)
    no_buffer = LayerRows(n_sink=1, residual=0)
    assert not no_buffer.holds_back and [no_buffer.encoded_end(t) for t in range(5)] == [0, 1, 2, 3, 4]
    assert LayerRows(n_sink=0, residual=0, value_group=2).holds_back


def test_the_flush_rule_applied_step_by_step_is_the_closed_form():
    """A buffer flushed after every chunk keeps recent(rows so far): recent(recent(a) + b) == recent(a + b)."""
    g = torch.Generator().manual_seed(0)
    for rows in (LayerRows(1, 3, 4, 1), LayerRows(0, 0, 1, 6), LayerRows(2, 5, 4, 6), LayerRows(0, 2, 1, 1)):
        buffered = arrived = 0
        for n in torch.randint(1, 9, (60,), generator=g).tolist():
            arrived += n
            buffered += n
            out = rows.flush(buffered)
            assert out % rows.unit == 0 and 0 <= out <= buffered
            buffered -= out
            assert buffered == rows.recent(arrived)
            assert rows.residual <= buffered < rows.residual + rows.unit or arrived < rows.residual + rows.unit


def test_the_elementwise_form_is_the_int_form():
    """The evaluation asks per query q for the cache of length q + 1 at once (integer tensors)."""
    for rows in (LayerRows(3, 5, 4, 1), LayerRows(0, 0, 1, 1), LayerRows(1, 0, 1, 6)):
        t = torch.arange(0, 40)
        assert rows.encoded_end(t).tolist() == [rows.encoded_end(int(x)) for x in t]
        assert rows.recent(t).tolist() == [rows.recent(int(x)) for x in t]


def test_a_sliding_layer_keeps_its_window_and_whole_units():
    """window 8, n_sink 1, residual 2, unit 4: at length t the first position held is t - 8, rounded down to
    1 + 4k when it falls in the encoded rows; sink rows leave one by one."""
    rows = LayerRows(n_sink=1, residual=2, key_group=4, window=8)
    assert rows.min_window == 6 and rows.visible_from(20) == 13 and LayerRows(1, 2).visible_from(20) == 0
    assert [rows.first_held(t) for t in (5, 8, 9, 12, 13, 16, 20)] == [0, 0, 1, 1, 5, 5, 9]
    held = rows.held(20)  # encoded rows 1..16 (recent 17..19): from 9, the units 9..12, 13..16
    assert (held.start, held.n_sink, held.n_encoded, held.n_residual) == (9, 0, 8, 3)
    assert rows.keep_from(0, 20) == 0 and rows.keep_from(18, 20) == 18  # a residual row: itself
    assert LayerRows(n_sink=4, residual=1, window=6).held(7) == LayerRows(4, 1, window=6).held(7, start=1)


def test_layer_rows_of_a_policy():
    """A prefix's P rows are sink rows: S = max(n_sink, prefix_len); each layer's own groups."""
    policy = CachePolicy("p", [(KIVI_KEY, TOKEN), (TOKEN, VALUE_GROUPS)], n_sink=1, residual=8,
                         prefix_ids=torch.tensor([5, 6, 7]), prefix_len=3)
    assert layer_rows(policy, 0) == LayerRows(n_sink=3, residual=8, key_group=4, value_group=1)
    assert layer_rows(policy, 1, window=32) == LayerRows(3, 8, 1, 6, window=32)
    with pytest.raises(ValueError, match="LayerRows.value_group must be >= 1, got 0"):
        LayerRows(0, 0, value_group=0)
