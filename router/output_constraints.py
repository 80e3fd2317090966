"""A request's output constraint: ``response_format`` (json_object, json_schema) or one of
vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, at most one,
as ``SamplingParams.structured_output`` with the field it came from. The checks that need no
grammar engine run here; parsing the spec with xgrammar runs in the router's helper process
(``router.grammar_check``)."""

from __future__ import annotations

from engine.grammar import precheck as precheck_grammar
from engine.wire.sampling_params import StructuredOutput
from router.bodies import SamplingBody
from router.errors import ApiError

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _response_format(rf: dict) -> tuple[str, StructuredOutput] | None:
    """(field, constraint) for a ``response_format``; None for ``{"type": "text"}``."""
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", StructuredOutput("json_object")
    if kind != "json_schema":
        raise ApiError(
            400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format.type",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object with a schema",
                       param="response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                       param="response_format.json_schema.schema")
    return "response_format.json_schema.schema", StructuredOutput.json_schema(schema)


def _guided(name: str, value) -> StructuredOutput:
    try:
        if name == "guided_json":
            return StructuredOutput.json_schema(value)
        if name == "guided_choice":
            return StructuredOutput.choice(value)
        return StructuredOutput("regex" if name == "guided_regex" else "grammar", value)
    except ValueError as e:
        text = str(e)
        raise ApiError(400, text if text.startswith(name) else f"{name}: {text}", param=name) from None


def structured_output(b: SamplingBody) -> tuple[str, StructuredOutput] | None:
    """(field, constraint): the request's output constraint, at most one kind; 400 naming
    the field. The spec is not parsed here (see ``router.grammar_check``)."""
    given = []
    if b.response_format is not None:
        rf = _response_format(b.response_format)
        if rf is not None:
            given.append(rf)
    given += [(name, _guided(name, getattr(b, name))) for name in _GUIDED if getattr(b, name) is not None]
    if not given:
        return None
    if len(given) > 1:
        names = [name.split(".")[0] for name, _ in given]
        raise ApiError(400, f"at most one structured output kind per request; got {', '.join(names)}",
                       param=names[1])
    field, so = given[0]
    try:
        precheck_grammar(so, field)
    except ValueError as e:
        raise ApiError(400, str(e), param=field) from None
    return field, so
