"""The preflight of ``scripts/gpu-check`` passes on a machine that can run the kernels,
and names what is missing on one that cannot."""

from __future__ import annotations

import pytest

from tests.gpu.preflight import PreflightError, c_compiler, check_python_extension_builds, python_include, run_checks


def test_preflight_passes_here_with_a_compiler_python_h_and_a_launched_kernel():
    result = run_checks()
    assert result["ok"], f"preflight failed: {result.get('error')}"
    assert result["triton_kernel_s"] > 0 and result["c_compiler"]


def test_no_c_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    with pytest.raises(PreflightError, match="no C compiler"):
        c_compiler(env={})


def test_a_compiler_given_in_cc_is_the_one_used():
    assert c_compiler(env={"CC": "/opt/my-cc"}) == "/opt/my-cc"


def test_missing_python_h_is_named(tmp_path):
    with pytest.raises(PreflightError, match="no Python.h"):
        check_python_extension_builds(c_compiler(), tmp_path)


def test_a_compiler_that_fails_is_reported_with_its_command():
    with pytest.raises(PreflightError, match="false .* failed"):
        check_python_extension_builds("false", python_include())
