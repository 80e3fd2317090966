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

The facade's helpers live beside it: ``engine.engine_build`` loads the shard and makes the
runner, ``engine.request_checks`` and ``engine.adapters`` check what comes in (the LoRA
adapters by name too), ``engine.step_outputs`` follows each request's output to its end,
and ``engine.engine_stats`` holds ``EngineLoad`` and ``EngineStats`` (importable from here).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence

import torch

from engine.adapters import adapter_key, load_on_every_rank, unload_unused
from engine.config import EngineConfig
from engine.core.block_hash import BlockHasher
from engine.core.block_pool import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.engine_build import load_shard, make_runner
from engine.engine_stats import EngineLoad, EngineStats, StepTotals, engine_load, engine_stats
from engine.model.gguf_checkpoint import is_gguf, open_gguf
from engine.model.model_config import ModelConfig
from engine.model.model_registry import resolve_model
from engine.model.runner_input import RunnerInputBuilder
from engine.model.sampler import TokenLogprobs
from engine.output_processor import OutputProcessor, RequestOutput, RequestTimes
from engine.ranks import TensorParallel, start_ranks
from engine.remote_kv import Arrival, RemoteKVIntake
from engine.request_checks import check_params, check_resumed_fits, checked_prompt_ids
from engine.step_outputs import StepOutputs
from engine.structured_output import GrammarPen, StructuredOutputs
from engine.tokenizer import Tokenizer
from engine.wire.sampling_params import SamplingParams

__all__ = ["EngineLoad", "EngineStats", "LLMEngine", "RequestOutput", "RequestTimes"]


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

    def _build(self, config: EngineConfig, source) -> None:
        """Everything past the tokenizer: the shard, the runner, the scheduler and its helpers
        (``engine.engine_build``)."""
        shard = load_shard(config, self.model_config, source, self.tensor_parallel)
        self.model, self.kv_cache, self.attention = shard.model, shard.kv_cache, shard.attention
        self.host_cache_blocks = shard.host_cache_blocks
        # The logits' width, not the tokenizer's size: ids past the tokenizer are masked too.
        eos = self.tokenizer.eos_token_ids or self.model_config.eos_token_ids
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, eos, config.grammar)
        tp_size = self.tensor_parallel.size
        self.runner, self.lora = make_runner(config, shard, self.structured, self.max_model_len, tp_size)
        # What the runner holds of each request: every step sends it deltas (it drops a
        # request the step after it ends, so this outlives a reset).
        self.runner_inputs = RunnerInputBuilder()
        self.outputs = OutputProcessor(self.tokenizer, self.structured)
        # Constrained requests waiting out their grammar's compile, new or arrived (outside the scheduler).
        self.pen = GrammarPen(self.structured)
        self._totals = StepTotals()
        self._make_parts(config, shard.num_blocks, shard.num_cpu_blocks)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.last_plan: SchedulerOutput | None = None  # the latest step's (``step_shape.shape_of`` reads it)

    def _make_parts(self, config: EngineConfig, num_blocks: int, num_cpu_blocks: int) -> None:
        """A fresh block manager (every block free, the prefix cache empty), scheduler and
        remote-KV intake over them, and the ``StepOutputs`` over those and the running totals."""
        self.kv_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks,
            BlockHasher(config.prefix_hash_algo, config.prefix_hash_seed), window=self.model_config.kv_window,
            host_cache_blocks=self.host_cache_blocks,
        )
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), self.kv_manager)
        self.remote_kv = RemoteKVIntake(self.scheduler, self.kv_manager, self.kv_cache, self.pen)
        self.step_outputs = StepOutputs(
            outputs=self.outputs, structured=self.structured, runner_inputs=self.runner_inputs, pen=self.pen,
            scheduler=self.scheduler, kv_manager=self.kv_manager, remote_kv=self.remote_kv, totals=self._totals,
            wait_for_device=self.wait_for_device,
        )

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
        self._totals = StepTotals()
        self._make_parts(config, self.kv_cache.num_blocks, self.kv_cache.num_cpu_blocks)
        self.outputs.clear()
        self._rng = random.Random(config.seed)

    # -- intake ----------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Tokenize and validate a prompt; ValueError names what is wrong (``engine.request_checks``)."""
        return checked_prompt_ids(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                  self.kv_manager, self.config.block_size)

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
        check_resumed_fits(request.num_prompt_tokens, resume_output, self.kv_manager, self.config.block_size)
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
        return None if request is None else self.step_outputs.first(request, arrival)

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
        return self.step_outputs.final(request)

    def _make_request(self, prompt, params, request_id, priority, arrival_time) -> Request:
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.holds(rid):
            raise ValueError(f"request_id {rid!r} is already in use")
        check_params(params, self.structured, self.config.grammar, self.model_config.vocab_size)
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
        load_on_every_rank(self.lora, self.tensor_parallel, name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter no request here runs under (ValueError names the ones that do)."""
        unload_unused(self.lora, self.tensor_parallel, self.scheduler.requests.values(), name)

    def check_adapter(self, name: str | None) -> str | None:
        """The key (``Adapter.key``) of the loaded adapter ``name`` (None for None, the base
        model); ValueError names an unknown one."""
        return adapter_key(self.lora, name)

    def _track(self, request: Request, resume_output: Sequence[int] = ()) -> None:
        """Seed the request's random stream and start following its output (``StepOutputs.track``)."""
        params = request.sampling_params
        request.sampling_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.step_outputs.track(request, resume_output)

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
        return [self.step_outputs.final(r) for r in finished]

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

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of the requests that produced tokens."""
        self.structured.expire(time.monotonic())  # a compile past its limit: its requests end below
        admitted = self.step_outputs.admit_compiled() if self.pen else []
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
        self._totals.forward_s += time.perf_counter() - wall
        self._totals.forward_cpu_s += time.thread_time() - cpu
        if result.prompt_logprobs:
            self.outputs.store_prompt_logprobs(result.prompt_logprobs)
        progressed = self.scheduler.update(sched, result.sampled)
        sampled = [r for r, token in progressed if token is not None]
        self._totals.generation_tokens += len(sampled)
        # Requests the scheduler ended while planning get their final output too.
        return admitted + self.step_outputs.emit(sampled, result.sampled, result.logprobs) + [
            self.step_outputs.final(r) for r in sched.finished
        ]

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine this engine started (at one rank
        there are none); such an engine cannot step after. Idempotent."""
        self.tensor_parallel.close()

    # -- introspection ---------------------------------------------------------

    def load(self) -> EngineLoad:
        """The engine's load now (workers report it for placement)."""
        return engine_load(self.scheduler, self.kv_manager, self.pen, self.remote_kv)

    def num_queued_tokens(self) -> int:
        """Tokens of the scheduler's requests not computed yet (a walk over them all)."""
        return self.scheduler.num_queued_tokens()

    def is_waiting_for_kv(self, request_id: str) -> bool:
        """The request holds reserved blocks and waits for its KV from another worker."""
        return self.remote_kv.is_waiting(request_id)

    def stats(self) -> EngineStats:
        """The load plus the running totals (every step, for metrics)."""
        return engine_stats(self.load(), self.scheduler, self.kv_manager, self.lora, self._totals)
