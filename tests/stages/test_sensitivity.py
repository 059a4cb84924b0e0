"""sensitivity.seq_len: the layer x position map taken on the first positions of its window (issue 50's lighter
default); the rest of the map's behaviour is tested in tests/stages/test_drift.py."""
import pytest
import torch

from exporters.codec import CachePolicy, TensorPolicy
from stages import sensitivity
from stages.base import InputError
from stages.sensitivity import SensitivityConfig

INT2 = TensorPolicy(format="uniform", bits=2, axis="token")


def test_the_map_on_the_first_positions_is_the_map_of_the_cut_window(tiny, tiny_windows):
    p = CachePolicy("int2", [(INT2, INT2)] * tiny.spec.n_layers, n_sink=1)
    cut = sensitivity.fit(sensitivity.Inputs(tiny.model, tiny.spec, tiny_windows.eval, p),
                          SensitivityConfig(n_windows=1, seq_len=20, buckets=[0, 16, 32]))
    short = sensitivity.fit(sensitivity.Inputs(tiny.model, tiny.spec, tiny_windows.eval[:, :20], p),
                            SensitivityConfig(n_windows=1, seq_len=0, buckets=[0, 16, 32]))
    whole = sensitivity.fit(sensitivity.Inputs(tiny.model, tiny.spec, tiny_windows.eval, p),
                            SensitivityConfig(n_windows=1, seq_len=0, buckets=[0, 16, 32]))
    assert cut.meta == short.meta and cut.meta["seq_len"] == 20 and cut.meta["bucket_edges"] == [0, 16]
    assert all(torch.equal(cut.tensors[k], short.tensors[k]) for k in short.tensors)
    assert whole.meta["seq_len"] == 48 and whole.meta["bucket_edges"] == [0, 16, 32]
    assert not torch.equal(whole.tensors["kl"], cut.tensors["kl"])  # the positions after 20 weigh in the whole map


@pytest.mark.parametrize("seq_len", [1, -4])
def test_a_map_window_below_two_positions_is_refused_naming_the_field(seq_len):
    with pytest.raises(InputError, match=rf"^sensitivity\.seq_len must be 0 \(the whole window\) or >= 2 positions, "
                                         rf"got {seq_len}$"):
        sensitivity.validate(SensitivityConfig(seq_len=seq_len))
    sensitivity.validate(SensitivityConfig(seq_len=0))
    sensitivity.validate(SensitivityConfig(seq_len=2))


def test_the_run_refuses_it_before_anything_loads():
    from pipeline.config import RunConfig, validate_run

    cfg = RunConfig()
    cfg.sensitivity.seq_len = 1
    with pytest.raises(InputError, match=r"^sensitivity\.seq_len must be 0"):
        validate_run(cfg)
