"""What ``scripts/gpu-check`` runs imports on the GPU image, which has no serving stack.

That image holds torch, triton, transformers, safetensors, tokenizers, jinja2, pytest
and prometheus-client, and nothing is installed on it. A subprocess that refuses the
packages it lacks imports the engine and ``bench.gpu`` and collects ``tests/gpu``: a
module-level ``import ray`` there would fail the check on the GPU machine first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSENT_ON_GPU_IMAGE = ("ray", "fastapi", "starlette", "uvicorn", "httpx", "grpc", "openai", "hypothesis")

_CHECK = """
import sys

class Hide:
    '''Finds nothing for the absent packages, as on a machine without them.'''

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {absent!r}:
            return None
        return self.inner.find_spec(name, path, target)

sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
import engine.llm, engine.triton_attention, bench.gpu  # noqa: E401
import pytest
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"])
sys.exit(int(code))
"""


def test_engine_bench_and_gpu_tests_import_without_the_serving_stack():
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "TANDEM_TEST_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK.format(absent=ABSENT_ON_GPU_IMAGE)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"importing the engine, bench.gpu or tests/gpu without {ABSENT_ON_GPU_IMAGE} failed:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    assert " tests collected" in proc.stdout, f"tests/gpu collected nothing:\n{proc.stdout[-2000:]}"
