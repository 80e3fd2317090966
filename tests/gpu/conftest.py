"""The GPU tests: every test in this folder is marked ``gpu``.

They run on CUDA at serving sizes, or, without CUDA (or with
``TANDEM_TEST_DEVICE=cpu``), on CPU at small sizes with Triton's interpreter: see
``tests/gpu/device.py``, imported first so that TRITON_INTERPRET is set before any test
module imports triton. Tests that need CUDA itself (NCCL-free GPU transfers between Ray
actors) skip on CPU, saying why.

Nothing here imports ray, triton or ``engine.model.triton_attention`` at module level: the GPU
image has no ray, and the kernels must be decorated after TRITON_INTERPRET is chosen.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu import device  # noqa: F401  (sets TRITON_INTERPRET on CPU)

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
