"""The batch-invariant CPU kernels of kernels/csrc/invariant.c: built on first use with the machine's C compiler,
loaded through ctypes, called on torch tensors.

Why a kernel of our own: a BLAS picks its kernel, its blocking and its thread split by the operand shapes and the
CPU, so a row's rounding changes with the batch it sits in (docs/deterministic.md). These kernels fix the order of
every reduction in the source (one fma chain per output), so the bits depend on the operands only: not on the
batch, the tiling or the thread count, nor (save bf16 x bf16 GEMMs on AMX, see bf16_dot) on the instruction set the
build uses.

Build: `cc -O3 -march=native -ffp-contract=off -fopenmp -shared` into TRAINYARD_KERNEL_CACHE (default
~/.cache/trainyard/kernels), one file per source, compiler and CPU (about a second; scripts/bootstrap.sh builds it
ahead). The library links libgomp.so.1, which resolves to the OpenMP runtime torch already loaded, so these kernels
and torch share one thread pool. TRAINYARD_INVARIANT_ISA=avx2 or scalar builds a narrower variant (tests compare
the variants' bits).

Shapes: M, N, K of a GEMM; J sequences, Kh kv heads, G query heads per kv head, T queries, S keys, D / Dv head dims.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "invariant.c"
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma"], "scalar": []}
BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
UNARY_OPS = {"exp": 0, "sigmoid": 1, "silu": 2}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class NativeKernelError(RuntimeError):
    """The invariant kernels could not be built or loaded on this machine."""


def cache_dir() -> Path:
    return Path(os.environ.get("TRAINYARD_KERNEL_CACHE") or Path.home() / ".cache" / "trainyard" / "kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeKernelError(
            "deterministic mode needs a C compiler to build kernels/csrc/invariant.c (none found: install gcc, "
            "e.g. `apt-get install -y gcc`, or set CC)")
    return cc


def build(isa: str = "native") -> Path:
    """The compiled library for this source, compiler and CPU (built if missing; safe across processes)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"TRAINYARD_INVARIANT_ISA must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
    cc = _compiler()
    flags = BASE_FLAGS + ISA_FLAGS[isa]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), cc, *version, *flags, _cpu_flags()]).encode()).hexdigest()
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"invariant-{isa}-{key[:16]}.so"
    if target.exists():
        return target
    with open(out_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so", delete=False) as tmp:
            pass
        result = subprocess.run([cc, *flags, "-o", tmp.name, str(SOURCE), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp.name)
            raise NativeKernelError(f"building {SOURCE.name} failed ({cc} {' '.join(flags)}):\n{result.stderr[-2000:]}")
        os.replace(tmp.name, target)
    return target


@functools.cache
def library(isa: str | None = None) -> ctypes.CDLL:
    isa = isa or os.environ.get("TRAINYARD_INVARIANT_ISA", "native")
    lib = ctypes.CDLL(str(build(isa)))
    lib.ty_isa.restype = ctypes.c_char_p
    lib.ty_bf16_dot.restype = ctypes.c_char_p
    lib.ty_gemm.argtypes = [_i64, _i64, _i64, _ptr, _i64, _i64, _i32, _ptr, _i64, _i64, _i32, _ptr, _i64, _i32, _i32]
    lib.ty_gemm.restype = None
    lib.ty_unary.argtypes = [_i32, _i64, _ptr, _i32, _ptr, _i32]
    lib.ty_unary.restype = None
    lib.ty_attention.argtypes = (
        [_i64] * 6 + [_ptr, _i32, _i64, _i64, _i64] + [_ptr, _ptr, _i32] + [_i64] * 8 + [_ptr, _i64, _i64]
        + [_ptr, _ptr] + [_ptr, _i64, _i64, _i64] + [_f32, _ptr, _i64, _i64, _i64, _i32])
    lib.ty_attention.restype = None
    return lib


def isa(lib: ctypes.CDLL | None = None) -> str:
    """The instruction set the loaded build vectorizes with: avx512, avx2 or scalar."""
    return (lib or library()).ty_isa().decode()


def bf16_dot(lib: ctypes.CDLL | None = None) -> str:
    """How the build computes bf16 x bf16 GEMMs: "amx_bf16" (AMX tiles, 32 k per instruction: bits of its own),
    "avx512_bf16" (the CPU's dot-product instruction) or "emulated" (the same chain with fma; the same bits as
    avx512_bf16 save for subnormals, which the instruction flushes). TRAINYARD_INVARIANT_AMX=0 keeps a process off
    AMX."""
    return (lib or library()).ty_bf16_dot().decode()


def _operand(t: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """t as float32 or bfloat16 on the CPU (float16 widened exactly), and the kernel's dtype flag."""
    if t.device.type != "cpu":
        raise ValueError(f"deterministic mode's kernels run on the CPU; {name} is on {t.device}")
    if t.dtype not in _DTYPES:
        if t.dtype != torch.float16:
            raise ValueError(f"deterministic mode computes float32 / bfloat16 / float16; {name} is {t.dtype}")
        t = t.to(torch.float32)
    return t, _DTYPES[t.dtype]


def _threads(threads: int | None) -> int:
    return max(1, threads or torch.get_num_threads())


def gemm(a_MK: torch.Tensor, b_KN: torch.Tensor, out_MN: torch.Tensor | None = None, *, accumulate: bool = False,
         threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """a @ b in float32, each output one fma chain over k in increasing order (from out's values if accumulate).
    Any strides; float32 or bfloat16 operands. Returns out_MN (float32 [M, N], rows contiguous)."""
    M, K = a_MK.shape
    K2, N = b_KN.shape
    if K2 != K:
        raise ValueError(f"gemm shapes {tuple(a_MK.shape)} x {tuple(b_KN.shape)} do not match")
    a_MK, fa = _operand(a_MK, "a")
    b_KN, fb = _operand(b_KN, "b")
    if out_MN is None:
        out_MN = torch.empty(M, N, dtype=torch.float32) if not accumulate else torch.zeros(M, N)
    if out_MN.dtype != torch.float32 or out_MN.shape != (M, N) or (N > 1 and out_MN.stride(1) != 1):
        raise ValueError(f"gemm output must be float32 [{M}, {N}] with contiguous rows")
    (lib or library()).ty_gemm(
        M, N, K, a_MK.data_ptr(), a_MK.stride(0), a_MK.stride(1), fa, b_KN.data_ptr(), b_KN.stride(0),
        b_KN.stride(1), fb, out_MN.data_ptr(), out_MN.stride(0) if M > 1 else N, int(accumulate), _threads(threads))
    return out_MN


def unary(op: str, x: torch.Tensor, *, threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """exp / sigmoid / silu of every element, float32 result of x's shape; an element's bits depend on its value."""
    x, fx = _operand(x.contiguous(), "x")
    out = torch.empty(x.shape, dtype=torch.float32)
    (lib or library()).ty_unary(UNARY_OPS[op], x.numel(), x.data_ptr(), fx, out.data_ptr(), _threads(threads))
    return out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo_JT: torch.Tensor, hi_JT: torch.Tensor, *, scale: float,
    q_strides: tuple[int, int, int], k_strides: tuple[int, int, int, int], v_strides: tuple[int, int, int, int],
    shape: tuple[int, int, int, int, int, int], out: torch.Tensor, out_strides: tuple[int, int, int],
    table: torch.Tensor | None = None, block_size: int = 0, mask: torch.Tensor | None = None,
    mask_strides: tuple[int, int, int] = (0, 0, 0), threads: int | None = None, lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """The kernel's attention (see invariant.c): shape (J, Kh, G, T, D, Dv); query row (j, h, t) sees keys
    lo_JT[j, t] .. hi_JT[j, t] - 1, through table [J, blocks] (int64) when given. Strides in elements: q (j, h, t),
    k / v (j, kh, block, slot) (slot alone without a table), out and mask (j, h, t). Writes out (float32)."""
    J, Kh, G, T, D, Dv = shape
    q, fq = _operand(q, "q")
    k, fk = _operand(k, "k")
    v, fv = _operand(v, "v")
    if fk != fv:
        k, v = k.float(), v.float()
        fk = 0
    assert out.dtype == torch.float32 and lo_JT.dtype == hi_JT.dtype == torch.int32
    assert lo_JT.is_contiguous() and hi_JT.is_contiguous() and lo_JT.numel() == hi_JT.numel() == J * T
    if table is not None:
        assert table.dtype == torch.int64 and table.stride(1) == 1
    if mask is not None:
        assert mask.dtype == torch.float32 and mask.stride(-1) == 1
    (lib or library()).ty_attention(
        J, Kh, G, T, D, Dv, q.data_ptr(), fq, *q_strides, k.data_ptr(), v.data_ptr(), fk, *k_strides, *v_strides,
        None if table is None else table.data_ptr(), 0 if table is None else table.stride(0), block_size or 1,
        lo_JT.data_ptr(), hi_JT.data_ptr(), None if mask is None else mask.data_ptr(), *mask_strides, float(scale),
        out.data_ptr(), *out_strides, _threads(threads))
    return out
