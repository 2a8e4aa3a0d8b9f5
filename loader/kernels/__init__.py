"""The compiled expert kernels (``qdot.c``): a quantized matrix times a few tokens, read from its stored bits.

Why compiled: torch has no CPU kernel for int3, int2, int8 weights or MXFP4, and its int4 kernel is compute-bound
at one token (it turns every weight into a float first). ``qdot.c`` multiplies the codes by activations rounded to
int8 per block of 32 (16 for 2-bit codes), in integer SIMD where the CPU has AVX2, portable C elsewhere.

The library is built once by ``make setup`` (``python -m loader.kernels``), or on first use, with the system's C
compiler (``$CC``, else ``cc``, ``gcc``, ``clang``) into ``loader/kernels/build/``, named by the source's hash so
an edit rebuilds it. Where it cannot be built or loaded (no compiler, ``MOEPREP_KERNELS=off``), ``available()``
is False, the loader holds experts in its torch forms, and says so once (``KernelNotice``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("qdot.c")
BUILD = Path(__file__).with_name("build")
ENV = "MOEPREP_KERNELS"  # "off": never build or load the library (the fallback, as on a machine without a compiler)
THREADS_ENV = "MOEPREP_KERNEL_THREADS"  # the threads a product runs on (default: every core this process may use)
KIND_MXFP4 = 1  # qdot.c's kind for MXFP4; the others are bits per code
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-fno-math-errno")


class KernelNotice(UserWarning):
    """The compiled kernels are unavailable here: experts are held in the torch forms instead."""


class QMat(ctypes.Structure):
    """``qmat`` of ``qdot.c``: one stored matrix's shape, format and the addresses of its parts."""

    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("group", ctypes.c_int32), ("meta", ctypes.c_int32),
                ("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("scale_meta", ctypes.c_void_p), ("zero_meta", ctypes.c_void_p)]


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return BUILD / f"qdot-{digest}.so"


def build(quiet: bool = True) -> Path:
    """The library, compiled unless already built from this source; raises ``RuntimeError`` naming the cause."""
    target = library_path()
    if target.exists():
        return target
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    BUILD.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=BUILD, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{Path(cc).name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        os.replace(tmp, target)  # atomic: a second process building at once finds a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for stale in BUILD.glob("qdot-*.so"):  # builds of earlier sources (a process that loaded one keeps its copy)
        if stale != target:
            stale.unlink(missing_ok=True)
    if not quiet:
        print(f"built {target}")
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(ENV, "").lower() in ("off", "0", "no"):
        _notice(f"{ENV}={os.environ[ENV]}")
        return None
    try:
        try:
            lib = ctypes.CDLL(str(build()))
        except OSError:  # a damaged build (a copy cut short): build it again, once
            library_path().unlink(missing_ok=True)
            lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        _notice(str(e))
        return None
    lib.qdot_matmul.argtypes = [ctypes.POINTER(QMat), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_int]
    lib.qdot_experts.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.qdot_check.argtypes = lib.qdot_path.argtypes = [ctypes.POINTER(QMat)]
    lib.qdot_read.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    lib.qdot_read.restype = ctypes.c_uint64
    return lib


def _notice(cause: str) -> None:
    warnings.warn(f"moeprep: the compiled expert kernels are unavailable ({cause}); experts are held in the torch "
                  "forms instead (slower, and low-bit experts take their decoded size in the cache). Run `make setup` "
                  "on a machine with a C compiler to build them.", KernelNotice, stacklevel=3)


@functools.cache
def default_threads() -> int:
    """Every core this process may use (``MOEPREP_KERNEL_THREADS`` pins it). Unlike torch's team, whose product
    waits for its slowest thread, the kernels' threads claim rows a chunk at a time, so a reader thread woken on a
    core delays a product by one chunk: the kernels use the cores the readers leave idle at that moment."""
    pinned = os.environ.get(THREADS_ENV, "")
    if pinned.isdigit() and int(pinned) > 0:
        return int(pinned)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _free_threads() -> int:
    """``default_threads()`` less torch's other intra-op threads: where torch runs a team (a prompt's forward),
    its threads spin on their cores between products, and a kernel thread there would wait for them."""
    return max(1, default_threads() - torch.get_num_threads() + 1)


def available() -> bool:
    """Whether the compiled kernels run here (built, loaded, not switched off)."""
    return _library() is not None


class StoredMatrix:
    """One stored matrix [N, K] the kernels compute from: its ``QMat`` and the tensors it points into (kept alive)."""

    def __init__(self, kind: int, shape: tuple[int, int], group: int, meta: int, parts: dict) -> None:
        self.shape = shape
        self._parts = parts  # the views the addresses point into
        address = {name: (t.data_ptr() if t is not None else None) for name, t in parts.items()}
        self.qmat = QMat(kind, shape[0], shape[1], group, meta, address["codes"], address.get("scale"),
                         address.get("zero"), address.get("scale_meta"), address.get("zero_meta"))

    def problem(self) -> int:
        """0 when the library computes this matrix (``qdot_check``'s code otherwise)."""
        return _library().qdot_check(ctypes.byref(self.qmat))

    def simd(self) -> bool:
        """Whether this matrix runs on the AVX2 path here (else the portable one)."""
        return bool(_library().qdot_path(ctypes.byref(self.qmat)))

    def matmul(self, x: torch.Tensor, threads: int | None = None, simd: bool = True) -> torch.Tensor:
        """``x`` [T, K] (any float dtype) times the matrix's transpose: [T, N] float32, on ``threads`` (default:
        the cores torch's own threads leave, ``_free_threads``); ``simd`` False keeps to the portable path. The result does not depend on the
        threads: each row is computed whole by one of them."""
        x = x.to(torch.float32).contiguous()
        t = x.shape[0]
        y = torch.empty(t, self.shape[0], dtype=torch.float32)
        status = _library().qdot_matmul(ctypes.byref(self.qmat), x.data_ptr(), t, y.data_ptr(),
                                        threads or _free_threads(), int(simd))
        if status:
            raise RuntimeError(f"qdot_matmul failed ({'out of memory' if status == 2 else 'bad matrix'})")
        return y


MAX_EXPERTS = 16  # qdot.c's MAX_SEGS: experts one ``experts_product`` call takes


def experts_product(gate_up: list[StoredMatrix], down: list[StoredMatrix], weights: list[float], x: torch.Tensor,
                    threads: int | None = None, simd: bool = True) -> torch.Tensor:
    """One token ``x`` [1, K] through gated experts in one call: ``sum_e weights[e] * down_e(silu(g_e) * u_e)``
    with ``g_e`` the first half of ``gate_up_e @ x`` and ``u_e`` the second; [1, H] float32. Every expert's gate_up
    rows are one job over the threads and their down rows another, so two experts cost two dispatches, not four,
    and no float copy is made between them."""
    n = len(gate_up)
    if not 1 <= n <= MAX_EXPERTS or len(down) != n or len(weights) != n:
        raise ValueError(f"experts_product takes 1 to {MAX_EXPERTS} experts with a down matrix and a weight each")
    x = x.to(torch.float32).contiguous()
    y = torch.empty(1, down[0].shape[0], dtype=torch.float32)
    pointers = (ctypes.c_void_p * (2 * n))(*[ctypes.addressof(m.qmat) for m in (*gate_up, *down)])
    w = (ctypes.c_float * n)(*weights)
    status = _library().qdot_experts(pointers, ctypes.addressof(pointers) + n * ctypes.sizeof(ctypes.c_void_p), w, n,
                                     x.data_ptr(), y.data_ptr(), threads or _free_threads(), int(simd))
    if status:
        raise RuntimeError(f"qdot_experts failed ({'out of memory' if status == 2 else 'matrices that do not fit'})")
    return y


def main(argv: list[str]) -> int:
    """``python -m loader.kernels``: build the library now (``make setup`` runs it), or say why it cannot be."""
    try:
        build(quiet="-q" in argv)
    except RuntimeError as e:
        print(f"moeprep: the expert kernels were not built ({e}); the loader will use its torch forms",
              file=sys.stderr)
    return 0


def read_bytes(buffer: torch.Tensor, threads: int) -> int:
    """Read every byte of the contiguous CPU tensor ``buffer`` once on ``threads`` threads (an xor of them): the
    bench's measure of the read bandwidth the kernels are held to."""
    return int(_library().qdot_read(buffer.data_ptr(), buffer.numel() * buffer.element_size(), threads))


def takes(spec) -> bool:
    """Whether the kernels compute the stored matrix ``spec`` (``loader.codec.MatrixSpec``) from its bits: a 2-D
    int2/int3/int4/int8 matrix in the codec's own parts with groups a multiple of 16, or an MXFP4 one."""
    from loader.vocab import BITS, MX

    if len(spec.shape) != 2 or spec.rows or spec.kernel:
        return False
    if spec.precision in MX:
        return True
    return spec.precision in BITS and spec.group_size % 16 == 0 and spec.shape[1] % spec.group_size == 0


def stored_matrix(spec, parts: dict[str, torch.Tensor]) -> StoredMatrix:
    """The kernels' view of the stored matrix ``spec`` (``takes(spec)``) inside a record split into ``parts``
    (``RecordLayout.split``): addresses only, nothing copied."""
    from loader.vocab import BITS, MX

    name = spec.name
    if spec.precision in MX:
        return StoredMatrix(KIND_MXFP4, spec.shape, 32, 0, {"codes": parts[f"{name}.codes"],
                                                            "scale": parts[f"{name}.scales"]})
    if spec.meta_group:
        views = {"scale": parts[f"{name}.scale.q"], "zero": parts[f"{name}.zero.q"],
                 "scale_meta": parts[f"{name}.scale.meta"], "zero_meta": parts[f"{name}.zero.meta"]}
    else:
        views = {"scale": parts[f"{name}.scale"], "zero": parts[f"{name}.zero"]}
    return StoredMatrix(BITS[spec.precision], spec.shape, spec.group_size, spec.meta_group,
                        {"codes": parts[f"{name}.codes"], **views})
