"""The CPU attention backend: decode rows read the paged KV cache in place.

``TorchAttention`` gathers each decode group's blocks into a padded copy and calls
SDPA; on a CPU that spends most of its time in the copies and in the per-matrix
overhead of thousands of tiny matmuls (a [G, D] x [D, ctx] product per request and
KV head). ``CpuAttention`` runs decode rows through a small C kernel
(``engine/model/csrc/paged_attention.c``) that walks each request's block table and reads
every key and value once; prefill chunks, whose queries make real matmuls, stay on
the torch path.

The kernel is compiled on first use with the machine's C compiler (``$CC``, else
``cc``; about a second) for this CPU (``-march=native``) and cached under
``$TANDEM_HOME/kernels``, keyed by the source, the flags and the CPU's feature
flags, so a cache shared between machines never hands one a binary it cannot run.
Without a compiler, ``attention_backend: auto`` falls back to ``torch`` with one
warning; ``attention_backend: cpu`` is an error that names the compiler's complaint.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.attention import AttentionMetadata, TorchAttention
from engine.model.model_registry import tandem_home
from engine.model.step_layout import StepLayout

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")
COMPILE_TIMEOUT_S = 120


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here; the message says why."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _library_path() -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), _compiler().encode(), _cpu_flags().encode()):
        key.update(part)
    return tandem_home() / "kernels" / f"paged_attention-{platform.machine()}-{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    """Compile into a temporary file next to ``target``, then rename: concurrent
    builders (several workers starting at once) each finish with a whole library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
    os.close(fd)
    command = [_compiler(), *CFLAGS, "-o", tmp, str(SOURCE), "-lm"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        raise KernelUnavailable(f"cannot compile the CPU attention kernel with {command[0]!r}: {exc}") from exc
    if done.returncode != 0:
        os.unlink(tmp)
        raise KernelUnavailable(
            f"compiling the CPU attention kernel failed ({' '.join(command)}): {done.stderr.strip()[-2000:]}"
        )
    os.replace(tmp, target)


@functools.cache
def load_kernel() -> ctypes._CFuncPtr:
    """The compiled ``tandem_paged_decode_f32``, built on first use; ``KernelUnavailable``
    says why not. Loaded after torch, so the kernel's OpenMP is torch's own libgomp."""
    path = _library_path()
    if not path.exists():
        _build(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load the CPU attention kernel {path}: {exc}") from exc
    fn = lib.tandem_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return fn


def kernel_available() -> bool:
    """Whether the kernel builds and loads here; the first failure is logged once."""
    try:
        load_kernel()
    except KernelUnavailable as exc:
        _warn_once(str(exc))
        return False
    return True


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("attention_backend auto: using torch on the CPU (%s)", reason)


@dataclass
class PagedDecode:
    """The step's decode rows (rows 0..B-1) as the kernel reads them."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (never read)
    context_lens: torch.Tensor  # [B] int64, the new token included


_ERRORS = {-1: "bad head, block or window sizes", -2: "a context length outside its block table", -3: "out of memory"}


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: PagedDecode, scale: float, out: torch.Tensor,
    window: int = 0,
) -> None:
    """Decode attention of ``q`` ([B, Hq, D]) over the paged caches into ``out`` (both
    float32 and contiguous; the caches' new K/V already written); ``window`` > 0: over
    each row's ``window`` latest keys only."""
    tensors = (q, k_cache, v_cache, out)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("CPU paged attention reads raw memory: q, the caches and out must be contiguous")
    if any(t.dtype != torch.float32 for t in tensors):
        raise ValueError(f"CPU paged attention runs float32, got {sorted({str(t.dtype) for t in tensors})}")
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    status = load_kernel()(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        rows.block_tables.data_ptr(), rows.context_lens.data_ptr(), out.data_ptr(),
        num_rows, num_heads, num_kv_heads, head_dim, block_size, rows.block_tables.shape[1],
        scale, window, torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise RuntimeError(f"CPU paged attention failed: {_ERRORS.get(status, status)}")


class CpuAttention(TorchAttention):
    """Float32 on the CPU: decode rows through the C kernel, prefill chunks as in torch."""

    name = "cpu"

    def __init__(self, block_size: int, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, got device {device}")
        load_kernel()  # raises KernelUnavailable with the compiler's message
        super().__init__(block_size, device)

    def build_metadata(self, layout: StepLayout) -> AttentionMetadata:
        lens = layout.decode_context_lens
        return AttentionMetadata(
            slot_mapping=torch.tensor(layout.slots, dtype=torch.long),
            decodes=[],
            prefills=[self._chunk(c) for c in layout.chunks],
            workspace=self._workspace,
            paged_decode=PagedDecode(
                block_tables=torch.from_numpy(layout.decode_block_table),
                context_lens=torch.tensor(lens, dtype=torch.long),
            ) if lens else None,
        )  # fmt: skip

    def _attend_decodes(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, window: int) -> None:
        rows = meta.paged_decode
        if rows is None:
            return
        b = rows.context_lens.shape[0]
        paged_decode(q[:b].contiguous(), k_cache, v_cache, rows, scale, out[:b], window)
