"""`kvcalib check` against artifacts built to game it (issue 68): each case an artifact a stranger could ship --
edited, re-signed as a tool that recomputes every checksum writes it (bench.manifest_mutations.resign, the tensor
file's header rebuilt from the edited manifest) -- and the verdict `check` must give it. bench/manifest_mutations.py
asks whether the loaders refuse what no decoder can use; this asks whether the verdict can be talked into "passed".

Cases (each judged by `kvcalib check FOLDER ...` as a user types it, in this process: pipeline.cli.main):
- honest: the artifact as its run wrote it -> exit 0;
- prefix_poison: one prefix token's stored K = V = 1e4, its run's canary claim removed, judged with
  allow_unclaimed=true (so the limits and the prefix comparison alone must see it) -> exit 1;
- canary_switch_off: layer 0's value side re-declared KIVI-style (uniform per channel) with a group of the model's
  positions -- a flush unit that never fills, which used to push the canary's warm-up past the model and switch it
  off -- and every other layer's key range x 0 -> exit 1 or 2;
- random_twin: model.source re-pointed to a random `tiny` model (and model.sha256 to another value) -> exit 2 (a random
  model is never followed unasked);
- huge_random: model.source a `tiny` model of 1024 layers of hidden size 65536, and the user asks for it
  (model.source=tiny) -> exit 2 before anything is allocated;
- redeclared_bits: every nuq side re-declared at 2 bits (codebook cut to 4 of its levels), its run's claim kept ->
  exit 1 (the claim, measured on the honest artifact, is not what it does); on a random model (--tiny), whose flat
  logits give every cache a KL near 1e-5, only "not exit 5" is required;
- claim_deleted: runtime_check.canary removed -> exit 1 (a claim is required unless the user allows none);
- equal_bounds: every layer's outlier bounds lower == upper (each key entry an outlier) -> exit 0 or 1: it loads
  (equal bounds are a constant channel's, Gemma 3 has them), and the serving cache holds at most (1 + OUTLIER_MARGIN)
  x the declared outliers, the rest clamped to their bounds (serving/cache.py), so storage stays bounded;
- subnormal_scale / subnormal_smoothing: an fp8 scale of 1e-45, a smoothing factor of 1e-40 -> exit 2 (refused at
  load);
- escaped_names: model name and a recorded path holding a terminal escape and a newline -> any exit but 5, and no
  escape character reaches the output.

Graded poisons (`--poisons`), the run's claims kept, each measured for what it serves: every layer's key range x 0.9,
x 0.7, x 0.5; adjacent codebook levels swapped; zero shifted by a tenth of the range; channels permuted (the
calibrated per-channel tensors rolled by one within each head). For each: `check`'s verdict and the perplexity ratio
to fp16 on the evaluation windows through stages/evaluate.py (the serving order's own emulation), beside the
honest artifact's -- so the worst artifact `check` still passes is a printed figure.

    python -m bench.check_verdicts --artifact DIR [--artifact DIR ...] [--check-args ARG ...] [--poisons]
        [--text FILE --windows N --seq-len L] [--json PATH]
    python -m bench.check_verdicts --tiny [--json PATH]     # builds the tiny model's artifacts (CI)

Exits 1 if any case gets another verdict than it must, or any call exits 5.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import json
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load as load_safetensors

from exporters import manifest as mf
from exporters.artifact import MANIFEST_FILE

TINY_RECIPES = ("kvquant-4b+sink16+recent128", "kvquant-3b-1pct+smooth+prefix", "fp8-e4m3")
ESC = "\x1b"


@dataclasses.dataclass
class Case:
    name: str
    expect: tuple[int, ...]                  # the exit codes the verdict must be one of
    edit: Callable[[dict, dict], str | None]  # (manifest, tensors) edited in place -> None, or why not applicable
    args: tuple[str, ...] = ()
    user_model: bool = True                  # append the bench's --check-args (the user's model arguments)
    quality: bool = False                    # seen only through the canary's KL: a random model's flat logits cannot
                                             # show it (judged on a pretrained model; on a random one: any but 5)


def resigned(manifest: dict, tensors: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    """Both files as a re-signing tool writes them: tensors listed and hashed, the header's bound fields rebuilt from
    the edited manifest, the tensor file hashed, the manifest signed."""
    from bench.manifest_mutations import resign

    return resign(manifest, tensors, mf.bound_metadata(manifest))


def _sides(manifest: dict):
    for layer in manifest["layers"]:
        for kind in ("key", "value"):
            yield layer["index"], kind, layer[kind]


def _scale_role(manifest: dict, tensors: dict, role: str, fn) -> int:
    """fn applied to every layer's `role` tensor (e.g. range) of the key side -> how many were edited."""
    n = 0
    for i, kind, side in _sides(manifest):
        name = side["tensors"].get(role)
        if kind == "key" and name:
            tensors[name] = fn(tensors[name].clone(), side)
            n += 1
    return n


