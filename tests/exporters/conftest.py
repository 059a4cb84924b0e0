import pytest


@pytest.fixture(scope="session")
def records():
    """Informative fields as the pipeline writes them: evaluation (stages/evaluate.py), runtime_check
    (pipeline/check.py), gate (stages/gate.py via pipeline/app.py). -> {field: value}"""
    each = {"max_abs_err": 1.5e-6, "max_rel_err": 3e-6, "worst_layer": 1, "ok": True}
    case = {"context": 16, "batch": 1, **each, "kernels": {"triton": each, "cpu": dict(each, max_rel_err=2e-6)}}
    return {
        "evaluation": {"fp16": {"ppl": 20.0, "kl": 0.0, "top1": 1.0, "avg_bits": 16.0, "outlier_fraction_k": 0.0,
                                "outlier_fraction_v": 0.0, "ppl_ratio": 1.0, "ppl_ratio_ci95": [1.0, 1.0]},
                       "int4-token": {"ppl": 21.5, "kl": 0.02, "top1": 0.93, "avg_bits": 4.5,
                                      "outlier_fraction_k": 0.0, "outlier_fraction_v": 0.0, "ppl_ratio": 1.075,
                                      "ppl_ratio_ci95": [1.01, 1.12], "ppl_seeds": [21.4, 21.6]}},
        "runtime_check": {"status": "passed", "max_abs_err": 1.5e-6, "max_rel_err": 3e-6,
                          "tolerance": {"atol": 1e-5, "rtol": 2e-4, "criterion": "max|kernel - oracle| <= ..."},
                          "reason": "float32 rounding", "device": "cpu (TRITON_INTERPRET=1)", "triton": "3.4.0",
                          "interpreter": True, "kernels": ["triton", "cpu"], "contexts": [16], "batches": [1],
                          "cases": [case], "kernel_s": 0.5,
                          "oracle_s": 0.2, "data": "embedded:pydoc_data.topics (evaluation half)",
                          "canary": {"tokens": 128, "warmup": 400, "kl": 0.0027, "agreement": 0.97,
                                     "baseline": "calibration-free", "baseline_kl": 0.0038,
                                     "baseline_agreement": 0.97, "limit": 0.0138, "recorded_kl": None, "ok": True,
                                     "reason": "passed: KL 0.0027 nats vs the calibration-free limit 0.0138"}},
        "gate": {"passed": False, "failures": ["perplexity ratio 1.0750 > max_ppl_ratio 1.05"],
                 "thresholds": {"max_ppl_ratio": 1.05, "max_cell_kl": 0.5, "min_cell_cos": 0.9,
                                "min_passkey_ratio": 0.9}},
    }
