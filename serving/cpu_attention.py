"""The fused CPU decode kernel (serving/csrc/decode_attention.c): build, load, and call it on DecodeInputs.

The kernel reads one layer's cache where it lies -- the page table of serving/pages.py, the one the Triton
kernel reads, and the fp16 sink and residual rows -- and computes the new token's attention in one call: per tile
of rows it decodes the stored bytes (codes through the codebook or code * scale + zero, fp8 bytes through their
table, sparse outliers put back), multiplies keys by lambda, rotates pre-RoPE keys at their positions, and folds
the scores of the GQA group into an online softmax and the value sum (docs/serving.md). Work items run on the
process's OpenMP threads (torch's runtime: the library links libgomp.so.1, which torch has already loaded).
Rotated values (serving/inputs.py): the library returns the fp16 rows' and the pages' value sums apart
(split_v) and decode_attention un-rotates the second once per query head (inputs.finish).

Built once per machine by `python -m serving.cpu_attention build` (scripts/install.sh runs it): the system's
C compiler (`$CC`, else cc) with -O3 -march=native -fopenmp, into `$KVCALIB_KERNEL_DIR`, else
`<sys.prefix>/kvcalib-kernels` (the virtual environment), else `~/.cache/kvcalib/kernels`; the library's name
carries a hash of the source, the flags, the compiler's version and this CPU's model and feature flags, so a
changed source or another CPU builds anew (a -march=native library must not run on a CPU without its
instructions). The first use builds it if it is missing. When it cannot be built or loaded the block-wise torch
path (serving/blockwise.py) serves every step instead, and the reason is said once (stderr) at first use;
`status()` reports it.

What reaches the library is checked first (InputError naming the buffer, the shape the library reads and what was
given): every tensor behind a pointer -- queries, lambda, the RoPE table, the policies' static tensors (range / zero
[H_kv, D], fp8 scales [] or [H_kv], codebooks [2^bits]), each page's codes, scales and outlier lists, the sink and
residual rows -- against B, H_kv, D and the rows, in dtype and layout, before kvcalib_decode / kvcalib_encode runs;
what an index read from the data could still make out of bounds (a page past the RoPE table, a negative stored
outlier index) the library refuses itself, and its codes are turned into the same exception. Sparse outliers need
n_kv_heads * head_dim <= exporters.layout.MAX_ROW_ENTRIES (int16 indices). Only addresses given raw (the vLLM
plugin's page table and slots: its own cache) are taken as they are.

$KVCALIB_KERNEL_SANITIZE=address builds the library with AddressSanitizer (`make test-asan` runs the kernel's tests
so, python preloaded with libasan); the flags enter the library's hash, so it is a library of its own.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import torch

from exporters.errors import InputError
from exporters.layout import calibrated_shape, check_row_entries, pages_of
from serving import pages
from serving.inputs import DecodeInputs, finish, value_unrotation
from serving.pages import FMT_NUQ, FMT_UNIFORM, N_PAGE, SC_HEAD, SC_STATIC, fp8_lut, side_flags

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11")


SANITIZERS = {"address": ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")}


def flags() -> tuple[str, ...]:
    """FLAGS, with the target CPU from $KVCALIB_KERNEL_MARCH when set (default native; a test builds the
    library for a CPU without AVX-512 this way, so the scalar paths are checked on a machine that has it), and
    $KVCALIB_KERNEL_SANITIZE's flags when set (SANITIZERS: "address" for AddressSanitizer; the process must then
    preload the sanitizer's runtime, LD_PRELOAD=$(cc -print-file-name=libasan.so), as `make test-asan` does)."""
    march = os.environ.get("KVCALIB_KERNEL_MARCH")
    out = tuple(f"-march={march}" if f == "-march=native" and march else f for f in FLAGS)
    sanitize = os.environ.get("KVCALIB_KERNEL_SANITIZE")
    if sanitize:
        if sanitize not in SANITIZERS:
            raise OSError(f"KVCALIB_KERNEL_SANITIZE must be one of {sorted(SANITIZERS)}, got {sanitize!r}")
        out += SANITIZERS[sanitize]
    return out
ABI = 5
CHUNK = 512          # rows per work item: a page's rows are cut into runs of at most this many


class _Side(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int32), ("bits", ctypes.c_int32), ("smode", ctypes.c_int32),
                ("group", ctypes.c_int32), ("outliers", ctypes.c_int32), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p), ("lut", ctypes.c_void_p)]


class _Rows(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("ks", ctypes.c_int64 * 4),
                ("vs", ctypes.c_int64 * 4), ("n", ctypes.c_int64), ("first", ctypes.c_int64),
                ("ring", ctypes.c_int64)]


