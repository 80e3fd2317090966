"""Tests that need a CUDA device: every test in this folder is marked ``gpu`` and is
skipped, with the reason, on a machine without one.

Nothing here imports triton or ``engine.triton_attention`` at module level: on a CPU
machine the unit tests run those kernels in Triton's interpreter, which must be chosen
before the module is first imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent
# A skipif on the test itself is evaluated before any module's own skipif, so a machine
# without CUDA reports this reason everywhere.
_NO_CUDA = pytest.mark.skipif(True, reason="needs CUDA (torch.cuda.is_available() is False)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(_NO_CUDA)
