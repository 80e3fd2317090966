"""Tensor parallelism across processes: rank 0's engine drives the other ranks' runners.

A worker at ``tensor_parallel_size`` N is N ranks over one ``TPGroup``
(``engine.model.parallel``). Rank 0 is the ``LLMEngine``: the scheduler, the block pool, the
outputs and the grammar masks live there alone. Every other rank holds its shard of the
model and of the KV cache under a ``ModelRunner`` and does what rank 0 broadcasts, in order::

    build the group ─▶ load the shard ─▶ KVBlocks ─▶ RunnerInput ... RunnerInput ─▶ Stop
                                          │             └ each executed on the rank's shard,
                                          │               its sampled ids discarded
                                          └ the cache rank 0 sized from the per-rank bytes

Each step's ``RunnerInput`` is plain data, so every rank's runner keeps the same copies of
the requests and their block tables as rank 0's, swaps the same blocks in and out of its
own swap space (a preemption's swap happens inside ``execute``), and the collectives in the
forward meet on every rank in the same order. An engine's reset (a worker switching roles)
renews only rank 0's scheduler and block pool: nothing the ranks hold changes.

What the ranks do is apart from how they were started: ``TensorParallel`` (rank 0's side)
and ``RankLoop`` (the others') need only a ``TPGroup``. ``LocalRanks`` starts them as
processes on this host (the offline ``LLM``) that meet at a ``TCPStore`` rank 0 hosts on a
free port of 127.0.0.1 and join a group over shared memory on CPUs
(``engine.model.shm_group``; gloo where it cannot run) or NCCL on GPUs; the service can run
``RankLoop`` in Ray actors instead. Besides the steps, rank 0 can ask every rank for its
weight bytes (``WeightBytes``, for the benchmarks) and have them load or forget a LoRA
adapter (``Adapter``: each rank reads its own cut of the files).

Failures: a rank that dies fails rank 0's next collective at once (a closed socket, or a
process found gone while waiting); one that hangs fails it after ``COLLECTIVE_TIMEOUT_S``.
Either way the step raises ``RankFailure``, naming the rank, how it ended and its error, and
the other ranks are killed: they may be mid-step, so the engine cannot go on. The other
ranks wait for rank 0's next message with no deadline (an offline ``LLM`` may sit idle for
hours); if rank 0's process dies, they see it (their parent gone, or its sockets closed)
and exit.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.model import shm_group
from engine.model.attention import create_attention_backend
from engine.model.gguf_checkpoint import is_gguf, open_gguf
from engine.model.kv_cache import KVCache
from engine.model.loader import load_model, resolve_dtype
from engine.model.lora import LoRASlots
from engine.model.model import DecoderModel
from engine.model.model_config import ModelConfig
from engine.model.model_registry import resolve_model
from engine.model.model_runner import ModelRunner, RunnerOutput
from engine.model.parallel import SINGLE, GlooGroup, Shard, TPGroup
from engine.model.runner_input import RunnerInput

COLLECTIVE_TIMEOUT_S = 300.0  # rank 0's wait in one collective for a rank that hangs
IDLE_TIMEOUT_S = 30 * 24 * 3600.0  # the other ranks' collectives (gloo's wait for the next step among them)
START_TIMEOUT_S = 120.0  # a spawned rank's start (an interpreter and torch) until it checks in
STOP_TIMEOUT_S = 10.0  # a rank's exit after Stop, before it is killed
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class KVBlocks:
    """The KV cache every rank allocates: rank 0 sized it from one rank's bytes per block."""

    num_blocks: int
    num_cpu_blocks: int


@dataclass(frozen=True)
class WeightBytes:
    """Every rank reports its shard's weight bytes (all-gathered in rank order)."""


@dataclass(frozen=True)
class Stop:
    """The ranks leave their loop: the engine is closing."""


@dataclass(frozen=True)
class Adapter:
    """Every rank loads its cut of a LoRA adapter rank 0 has checked (``path``), or, with
    ``path`` None, forgets it."""

    name: str
    path: str | None


class RankFailure(RuntimeError):
    """A rank died, hung or raised: the ranks are out of step and the engine cannot go on."""


class RankState(IntEnum):
    """Rank 0's view of the ranks, in the only order it moves."""

    RUNNING = 0
    FAILED = 1  # a step failed: the ranks were stopped, every later call raises
    CLOSED = 2