# ---- the gaming cases ---------------------------------------------------------------------------------------------

def prefix_poison(m: dict, t: dict) -> str | None:
    prefix = m["cache"]["prefix"]
    if not prefix:
        return "no prefix"
    for side in ("k", "v"):
        name = prefix["tensors"][side]
        x = t[name].clone()
        x[:, :, 0, :] = 1e4
        t[name] = x
    m["runtime_check"].pop("canary", None)
    return None


def canary_switch_off(m: dict, t: dict) -> str | None:
    first = m["layers"][0]["value"]
    for name in first["tensors"].values():
        t.pop(name, None)
    m["layers"][0]["value"] = {"format": "uniform", "bits": first["bits"], "axis": "channel",
                               "group_size": m["model"]["max_positions"], "zero_point": "min",
                               "outliers": {"fraction": 0.0, "rule": "none"}, "tensors": {}}
    for layer in m["layers"][1:]:
        name = layer["key"]["tensors"].get("range")
        if name:
            t[name] = torch.zeros_like(t[name])
    return None


def random_twin(m: dict, t: dict) -> str | None:
    src = m["model"].get("source") or {}
    settings = copy.deepcopy(src.get("settings") or {})
    settings["source"] = "tiny"
    settings["tiny"] = dict(settings.get("tiny") or {}, n_layers=m["model"]["n_layers"],
                            n_q_heads=m["model"]["n_q_heads"], n_kv_heads=m["model"]["n_kv_heads"],
                            head_dim=m["model"]["head_dim"])
    m["model"]["source"] = {"kind": "tiny", "path": "", "revision": None, "config": "tiny", "settings": settings}
    m["model"]["sha256"] = "0" * 63 + "1"
    return None


def huge_random(m: dict, t: dict) -> str | None:
    random_twin(m, t)
    m["model"]["source"]["settings"]["tiny"].update(n_layers=1024, hidden_size=65536, intermediate_size=4 * 65536)
    return None


def redeclared_bits(m: dict, t: dict) -> str | None:
    n = 0
    for _, _, side in _sides(m):
        if side["format"] == "nuq" and side["bits"] > 2:
            name = side["tensors"]["codebook"]
            levels = t[name]
            keep = torch.linspace(0, levels.shape[-1] - 1, 4).round().long()
            t[name] = levels[..., keep].contiguous()
            side["bits"] = 2
            n += 1
    return None if n else "no nuq side above 2 bits"


def claim_deleted(m: dict, t: dict) -> str | None:
    if not (m.get("runtime_check") or {}).get("canary"):
        return "no canary claim"
    m["runtime_check"].pop("canary")
    return None


def equal_bounds(m: dict, t: dict) -> str | None:
    for _, kind, side in _sides(m):
        if "lower" in side["tensors"]:
            t[side["tensors"]["upper"]] = t[side["tensors"]["lower"]].clone()
            return None
    return "no outlier bounds"


def subnormal_scale(m: dict, t: dict) -> str | None:
    for _, kind, side in _sides(m):
        if side["format"] == "fp8" and "fp8_scale" in side["tensors"]:
            name = side["tensors"]["fp8_scale"]
            x = t[name].clone()
            x.reshape(-1)[0] = 1e-45
            t[name] = x
            return None
    return "no fp8 scale"


def subnormal_smoothing(m: dict, t: dict) -> str | None:
    if not m["cache"]["smoothing"]:
        return "no smoothing"
    name = m["cache"]["smoothing"]["tensor"]
    x = t[name].clone()
    x.reshape(-1)[0] = 1e-40
    t[name] = x
    return None


def escaped_names(m: dict, t: dict) -> str | None:
    m["model"]["name"] = f"evil{ESC}[2J{ESC}]0;pwned\x07\nname"
    return None


