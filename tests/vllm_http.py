"""A `vllm serve ...` line run as printed from .venv-vllm on 127.0.0.1 and asked for a completion over HTTP, and our own
cache's greedy decode to check a packed folder's tokens against (tests/test_readme.py, tests/pipeline/test_user_path.py)."""
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from bench.vllm_runs import DEFAULT_VLLM_PYTHON

VLLM_BIN = Path(DEFAULT_VLLM_PYTHON).parent / "vllm"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_and_complete(line: str, cwd: Path, timeout: float = 600.0) -> dict:
    """A README `vllm serve ...` line, as printed, from .venv-vllm's bin on 127.0.0.1 (a free port): waits until
    the server answers, asks it for a greedy completion of 8 tokens over HTTP, stops it -> the completion's JSON."""
    words = shlex.split(line)
    port = _free_port()
    log = cwd / f"vllm-serve-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the line's own --kv-cache-memory-bytes, not a leftover setting
    with open(log, "w") as out:
        proc = subprocess.Popen([str(VLLM_BIN)] + words[1:] + ["--host", "127.0.0.1", "--port", str(port)],
                                cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"{line}: exited {proc.returncode}\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"{line}: no answer in {timeout:.0f} s\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        body = json.dumps({"model": words[2], "prompt": "The capital of France is", "max_tokens": 8,
                           "temperature": 0, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def own_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    """Our own cache's greedy decode of the folder's artifact on its weights, the prompt one token at a time (what
    the plugin serves a prompt as: serving.blockwise.greedy_stepwise)."""
    from transformers import AutoModelForCausalLM

    from exporters.compressed_tensors import verify_checkpoint
    from serving.blockwise import greedy_stepwise

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return greedy_stepwise(model, verify_checkpoint(folder).policy, prompt, n)
