"""A request's outputs, from the engine's intake to the request's end.

``StepOutputs`` is the collaborator ``LLMEngine`` (``engine.llm_engine``) gives both ends
of a request's way through: ``track`` starts following its output (the output processor,
``engine.output_processor``, and a grammar matcher for a constraint); a request that
took a token gets its ``RequestOutput`` (``emit``), one that a stop string or a complete
grammar ends being finished in the scheduler first; a finished request's final output
names the blocks it holds for a transfer (``hold_kv``) once the device has written them,
and then every part that followed the request forgets it (output processor, remote-KV
intake, runner inputs, grammar matchers). It also lets out of the grammar pen the
requests whose grammar is now ready (``admit_compiled``)::

    track ─▶ [pen: grammar compiling] ─▶ scheduler (new) or batch with its first token (``first``)
      │              └─ grammar failed ─▶ ``final``: finish reason ``error``
      └─ stepped ─▶ ``emit``: an output each token ─▶ finished (stopped, length, aborted)
           ─▶ ``final``: held KV named, the request forgotten

The engine makes one with each set of its scheduler, block manager and remote-KV intake
(``LLMEngine._make_parts``, again on a reset); the other parts live as long as the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.block_pool import KVCacheManager
    from engine.core.scheduler import Scheduler
    from engine.engine_stats import StepTotals
    from engine.model.runner_input import RunnerInputBuilder
    from engine.model.sampler import TokenLogprobs
    from engine.output_processor import OutputProcessor, RequestOutput
    from engine.remote_kv import Arrival, RemoteKVIntake
    from engine.structured_output import GrammarPen, StructuredOutputs

__all__ = ["StepOutputs"]


class StepOutputs:
    """Each request's outputs as the engine steps, and its end (the module docstring)."""

    def __init__(
        self, *, outputs: OutputProcessor, structured: StructuredOutputs, runner_inputs: RunnerInputBuilder,
        pen: GrammarPen, scheduler: Scheduler, kv_manager: KVCacheManager, remote_kv: RemoteKVIntake,
        totals: StepTotals, wait_for_device: Callable[[], None],
    ) -> None:
        """The engine's parts; ``wait_for_device`` returns once the last step's KV writes ran."""
        self.outputs = outputs
        self.structured = structured
        self.runner_inputs = runner_inputs
        self.pen = pen
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.remote_kv = remote_kv
        self.totals = totals
        self.wait_for_device = wait_for_device

    def track(self, request: Request, resume_output: Sequence[int] = ()) -> None:
        """Start following a request's output; ``resume_output``: tokens a worker it
        migrated from had already streamed (their text is not sent again)."""
        params = request.sampling_params
        self.outputs.add(request, resume_output)
        self.totals.prompt_tokens += request.num_prompt_tokens
        if params.structured_output is not None:
            self.structured.add(request.request_id, params.structured_output)

    def admit_compiled(self) -> list[RequestOutput]:
        """Take the requests whose grammar is now ready out of the pen: a new one goes to the
        scheduler, an arrived one joins the batch with its first token; a grammar that failed
        to compile (or ran past its time limit) ends its request with an error."""
        outputs = []
        for rid, held, error in self.pen.take_ready():
            if isinstance(held, Request) and error is None:
                self.scheduler.add_request(held)
            elif isinstance(held, Request):
                held.status, held.stop_reason = RequestStatus.FINISHED_ERROR, f"grammar: {error}"
                outputs.append(self.final(held))
            elif error is None:  # an Arrival: its KV landed while the grammar compiled
                request = self.remote_kv.commit(rid, held)
                outputs += [] if request is None else [self.first(request, held)]
            else:
                ended = self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                outputs += [self.final(r) for r in ended]
        return outputs

    def first(self, request: Request, arrival: Arrival) -> RequestOutput:
        """The output of a request that joined the batch with a token sampled elsewhere."""
        request.first_scheduled_time = time.monotonic()
        self.totals.generation_tokens += 1
        rid = request.request_id
        logprobs = {rid: arrival.first_logprobs} if arrival.first_logprobs is not None else {}
        return self.emit([request], {rid: arrival.first_token}, logprobs)[0]

    def emit(
        self, requests: list[Request], sampled: dict[str, int], logprobs: dict[str, TokenLogprobs]
    ) -> list[RequestOutput]:
        """The outputs of requests that took a token this step; those a stop string or a
        complete grammar ends are finished first."""
        stopped = self.outputs.update(requests, sampled, logprobs, time.monotonic())
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        output = self.outputs.output
        return [self.final(r) if r.is_finished else output(r) for r in requests]

    def final(self, request: Request) -> RequestOutput:
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

    def _forget(self, rid: str) -> None:
        self.outputs.remove(rid)
        self.remote_kv.forget(rid)
        self.runner_inputs.forget(rid)
        self.structured.remove(rid)
