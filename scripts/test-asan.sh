#!/usr/bin/env bash
# The C kernel's tests with the library built under AddressSanitizer (`make test-asan`; `make test` runs it once
# after the suite). KVCALIB_KERNEL_SANITIZE=address makes serving/cpu_attention.py build the library with
# -fsanitize=address (a library of its own: the flags enter its hash); python itself is not instrumented, so the
# sanitizer's runtime is preloaded and its leak checker is off (python's own allocations would be reported).
# tests/serving/test_cpu_attention_asan.py checks that the sanitized library is the one loaded and that an
# out-of-bounds read in it is reported. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
CC="${CC:-cc}"
lib="$("$CC" -print-file-name=libasan.so)"
if [ ! -f "$lib" ]; then
    echo "test-asan: $CC has no libasan.so (got '$lib'); install the compiler's AddressSanitizer runtime (Debian: libasan8)" >&2
    exit 2
fi
export KVCALIB_KERNEL_SANITIZE=address ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
# --capture=sys: an AddressSanitizer report (written to fd 2, then the process ends) reaches the terminal
LD_PRELOAD="$lib" exec .venv/bin/python -m pytest -q -p no:cacheprovider --capture=sys \
    tests/serving/test_cpu_attention.py tests/serving/test_untrusted_binding.py tests/serving/test_cpu_attention_asan.py "$@"
