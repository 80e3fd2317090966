"""How ``LLMEngine`` (``engine.llm_engine``) is put together past its tokenizer.

Two steps, in this order: ``load_shard`` loads this rank's shard of the model, sizes the
KV cache from one rank's bytes per block (and tells the other tensor-parallel ranks that
size), and makes the cache and the attention backend; ``make_runner`` makes the model
runner over them, with its LoRA slots (the adapters named at start loaded) and its CUDA
graphs, every bucket captured before the first step. The engine keeps what these return
as its attributes and makes its scheduler, block manager and remote-KV intake over them
itself (``LLMEngine._make_parts``, again on a reset). The other ranks build their side
in ``engine.ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.model.attention import create_attention_backend
from engine.model.cuda_graphs import step_graphs_for
from engine.model.kv_cache import KVCache, bytes_per_block
from engine.model.loader import load_model, resolve_dtype
from engine.model.lora import LoRASlots
from engine.model.model_runner import ModelRunner

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model.gguf_checkpoint import GGUFFile
    from engine.model.model import DecoderModel
    from engine.model.model_config import ModelConfig
    from engine.model.step_layout import AttentionBackend
    from engine.ranks import TensorParallel
    from engine.structured_output import StructuredOutputs

__all__ = ["Shard", "load_shard", "make_runner"]


@dataclass(frozen=True)
class Shard:
    """This rank's model, KV cache and attention backend, and the cache's size in blocks:
    ``num_cpu_blocks`` is the one host pool, swap space then the host tier's
    ``host_cache_blocks`` (``engine.core.host_tier``)."""

    model: DecoderModel
    kv_cache: KVCache
    attention: AttentionBackend
    num_blocks: int
    num_cpu_blocks: int
    host_cache_blocks: int


def load_shard(
    config: EngineConfig, model_config: ModelConfig, source: str | Path | GGUFFile, tp: TensorParallel
) -> Shard:
    """This rank's model, KV cache and attention backend; the cache's size, sized from one
    rank's bytes per block, goes to the other ranks (``tp.start``) before the cache is made."""
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model = load_model(source, dtype, device, pack=config.pack_weights, tp=tp.group)
    per_block = bytes_per_block(model_config, config.block_size, dtype, tp_size=tp.size)
    num_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory // per_block)
    # One host pool: swap space, then the host tier's blocks (engine.core.host_tier).
    host_cache_blocks = config.host_kv_cache_memory // per_block
    num_cpu_blocks = config.swap_space // per_block + host_cache_blocks
    tp.start(num_blocks, num_cpu_blocks)
    kv_cache = KVCache(model_config, num_blocks, config.block_size, dtype, device, num_cpu_blocks, tp=tp.shard)
    attention = create_attention_backend(
        config.attention_backend, device, config.block_size, model_config.head_dim, dtype
    )
    return Shard(model, kv_cache, attention, num_blocks, num_cpu_blocks, host_cache_blocks)


def make_runner(
    config: EngineConfig, shard: Shard, structured: StructuredOutputs, max_model_len: int, tp_size: int
) -> tuple[ModelRunner, LoRASlots | None]:
    """The model runner over ``shard`` and its LoRA slots (None without ``max_loras``), the
    adapters ``config`` names loaded and every CUDA graph bucket captured."""
    # Above one rank steps run eagerly: a captured step would have to replay its collectives
    # in step with the other ranks' graphs, which nothing captures yet.
    graphs = step_graphs_for(
        shard.model, shard.kv_cache, shard.attention, config.max_num_seqs, max_model_len,
        config.max_num_batched_tokens, config.cuda_graphs and tp_size == 1,
    )  # fmt: skip
    lora = LoRASlots(shard.model, config.max_loras, config.max_lora_rank) if config.max_loras else None
    if lora is not None:
        for name, path in config.lora_adapters.items():
            lora.load(name, path)  # (the other ranks load these themselves)
    runner = ModelRunner(shard.model, shard.kv_cache, shard.attention, structured, graphs, lora)
    for g in graphs:  # every bucket now, so that no step waits on a capture
        g.capture_all()
    return runner, lora