CASES = (
    Case("honest", (0,), lambda m, t: None),
    Case("prefix_poison", (1,), prefix_poison, ("allow_unclaimed=true",)),
    Case("canary_switch_off", (1, 2), canary_switch_off),
    Case("random_twin", (2,), random_twin, user_model=False),
    Case("huge_random", (2,), huge_random, ("model.source=tiny",), user_model=False),
    Case("redeclared_bits", (1,), redeclared_bits, quality=True),
    Case("claim_deleted", (1,), claim_deleted),
    Case("equal_bounds", (0, 1), equal_bounds),
    Case("subnormal_scale", (2,), subnormal_scale),
    Case("subnormal_smoothing", (2,), subnormal_smoothing),
    Case("escaped_names", (0, 1, 2), escaped_names),
)


# ---- the graded poisons (claims kept) -----------------------------------------------------------------------------

def _range_times(f: float):
    def edit(m: dict, t: dict) -> str | None:
        return None if _scale_role(m, t, "range", lambda x, _s: x * f) else "no key range"
    return edit


def codebook_swap(m: dict, t: dict) -> str | None:
    n = 0
    for _, kind, side in _sides(m):
        name = side["tensors"].get("codebook")
        if kind == "key" and name:
            x = t[name].clone()
            mid = x.shape[-1] // 2
            x[..., [mid - 1, mid]] = x[..., [mid, mid - 1]]
            t[name] = x
            n += 1
    return None if n else "no key codebook"


def zero_shift(m: dict, t: dict) -> str | None:
    n = 0
    for _, kind, side in _sides(m):
        if kind == "key" and "zero" in side["tensors"] and "range" in side["tensors"]:
            t[side["tensors"]["zero"]] = t[side["tensors"]["zero"]] + 0.1 * t[side["tensors"]["range"]]
            n += 1
    return None if n else "no key zero"


def channel_permutation(m: dict, t: dict) -> str | None:
    n = 0
    for _, kind, side in _sides(m):
        if kind != "key" or side["axis"] != "channel":
            continue
        for role in ("zero", "range", "lower", "upper"):
            name = side["tensors"].get(role)
            if name:
                t[name] = torch.roll(t[name], 1, dims=-1).contiguous()
                n += 1
    return None if n else "no per-channel key tensors"


POISONS = (
    Case("range_x0.9", (), _range_times(0.9)),
    Case("range_x0.7", (), _range_times(0.7)),
    Case("range_x0.5", (), _range_times(0.5)),
    Case("codebook_swap", (), codebook_swap),
    Case("zero_shift", (), zero_shift),
    Case("channel_permutation", (), channel_permutation),
)


# ---- running them -------------------------------------------------------------------------------------------------

def write_case(src: Path, case: Case, dst: Path) -> str | None:
    """The artifact at `src` edited by `case` into folder `dst` (re-signed) -> None, or why the case does not apply."""
    manifest = json.loads((src / MANIFEST_FILE).read_bytes())
    tensors = load_safetensors((src / mf.TENSOR_FILE).read_bytes())
    why = case.edit(manifest, tensors)
    if why:
        return why
    raw_manifest, raw_tensors = resigned(manifest, tensors)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    (dst / MANIFEST_FILE).write_bytes(raw_manifest)
    (dst / mf.TENSOR_FILE).write_bytes(raw_tensors)
    return None


_MODELS: dict[str, object] = {}


def _memoized_models() -> None:
    """pipeline.model.load_model memoized by its config for this process: `check` loads the model it judges on for
    every call, and what this bench tests is the verdict, not the loading (a model is never changed by a check)."""
    from pipeline import model as pm

    real = getattr(pm.load_model, "__wrapped__", pm.load_model)

    def load(cfg):
        key = repr(cfg)
        if key not in _MODELS:
            _MODELS[key] = real(cfg)
        return _MODELS[key]

    load.__wrapped__ = real
    pm.load_model = load


def run_check_cli(folder: Path, args: list[str]) -> tuple[int, str]:
    """`kvcalib check FOLDER ARGS` in this process -> (exit code, stdout + stderr)."""
    from pipeline import cli

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            cli.main(["check", str(folder), *args, "--out", str(folder.parent / f"{folder.name}.check.json")])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        except Exception as exc:  # noqa: BLE001 -- an exception escaping the CLI is what exit 5 reports
            out.write(f"\n{type(exc).__name__}: {exc}")
            code = 5
    return code, out.getvalue()


