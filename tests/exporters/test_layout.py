"""The stored byte layout (exporters/layout.py): bytes that decode as the codec's output, exactly the size model's
bits (exporters.codec.encoded_bits, what exporters/ledger.py predicts from), slices of rows that decode as
those rows of the whole, and pages that grow without moving what they hold."""
import pytest
import torch

from exporters.codec import TensorPolicy, decode, encode, encoded_bits
from exporters.layout import PagedRows, append, join, load, slice_rows, store

BOOK4 = torch.linspace(-1, 1, 16)


@pytest.mark.parametrize("p", [
    TensorPolicy(format="uniform", bits=3, axis="token"),
    TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4),
    TensorPolicy(format="nuq", bits=4, axis="token", codebook=BOOK4, outlier_fraction=0.05),
    TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=torch.tensor(0.01)),
    TensorPolicy(),
])
def test_stored_bytes_decode_like_the_codec(p):
    x = torch.randn(2, 3, 8, 16, generator=torch.Generator().manual_seed(0))
    e = encode(x, p)
    block = store(e, p, start=5)
    assert torch.equal(decode(load(block, p), p), decode(e, p))
    # appending rows block by block decodes like encoding them separately
    first, second = encode(x[:, :, :4], p), encode(x[:, :, 4:], p)
    merged = append(store(first, p, 5), store(second, p, 9))
    assert torch.equal(decode(load(merged, p), p), torch.cat([decode(first, p), decode(second, p)], 2))
    if p.format in ("uniform", "nuq"):
        assert block.tensors["codes"].dtype == torch.uint8 and block.tensors["codes"].shape[-1] == 16 * p.bits // 8


@pytest.mark.parametrize("p", [
    TensorPolicy(format="uniform", bits=3, axis="token"),
    TensorPolicy(format="uniform", bits=2, axis="channel", group_size=3),
    TensorPolicy(format="uniform", bits=4, axis="token", outlier_fraction=0.05),
    TensorPolicy(format="nuq", bits=3, axis="token", codebook=torch.linspace(-1, 1, 8), outlier_fraction=0.05),
    TensorPolicy(format="nuq", bits=2, axis="channel", codebook=torch.linspace(-1, 1, 4), zero=torch.zeros(3, 5),
                 range=torch.ones(3, 5)),
    TensorPolicy(format="fp8", bits=8, axis="head", fp8_scale=torch.full((3,), 0.01)),
    TensorPolicy(),
])
def test_stored_bytes_are_the_size_model(p):
    """What the cache stores, measured, is what codec.encoded_bits counts (d=5: codes do not fill whole bytes)."""
    x = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(0))
    e = encode(x, p)
    assert store(e, p, start=0).nbytes * 8 == encoded_bits(e, p)


@pytest.mark.parametrize("p", [
    TensorPolicy(format="uniform", bits=3, axis="token"),
    TensorPolicy(format="uniform", bits=2, axis="channel", group_size=4),
    TensorPolicy(format="nuq", bits=4, axis="token", codebook=torch.linspace(-1, 1, 16), outlier_fraction=0.05),
    TensorPolicy(format="nuq", bits=3, axis="channel", codebook=torch.linspace(-1, 1, 8), zero=torch.zeros(3, 16),
                 range=torch.ones(3, 16), lower=-torch.ones(3, 16), upper=torch.ones(3, 16), outlier_fraction=0.05),
    TensorPolicy(format="fp8", bits=8, axis="head", fp8_scale=torch.full((3,), 0.01)),
    TensorPolicy(),
])
def test_a_slice_of_stored_rows_decodes_like_those_rows_of_the_whole(p):
    x = 1.5 * torch.randn(2, 3, 23, 16, generator=torch.Generator().manual_seed(0))
    block = store(encode(x, p), p, start=5)
    whole = decode(load(block, p), p)
    if "outlier_count" in block.tensors:
        assert block.tensors["outlier_value"].numel() > 10
    for a, b in ((0, 4), (4, 12), (8, 23), (12, 13), (20, 23), (0, 23)):
        part = slice_rows(block, a, b, p)
        assert part.start == 5 + a and part.shape == (2, 3, b - a, 16)
        assert torch.equal(decode(load(part, p), p), whole[:, :, a:b]), (a, b)
        assert part.nbytes < block.nbytes or (a, b) == (0, 23)  # views of the slice only
    if p.format == "uniform" and p.axis == "channel":
        with pytest.raises(ValueError, match="must start on a group boundary"):
            slice_rows(block, 3, 9, p)



def test_a_page_outgrowing_its_outlier_slots_moves_its_own_lists_only():
    """Outlier slots are sized from the rate seen so far; rows with more outliers than the open page has slots
    for move that page's two outlier lists to a larger buffer -- nothing else moves, and the bytes are still
    those of one block."""
    ones = torch.ones(2, 8)
    p = TensorPolicy(format="nuq", bits=4, axis="channel", outlier_fraction=0.01, codebook=BOOK4,
                     zero=0 * ones, range=ones, lower=-ones, upper=ones)
    x = 0.1 * torch.randn(1, 2, 12, 8, generator=torch.Generator().manual_seed(0))  # inliers
    x[:, :, 9, :5] = 3.0                                                              # a row of 10 outliers
    rows = PagedRows(p, page=8)
    for a, b in ((0, 8), (8, 9), (9, 10), (10, 12)):
        if a == 9:
            full = {name: t.data_ptr() for name, t in rows.sealed[0].tensors.items()}
            slots, codes = rows.open.out_cap, rows.open.buf["codes"].data_ptr()
            assert slots < 10
        rows.write(store(encode(x[:, :, a:b], p), p, a))
    assert {name: t.data_ptr() for name, t in rows.sealed[0].tensors.items()} == full
    assert rows.open.buf["codes"].data_ptr() == codes and rows.open.out_cap >= 10 > slots
    whole = store(encode(x, p), p, 0)
    assert all(torch.equal(join(rows.pages()).tensors[k], whole.tensors[k]) for k in whole.tensors)
    assert rows.nbytes == whole.nbytes and rows.reserved_bytes() > 0
