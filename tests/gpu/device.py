"""Where the GPU tests run: on CUDA at serving sizes, or on CPU at small sizes.

``TANDEM_TEST_DEVICE`` chooses (``cuda`` or ``cpu``); unset, it is ``cuda`` when torch
sees a device and ``cpu`` otherwise. On CPU the same test functions and references run
with Triton's kernels in its interpreter, so a wrong reference or a broken import fails
in CI rather than first on a GPU. ``TANDEM_TEST_DEVICE=cuda`` on a machine without CUDA
is an error, not a quiet CPU run (``scripts/gpu-check`` sets it).

TRITON_INTERPRET must be set before triton decorates the kernels, i.e. before
``engine.model.triton_attention`` is first imported: the folder's conftest imports this module
first.
"""

from __future__ import annotations

import os

import torch

_CHOICES = ("cuda", "cpu")


def _test_device() -> str:
    name = os.environ.get("TANDEM_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in _CHOICES:
        raise RuntimeError(f"TANDEM_TEST_DEVICE must be one of {_CHOICES}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "TANDEM_TEST_DEVICE=cuda, but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda})"
        )
    return name


DEVICE = _test_device()
ON_GPU = DEVICE == "cuda"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def sync() -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if ON_GPU:
        torch.cuda.synchronize()
