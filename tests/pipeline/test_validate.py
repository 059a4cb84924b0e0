"""One validation pass (pipeline.config.validate_run) over every config of a run, before anything loads: each bad
value is refused as an exporters.errors.InputError (the one base class of refused input) naming the field, with
the model never loaded (its path does not exist) and no cache entry or run folder written."""
import pytest

from exporters.codec import CodecError
from exporters.errors import InputError
from exporters.manifest import ManifestError
from pipeline.app import run_pipeline
from pipeline.config import ModelConfig, RunConfig, load_recipe
from pipeline.errors import UserError, user_errors
from stages.base import NonFiniteError

NOT_LOADED = ModelConfig(source="local", path="/nonexistent/kvcalib-test-model")  # loading it would fail


def _bad(edit):
    cfg = RunConfig(model=NOT_LOADED, quant=load_recipe("kvquant-3b-1pct+smooth+prefix"))
    edit(cfg)
    return cfg


CASES = [
    (lambda c: setattr(c.data, "seq_len", 1), r"data\.seq_len must be >= 2 tokens, got 1"),
    (lambda c: setattr(c.data, "source", "web"), r"data\.source must be one of \('embedded', 'local', 'hub'\), got 'web'"),
    (lambda c: setattr(c.quant, "key_rope", "mid"), r"quant\.key_rope must be one of \('pre', 'post'\), got 'mid'"),
    (lambda c: setattr(c.fisher, "recompute", "sometimes"), r"fisher\.recompute must be one of .*got 'sometimes'"),
    (lambda c: setattr(c.codebooks, "weighting", "uniform"), r"weighting"),
    (lambda c: setattr(c.smooth, "alpha", 2.0), r"smooth\.alpha must be in \[0, 1\], got 2\.0"),
    (lambda c: setattr(c.prefix, "eta", 0.5), r"prefix\.eta must be > 1"),
    (lambda c: setattr(c.eval, "perturb_scale", -1.0), r"eval\.perturb_scale must be >= 0.*got -1\.0"),
    (lambda c: setattr(c.eval, "perturb_seeds", [1, -2]), r"eval\.perturb_seeds must be integers >= 0, got \[1, -2\]"),
    (lambda c: setattr(c.check, "contexts", [0]), r"check\.contexts: each context must be in \[1\].*got 0"),
    (lambda c: setattr(c.sensitivity, "n_windows", 0), r"sensitivity\.n_windows must be >= 1, got 0"),
    (lambda c: (setattr(c.eval, "enabled", False), setattr(c.gate, "enabled", True)),
     r"gate\.enabled=true needs eval\.enabled=true"),
    (lambda c: setattr(c.eval, "recipes", ["fp16", "no-such-recipe"]), r"quant recipe must be one of .*'no-such-recipe'"),
    (lambda c: setattr(c.llamacpp, "types", ["q4_0", "q3_k"]), r"llamacpp\.types: unknown cache type 'q3_k'"),
    (lambda c: (setattr(c.llamacpp, "types", ["q4_0"]), setattr(c.llamacpp, "python", "/nowhere/python")),
     r"llamacpp\.python: no llama.cpp environment at /nowhere/python"),
]


@pytest.mark.parametrize("edit,pattern", CASES)
def test_a_bad_value_is_refused_before_anything_loads(tmp_path, edit, pattern):
    cfg = _bad(edit)
    cfg.cache_dir = str(tmp_path / "cache")
    with pytest.raises(InputError, match=pattern) as exc:
        run_pipeline(cfg, tmp_path / "run", log=lambda _m: None, show_progress=False)
    assert isinstance(exc.value, user_errors())
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_one_base_class_for_bad_input():
    """UserError, the stages', the codec's and the manifest's refusals share exporters.errors.InputError, so the
    command line maps every one of them to EXIT_USER by one rule."""
    for cls in (UserError, NonFiniteError, CodecError, ManifestError):
        assert issubclass(cls, InputError), cls
    assert InputError in user_errors()
