"""The checks a request passes on its way into an engine.

Each is a ValueError that names what is wrong and the limit (the user's error, not the
engine's): the prompt, text or token ids, must be non-empty, its ids within the
vocabulary, shorter than ``max_model_len`` and within the KV pool (``checked_prompt_ids``); a
migrated stream's prompt and resumed output must fit the pool together
(``check_resumed_fits``); the sampling parameters must stay within the vocabulary and a
structured-output spec within the grammar bounds (``check_params``). ``LLMEngine``
(``engine.llm_engine``) runs them with its limits of the moment (a reset may change
``max_model_len`` and the block manager), before a request takes anything; the LoRA
adapter a request names is looked up in ``engine.adapters``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.grammar import precheck as precheck_structured_output

if TYPE_CHECKING:
    from engine.core.block_pool import KVCacheManager
    from engine.grammar import GrammarLimits
    from engine.structured_output import StructuredOutputs
    from engine.tokenizer import Tokenizer
    from engine.wire.sampling_params import SamplingParams

__all__ = ["check_params", "check_resumed_fits", "checked_prompt_ids"]


def checked_prompt_ids(
    prompt: str | Sequence[int], tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
    kv_manager: KVCacheManager, block_size: int,
) -> list[int]:
    """The prompt's token ids (text tokenized), validated; ValueError names what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt_token_ids must be integers in [0, {vocab_size}), got {t!r}")
    if not ids:
        raise ValueError("prompt must not be empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens; it must be shorter than max_model_len "
            f"({max_model_len}) to leave room for output"
        )
    if not kv_manager.fits_in_pool(len(ids) + 1):
        raise ValueError(
            f"prompt has {len(ids)} tokens, more than the KV cache holds "
            f"({kv_manager.pool.num_usable_blocks} blocks of {block_size}); "
            "raise num_kv_blocks or kv_cache_memory"
        )
    return ids


def check_resumed_fits(
    num_prompt_tokens: int, resume_output: Sequence[int], kv_manager: KVCacheManager, block_size: int
) -> None:
    """A migrated stream's prompt and output together must fit the pool (the prompt
    alone was checked): else it would be preempted for good and end early."""
    total = num_prompt_tokens + len(resume_output)
    if resume_output and not kv_manager.fits_in_pool(total + 1):
        raise ValueError(
            f"prompt and resumed output have {total} tokens, more than the KV cache holds "
            f"({kv_manager.pool.num_usable_blocks} blocks of {block_size})"
        )


def check_params(
    params: SamplingParams, structured: StructuredOutputs, limits: GrammarLimits, vocab_size: int
) -> None:
    """The sampling parameters' token ids within the vocabulary, and a structured-output
    spec within ``limits``' bounds."""
    so = params.structured_output
    if so is not None and not structured.cached(so):  # a cached spec passed the bounds before
        # Only the bounds, in milliseconds: the parse is the compile thread's (a spec
        # that does not parse ends its request with an error there).
        precheck_structured_output(so, limits=limits)
    params.check_vocab(vocab_size)
