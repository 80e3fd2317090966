"""One worker's paged-KV LLM runtime. Start with ``LLM`` and ``SamplingParams``."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]
