"""Imports of the packages only some paths need, failing with the package's name.

gguf (reading GGUF files) and xgrammar (structured output) are installed with Tandem
but absent from lighter machines, such as the GPU image ``scripts/gpu-check`` runs on
(``tests/gpu/image-packages.txt``): the engine imports them where a GGUF is read or a
grammar compiled, through :func:`optional_import`, so a plain Hugging Face checkpoint
serves without them and a missing one says what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def optional_import(module: str, needed_for: str, package: str | None = None) -> ModuleType:
    """``module`` imported; raises ImportError naming ``package`` (default: ``module``)
    and what needs it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = package or module
        raise ImportError(f"{needed_for} needs the {package!r} package (pip install {package})") from e
