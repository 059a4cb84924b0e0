import torch

from bench import eval_profile
from exporters import codec
from exporters.codec import CachePolicy, TensorPolicy
from stages import evaluate


def test_timed_parts_time_the_evaluation_and_restore_it(tiny, tiny_windows):
    """Every part a quantized unit goes through is timed, and the evaluation's own functions come back after."""
    before = {n: getattr(evaluate, n) for n in ("fake_quant", "quantized_attention", "sdpa_attention")}
    call = evaluate.Perturbation.__call__
    nuq = TensorPolicy(format="uniform", bits=2, axis="token", outlier_fraction=0.1)
    policy = CachePolicy("int2", [(nuq, nuq)] * tiny.spec.n_layers, key_rope="pre", n_sink=1)
    totals = eval_profile.defaultdict(float)
    with torch.no_grad(), eval_profile.timed_parts(totals):
        perturb = evaluate.Perturbation(1e-5, torch.Generator().manual_seed(1))
        evaluate.policy_hidden(tiny.model, tiny_windows.eval[:1], policy, None, perturb)
    for part in ("attention", "perturb", "codec", "outlier", "rope", "sdpa"):
        assert totals[part] > 0, part
    assert totals["attention"] >= totals["codec"] >= totals["outlier"]
    assert {n: getattr(evaluate, n) for n in before} == before and evaluate.Perturbation.__call__ is call
    assert codec.token_outlier_bounds.__name__ == "token_outlier_bounds"