class _Enc(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("x_half", ctypes.c_int32), ("xs", ctypes.c_int64 * 4),
                ("B", ctypes.c_int64), ("H", ctypes.c_int64), ("n", ctypes.c_int64), ("D", ctypes.c_int64),
                ("start", ctypes.c_int64), ("rope", ctypes.c_void_p), ("lam", ctypes.c_void_p),
                ("fmt", ctypes.c_int32), ("bits", ctypes.c_int32), ("token_axis", ctypes.c_int32),
                ("group", ctypes.c_int32), ("mids", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("range", ctypes.c_void_p), ("outliers", ctypes.c_int32), ("q_lo", ctypes.c_float),
                ("q_hi", ctypes.c_float), ("lower", ctypes.c_void_p),
                ("upper", ctypes.c_void_p), ("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero_out", ctypes.c_void_p), ("out_count", ctypes.c_void_p), ("out_index", ctypes.c_void_p),
                ("out_value", ctypes.c_void_p), ("out_cap", ctypes.c_int64), ("n_threads", ctypes.c_int32)]


class _Call(ctypes.Structure):
    _fields_ = [("pages", ctypes.c_void_p), ("n_pages", ctypes.c_int64), ("q", ctypes.c_void_p),
                ("B", ctypes.c_int64), ("H_kv", ctypes.c_int64), ("G", ctypes.c_int64), ("D", ctypes.c_int64),
                ("scaling", ctypes.c_float), ("lam", ctypes.c_void_p), ("rope", ctypes.c_void_p),
                ("rope_n", ctypes.c_int64), ("sink", _Rows), ("recent", _Rows), ("ks", _Side), ("vs", _Side),
                ("klut16", ctypes.c_float * 16), ("vlut16", ctypes.c_float * 16), ("split_v", ctypes.c_int32),
                ("page_b", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("recents", ctypes.c_void_p),
                ("byte_f", ctypes.c_void_p), ("half_f", ctypes.c_void_p), ("base", ctypes.c_int64)]


# ---- build and load ------------------------------------------------------------------------------------------

def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _cpu_identity() -> str:
    """This CPU's model and feature flags (Linux /proc/cpuinfo; elsewhere the platform's processor string)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep)))


def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise OSError(f"{cc} --version failed: {out.stderr.strip()[:200]}")
    return out.stdout.splitlines()[0] if out.stdout else ""


def kernel_dir() -> Path:
    """Where built libraries live (see the module docstring)."""
    if os.environ.get("KVCALIB_KERNEL_DIR"):
        return Path(os.environ["KVCALIB_KERNEL_DIR"])
    venv = Path(sys.prefix) / "kvcalib-kernels"
    if os.access(sys.prefix, os.W_OK) or venv.is_dir():
        return venv
    return Path.home() / ".cache" / "kvcalib" / "kernels"


def library_path() -> Path:
    """The library this source, these flags and this CPU build to. Read at every start-up, so it runs no compiler:
    which compiler built a library is recorded beside it (.txt), and a changed compiler does not call for a
    rebuild of a library already built for this CPU (`build(force=True)` makes one anyway)."""
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(flags()), _cpu_identity(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    return kernel_dir() / f"decode_attention-{key}.so"


def build(force: bool = False) -> Path:
    """Compile the kernel (atomically: a temporary file renamed into place) unless it is built. -> its path.
    Raises OSError naming the compiler's complaint when it cannot."""
    path = library_path()
    if path.exists() and not force:
        return path
    cc = shutil.which(_compiler())
    if cc is None:
        raise OSError(f"no C compiler: {_compiler()!r} is not on PATH (set CC)")
    version = _compiler_version(cc)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [_compiler(), *flags(), "-o", tmp, str(SOURCE)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {(out.stderr or out.stdout).strip()[-600:]}")
        os.replace(tmp, path)
        path.with_suffix(".txt").write_text(f"{' '.join(cmd[:-3] + ['-o', path.name, str(SOURCE)])}\n{version}\n")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


_LIB: dict = {}


def _load() -> ctypes.CDLL | None:
    """The loaded kernel, built first if missing; None (the reason said once on stderr, kept for status()) when it
    cannot be built or loaded."""
    if "lib" in _LIB:
        return _LIB["lib"]
    lib, reason = None, None
    if os.environ.get("KVCALIB_CPU_KERNEL", "1") == "0":
        reason = "disabled by KVCALIB_CPU_KERNEL=0"
    else:
        try:
            lib = ctypes.CDLL(str(build()))
            if lib.kvcalib_abi() != ABI:
                raise OSError(f"the library's ABI is {lib.kvcalib_abi()}, this module's {ABI}")
            lib.kvcalib_decode.argtypes = [ctypes.POINTER(_Call), ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
            lib.kvcalib_decode.restype = ctypes.c_int
            lib.kvcalib_encode.argtypes = [ctypes.POINTER(_Enc)]
            lib.kvcalib_encode.restype = ctypes.c_int64
            if os.environ.get("KVCALIB_KERNEL_FUSED") == "0":   # the general path only (fused_path; an A/B)
                lib.kvcalib_set_fast(0)
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            lib, reason = None, f"{type(exc).__name__}: {exc}"
    if lib is None:
        print(f"kvcalib: the fused CPU decode kernel is not available ({reason}); single-token steps on the CPU "
              f"use the block-wise torch attention (serving/blockwise.py)", file=sys.stderr)
    _LIB.update(lib=lib, reason=reason)
    return lib


def available() -> bool:
    return _load() is not None


def fused_path(on: bool) -> None:
    """Take (the default) or skip the library's fused path for head_dim 64 pages (decode_attention.c
    run_page_fast64), whose output is bit for bit the general path's: the tests compare the two."""
    lib = _load()
    if lib is None:
        raise InputError(f"the CPU kernel is not available: {_LIB['reason']}")
    lib.kvcalib_set_fast(int(bool(on)))


def status() -> dict:
    """{"available": bool, "path": str | None, "reason": str | None} (builds / loads on first call)."""
    lib = _load()
    return {"available": lib is not None, "path": None if lib is None else lib._name, "reason": _LIB["reason"]}


# ---- what the kernel reads exactly ---------------------------------------------------------------------------

_HALVES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _rope_table(rotary: torch.nn.Module, end: int) -> torch.Tensor | None:
    """[N >= end, 2, D / 2] float32: cos then sin of the first D / 2 frequencies at positions 0..N-1 (slices of the
    block-wise reader's shared table, serving.rope_tables.rope_at: the model's rotary module's own values), or
    None when the tables do not repeat their halves (the kernel rotates half by half). Kept per rotary module,
    grown as positions come."""
    from serving.rope_tables import _ROPE, _repeated_halves, rope_at

    cos, sin = rope_at(rotary, 0, end, torch.device("cpu"))
    dynamic = "dynamic" in str(getattr(rotary, "rope_type", ""))
    if not dynamic:  # the whole shared table (grown ahead of the positions asked), made compact once per growth
        _, cos, sin = _ROPE[rotary]
    key = (cos.data_ptr(), cos.shape[0])
    held = _HALVES.get(rotary)
    if held is not None and held[0] == key:
        return held[1]
    n = min(cos.shape[0], 64)
    if not _repeated_halves(cos[:n], sin[:n]) or not _repeated_halves(cos[-1:], sin[-1:]):
        return None
    h = cos.shape[1] // 2
    table = torch.stack([cos[:, :h], sin[:, :h]], 1).contiguous()   # [N, 2, D / 2]
    if not dynamic:
        _HALVES[rotary] = (key, table)
    return table


def refusal(inp: DecodeInputs) -> str | None:
    """Why the kernel cannot read these inputs, or None: it must be built, everything on the CPU, head_dim even
    and at most its MAX_D, the GQA group at most its MAX_G, stored rows with unit stride along the row, and
    pre-RoPE keys from a rotary module whose tables repeat their halves. The block-wise torch path reads the
    rest."""
    lib = _load()
    if lib is None:
        return f"the CPU kernel is not available: {_LIB['reason']}"
    d = inp.head_dim
    if inp.q.device.type != "cpu":
        return f"the CPU kernel reads CPU tensors, the query is on {inp.q.device}"
    if d % 2 or d > lib.kvcalib_max_d():
        return f"head_dim must be even and at most {lib.kvcalib_max_d()} for the CPU kernel, got {d}"
    g = inp.q.shape[1] // inp.n_kv_heads
    if g > lib.kvcalib_max_g():
        return f"a GQA group of at most {lib.kvcalib_max_g()} query heads per kv head, got {g}"
    return None


def temporary_bytes(b: int, h_kv: int, g: int, d: int, page_rows: list[int], sink: bool, recent: bool,
                    chunk: int, threads: int) -> int:
    """The kernel's working set in a call (what it allocates beyond its inputs): the work items and their partials
    (max, sum, accumulator per query head: kvcalib_decode's malloc) and each thread's tiles on its stack (the
    scaled queries, TILE decoded keys and values, their scores, codes and levels of a row), with the library's own
    TILE / MAX_D / MAX_G: what the kernel allocates for these shapes, computed as it does."""
    lib = _LIB["lib"]
    per = max(1, int(sink) + int(recent) + sum(-(-n // chunk) for n in page_rows))
    items = b * h_kv * per
    tile, max_d, max_g = lib.kvcalib_tile(), lib.kvcalib_max_d(), lib.kvcalib_max_g()
    per_thread = 4 * (max_g * max_d + 2 * tile * max_d + 2 * max_g * tile) + 5 * max_d
    return items * (5 * 8) + items * g * (d + 2) * 4 + threads * per_thread


# ---- what the library reads, checked ---------------------------------------------------------------------------

def _need(t: torch.Tensor | None, name: str, shape: tuple, dtype: torch.dtype, contiguous: bool = True) -> None:
    """Refuse (InputError) a buffer the library reads as `shape` entries of `dtype` (contiguous unless it is given
    its strides), on the CPU, that is not exactly that."""
    if t is None:
        raise InputError(f"{name}: missing; the CPU kernel reads a {dtype} tensor of shape {list(shape)}")
    if (tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device.type != "cpu"
            or (contiguous and not t.is_contiguous())):
        layout = "" if t.is_contiguous() or not contiguous else ", not contiguous"
        raise InputError(f"{name}: the CPU kernel reads a {'contiguous ' if contiguous else ''}CPU {dtype} tensor of "
                         f"shape {list(shape)}; got {t.dtype} {list(t.shape)} on {t.device}{layout}")


def _check_static(p, names: tuple[str, ...], n_kv: int, d: int, where: str) -> None:
    """The policy's calibrated tensors `names` (those the call reads) hold what the library reads for n_kv heads
    of d channels (exporters.layout.calibrated_shape: range / zero / lower / upper [H_kv, D], fp8_scale [] or
    [H_kv], codebook [2^bits])."""
    for name in names:
        t = getattr(p, name)
        want = calibrated_shape(p, name, n_kv, d)
        if t is None or tuple(t.shape) != want:
            got = None if t is None else list(t.shape)
            raise InputError(f"{where}.{name}: the CPU kernel reads shape {list(want)} for n_kv_heads={n_kv}, "
                             f"head_dim={d}; got {got}")


def _check_page(blk, side: "pages.PageSide", flags: dict, where: str) -> None:
    """One laid-out page of one side holds what the kernel reads for its shape [B, H_kv, rows, D]: the codes
    (or fp8 / fp16 rows), the per-token or per-group scales and zero-points, the outlier counts [rows, B] and
    lists at least as long as the counts say. Run once per laid-out page (_CHECKED): a page held is immutable."""
    held = _CHECKED.get(id(side))
    if held is not None and held() is side:
        return
    b, h, n, d = blk.shape
    data, scale, zero, counts, offsets, index, value = side.tensors
    if flags["FMT"] in (pages.FMT_UNIFORM, pages.FMT_NUQ):
        _need(data, f"{where} codes", (b, h, n, -(-d * flags["BITS"] // 8)), torch.uint8, contiguous=False)
    else:
        _need(data, f"{where} rows", (b, h, n, d), torch.uint8 if flags["FMT"] == pages.FMT_FP8 else torch.float16,
              contiguous=False)
    if flags["SMODE"] in (pages.SC_TOKEN, pages.SC_GROUP):
        shape = (b, h, n, 1) if flags["SMODE"] == pages.SC_TOKEN else (b, h, -(-n // flags["GROUP"]), d)
        _need(scale, f"{where} scale", shape, torch.float16, contiguous=False)
        _need(zero, f"{where} zero", shape, torch.float16, contiguous=False)
    if counts is not None:
        _need(counts, f"{where} outlier_count", (n * b,), torch.int16)
        if n * b and int(counts.min()) < 0:
            raise InputError(f"{where} outlier_count: counts must be >= 0, got {int(counts.min())}")
        stored = int(offsets[-1] + counts[-1]) if n * b else 0
        for t, name, dtype in ((index, "outlier_index", torch.int16), (value, "outlier_value", torch.float16)):
            if t.dtype != dtype or not t.is_contiguous() or t.numel() < stored:
                raise InputError(f"{where} {name}: the counts list {stored} outliers, the CPU kernel reads them from "
                                 f"a contiguous {dtype} list; got {t.dtype} of {t.numel()}")
        check_row_entries(h, d, where)
    _CHECKED[id(side)] = weakref.ref(side, lambda _, key=id(side): _CHECKED.pop(key, None))


_CHECKED: dict[int, weakref.ref] = {}


# ---- the call --------------------------------------------------------------------------------------------------

def _rows(pair: tuple[torch.Tensor, torch.Tensor] | None, b: int, h: int, d: int, name: str) -> _Rows:
    """The kernel's view of fp16 sink or residual rows K, V [B, H_kv, n, D] (any strides), checked."""
    if pair is None:
        return _Rows()
    k, v = pair
    n = k.shape[2] if k.dim() == 4 else -1
    _need(k, f"{name} keys", (b, h, n, d), torch.float16, contiguous=False)
    _need(v, f"{name} values", (b, h, n, d), torch.float16, contiguous=False)
    return _Rows(k.data_ptr(), v.data_ptr(), (ctypes.c_int64 * 4)(*k.stride()), (ctypes.c_int64 * 4)(*v.stride()),
                 k.shape[2])


_SIDES: dict[tuple, tuple] = {}


def _side(p, flags: dict, n_kv: int, d: int, keep: list) -> _Side:
    """The kernel's view of one side's policy (format, bits, scale layout, its static tensors), made -- and its
    tensors checked against n_kv heads of d channels -- once per policy object, kv-head count and head_dim."""
    key = (id(p), n_kv, d)
    held = _SIDES.get(key)
    if held is not None and held[0]() is p:
        keep.append(held[2])
        return held[1]
    side, tensors = _make_side(p, flags, n_kv, d)
    _SIDES[key] = (weakref.ref(p), side, tensors)
    keep.append(tensors)
    return side


def _make_side(p, flags: dict, n_kv: int, d: int) -> tuple[_Side, list]:
    where = f"{p.format} {p.axis} policy"
    needed = {SC_HEAD: ("fp8_scale",), SC_STATIC: ("range", "zero")}.get(flags["SMODE"], ())
    _check_static(p, needed + (("codebook",) if flags["FMT"] == FMT_NUQ else ()), n_kv, d, where)
    scale = zero = lut = None
    if flags["SMODE"] == SC_HEAD:
        scale = p.fp8_scale.float().reshape(-1)
        scale = scale.expand(n_kv).contiguous() if scale.numel() == 1 else scale.contiguous()
        lut = fp8_lut(p.fp8_dtype, torch.device("cpu"))
    elif flags["SMODE"] == SC_STATIC:
        scale, zero = p.range.float().contiguous(), p.zero.float().contiguous()
    if flags["FMT"] == FMT_NUQ:
        lut = p.codebook.float().contiguous()
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    side = _Side(flags["FMT"], flags["BITS"], flags["SMODE"], flags["GROUP"], 0, ptr(scale), ptr(zero), ptr(lut))
    return side, [t for t in (scale, zero, lut) if t is not None]


def launch(table: torch.Tensor, n_pages: int, q: torch.Tensor, h_kv: int, scaling: float, key_policy, value_policy,
           outliers: tuple[int, int], rope: torch.Tensor | None, sink: "_Rows", recent: "_Rows",
           lam: torch.Tensor | None, chunk: int, threads: int, keep: list, split: bool = False,
           page_b: torch.Tensor | None = None, sinks: list | None = None, recents: list | None = None,
           relative: tuple | None = None) -> torch.Tensor:
    """One kvcalib_decode call: the page table [n_pages, N_PAGE] int64 (serving/pages.py's fields), queries
    q [B, H_q, D], the policies' static tensors, which sides store outliers (0: none, 1: lists at int64 offsets,
    2: at int16 offsets -- a page's own pool, exporters/vllm_slots.py), the RoPE table [N, 2, D / 2] (pre-RoPE
    keys) or None, the fp16 sink / residual rows -> [B, H_q, D] float32; split: [2, B, H_q, D], the value sum of
    the sink and residual rows, then that of the pages (rotated values: the caller un-rotates the second). The one
    entry to the library's decode, for the serving cache (decode_attention) and the vLLM plugin
    (serving/vllm_backend.py: every decoding sequence of a step in one call -- page_b [n_pages] int64, each page's
    sequence, its pages of its own; sinks / recents, B _Rows each, every sequence's own fp16 rows in place of
    sink / recent; a _Rows may read a ring in place: row i at row (first + i) % ring); relative: (byte_f, half_f,
    base) -- the table's addresses relative to one cache, field + byte_f * base + half_f * (base / 2), byte_f and
    half_f [N_PAGE] int64 0 / 1 (a table shared by the layers of a step). A Launcher made for this one call (a
    caller launching layer after layer keeps one per layer)."""
    if q.dim() != 3:
        raise InputError(f"queries: the CPU kernel reads [B, H_q, D] with H_q a multiple of n_kv_heads={h_kv}; got "
                         f"{list(q.shape)}")
    run = Launcher(key_policy, value_policy, outliers, rope, lam, h_kv, q.shape[1], q.shape[2], scaling, split)
    return run(table, n_pages, q, chunk, threads, keep, sink, recent, page_b, sinks, recents, relative)


class Launcher:
    """kvcalib_decode for one layer's policies, RoPE table, smoothing and shape: their checks made and the call's
    fixed fields set once; a call sets the table, the queries and the rows (launch's contract)."""

    def __init__(self, key_policy, value_policy, outliers: tuple[int, int], rope: torch.Tensor | None,
                 lam: torch.Tensor | None, h_kv: int, h_q: int, d: int, scaling: float, split: bool = False) -> None:
        lib = _load()   # loaded once (a caller that never asked available() first still gets it)
        if lib is None:
            raise InputError(f"the CPU kernel is not available: {_LIB['reason']}")
        if h_kv < 1 or h_q % h_kv or h_q // h_kv > lib.kvcalib_max_g():
            raise InputError(f"queries: the CPU kernel reads [B, H_q, D] with H_q a multiple of n_kv_heads={h_kv}, "
                             f"at most {lib.kvcalib_max_g()} per kv head; got H_q={h_q}")
        if d % 2 or not 2 <= d <= lib.kvcalib_max_d():
            raise InputError(f"queries: head_dim must be even and in [2, {lib.kvcalib_max_d()}] for the CPU kernel, "
                             f"got {d}")
        if lam is not None:
            _need(lam, "smooth (lambda)", (h_kv, d), torch.float32)
        if rope is not None:  # its length: the library refuses pages past it (-4)
            _need(rope, "RoPE table", (rope.shape[0] if rope.dim() == 3 else -1, 2, d // 2), torch.float32)
        if any(int(o) not in (0, 1, 2) for o in outliers):
            raise InputError(f"outliers: allowed 0 (none), 1 (int64 list offsets) or 2 (int16) per side, got "
                             f"{outliers}")
        self.keep: list = [lam, rope]
        ks_ = _side(key_policy, side_flags(key_policy), h_kv, d, self.keep)
        vs_ = _side(value_policy, side_flags(value_policy), h_kv, d, self.keep)
        self.call = _Call(None, 0, None, 0, h_kv, h_q // h_kv, d, scaling, None if lam is None else lam.data_ptr(),
                          None if rope is None else rope.data_ptr(), 0 if rope is None else rope.shape[0], _Rows(),
                          _Rows(), ks_, vs_)
        self.call.ks.outliers, self.call.vs.outliers = int(outliers[0]), int(outliers[1])   # the call's copies
        self.call.split_v = int(split)
        self.ref = ctypes.byref(self.call)
        self.lib, self.h_kv, self.h_q, self.d, self.split = lib, h_kv, h_q, d, split

    def __call__(self, table: torch.Tensor, n_pages: int, q: torch.Tensor, chunk: int, threads: int, keep: list,
                 sink: "_Rows | None" = None, recent: "_Rows | None" = None, page_b: torch.Tensor | None = None,
                 sinks=None, recents=None, relative: tuple | None = None) -> torch.Tensor:
        h_kv, h_q, d = self.h_kv, self.h_q, self.d
        if q.dim() != 3 or q.shape[1] != h_q or q.shape[2] != d:
            raise InputError(f"queries: this launch reads [B, {h_q}, {d}]; got {list(q.shape)}")
        b = q.shape[0]
        if (table.dtype != torch.int64 or not table.is_contiguous() or table.device.type != "cpu"
                or not 0 <= n_pages * N_PAGE <= table.numel()):
            raise InputError(f"page table: the CPU kernel reads n_pages={n_pages} rows of {N_PAGE} int64 fields, "
                             f"contiguous on the CPU; got {table.dtype} of {table.numel()} entries on {table.device}")
        q = q.float().contiguous()
        call = self.call
        call.pages, call.n_pages, call.q, call.B = table.data_ptr(), n_pages, q.data_ptr(), b
        call.sink = sink if sink is not None else _Rows()
        call.recent = recent if recent is not None else _Rows()
        call.page_b = call.sinks = call.recents = call.byte_f = call.half_f = None
        call.base = 0
        if page_b is not None:
            if page_b.dtype != torch.int64 or not page_b.is_contiguous() or page_b.numel() < n_pages:
                raise InputError(f"page_b: the CPU kernel reads n_pages={n_pages} int64 sequence indices, contiguous; "
                                 f"got {page_b.dtype} of {page_b.numel()}")
            call.page_b = page_b.data_ptr()
        for name, rows in (("sinks", sinks), ("recents", recents)):
            if rows is not None:
                if len(rows) != b:
                    raise InputError(f"{name}: the CPU kernel reads one _Rows per sequence (B={b}), got {len(rows)}")
                arr = rows if isinstance(rows, ctypes.Array) else (_Rows * b)(*rows)
                keep.append(arr)
                setattr(call, name, ctypes.addressof(arr))
        if relative is not None:
            byte_f, half_f, base = relative
            for f in (byte_f, half_f):
                if f.dtype != torch.int64 or not f.is_contiguous() or f.numel() != N_PAGE:
                    raise InputError(f"relative: the CPU kernel reads two [{N_PAGE}] int64 field masks, got {f.dtype} "
                                     f"of {f.numel()}")
            keep += [byte_f, half_f]
            call.byte_f, call.half_f, call.base = byte_f.data_ptr(), half_f.data_ptr(), int(base)
        out = torch.empty(*((2,) if self.split else ()), b, h_q, d, dtype=torch.float32)
        rc = self.lib.kvcalib_decode(self.ref, chunk, threads, out.data_ptr())
        if rc == -4:
            raise InputError(f"page table: positions run past the RoPE table's {call.rope_n} positions "
                             f"(kvcalib_decode refused the call)")
        if rc == -5:
            raise InputError("stored outliers: a negative outlier count, offset or index (a corrupt page; "
                             "kvcalib_decode refused it)")
        if rc == -1:
            raise InputError(f"kvcalib_decode refused the shapes: B={b}, n_kv_heads={h_kv}, G={h_q // h_kv}, "
                             f"head_dim={d}, chunk={chunk}, or a page's rows below 0")
        if rc != 0:
            raise RuntimeError(f"kvcalib_decode returned {rc}")
        return out


def decode_attention(inp: DecodeInputs, chunk: int = CHUNK, threads: int | None = None,
                     stats: dict | None = None) -> torch.Tensor:
    """The new token's attention over every stored row -> [B, H_q, D] float32 (the signature of
    reference.decode_attention: a `kernel` for runtime_check.check.check_case). Rotated values: the pages' value
    sum comes back apart and is un-rotated once (serving/inputs.py). Refuses (ValueError, the reason) what
    `refusal` names. stats: {"largest_decode_temporary_bytes"} raised to this call's working set (temporary_bytes)."""
    why = refusal(inp)
    if why is not None:
        raise ValueError(why)
    b, h_q, d = inp.q.shape
    h_kv = inp.n_kv_heads
    if h_q % h_kv:
        raise ValueError(f"n_q_heads={h_q} must be a multiple of n_kv_heads={h_kv}")
    k_pages, v_pages = pages_of(inp.k_block), pages_of(inp.v_block)
    if len(k_pages) != len(v_pages):
        raise ValueError(f"keys are stored in {len(k_pages)} pages, values in {len(v_pages)}: K and V pages must "
                         f"cover the same rows")
    kf, vf = side_flags(inp.key_policy), side_flags(inp.value_policy)
    keep: list = []
    table, outl = [], set()
    for kb, vb in zip(k_pages, v_pages):
        if kb.shape[2] != vb.shape[2]:
            raise ValueError(f"K and V pages must hold the same rows: a key page at {kb.start} holds {kb.shape[2]} "
                             f"rows, its value page at {vb.start} {vb.shape[2]}")
        for blk, side in ((kb, "key"), (vb, "value")):
            if tuple(blk.shape) != (b, h_kv, blk.shape[2], d):
                raise InputError(f"{side} page at {blk.start}: shape {list(blk.shape)}; the inputs ask for [B={b}, "
                                 f"n_kv_heads={h_kv} (of the sink / residual rows, else the keys), rows, "
                                 f"head_dim={d}]")
        ks, vs = pages.laid_out(kb, inp.key_policy, kf["SMODE"]), pages.laid_out(vb, inp.value_policy, vf["SMODE"])
        _check_page(kb, ks, kf, f"key page at {kb.start}")
        _check_page(vb, vs, vf, f"value page at {vb.start}")
        for side in (ks, vs):
            if side.fields[4] != 1 and side.tensors[0].dtype == torch.uint8 and side.tensors[0].shape[-1] > 1:
                raise ValueError(f"stored codes must be contiguous along the row, got stride {side.fields[4]}")
        table += [kb.start, kb.shape[2], *ks.fields, *vs.fields]
        outl.add((ks.outliers, vs.outliers))
        keep.append((ks, vs))
    if len(outl) > 1:
        raise ValueError("every page of a side must store sparse outliers, or none")
    k_outl, v_outl = next(iter(outl)) if outl else (False, False)
    tab = torch.tensor(table or [0] * N_PAGE, dtype=torch.int64)
    rope = None
    if inp.key_rope == "pre" and k_pages:
        end = k_pages[-1].start + k_pages[-1].shape[2]
        rope = _rope_table(inp.rotary, end)
        if rope is None:
            raise ValueError("the rotary module's cos / sin tables do not repeat their halves: the CPU kernel rotates "
                             "half by half; the block-wise torch path reads them")
    lam = None if inp.smooth is None else inp.smooth.float().contiguous()
    threads = threads or torch.get_num_threads()
    unrotate = value_unrotation(inp.value_policy, d, torch.device("cpu"))
    out = launch(tab, len(k_pages), inp.q, h_kv, float(inp.scaling), inp.key_policy, inp.value_policy,
                 (k_outl, v_outl), rope, _rows(inp.sink, b, h_kv, d, "sink"), _rows(inp.recent, b, h_kv, d, "recent"),
                 lam, chunk, threads, keep, split=unrotate is not None)
    if unrotate is not None:
        out = finish(out[0], out[1], unrotate)
    b, h_q, d = out.shape
    if stats is not None:
        rows = [p.shape[2] for p in k_pages]
        work = temporary_bytes(b, h_kv, h_q // h_kv, d, rows, inp.sink is not None, inp.recent is not None, chunk,
                               threads) + tab.numel() * 8 + out.numel() * 4 * (1 if unrotate is None else 2)
        key = "largest_decode_temporary_bytes"
        stats[key] = max(stats.get(key, 0), work)
    del keep, tab
    return out


# ---- encoding new rows ---------------------------------------------------------------------------------------

_CONSTS: dict[int, tuple] = {}


def _encoder_consts(p) -> dict | None:
    """A policy's tensors as the encoder reads them (float32, contiguous; nuq's midpoints as
    exporters.codec.nearest_level computes them), made once per policy object; None for a policy the encoder does
    not take (fp16 and fp8 rows are a cast: the codec's torch path stores them; a rotation or a range clip is
    encoded by the codec too: its clip picks a ratio by a torch float32 sum whose order a C port would not promise
    to repeat on a near tie)."""
    held = _CONSTS.get(id(p))
    if held is not None and held[0]() is p:
        return held[1]
    if p.format not in ("nuq", "uniform") or p.rotation != "none" or p.clip != "none" or p.bits > 8:
        consts = None
    else:
        p.validate("policy")
        f32 = (lambda t: None if t is None else t.float().contiguous())  # noqa: E731
        cb = None if p.codebook is None else p.codebook.float()
        consts = {"mids": None if cb is None else ((cb[1:] + cb[:-1]) / 2).contiguous(),
                  "zero": f32(p.zero) if p.axis == "channel" and p.format == "nuq" else None,
                  "range": f32(p.range) if p.axis == "channel" and p.format == "nuq" else None,
                  "lower": f32(p.lower) if p.outlier_fraction > 0 and p.axis == "channel" else None,
                  "upper": f32(p.upper) if p.outlier_fraction > 0 and p.axis == "channel" else None,
                  "group": p.group_size if p.is_grouped else 0,
                  # per-token outlier bounds: the quantiles codec.token_outlier_bounds asks torch for, in float32
                  "quantiles": tuple(torch.tensor([p.outlier_fraction / 2, 1 - p.outlier_fraction / 2],
                                                  dtype=torch.float32).tolist())}
    _CONSTS[id(p)] = (weakref.ref(p), consts)
    return consts


def encode_rows(rows: torch.Tensor, p, start: int, rotary: torch.nn.Module | None = None,
                lam: torch.Tensor | None = None):
    """Rows [B, H, n, D] (float16 as the cache holds them, post-RoPE keys or values) at positions start.. ->
    the StoredBlock `exporters.layout.store(exporters.codec.encode(x, p), p, start)` gives, byte for byte, where x is
    the rows in float32, rotated back by `rotary` at their positions (pre-RoPE keys; exporters.rope.invert_rope)
    and divided by lambda [H, D] (keys of a smoothed policy): the library's kvcalib_encode, per-token outlier bounds
    included (torch.quantile's linear interpolation, to the bit). None when the kernel does not encode this policy
    or is not available (the caller runs the codec). Non-finite rows raise the codec's CodecError."""
    from exporters.codec import CodecError
    from exporters.layout import StoredBlock

    consts = _encoder_consts(p) if _load() is not None else None
    if consts is None or rows.device.type != "cpu" or rows.dim() != 4:
        return None
    b, h, n, d = rows.shape
    if p.outlier_fraction > 0:
        check_row_entries(h, d, "encode_rows")
    if d > _LIB["lib"].kvcalib_max_d() or (consts["group"] and n % consts["group"]) or (rotary is not None and d % 2):
        return None
    _check_consts(p, consts, h, d, "encode_rows")
    rope = None
    if rotary is not None:
        rope = _rope_table(rotary, start + n)
        if rope is None:
            return None
        _need(rope, "RoPE table", (max(rope.shape[0], start + n), 2, d // 2), torch.float32)
    x, x_half = rows, rows.dtype == torch.float16
    if not x_half:
        x = x.float()
    lo = hi = None
    mode, q_lo, q_hi = 0, 0.0, 0.0
    if p.outlier_fraction > 0:
        if p.axis == "channel":
            mode, lo, hi = 1, consts["lower"], consts["upper"]
        else:  # per-token bounds over every head: the quantiles codec.token_outlier_bounds takes, in float32
            mode, (q_lo, q_hi) = 3, consts["quantiles"]
    lam_c = None if lam is None else lam.float().contiguous()
    if lam_c is not None:
        _need(lam_c, "encode_rows: smooth (lambda)", (h, d), torch.float32)
    n_bytes = -(-d * p.bits // 8)
    codes = torch.empty(b, h, n, n_bytes, dtype=torch.uint8)
    g = consts["group"]
    token = p.axis == "token"
    sc_shape = (b, h, n, 1) if token else ((b, h, n // g, d) if g else None)
    scale = None if sc_shape is None else torch.empty(sc_shape, dtype=torch.float16)
    zero = None if sc_shape is None else torch.empty(sc_shape, dtype=torch.float16)
    cap = b * h * n * d if mode else 0
    count = torch.empty(n, b, dtype=torch.int16) if mode else None
    index = torch.empty(cap, dtype=torch.int16) if mode else None
    value = torch.empty(cap, dtype=torch.float16) if mode else None
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    enc = _Enc(x.data_ptr(), int(x_half), (ctypes.c_int64 * 4)(*x.stride()), b, h, n, d, start, ptr(rope),
               ptr(lam_c), FMT_NUQ if p.format == "nuq" else FMT_UNIFORM, p.bits, int(token), g,
               ptr(consts["mids"]), ptr(consts["zero"]), ptr(consts["range"]), mode, q_lo, q_hi, ptr(lo), ptr(hi),
               codes.data_ptr(), ptr(scale), ptr(zero), ptr(count), ptr(index), ptr(value), cap,
               torch.get_num_threads())
    m = _LIB["lib"].kvcalib_encode(ctypes.byref(enc))
    if m == -3:
        bad = x.float()
        raise CodecError(f"{int((~torch.isfinite(bad)).sum())} non-finite entries in the rows to encode")
    _encode_refused(m, b, h, n, d, p)
    if m < 0:
        raise RuntimeError(f"kvcalib_encode returned {m}")
    out = {"codes": codes}
    if scale is not None:
        out["scale"], out["zero"] = scale, zero
    if mode:
        out["outlier_count"], out["outlier_index"], out["outlier_value"] = count, index[:m], value[:m]
    return StoredBlock(start, (b, h, n, d), out)


def encode_into(x: torch.Tensor, p, start: int, rope: torch.Tensor | None, codes: int, scale: int | None,
                zero: int | None, index: int | None, value: int | None, cap: int, count: torch.Tensor) -> int:
    """One token's rows x [1, H, 1, D] (float32 or float16, pre-RoPE after `rope`: the inverse rotation at position
    `start` from a [N, 2, D / 2] table, as encode_rows applies it) encoded by kvcalib_encode straight into the given
    addresses: packed codes [H, bytes], fp16 scale / zero [H] (per-token formats), at most `cap` outliers (int16
    index h * D + d, fp16 value) in store's order -- the fields of one slot of exporters/vllm_slots.py. count: an
    int16 scratch [1]. -> the outliers written, or -1 when they exceed cap (the codes and scales are written
    anyway; the caller stores the token another way). The policy must be one encode_rows takes. A TokenEncoder
    made for this one call (a caller encoding token after token keeps one)."""
    if x.dim() != 4 or x.shape[0] != 1 or x.shape[2] != 1 or x.dtype not in (torch.float16, torch.float32):
        raise InputError(f"encode_into: one token's rows [1, H, 1, D] in float16 or float32, got {x.dtype} "
                         f"{list(x.shape)}")
    if tuple(x.stride()) != (x.shape[1] * x.shape[3], x.shape[3], x.shape[3], 1):
        x = x.contiguous()
    if rope is not None:
        _need(rope, "encode_into: RoPE table", (max(rope.shape[0], start + 1), 2, x.shape[3] // 2), torch.float32)
    _need(count, "encode_into: count", (1,), torch.int16)
    enc = TokenEncoder(p, x.shape[1], x.shape[3], rope, x.dtype == torch.float16, count)
    return enc(x.data_ptr(), start, codes, scale, zero, index, value, cap, x)


class TokenEncoder:
    """kvcalib_encode for one token's rows [1, H, 1, D] at a time under one policy: its checks -- the policy one
    encode_rows takes, its tensors of H heads x D channels, the RoPE table's shape -- made once, and the fields that
    do not change between tokens set once; a call sets the row's address, its position and its destinations (the
    vLLM plugin's write of a decode step: one call per token and side, in every layer)."""

    def __init__(self, p, h: int, d: int, rope: torch.Tensor | None, x_half: bool,
                 count: torch.Tensor | None = None) -> None:
        consts = _encoder_consts(p)
        if consts is None:
            raise InputError(f"encode_into: the CPU encoder does not take a {p.format} {p.axis} policy (rotation "
                             f"{p.rotation}, clip {p.clip}, {p.bits} bits); allowed: nuq or uniform, no rotation, no "
                             f"clip, at most 8 bits")
        if p.outlier_fraction > 0:
            check_row_entries(h, d, "encode_into")
        _check_consts(p, consts, h, d, "encode_into")
        if rope is not None:
            _need(rope, "encode_into: RoPE table", (rope.shape[0] if rope.dim() == 3 else -1, 2, d // 2),
                  torch.float32)
        mode, q_lo, q_hi, lo, hi = 0, 0.0, 0.0, None, None
        if p.outlier_fraction > 0:
            if p.axis == "channel":
                mode, lo, hi = 1, consts["lower"], consts["upper"]
            else:
                mode, (q_lo, q_hi) = 3, consts["quantiles"]
        self.p, self.h, self.d, self.rope, self.outliers = p, h, d, rope, p.outlier_fraction > 0
        self.count = torch.zeros(1, dtype=torch.int16) if count is None else count
        self.keep = (consts, rope, self.count)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.enc = _Enc(None, int(x_half), (ctypes.c_int64 * 4)(h * d, d, d, 1), 1, h, 1, d, 0, ptr(rope), None,
                        FMT_NUQ if p.format == "nuq" else FMT_UNIFORM, p.bits, int(p.axis == "token"), 0,
                        ptr(consts["mids"]), ptr(consts["zero"]), ptr(consts["range"]), mode, q_lo, q_hi, ptr(lo),
                        ptr(hi), None, None, None, self.count.data_ptr(), None, None, 0, 1)
        self.ref = ctypes.byref(self.enc)

    def __call__(self, x: int, start: int, codes: int, scale: int | None, zero: int | None, index: int | None,
                 value: int | None, cap: int, rows: torch.Tensor | None = None) -> int:
        """Rows at address x (contiguous [H, D], float16 or float32 as made), position `start` -> the outliers
        written, or -1 when they exceed cap (encode_into's contract). rows: the tensor at x, for the error of
        non-finite entries."""
        if self.rope is not None and not 0 <= start < self.rope.shape[0]:
            raise InputError(f"encode_into: position {start} is past the RoPE table's {self.rope.shape[0]} positions")
        if cap < 0 or (self.outliers and cap and (index is None or value is None)):
            raise InputError(f"encode_into: an outlier capacity of {cap} needs index and value addresses")
        e = self.enc
        e.x, e.start, e.codes, e.scale, e.zero_out = x, start, codes, scale, zero
        e.out_index, e.out_value, e.out_cap = index, value, cap
        m = _LIB["lib"].kvcalib_encode(self.ref)
        if m == -3:
            from exporters.codec import CodecError
            bad = "" if rows is None else f"{int((~torch.isfinite(rows.float())).sum())} "
            raise CodecError(f"{bad}non-finite entries in the rows to encode")
        _encode_refused(m, 1, self.h, 1, self.d, self.p)
        if m < -1:
            raise RuntimeError(f"kvcalib_encode returned {m}")
        return m


def _check_consts(p, consts: dict, h: int, d: int, where: str) -> None:
    """The policy's tensors the encoder reads (_encoder_consts) hold h heads x d channels: zero / range / lower /
    upper [H, D], the codebook's 2^bits - 1 midpoints."""
    for name in ("zero", "range", "lower", "upper"):
        if consts[name] is not None:
            _need(consts[name], f"{where}: {p.format} {p.axis} policy.{name}", (h, d), torch.float32)
    if consts["mids"] is not None:
        _need(consts["mids"], f"{where}: {p.format} policy codebook midpoints", (2 ** p.bits - 1,), torch.float32)


def _encode_refused(m: int, b: int, h: int, n: int, d: int, p) -> None:
    if m == -4:
        raise InputError(f"kvcalib_encode refused the shapes: B={b}, n_kv_heads={h}, rows={n}, head_dim={d} (at "
                         f"most {_LIB['lib'].kvcalib_max_d()}), bits={p.bits}, group={p.group_size}, outliers "
                         f"{p.outlier_fraction > 0}")


def main(argv: list[str] | None = None) -> int:
    """`python -m serving.cpu_attention build|status`: build the kernel (or say why not) / report it."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] not in (["build"], ["status"]):
        print("usage: python -m serving.cpu_attention build|status", file=sys.stderr)
        return 2
    if argv[0] == "build":
        try:
            print(f"kvcalib: fused CPU decode kernel built: {build()}")
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"kvcalib: the fused CPU decode kernel was not built ({exc}); the block-wise torch attention "
                  f"serves single-token steps instead", file=sys.stderr)
        return 0
    print(status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
