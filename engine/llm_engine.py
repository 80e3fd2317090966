"""One worker's engine: requests in, token deltas out, one ``step()`` at a time.

``LLMEngine`` is the step loop over four parts: the scheduler plans a step, the model
runner computes and samples it, the scheduler applies the results, and the output
processor (``engine.output_processor``) turns the new tokens into deltas (text, stop
strings, logprobs). The remote-KV intake (``engine.remote_kv``) is the decode role's way
in: requests whose prompt KV another worker computes. The prefill and decode workers
drive this same engine.

A request's way through: ``add_request`` validates and tokenizes it and hands it to
the scheduler; each ``step`` that samples a token for it yields a ``RequestOutput``
with the new ids and text; the last one has ``finished=True`` and a finish reason
(``stop``, ``length`` or ``abort``). Finished requests free their blocks at once.

A request with a structured-output constraint waits outside the scheduler until its
grammar is compiled (``engine.structured_output``; a cached grammar is ready at
once), then enters it like any other. Each step the sampler masks its logits row with
the grammar's token bitmask, and a request whose matcher terminates finishes with
``stop``. ``add_request`` checks only the spec's bounds (``EngineConfig.grammar``;
a ValueError naming the limit); a spec that does not parse, or whose compile runs past
``compile_timeout_s``, ends its request with finish reason ``error`` and the reason in
``stop_reason``.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core.block_hash import BlockHasher
from engine.core.block_pool import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.grammar import precheck as precheck_structured_output
from engine.model.attention import create_attention_backend
from engine.model.cuda_graphs import step_graphs_for
from engine.model.gguf_checkpoint import is_gguf, open_gguf
from engine.model.kv_cache import KVCache, bytes_per_block
from engine.model.loader import load_model, resolve_dtype
from engine.model.lora import LoRASlots
from engine.model.model_config import ModelConfig
from engine.model.model_registry import resolve_model
from engine.model.model_runner import ModelRunner
from engine.model.runner_input import RunnerInputBuilder
from engine.model.sampler import TokenLogprobs
from engine.output_processor import OutputProcessor, RequestOutput, RequestTimes
from engine.ranks import TensorParallel, start_ranks
from engine.remote_kv import Arrival, RemoteKVIntake
from engine.structured_output import GrammarPen, StructuredOutputs
from engine.tokenizer import Tokenizer
from engine.wire.sampling_params import SamplingParams

__all__ = ["EngineLoad", "EngineStats", "LLMEngine", "RequestOutput", "RequestTimes"]


@dataclass
class EngineStats:
    """The engine's load plus running totals since it was built (preemptions, prefix cache, steps,
    tokens, model-runner time): what ``stats()`` returns for metrics and worker stats."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_blocks_in_use: int
    kv_cache_usage: float
    num_preemptions: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    prompt_tokens: int
    generation_tokens: int
    # Time in the model runner (inputs, forward, sampling) over all steps: wall clock,
    # and CPU of the step thread (below the wall clock when the step waited for a core).
    forward_s: float = 0.0
    forward_cpu_s: float = 0.0
    num_window_released_blocks: int = 0  # blocks given back from behind a sliding window
    # The host tier behind the prefix cache (EngineConfig.host_kv_cache_memory), in blocks:
    # its size, its entries now, the evicted blocks copied into it and those restored
    # from it (hits), and the prompt tokens those hits served.
    host_cache_blocks: int = 0
    host_cache_blocks_used: int = 0
    host_cache_spills: int = 0
    host_cache_restores: int = 0
    host_cache_hits: int = 0
    # LoRA (EngineConfig.max_loras): the adapters in a device slot now, by name, least
    # recently used first, and the adapters written into a slot and pushed out of one so far.
    lora_resident_adapters: tuple[str, ...] = ()
    lora_loads: int = 0
    lora_evictions: int = 0

    @property
    def host_cache_hit_rate(self) -> float:
        """Of the admitted prompt tokens the device's cache missed, the share the host tier served."""
        missed = self.prefix_cache_queries - (self.prefix_cache_hits - self.host_cache_hits)
        return self.host_cache_hits / missed if missed else 0.0

    @property
    def lora_resident(self) -> int:
        """The LoRA adapters in a device slot now."""
        return len(self.lora_resident_adapters)


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is now, in counts: what a worker's load report is made of."""

    num_running: int
    num_waiting: int  # to be scheduled (their grammar may still be compiling)
    num_swapped: int
    num_waiting_for_kv: int  # blocks reserved, KV on its way from another worker
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class LLMEngine:
    """One worker's model, KV cache and scheduler behind one door (``add_request``, ``abort``,
    ``step``, ``load``, ``stats``): the step loop over the scheduler, the model runner (fed
    ``RunnerInputBuilder``'s deltas), the output processor and, in the decode role, the remote-KV
    intake. A worker (``WorkerBase``), ``LLM`` or a benchmark builds it; it is not thread-safe: in
    a worker only ``AsyncEngine``'s step thread calls it."""

    def __init__(
        self, config: EngineConfig | None = None, tensor_parallel: TensorParallel | None = None, **overrides
    ) -> None:
        """``tensor_parallel``: rank 0's side of ranks the caller started (``engine.ranks``);
        None starts ``config.tensor_parallel_size - 1`` rank processes on this host (none at 1),
        which ``close`` stops."""
        config = config or EngineConfig(**overrides)
        self.config = config
        resolved = resolve_model(config.model)
        self.model_dir = resolved.path  # a checkpoint directory or a .gguf file
        self.model_name = resolved.name  # the name the API serves it under
        # A GGUF file is opened once: reading its metadata takes seconds.
        source = open_gguf(self.model_dir) if is_gguf(self.model_dir) else self.model_dir
        self.model_config = ModelConfig.from_pretrained(source)
        self.tokenizer = Tokenizer.from_pretrained(source)
        self.max_model_len = min(config.max_model_len or 1 << 62, self.model_config.max_model_len)
        # The ranks start first: they load their shards while this one loads its own.
        self.tensor_parallel = tensor_parallel or start_ranks(config)
        if self.tensor_parallel.size != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size is {config.tensor_parallel_size} but the ranks given "
                             f"are {self.tensor_parallel.size}")
        try:
            self._build(config, source)
        except BaseException:
            self.tensor_parallel.close()
            raise

    def _load_shard(self, config: EngineConfig, source) -> tuple[int, int]:
        """This rank's model, KV cache and attention backend; the cache's size, sized from one
        rank's bytes per block, goes to the other ranks. Returns (device, swap) blocks."""
        tp = self.tensor_parallel
        device = torch.device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        self.model = load_model(source, dtype, device, pack=config.pack_weights, tp=tp.group)
        per_block = bytes_per_block(self.model_config, config.block_size, dtype, tp_size=tp.size)
        num_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory // per_block)
        # One host pool: swap space, then the host tier's blocks (engine.core.host_tier).
        self.host_cache_blocks = config.host_kv_cache_memory // per_block
        num_cpu_blocks = config.swap_space // per_block + self.host_cache_blocks
        tp.start(num_blocks, num_cpu_blocks)
        self.kv_cache = KVCache(
            self.model_config, num_blocks, config.block_size, dtype, device, num_cpu_blocks, tp=tp.shard
        )
        self.attention = create_attention_backend(
            config.attention_backend, device, config.block_size, self.model_config.head_dim, dtype
        )
        return num_blocks, num_cpu_blocks

    def _build(self, config: EngineConfig, source) -> None:
        """Everything past the tokenizer: the shard, the runner, the scheduler and its helpers."""
        num_blocks, num_cpu_blocks = self._load_shard(config, source)
        # The logits' width, not the tokenizer's size: ids past the tokenizer are masked too.
        self.structured = StructuredOutputs(
            self.tokenizer,
            self.model_config.vocab_size,
            self.tokenizer.eos_token_ids or self.model_config.eos_token_ids,
            config.grammar,
        )
        # Above one rank steps run eagerly: a captured step would have to replay its collectives
        # in step with the other ranks' graphs, which nothing captures yet.
        graphs = step_graphs_for(
            self.model, self.kv_cache, self.attention, config.max_num_seqs, self.max_model_len,
            config.max_num_batched_tokens, config.cuda_graphs and self.tensor_parallel.size == 1,
        )  # fmt: skip
        self.lora = LoRASlots(self.model, config.max_loras, config.max_lora_rank) if config.max_loras else None
        for name, path in config.lora_adapters.items() if self.lora is not None else ():
            self.lora.load(name, path)  # (the other ranks load these themselves)
        self.runner = ModelRunner(self.model, self.kv_cache, self.attention, self.structured, graphs, self.lora)
        for g in graphs:  # every bucket now, so that no step waits on a capture
            g.capture_all()
        # What the runner holds of each request: every step sends it deltas (it drops a
        # request the step after it ends, so this outlives a reset).
        self.runner_inputs = RunnerInputBuilder()
        self.outputs = OutputProcessor(self.tokenizer, self.structured)
        # Constrained requests waiting out their grammar's compile, new or arrived (outside the scheduler).
        self.pen = GrammarPen(self.structured)
        self._make_parts(config, num_blocks, num_cpu_blocks)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._forward_s = 0.0
        self._forward_cpu_s = 0.0
        self.last_plan: SchedulerOutput | None = None  # the latest step's (``step_shape.shape_of`` reads it)

    def _make_parts(self, config: EngineConfig, num_blocks: int, num_cpu_blocks: int) -> None:
        """A fresh block manager (every block free, the prefix cache empty), scheduler and
        remote-KV intake over them."""
        self.kv_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks,
            BlockHasher(config.prefix_hash_algo, config.prefix_hash_seed), window=self.model_config.kv_window,
            host_cache_blocks=self.host_cache_blocks,
        )
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), self.kv_manager)
        self.remote_kv = RemoteKVIntake(self.scheduler, self.kv_manager, self.kv_cache, self.pen)

    def reset(self, config: EngineConfig) -> None:
        """Start over under ``config`` on the same model and KV cache (a worker switching
        roles): every block free, the prefix cache emptied, the scheduler and its counters
        new. Only an engine that holds nothing may reset (``RuntimeError`` otherwise), and
        only to settings it can change in place (``EngineConfig.RESETTABLE``; ``ValueError``
        naming the others)."""
        if fixed := self.config.fixed_differences(config):
            raise ValueError(f"a reset cannot change {', '.join(fixed)} (the model and the KV cache stay)")
        busy = self.request_ids() + sorted(self.scheduler.held)
        if busy or self.kv_manager.pool.num_used_blocks:
            raise RuntimeError(f"the engine still holds requests {busy[:5]} or "
                               f"{self.kv_manager.pool.num_used_blocks} blocks; drain it before a reset")
        self.config = config
        self.max_model_len = min(config.max_model_len or 1 << 62, self.model_config.max_model_len)
        self._make_parts(config, self.kv_cache.num_blocks, self.kv_cache.num_cpu_blocks)
        self.outputs.clear()
        self._rng = random.Random(config.seed)
        self._prompt_tokens = self._generation_tokens = 0
        self._forward_s = self._forward_cpu_s = 0.0

    # -- intake ----------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Tokenize and validate a prompt; ValueError names what is wrong."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {t!r}")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for output"
            )
        if not self.kv_manager.fits_in_pool(len(ids) + 1):
            raise ValueError(
                f"prompt has {len(ids)} tokens, more than the KV cache holds "
                f"({self.kv_manager.pool.num_usable_blocks} blocks of {self.config.block_size}); "
                "raise num_kv_blocks or kv_cache_memory"
            )
        return ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        hold_kv: bool = False,
        resume_output: Sequence[int] = (),
    ) -> str:
        """Queue a request; returns its id. It runs under the LoRA adapter its params name.

        ``hold_kv`` (prefill role): the final output carries the ids of the blocks holding
        the prompt's KV in ``kv_blocks``, and the blocks stay allocated until
        ``release_held`` (a transfer reads them in place; ``take_held_kv`` packs them).
        ``resume_output``: tokens this request already generated elsewhere (a migrated
        stream). They are recomputed with the prompt, as after a recompute preemption,
        and count towards ``max_tokens``, penalties and the seeded random stream; the
        outputs carry only what comes after them.
        """
        request = self._make_request(prompt, params, request_id, priority, arrival_time)
        self._check_fits(request, resume_output)
        request.hold_kv = hold_kv
        request.output_token_ids = list(resume_output)
        self._track(request, resume_output)
        rid = request.request_id
        if self.pen.must_wait(rid):
            self.pen.hold(rid, request)
        else:
            self.scheduler.add_request(request)
        return request.request_id

    def add_remote_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        resume_output: Sequence[int] = (),
    ) -> tuple[list[int], int] | None:
        """Decode role: reserve blocks for a prompt whose KV another worker sends.

        ``resume_output``: a migrated stream's tokens so far (see ``add_request``); the
        prefill worker computes their KV with the prompt's, and the stream goes on after
        them. Returns the reserved block ids (in token order) and how many leading ones
        need not be sent (this engine's prefix cache holds them, or they are behind every
        layer's window: ``NULL_BLOCK_ID`` in the table), or None when the pool has no room
        now (nothing is kept; try again later or elsewhere).
        """
        request = self._make_request(prompt, params, request_id, priority, arrival_time=None)  # arrives now
        request.output_token_ids = list(resume_output)
        reserved = self.remote_kv.reserve(request)
        if reserved is not None:
            self._track(request, resume_output)  # a constraint starts compiling while the KV is on its way
        return reserved

    def remote_kv_arrived(
        self,
        request_id: str,
        first_token: int,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        first_logprobs: TokenLogprobs | None = None,
        num_cached_tokens: int = 0,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> RequestOutput | None:
        """Write the received KV into the reserved blocks and start decoding.

        ``k``/``v``: [layers, blocks, block, Hkv, D], the blocks in prompt order from the
        first one the prefix cache did not hold (or all of them: the held ones are shared
        and not written); None when the transfer already wrote them into the reserved blocks.
        ``num_cached_tokens``: prefix-cache hits on the prefill side, for the usage.
        ``prompt_logprobs``: the prompt's, as the prefill worker computed them.
        Returns the output for the first token (sampled by the prefill worker).
        """
        if not self.remote_kv.land(request_id, k, v):
            return None
        if prompt_logprobs is not None:
            self.outputs.set_prompt_logprobs(request_id, prompt_logprobs)
        arrival = Arrival(first_token, first_logprobs, num_cached_tokens)
        request = self.remote_kv.commit(request_id, arrival)
        return None if request is None else self._first_output(request, arrival)

    def _first_output(self, request: Request, arrival: Arrival) -> RequestOutput:
        """The output of a request that joined the batch with a token sampled elsewhere."""
        request.first_scheduled_time = time.monotonic()
        self._generation_tokens += 1
        rid = request.request_id
        logprobs = {rid: arrival.first_logprobs} if arrival.first_logprobs is not None else {}
        return self._emit([request], {rid: arrival.first_token}, logprobs)[0]

    def release_held(self, request_id: str) -> None:
        """Free the blocks a finished ``hold_kv`` request still holds (its KV was read)."""
        self.scheduler.release_held(request_id)

    def take_held_kv(self, request_id: str, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A finished ``hold_kv`` request's KV packed, [layers, blocks, block, Hkv, D] each,
        from its ``kv_blocks``; its blocks are freed (an engine handing KV to another in
        the same process)."""
        k, v = self.kv_cache.gather(block_ids)
        self.release_held(request_id)
        return k, v

    def wait_for_device(self) -> None:
        """Return once the last step's KV writes have run on the device (before blocks it
        computed are offered to another process)."""
        self.runner.step_done.synchronize()

    def computed_blocks(self, request_id: str) -> list[int]:
        """Ids of a running request's blocks whose every token's KV is computed, in token
        order (a chunked prefill offers them before its last chunk). Empty for a request
        that is not running here (waiting, swapped, finished or unknown)."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return []
        full = request.num_computed_tokens // self.config.block_size
        return self.kv_manager.block_ids(request_id)[:full]

    def pin_blocks(self, request_id: str) -> list:
        """One more reference to each block of the request: they stay out of the free
        pool, whatever happens to the request, until ``unpin_blocks`` (a transfer may
        still be writing into them)."""
        return self.remote_kv.pin(request_id)

    def unpin_blocks(self, pinned: list) -> None:
        self.remote_kv.unpin(pinned)

    def remote_kv_failed(self, request_id: str, recompute: bool) -> RequestOutput | None:
        """The KV will not come: prefill locally, or end the request with an error."""
        request = self.remote_kv.fail(request_id, recompute)
        if request is None or not request.is_finished:
            return None
        return self._finish_output(request)

    def _check_fits(self, request: Request, resume_output: Sequence[int]) -> None:
        """A migrated stream's prompt and output together must fit the pool (the prompt
        alone was checked): else it would be preempted for good and end early."""
        total = request.num_prompt_tokens + len(resume_output)
        if resume_output and not self.fits(total + 1):
            raise ValueError(
                f"prompt and resumed output have {total} tokens, more than the KV cache holds "
                f"({self.kv_manager.pool.num_usable_blocks} blocks of {self.config.block_size})"
            )

    def _make_request(self, prompt, params, request_id, priority, arrival_time) -> Request:
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.holds(rid):
            raise ValueError(f"request_id {rid!r} is already in use")
        so = params.structured_output
        if so is not None and not self.structured.cached(so):  # a cached spec passed the bounds before
            # Only the bounds, in milliseconds: the parse is the compile thread's (a spec
            # that does not parse ends its request with an error there).
            precheck_structured_output(so, limits=self.config.grammar)
        params.check_vocab(self.model_config.vocab_size)
        adapter = self.check_adapter(params.adapter)  # its key: prefix hashes are rooted in it
        return Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            eos_token_ids=self.tokenizer.eos_token_ids or self.model_config.eos_token_ids,
            adapter=adapter,
        )

    def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter at ``path`` as ``name`` (``engine.model.lora.AdapterError``
        says why one does not fit; nothing changes then). Needs ``max_loras``."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with max_loras >= 1")
        self.lora.load(name, path)  # checked here first: the other ranks then read theirs
        self.tensor_parallel.adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter no request here runs under (ValueError names the ones that do)."""
        if self.lora is None or name not in self.lora.loaded:
            raise KeyError(f"adapter {name!r} is not loaded")
        key = self.lora.loaded[name].key
        users = [r.request_id for r in self.scheduler.requests.values() if r.adapter == key]
        if users:
            raise ValueError(f"adapter {name!r} is in use by {len(users)} requests ({users[:3]}...)")
        self.lora.unload(name)
        self.tensor_parallel.adapter(name, None)

    def check_adapter(self, name: str | None) -> str | None:
        """The key (``Adapter.key``) of the loaded adapter ``name`` (None for None, the base
        model); ValueError names an unknown one."""
        if name is None:
            return None
        if self.lora is None or name not in self.lora.loaded:
            loaded = sorted(self.lora.loaded) if self.lora is not None else []
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return self.lora.loaded[name].key

    def _track(self, request: Request, resume_output: Sequence[int] = ()) -> None:
        """Start following a request's output; ``resume_output``: tokens a worker it
        migrated from had already streamed (their text is not sent again)."""
        params = request.sampling_params
        rid = request.request_id
        request.sampling_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.outputs.add(request, resume_output)
        self._prompt_tokens += request.num_prompt_tokens
        if params.structured_output is not None:
            self.structured.add(rid, params.structured_output)

    def abort(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Finish requests now and free their blocks; unknown ids are ignored.

        Returns the final outputs (``finish_reason="abort"``) of the aborted requests.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            request = self.pen.pop(rid)  # an arrival held there ended with its request above
            if isinstance(request, Request):
                request.status = RequestStatus.FINISHED_ABORTED
                finished.append(request)
        return [self._finish_output(r) for r in finished]

    def _forget(self, rid: str) -> None:
        self.outputs.remove(rid)
        self.remote_kv.forget(rid)
        self.runner_inputs.forget(rid)
        self.structured.remove(rid)

    def fits(self, num_tokens: int) -> bool:
        """``num_tokens`` tokens' KV fits this engine's pool when it holds nothing else."""
        return self.kv_manager.fits_in_pool(num_tokens)

    @property
    def num_kv_blocks(self) -> int:
        """The blocks of the pool a request's KV can use (all but the null block). Fixed
        for the engine's life, so, like ``fits``, safe to read off the step thread (a
        worker's refusal says it)."""
        return self.kv_manager.pool.num_usable_blocks

    def holds(self, request_id: str) -> bool:
        """Anything here still goes by ``request_id``: a request queued, running or
        compiling its grammar, one finished whose blocks are held for a transfer, or a
        block table. Such an id is refused: a second request under it would share the
        first one's blocks, stream or hand-off."""
        return (
            request_id in self.outputs
            or request_id in self.scheduler.requests
            or request_id in self.scheduler.held
            or self.kv_manager.has_table(request_id)
        )

    def request_ids(self) -> list[str]:
        """Every request the engine holds (scheduled or waiting for its grammar)."""
        return [*self.scheduler.requests, *self.pen.held(Request)]

    def held_request_ids(self) -> list[str]:
        """Requests finished with ``hold_kv`` whose blocks are still held, until
        ``release_held`` (their KV is being read): not in ``request_ids``, yet a worker
        holding any is not idle, and its stats list them."""
        return list(self.scheduler.held)

    def kv_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged cache's K and V tensors, [layers, blocks, block, Hkv, D] each, fixed
        for the engine's life: a worker attaches its transfer backend to them (transfers
        read and write blocks in place) and sums blocks of them for a transfer's checksums.
        Nothing else of the cache is the workers'."""
        return self.kv_cache.k, self.kv_cache.v

    # -- stepping --------------------------------------------------------------

    def on_grammar_ready(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (on the compile thread) whenever a grammar finishes compiling, or
        fails: a step loop asleep for want of schedulable work has requests to admit."""
        self.structured.on_ready = wake

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.pen)

    def has_schedulable_work(self) -> bool:
        """A step can do something now (requests waiting for remote KV or for their
        grammar cannot be stepped until it has arrived)."""
        if self.scheduler.has_schedulable_work():
            return True
        return self.pen.has_ready() or self.structured.overdue(time.monotonic())

    def _admit_compiled(self) -> list[RequestOutput]:
        """Take the requests whose grammar is now ready out of the pen: a new one goes to the
        scheduler, an arrived one joins the batch with its first token; a grammar that failed
        to compile (or ran past its time limit) ends its request with an error."""
        outputs = []
        for rid, held, error in self.pen.take_ready():
            if isinstance(held, Request) and error is None:
                self.scheduler.add_request(held)
            elif isinstance(held, Request):
                held.status, held.stop_reason = RequestStatus.FINISHED_ERROR, f"grammar: {error}"
                outputs.append(self._finish_output(held))
            elif error is None:  # an Arrival: its KV landed while the grammar compiled
                request = self.remote_kv.commit(rid, held)
                outputs += [] if request is None else [self._first_output(request, held)]
            else:
                ended = self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                outputs += [self._finish_output(r) for r in ended]
        return outputs

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of the requests that produced tokens."""
        self.structured.expire(time.monotonic())  # a compile past its limit: its requests end below
        admitted = self._admit_compiled() if self.pen else []
        if not self.scheduler.has_schedulable_work() and self.pen and not admitted:
            self.structured.wait_any(0.05)  # offline loops: nothing else to do meanwhile
        sched = self.last_plan = self.scheduler.schedule()
        now = time.monotonic()
        for item in sched.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now
        wall, cpu = time.perf_counter(), time.thread_time()
        # Every rank runs the same input on its own shard; rank 0 samples from the full logits.
        result = self.tensor_parallel.execute(self.runner, self.runner_inputs.build(sched))
        self._forward_s += time.perf_counter() - wall
        self._forward_cpu_s += time.thread_time() - cpu
        if result.prompt_logprobs:
            self.outputs.store_prompt_logprobs(result.prompt_logprobs)
        progressed = self.scheduler.update(sched, result.sampled)
        sampled = [r for r, token in progressed if token is not None]
        self._generation_tokens += len(sampled)
        # Requests the scheduler ended while planning get their final output too.
        return admitted + self._emit(sampled, result.sampled, result.logprobs) + [
            self._finish_output(r) for r in sched.finished
        ]

    def _emit(
        self, requests: list[Request], sampled: dict[str, int], logprobs: dict[str, TokenLogprobs]
    ) -> list[RequestOutput]:
        """The outputs of requests that took a token this step; those a stop string or a
        complete grammar ends are finished first."""
        stopped = self.outputs.update(requests, sampled, logprobs, time.monotonic())
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        output = self.outputs.output
        return [self._finish_output(r) if r.is_finished else output(r) for r in requests]

    def _finish_output(self, request: Request) -> RequestOutput:
        """Final output of a finished request: hands over held KV and forgets the request."""
        out = self.outputs.final(request, time.monotonic())
        rid = request.request_id
        if rid in self.scheduler.held:
            # The blocks of every token but the one just sampled (a migrated stream's
            # earlier output included): what the decode side reserved.
            held = self.kv_manager.num_blocks_needed(request.num_tokens - 1)
            out.kv_blocks = self.kv_manager.block_ids(rid)[:held]
            self.wait_for_device()  # another process reads them next
        self._forget(rid)
        return out

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine this engine started (at one rank
        there are none); such an engine cannot step after. Idempotent."""
        self.tensor_parallel.close()

    # -- introspection ---------------------------------------------------------

    def load(self) -> EngineLoad:
        """The engine's load now (workers report it for placement)."""
        s = self.scheduler
        pool = self.kv_manager.pool
        return EngineLoad(
            num_running=len(s.running),
            num_waiting=s.num_waiting + len(self.pen.held(Request)),
            num_swapped=len(s.swapped),
            num_waiting_for_kv=self.remote_kv.num_waiting,
            num_free_blocks=pool.num_free_blocks,
            num_blocks=pool.num_usable_blocks,
            prefix_cache_queries=self.kv_manager.stats.queries,
            prefix_cache_hits=self.kv_manager.stats.hits,
        )

    def num_queued_tokens(self) -> int:
        """Tokens of the scheduler's requests not computed yet (a walk over them all)."""
        return self.scheduler.num_queued_tokens()

    def is_waiting_for_kv(self, request_id: str) -> bool:
        """The request holds reserved blocks and waits for its KV from another worker."""
        return self.remote_kv.is_waiting(request_id)

    def stats(self) -> EngineStats:
        """The load plus the running totals (every step, for metrics)."""
        load, steps, pool = self.load(), self.scheduler.stats, self.kv_manager.pool
        lora = self.lora
        names = {adapter.key: name for name, adapter in lora.loaded.items()} if lora is not None else {}
        return EngineStats(
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_swapped=load.num_swapped,
            num_blocks=load.num_blocks,
            num_blocks_in_use=pool.num_used_blocks,
            kv_cache_usage=pool.usage,
            num_preemptions=steps.num_preemptions,
            num_preemptions_recompute=steps.num_preemptions_recompute,
            num_preemptions_swap=steps.num_preemptions_swap,
            prefix_cache_queries=load.prefix_cache_queries,
            prefix_cache_hits=load.prefix_cache_hits,
            num_steps=steps.num_steps,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            forward_s=self._forward_s,
            forward_cpu_s=self._forward_cpu_s,
            num_window_released_blocks=self.kv_manager.num_released,
            host_cache_blocks=self.kv_manager.host_tier.capacity,
            host_cache_blocks_used=self.kv_manager.host_tier.num_entries,
            host_cache_spills=self.kv_manager.host_tier.stats.spills,
            host_cache_restores=self.kv_manager.host_tier.stats.restores,
            host_cache_hits=self.kv_manager.stats.host_hits,
            lora_resident_adapters=tuple(names[key] for key in lora.resident) if lora is not None else (),
            lora_loads=lora.loads if lora is not None else 0,
            lora_evictions=lora.evictions if lora is not None else 0,
        )
