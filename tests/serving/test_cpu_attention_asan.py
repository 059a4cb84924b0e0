"""The C kernel's tests under AddressSanitizer (`make test-asan`, once per `make test`: scripts/test-asan.sh runs
test_cpu_attention.py, test_untrusted_binding.py and this file with the library built with -fsanitize=address and
python preloaded with the sanitizer's runtime). This file proves that run has teeth: the library loaded is the
sanitized build, and an out-of-bounds read in it -- the library called without its wrapper's checks -- ends the
process with AddressSanitizer's report. Skipped outside that run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving import cpu_attention

pytestmark = pytest.mark.skipif(os.environ.get("KVCALIB_KERNEL_SANITIZE") != "address",
                                reason="run by `make test-asan` (KVCALIB_KERNEL_SANITIZE=address, libasan preloaded)")

ROOT = Path(__file__).resolve().parents[2]

# kvcalib_encode handed zero / range of ONE head for rows of two (what an artifact for another n_kv_heads gave it
# before serving.cache.bind and the wrapper's checks): the encoder reads 16 floats past each buffer's end
UNCHECKED_READ = """
import ctypes, torch
from serving import cpu_attention as ca
lib = ca._load()
h, d = 2, 16
x = torch.zeros(1, h, 1, d)
zero, rng = torch.zeros(1, d), torch.ones(1, d)            # the model has h = 2 heads: 16 entries short
mids = torch.linspace(-1, 1, 15)
codes = torch.zeros(h, d // 2, dtype=torch.uint8)
enc = ca._Enc(x.data_ptr(), 0, (ctypes.c_int64 * 4)(*x.stride()), 1, h, 1, d, 0, None, None, ca.FMT_NUQ, 4, 0, 0,
              mids.data_ptr(), zero.data_ptr(), rng.data_ptr(), 0, 0.0, 0.0, None, None, codes.data_ptr(), None,
              None, None, None, None, 0, 1)
print("returned", lib.kvcalib_encode(ctypes.byref(enc)))
"""


def test_the_library_is_the_sanitized_build():
    status = cpu_attention.status()
    assert status["available"], status
    record = Path(status["path"]).with_suffix(".txt").read_text()
    assert "-fsanitize=address" in record, record


def test_asan_reports_an_out_of_bounds_read_in_the_library():
    out = subprocess.run([sys.executable, "-c", UNCHECKED_READ], cwd=ROOT, env=os.environ, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0 and "returned" not in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in out.stderr, out.stderr[-2000:]
    assert "kvcalib_encode" in out.stderr, out.stderr[-2000:]