def reason(output: str) -> str:
    """The line of the output that says why: a refusal, the canary's verdict, or the kernels' failure."""
    for key in ("error:", "quality canary (", "runtime check FAILED", "runtime check passed"):
        for line in output.splitlines():
            if key in line:
                return line.strip()[:300]
    return output.strip().splitlines()[-1][:300] if output.strip() else ""


def judge(src: Path, cases, work: Path, user_args: list[str], log=print) -> list[dict]:
    rows = []
    kind = ((json.loads((src / MANIFEST_FILE).read_bytes())["model"].get("source") or {}).get("kind"))
    for case in cases:
        if case.quality and kind in ("tiny", "shape"):
            case = dataclasses.replace(case, expect=())
        folder = work / case.name
        why = write_case(src, case, folder)
        if why:
            rows.append({"case": case.name, "applies": False, "why": why})
            log(f"  {case.name:<22} n/a ({why})")
            continue
        args = [*(user_args if case.user_model else []), *case.args]
        start = time.perf_counter()
        code, output = run_check_cli(folder, args)
        row = {"case": case.name, "applies": True, "args": args, "exit": code, "expect": list(case.expect),
               "ok": (code in case.expect) if case.expect else code != 5, "reason": reason(output),
               "escape_in_output": ESC in output, "seconds": round(time.perf_counter() - start, 1)}
        if case.name == "escaped_names" and row["escape_in_output"]:
            row["ok"] = False
        rows.append(row)
        log(f"  {case.name:<22} exit {code} (must be {'/'.join(map(str, case.expect)) or 'any but 5'}) "
            f"{'ok' if row['ok'] else 'WRONG'} {row['seconds']:>6.1f} s  {row['reason']}")
    return rows


def served_ratios(src: Path, work: Path, names: list[str], windows: torch.Tensor, lm) -> dict[str, dict]:
    """Perplexity ratio to fp16 (95% CI) of the honest artifact and each poisoned folder that loads, on `windows`,
    through stages/evaluate.py (the serving order's emulation) in one pass."""
    from exporters.codec import CachePolicy, TensorPolicy
    from exporters.native import load_artifact
    from stages import evaluate

    policies, out = [], {}
    for name in names:
        folder = src if name == "honest" else work / name
        try:
            policy = load_artifact(folder).policy
        except mf.ManifestError as exc:
            out[name] = {"refused_at_load": str(exc)[:200]}
            continue
        policies.append(dataclasses.replace(policy, name=name))
    fp16 = CachePolicy("fp16", [(TensorPolicy(), TensorPolicy()) for _ in range(lm.spec.n_layers)])
    result = evaluate.fit(evaluate.Inputs(lm.model, lm.spec, windows, [fp16, *policies]),
                          evaluate.EvalConfig(recipes=[]))
    for p in policies:
        r = result.meta["recipes"][p.name]
        out[p.name] = {"ppl_ratio": r["ppl_ratio"], "ppl_ratio_ci95": r.get("ppl_ratio_ci95")}
    return out


def eval_windows(lm, text: str | None, n: int, length: int) -> torch.Tensor:
    from pipeline.check import eval_ids
    from pipeline.data import consecutive_windows, tokenize

    if text is None:
        return eval_ids(lm.tokenizer, n, length)
    return consecutive_windows(tokenize(lm.tokenizer, Path(text).read_text()), n, length, what="check_verdicts")


