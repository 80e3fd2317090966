"""One worker's paged-KV LLM runtime. Start with ``LLM`` and ``SamplingParams``."""

from importlib import import_module

__all__ = ["LLM", "LLMEngine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]

# Loaded on first use, so that importing a pure-Python submodule (``engine.core.scheduler``,
# ``engine.core.block_pool``) does not pull in torch through the package.
_EXPORTS = {
    "EngineConfig": "engine.config",
    "LLM": "engine.llm",
    "EngineStats": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.llm_engine",
    "SamplingParams": "engine.wire.sampling_params",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
