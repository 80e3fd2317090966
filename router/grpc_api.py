"""The gRPC edge: ``tandem.v1`` messages to and from the router's plain types.

Validation is shared with HTTP (``router.validation``); ``ApiError`` statuses map to
gRPC codes here: 400 INVALID_ARGUMENT, 404 NOT_FOUND, 401 UNAUTHENTICATED,
413 and 429 RESOURCE_EXHAUSTED (413 as grpc's own answer to a message over Serve's
limit, ``ServiceConfig.grpc_max_message_bytes``), 503 UNAVAILABLE, anything else INTERNAL.

The servicer registrations (``add_generation_servicer``, ``add_health_servicer``; Serve's
proxy calls them) parse requests leniently: bytes that are not the method's message
become a ``MalformedRequest``, which the router answers with INVALID_ARGUMENT (the
generated stubs' parsers raise in the proxy, which gRPC reports as UNKNOWN). The health
service registers ``Check`` only, so ``Watch`` is UNIMPLEMENTED.
"""

from __future__ import annotations

import json

import grpc

from protos.grpc.health.v1 import health_pb2
from protos.tandem.v1 import generate_pb2 as pb
from router.bodies import check_depth
from router.errors import ApiError
from router.validation import PreparedRequest, ServedModel, bearer, prepare_completion

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,  # as grpc's own refusal of a message over Serve's limit
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}

_GUIDED = ("guided_json", "guided_regex", "guided_grammar")
_OPTIONAL = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "logprobs", "n", "prompt_logprobs", "priority",
)


def status_code(error: ApiError) -> grpc.StatusCode:
    return _CODES.get(error.status, grpc.StatusCode.INTERNAL)


def prepare(request: pb.GenerateRequest, model: ServedModel, tokenizer) -> PreparedRequest:
    """Validate a GenerateRequest through the same rules as an HTTP completion (its
    ``n`` included: ``router.validation.choices`` makes the choices)."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise ApiError(400, "prompt: set either text or token_ids", param="prompt")
    s = request.sampling
    body: dict = {
        "model": request.model or None,
        "prompt": request.text if which == "text" else list(request.token_ids.ids),
        "stop": list(s.stop) or None,
        "stop_token_ids": list(s.stop_token_ids) or None,
        "ignore_eos": s.ignore_eos,
        "min_tokens": s.min_tokens,
    }
    body.update({name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)})
    body.update({name: getattr(s, name) for name in _GUIDED if s.HasField(name)})
    if s.guided_choice:
        body["guided_choice"] = list(s.guided_choice)
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias.items()}
    if s.allowed_token_ids:
        body["allowed_token_ids"] = list(s.allowed_token_ids)
    if s.bad_words:
        body["bad_words"] = list(s.bad_words)
    if s.HasField("response_format"):
        try:
            body["response_format"] = json.loads(s.response_format)
        except ValueError as e:
            raise ApiError(400, f"response_format is not valid JSON: {e}", param="response_format") from None
        except RecursionError:
            raise ApiError(400, "response_format is not valid JSON: nested too deeply",
                           param="response_format") from None
        if not isinstance(body["response_format"], dict):
            raise ApiError(400, "response_format must be a JSON object", param="response_format")
        check_depth(body["response_format"], "response_format", "response_format")
    return prepare_completion(body, model, tokenizer)


def response(delta, request_id: str, prompt_token_ids: list[int], index: int = 0) -> pb.GenerateResponse:
    """A delta of choice ``index`` of request ``request_id`` (whose prompt is
    ``prompt_token_ids``) as a GenerateResponse."""
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        finished=delta.finished,
        finish_reason=delta.finish_reason or "" if delta.finished else "",
        usage=pb.Usage(
            prompt_tokens=delta.num_prompt_tokens,
            completion_tokens=delta.num_output_tokens,
            cached_tokens=delta.num_cached_tokens,
        ),
        index=index,
    )
    for token, logprob, top in delta.logprobs or ():
        msg.logprobs.add(token_id=token, logprob=logprob, top=_top(top))
    if delta.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(prompt_logprobs(prompt_token_ids, delta.prompt_logprobs))
    return msg


def prompt_logprobs(prompt_token_ids: list[int], entries: list) -> list[pb.PromptTokenLogprob]:
    """A delta's prompt logprobs (None for the first token, then (token, logprob, rank,
    top) tuples) as one ``PromptTokenLogprob`` a prompt token, the first without a logprob."""
    out = [pb.PromptTokenLogprob(token_id=prompt_token_ids[0])]
    for token, logprob, rank, top in entries[1:]:
        out.append(pb.PromptTokenLogprob(token_id=token, logprob=logprob, rank=rank, top=_top(top)))
    return out


def _top(top) -> list[pb.TopLogprob]:
    return [pb.TopLogprob(token_id=i, logprob=v) for i, v in top]


def model_info(model: ServedModel) -> pb.ModelInfo:
    """``ModelInfo``: each of its fields is the served model's attribute of that name."""
    fields = pb.ModelInfo.DESCRIPTOR.fields
    return pb.ModelInfo(**{f.name: getattr(model, f.name) for f in fields})


# -- servicer registration -----------------------------------------------------------


class MalformedRequest:
    """A request whose bytes did not parse as the method's message type."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error

    @property
    def details(self) -> str:
        return f"the request is not a valid {self.type_name}: {self.error}"


def _lenient(message_cls):
    def parse(raw: bytes):
        try:
            return message_cls.FromString(raw)
        except Exception as e:  # DecodeError (bad wire format or UTF-8), RecursionError (nesting)
            return MalformedRequest(message_cls.DESCRIPTOR.full_name, str(e) or type(e).__name__)

    return parse


def _register(server, service: str, handlers: dict) -> None:
    # As the generated add_*_to_server functions do.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def add_generation_servicer(servicer, server) -> None:
    """``tandem.v1.Generation`` (``protos/tandem/v1/generate.proto``), parsed leniently."""
    _register(server, "tandem.v1.Generation", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_lenient(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=_lenient(pb.GetModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    })


def add_health_servicer(servicer, server) -> None:
    """``grpc.health.v1.Health/Check``, parsed leniently (``Watch``: UNIMPLEMENTED)."""
    _register(server, "grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(
            servicer.Check, request_deserializer=_lenient(health_pb2.HealthCheckRequest),
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        ),
    })


# -- answering a call -------------------------------------------------------------


class GrpcStatusError(Exception):
    """Raised after the status code is set: Serve sends the code and details."""


def fail(grpc_context, code, details: str):
    """Set the call's status and end the handler (``GrpcStatusError``)."""
    # Serve drops trailing metadata on errors, so hints (retry after) go in the details.
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    raise GrpcStatusError(details)


def well_formed(request, grpc_context):
    """INVALID_ARGUMENT for bytes that did not parse as the method's message."""
    if isinstance(request, MalformedRequest):
        fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, request.details)
    return request


def api_key(grpc_context) -> str | None:
    """The API key a call presents (``authorization: Bearer <key>`` or ``x-api-key``)."""
    metadata = dict(grpc_context.invocation_metadata())
    return bearer(metadata.get("authorization")) or metadata.get("x-api-key")
