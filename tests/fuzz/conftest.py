"""The fuzz modules' live service, one for the package (a small body limit), and the
oracle they judge its answers by: the router's validation run locally, then its check of
a structured-output spec (``check_grammar``)."""

from __future__ import annotations

import pytest

from engine.grammar import GrammarLimits, check
from router.errors import ApiError
from tests.helpers import clear_ray, running_service

MAX_BODY = 64 * 1024  # small, so the fuzzers reach the body limit often
GRAMMAR = GrammarLimits()  # the service's bounds on structured-output specs (the router's default)


@pytest.fixture(scope="package")
def service(ray_session, tiny_model):
    """One live service for both fuzzers; the session's Ray is cleared after them."""
    from router.server import RouterConfig

    router = RouterConfig(max_body_bytes=MAX_BODY, grammar=GRAMMAR)
    with running_service(tiny_model, router=router, num_kv_blocks=256) as svc:
        yield svc
    clear_ray()


@pytest.fixture(scope="module")
def oracle(service):
    """The served model's limits and tokenizer, for running the router's validation locally."""
    from engine.tokenizer import Tokenizer
    from router.validation import ServedModel

    info = dict(service.model_info)
    tokenizer = Tokenizer.from_pretrained(info.pop("model_dir"))
    return ServedModel(**info, max_chars_per_token=tokenizer.max_chars_per_token()), tokenizer


def check_grammar(prepared) -> None:
    """What the router checks of a validated request before admission
    (``RouterCore.check_structured_output``), run here: its output constraint's spec
    within ``GRAMMAR``'s bounds and parsed by xgrammar, else an ApiError 400 naming the
    field. (No time limit here: a spec within the bounds parses in milliseconds.)"""
    so = prepared.params.structured_output
    if so is None:
        return
    try:
        check(so, prepared.structured_field, GRAMMAR)
    except ValueError as e:
        raise ApiError(400, str(e), param=prepared.structured_field) from None