def build_tiny(directory: Path, log=print) -> list[Path]:
    from bench.manifest_mutations import build_originals

    build_originals(directory, list(TINY_RECIPES), log=log)
    return [directory / r / "artifact" for r in TINY_RECIPES]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.check_verdicts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", action="append", default=[], help="an artifact folder (repeatable)")
    ap.add_argument("--tiny", action="store_true", help="build the tiny model's artifacts and judge those (CI)")
    ap.add_argument("--check-args", nargs="*", default=[], help="the user's model arguments for check (model=..., "
                    "model.path=...); for --tiny: model.source=tiny")
    ap.add_argument("--cases", nargs="*", default=None, help="only these cases")
    ap.add_argument("--poisons", action="store_true", help="also the graded poisons with their served perplexity")
    ap.add_argument("--poison-cases", nargs="*", default=None, help="only these poisons (e.g. the ones check "
                    "passed, measured again on more windows)")
    ap.add_argument("--served", choices=("all", "passing"), default="all", help="serve every poison, or only the "
                    "ones check passes (the worst passing one is the figure; the protocol's windows cost)")
    ap.add_argument("--text", default=None, help="evaluation text for the poisons (default: the embedded text)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    _memoized_models()
    work = Path(tempfile.mkdtemp(prefix="check-verdicts-"))
    artifacts = [Path(a) for a in args.artifact]
    user_args = list(args.check_args)
    if args.tiny:
        artifacts += build_tiny(work / "built", log=lambda m: print(m, flush=True))
        user_args = user_args or ["model.source=tiny"]
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    report, bad = [], 0
    try:
        for src in artifacts:
            manifest = json.loads((src / MANIFEST_FILE).read_bytes())
            print(f"{src} ({manifest['recipe']}, {manifest['model']['name']}):", flush=True)
            rows = judge(src, cases, work / src.parent.name, user_args, log=lambda m: print(m, flush=True))
            entry = {"artifact": str(src), "recipe": manifest["recipe"], "model": manifest["model"]["name"],
                     "cases": rows}
            if args.poisons:
                chosen = [p for p in POISONS if args.poison_cases is None or p.name in args.poison_cases]
                prows = judge(src, chosen, work / src.parent.name, user_args, log=lambda m: print(m, flush=True))
                names = ["honest", *(r["case"] for r in prows
                                     if r["applies"] and (args.served == "all" or r["exit"] == 0))]
                from pipeline.check import model_config_for
                from pipeline.model import load_model

                cfg = model_config_for(manifest, [a for a in user_args if a.startswith("model.")],
                                       next((a[6:] for a in user_args if a.startswith("model=")), None))
                lm = load_model(cfg)
                windows = eval_windows(lm, args.text, args.windows, args.seq_len)
                start = time.perf_counter()
                ratios = served_ratios(src, work / src.parent.name, names, windows, lm)
                honest = ratios["honest"]["ppl_ratio"]
                print(f"  served perplexity on {windows.shape[0]} x {windows.shape[1]} tokens "
                      f"({time.perf_counter() - start:.0f} s): honest x{honest:.4f}", flush=True)
                print(f"  {'poison':<22} {'check':>6} {'ppl x fp16':>11} {'95% CI':>18} {'vs honest':>10}")
                passed_worst = 0.0
                for r in prows:
                    if not r["applies"]:
                        continue
                    got = ratios.get(r["case"], {})
                    if "ppl_ratio" in got:
                        rel = got["ppl_ratio"] / honest - 1
                        r.update(ppl_ratio=got["ppl_ratio"], ppl_ratio_ci95=got["ppl_ratio_ci95"], vs_honest=rel)
                        ci = got["ppl_ratio_ci95"] or [float("nan")] * 2
                        print(f"  {r['case']:<22} {'pass' if r['exit'] == 0 else 'FAIL':>6} {got['ppl_ratio']:>11.4f} "
                              f"[{ci[0]:.4f}, {ci[1]:.4f}] {100 * rel:>+9.2f}%")
                        if r["exit"] == 0:
                            passed_worst = max(passed_worst, rel)
                    elif r["case"] not in names:
                        print(f"  {r['case']:<22} {'FAIL' if r['exit'] else 'pass':>6}  not served (--served passing)")
                    else:
                        print(f"  {r['case']:<22} {'FAIL' if r['exit'] else 'pass':>6}  refused at load")
                if any(r["applies"] and r["exit"] == 0 for r in prows):
                    print(f"  worst poison check passes: {100 * passed_worst:+.2f}% perplexity beyond the honest "
                          f"artifact")
                else:
                    print("  no poison passes check")
                entry.update(poisons=prows, honest_ppl_ratio=ratios["honest"], worst_passed=passed_worst)
            bad += sum(not r["ok"] for r in rows if r["applies"])
            bad += sum(r.get("exit") == 5 for r in entry.get("poisons", []))
            report.append(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = sum(r["applies"] for e in report for r in e["cases"])
    print(f"check_verdicts: {total} cases judged, {bad} with another verdict than required or exit 5")
    if args.json:
        from exporters.files import atomic_write_json

        atomic_write_json(Path(args.json), {"artifacts": report, "wrong": bad})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