class RankProcesses(Protocol):
    """Whatever started ranks 1..N-1 (``LocalRanks``): asked what went wrong, and stopped."""

    def failure(self) -> str:
        """What is known of a rank that died or raised ('' if none did)."""
        ...

    def stop(self, graceful: bool) -> None:
        """End the ranks: ``graceful``, they were sent ``Stop`` and are waited for first."""
        ...


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device on a host where each rank takes one GPU (``cuda`` or ``cuda:i``
    counts on from i); on a CPU every rank's is the same."""
    d = torch.device(device)
    return f"cuda:{(d.index or 0) + rank}" if d.type == "cuda" else device


class TensorParallel:
    """Rank 0's side of its ranks (the module docstring's order): the cache size at start,
    then each step's input before rank 0 runs it, ``Stop`` at the end. At size 1 (``SINGLE``)
    it sends nothing. ``processes``: what started the ranks, asked what went wrong when a
    collective fails and stopped on ``close``; None when the caller owns them."""

    def __init__(self, group: TPGroup = SINGLE, processes: RankProcesses | None = None) -> None:
        self.group = group
        self.processes = processes
        self.state = RankState.RUNNING
        self._failure: RankFailure | None = None

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def shard(self) -> Shard:
        """Rank 0's part of the model."""
        return Shard(self.group.rank, self.group.size)

    def start(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Tell the ranks the KV cache to allocate (rank 0 allocates the same)."""
        if self.size > 1:
            self._collective(self.group.broadcast_object, KVBlocks(num_blocks, num_cpu_blocks))

    def execute(self, runner: ModelRunner, step: RunnerInput) -> RunnerOutput:
        """Run one step on every rank: the input to the others, then rank 0's own share."""
        if self.size == 1:
            return runner.execute(step)
        return self._collective(self._execute, runner, step)

    def _execute(self, runner: ModelRunner, step: RunnerInput) -> RunnerOutput:
        self.group.broadcast_object(step)
        return runner.execute(step)

    def adapter(self, name: str, path: str | None) -> None:
        """Every other rank loads the adapter ``name`` from ``path`` (None: unloads it)."""
        if self.size > 1:
            self._collective(self.group.broadcast_object, Adapter(name, path))

    def weight_bytes(self, model: DecoderModel) -> list[int]:
        """Every rank's weight bytes, rank order (rank 0's is ``model``'s)."""
        if self.size == 1:
            return [model.weight_bytes()]
        return self._collective(self._weight_bytes, model)

    def _weight_bytes(self, model: DecoderModel) -> list[int]:
        self.group.broadcast_object(WeightBytes())
        return self.group.all_gather(torch.tensor([model.weight_bytes()], dtype=torch.int64), dim=0).tolist()

    def _collective(self, call, *args):
        """``call(*args)`` while the ranks follow; any error stops them and raises ``RankFailure``."""
        if self.state != RankState.RUNNING:
            raise self._failure or RankFailure("the tensor-parallel ranks are closed")
        try:
            return call(*args)
        except BaseException as e:  # an interrupt too: the ranks may be mid-step, out of step
            self.state = RankState.FAILED
            if isinstance(e, Exception) and self.processes is not None:
                known = self.processes.failure() or "no other rank exited or reported an error"
            else:
                known = "the ranks' state is unknown"
            self._failure = RankFailure(
                f"a tensor-parallel step failed: {known}; rank 0 saw {type(e).__name__}: {e}; "
                "the ranks are stopped and this engine cannot step on"
            )
            self._stop(graceful=False)
            if not isinstance(e, Exception):
                raise  # (a KeyboardInterrupt stays one)
            raise self._failure from e

    def close(self) -> None:
        """Stop the ranks (idempotent): ``Stop`` to each, then their processes end."""
        if self.state == RankState.CLOSED:
            return
        graceful = self.state == RankState.RUNNING and self.size > 1
        if graceful:
            try:
                self.group.broadcast_object(Stop())
            except Exception:  # a rank died meanwhile: the processes are ended below
                graceful = False
        self._stop(graceful)
        self.state = RankState.CLOSED

    def _stop(self, graceful: bool) -> None:
        if self.processes is not None:
            self.processes.stop(graceful)
        self.group.close()


class RankLoop:
    """One rank other than 0: its shard of the model, then, once rank 0 has sized it, of the KV
    cache under a ``ModelRunner`` (no grammar masks, no CUDA graphs), and the loop that runs
    rank 0's messages on them (the module docstring's order)."""

    def __init__(self, config: EngineConfig, group: TPGroup, device: str | None = None) -> None:
        self.config = config
        self.group = group
        path = resolve_model(config.model).path
        source = open_gguf(path) if is_gguf(path) else path
        self.model_config = ModelConfig.from_pretrained(source)
        self.device = torch.device(device or config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = load_model(source, self.dtype, self.device, pack=config.pack_weights, tp=group)
        self.lora = LoRASlots(self.model, config.max_loras, config.max_lora_rank) if config.max_loras else None
        for name, adapter_path in config.lora_adapters.items():
            self._adapter(Adapter(name, adapter_path))
        self.runner: ModelRunner | None = None
        self.allocated = threading.Event()  # set once the KV cache is (``kv_tensors``)
        self.num_steps = 0

    def run(self) -> int:
        """Follow rank 0 until it sends ``Stop``; returns the steps run."""
        while True:
            message = self.group.broadcast_object()
            if isinstance(message, RunnerInput):
                if self.runner is None:
                    raise RuntimeError(f"rank {self.group.rank} got a step before the KV cache's size")
                self.runner.execute(message)
                self.num_steps += 1
            elif isinstance(message, KVBlocks):
                self._allocate(message)
            elif isinstance(message, Adapter):
                self._adapter(message)
            elif isinstance(message, WeightBytes):
                self.group.all_gather(torch.tensor([self.model.weight_bytes()], dtype=torch.int64), dim=0)
            elif isinstance(message, Stop):
                return self.num_steps
            else:
                raise RuntimeError(f"rank {self.group.rank} got an unknown message {type(message).__name__}")

    def _adapter(self, message: Adapter) -> None:
        if self.lora is None:
            raise RuntimeError(f"rank {self.group.rank} serves no LoRA adapters (max_loras 0)")
        if message.path is None:
            self.lora.unload(message.name)
        else:
            self.lora.load(message.name, message.path)

    def _allocate(self, blocks: KVBlocks) -> None:
        """The rank's KV heads of every block, and the runner over them."""
        config = self.config
        kv_cache = KVCache(
            self.model_config, blocks.num_blocks, config.block_size, self.dtype, self.device, blocks.num_cpu_blocks,
            tp=Shard(self.group.rank, self.group.size),
        )
        attention = create_attention_backend(
            config.attention_backend, self.device, config.block_size, self.model_config.head_dim, self.dtype
        )
        self.runner = ModelRunner(self.model, kv_cache, attention, lora=self.lora)
        self.allocated.set()

    def kv_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's paged K and V (its heads of every block), once ``allocated``: what
        the rank's own transfer endpoint reads into and offers (``kv_transfer.sharded``)."""
        if self.runner is None:
            raise RuntimeError(f"rank {self.group.rank}'s KV cache is not allocated yet")
        return self.runner.kv_cache.k, self.runner.kv_cache.v


def start_ranks(config: EngineConfig) -> TensorParallel:
    """Rank 0's side of ``config.tensor_parallel_size`` ranks, the others spawned on this host
    (``LocalRanks``); at size 1 there are none."""
    if config.tensor_parallel_size == 1:
        return TensorParallel()
    ranks = LocalRanks(config)
    return TensorParallel(ranks.group, ranks)


TRANSPORTS = ("auto", "gloo")  # a CPU group's: auto is shared memory where it runs


def make_group(store, rank: int, size: int, device: str, timeout_s: float, peers_alive,
               transport: str = "auto") -> TPGroup:
    """The ranks' group: NCCL between GPUs; between CPU processes shared memory where the
    processor allows it (``engine.model.shm_group``: every rank on this host) unless
    ``transport`` is gloo, else gloo."""
    if torch.device(device).type == "cuda":
        from engine.model.nccl import NcclGroup

        return NcclGroup(store, rank, size, timeout_s=timeout_s, device=torch.device(device))
    if transport == "auto" and shm_group.supported():
        return shm_group.SharedMemoryGroup(store, rank, size, timeout_s=timeout_s, peers_alive=peers_alive)
    return GlooGroup(store, rank, size, timeout_s=timeout_s)


def _checked_in(rank: int) -> str:
    return f"ranks/checked-in/{rank}"


def _error(rank: int) -> str:
    return f"ranks/error/{rank}"


def rank_main(
    rank: int, size: int, store_host: str, store_port: int, config: EngineConfig, transport: str = "auto"
) -> None:
    """A spawned rank's process: check in at rank 0's store, join the group, then follow rank
    0 until it stops. An error is left in the store for rank 0 to report, then raised."""
    from torch.distributed import TCPStore

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is rank 0's to handle
    torch.set_num_threads(1)
    store = TCPStore(store_host, store_port, size, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    try:
        store.set(_checked_in(rank), "1")
        device = rank_device(config.device, rank)
        parent = os.getppid()  # rank 0: gone if this process is handed to another parent
        group = make_group(store, rank, size, device, IDLE_TIMEOUT_S, lambda: os.getppid() == parent, transport)
        RankLoop(config, group, device).run()
    except BaseException:
        with contextlib.suppress(Exception):  # rank 0 (the store's host) may be gone
            store.set(_error(rank), traceback.format_exc())
        raise


def _exit_status(process) -> str:
    """How a rank's process ended, in words ('running' while it has not)."""
    code = process.exitcode
    if code is None:
        return "running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _end(processes: list) -> None:
    """Kill ``processes`` that are still alive (a rank holds nothing to clean up; SIGKILL also
    ends one that is stopped or stuck in a collective), and reap them."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()


class LocalRanks:
    """Ranks 1..N-1 of ``config`` as processes spawned on this host, joined to rank 0 by a
    group over a ``TCPStore`` rank 0 hosts (on CPUs, ``transport="gloo"`` forgoes shared
    memory). Lifecycle: spawned ─▶ each checks in at the store (a rank that dies first fails
    the start, naming it) ─▶ rank 0 builds its side of ``group`` ─▶ running ─▶ stopped
    (joined after ``Stop``, else killed). A finalizer kills them if the owner never stops
    them (garbage collection, interpreter exit)."""

    def __init__(self, config: EngineConfig, transport: str = "auto") -> None:
        from torch.distributed import TCPStore

        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.size = config.tensor_parallel_size
        # The ranks load the checkpoint rank 0 resolved (a named model is fetched once).
        config = replace(config, model=str(resolve_model(config.model).path))
        self.store = TCPStore(LOCALHOST, 0, self.size, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        spawn = multiprocessing.get_context("spawn")
        self.processes = [
            spawn.Process(target=rank_main, args=(r, self.size, LOCALHOST, self.store.port, config, transport),
                          name=f"tandem-tp-rank-{r}", daemon=True)
            for r in range(1, self.size)
        ]
        self._finalizer = weakref.finalize(self, _end, self.processes)
        self._threads = torch.get_num_threads()  # this process's own, given back at the stop
        if torch.device(config.device).type == "cpu":
            # One torch thread here too, as in every rank: the ranks meet at each collective, so
            # rank 0's extra threads would only wait, and on a host without a spare core their
            # spinning takes the core another rank needs.
            torch.set_num_threads(1)
        try:
            for p in self.processes:
                p.start()
            self._wait_checked_in()
            processes = self.processes
            self.group = make_group(self.store, 0, self.size, config.device, COLLECTIVE_TIMEOUT_S,
                                     lambda: all(p.is_alive() for p in processes), transport)
        except BaseException:
            self.stop(graceful=False)
            raise

    def _wait_checked_in(self) -> None:
        """Until every rank has checked in; a rank that exits first, or the deadline, raises."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(range(1, self.size))
        while waiting:
            waiting = [r for r in waiting if not self.store.check([_checked_in(r)])]
            if failed := self.failure(wait_s=0):
                raise RankFailure(f"a tensor-parallel rank failed to start: {failed}")
            if waiting and time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel ranks {waiting} did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def failure(self, wait_s: float = 2.0) -> str:
        """What is known of ranks that exited or raised; waits up to ``wait_s`` for one to exit
        (a rank whose socket just closed may still be exiting)."""
        deadline = time.monotonic() + wait_s
        while all(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(0.02)
        notes = []
        for rank, p in enumerate(self.processes, start=1):
            error = self.store.get(_error(rank)).decode() if self.store.check([_error(rank)]) else ""
            if error or not p.is_alive():
                last = error.strip().splitlines()[-1] if error else "no error reported"
                notes.append(f"rank {rank} ({_exit_status(p)}): {last}" + (f"\n{error}" if error else ""))
        return "; ".join(notes)

    def stop(self, graceful: bool) -> None:
        """End the ranks: after ``Stop`` wait for each to exit, then kill what remains."""
        if graceful:
            for p in self.processes:
                p.join(STOP_TIMEOUT_S)
        self._finalizer()
        torch.set_num_threads(self._threads)
