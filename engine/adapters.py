"""An engine's LoRA adapters by name: loading one on every rank, unloading one that no
request runs under, and the key of the adapter a request names.

The adapters themselves, their device slots and the batched step over them are
``engine.model.lora.LoRASlots`` (an engine holds one when ``EngineConfig.max_loras`` is
set, None otherwise); ``LLMEngine.load_adapter``, ``unload_adapter`` and
``check_adapter`` (``engine.llm_engine``) call these, rank 0 first, then the other
tensor-parallel ranks (``engine.ranks.TensorParallel.adapter``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Request
    from engine.model.lora import LoRASlots
    from engine.ranks import TensorParallel

__all__ = ["adapter_key", "load_on_every_rank", "unload_unused"]


def load_on_every_rank(lora: LoRASlots | None, tensor_parallel: TensorParallel, name: str, path: str) -> None:
    """Load the PEFT adapter at ``path`` as ``name`` here, then on the other ranks."""
    if lora is None:
        raise ValueError("this engine serves no LoRA adapters: start it with max_loras >= 1")
    lora.load(name, path)  # checked here first: the other ranks then read theirs
    tensor_parallel.adapter(name, path)


def unload_unused(
    lora: LoRASlots | None, tensor_parallel: TensorParallel, requests: Iterable[Request], name: str
) -> None:
    """Forget the adapter ``name`` on every rank unless one of ``requests`` runs under it
    (ValueError names them); KeyError when it is not loaded."""
    if lora is None or name not in lora.loaded:
        raise KeyError(f"adapter {name!r} is not loaded")
    key = lora.loaded[name].key
    users = [r.request_id for r in requests if r.adapter == key]
    if users:
        raise ValueError(f"adapter {name!r} is in use by {len(users)} requests ({users[:3]}...)")
    lora.unload(name)
    tensor_parallel.adapter(name, None)


def adapter_key(lora: LoRASlots | None, name: str | None) -> str | None:
    """The key (``Adapter.key``) of the loaded adapter ``name`` (None for None, the base
    model); ValueError names an unknown one."""
    if name is None:
        return None
    if lora is None or name not in lora.loaded:
        loaded = sorted(lora.loaded) if lora is not None else []
        raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
    return lora.loaded[name].key
