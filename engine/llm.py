"""The offline API: ``LLM(...).generate(prompts, params)`` runs a batch to completion."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from engine.wire.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Offline generation over the engine's continuous batching.

    ``LLM(model=None)`` uses the built-in default model; keyword arguments are
    ``EngineConfig`` fields. With ``tensor_parallel_size=N`` above 1 it starts N - 1 rank
    processes on this host (``engine.ranks``); ``close()``, or leaving a ``with LLM(...)``
    block, stops them (else they are stopped when the ``LLM`` is collected or the
    interpreter exits).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if it has any. Idempotent."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapter: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts, each
        with its whole output (and its prompt's logprobs, when asked for). ``adapter``: the
        LoRA adapter (loaded, by name) every prompt runs under, or one per prompt (None: the
        base model)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
            )
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        adapters = [adapter] * len(prompts) if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} adapters for {len(prompts)} prompts")
        encoded = [self.engine.encode_prompt(p) for p in prompts]
        for name in set(adapters):
            self.engine.check_adapter(name)
        params = [sp if a is None else dataclasses.replace(sp, adapter=a) for sp, a in zip(sampling_params, adapters)]
        ids = [self.engine.add_request(p, sp) for p, sp in zip(encoded, params)]
        final: dict[str, RequestOutput] = {}
        prompt_logprobs: dict[str, list] = {}  # come with a request's first output
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    out.prompt_logprobs = prompt_logprobs.pop(out.request_id, None)
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stats(self) -> EngineStats:
        """The engine's load and running totals (``LLMEngine.stats``)."""
        return self.engine.stats()
