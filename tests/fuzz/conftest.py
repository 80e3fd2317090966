"""The fuzz modules' live service (tests/conftest.py's, with a small body limit) and the
oracle they judge its answers by."""

from __future__ import annotations

import pytest

MAX_BODY = 64 * 1024  # small, so the fuzzers reach the body limit often


@pytest.fixture(scope="module")
def service_settings() -> dict:
    from router.server import RouterConfig

    return {"router": RouterConfig(max_body_bytes=MAX_BODY), "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def oracle(service):
    """The served model's limits and tokenizer, for running the router's validation locally."""
    from engine.tokenizer import Tokenizer
    from router.validation import ServedModel

    info = dict(service.model_info)
    tokenizer = Tokenizer.from_pretrained(info.pop("model_dir"))
    return ServedModel(**info), tokenizer
