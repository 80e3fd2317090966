"""LoRA adapters through the service: a request names an adapter as its ``model``.

Two PEFT adapters over the tiny Llama, loaded by every worker at start (the topology's
``engine.lora_adapters``). Colocated and 1P+1D, greedy completions under each adapter and
the base, sent together, give the offline engine's texts under the same adapter (itself
equal to the PEFT-merged transformers model's, ``tests/unit/test_lora.py``): the prefill
worker computes the prompt's KV under the adapter and the decode worker decodes under it.
``/v1/models`` lists the adapters with the base as their parent; an unknown model is a 404
naming what is served. A prefill worker whose adapter differs from the decode worker's
(other files under the same name) refuses to send its KV: the decode worker recomputes,
and the text is still the decode worker's adapter's. Every block is back at the end.
"""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.chaos.streams import model_name
from tests.helpers import assert_blocks_freed, running_service
from tests.unit.test_lora import make_adapter

PROMPTS = ["the adapter said", "one two three four five six", "a b c", "tandem serves fine-tunes and the base"]
TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("adapters")
    paths = {"qv": root / "qv", "mlp": root / "mlp", "other-qv": root / "other"}
    make_adapter(tiny_model, paths["qv"], 8, 16, ["q_proj", "v_proj"], False, seed=1)
    make_adapter(tiny_model, paths["mlp"], 4, 8, ["gate_proj", "up_proj", "down_proj"], False, seed=2)
    make_adapter(tiny_model, paths["other-qv"], 8, 16, ["q_proj", "v_proj"], False, seed=3)
    return {name: str(p) for name, p in paths.items()}


def _offline(model: str, adapters: dict[str, str], names: list[str | None]) -> list[str]:
    """The offline engine's greedy text of each prompt under each name (None: the base)."""
    with LLM(model=model, max_loras=2, lora_adapters=adapters) as llm:
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([p for _ in names for p in PROMPTS], params, adapter=[n for n in names for _ in PROMPTS])
    return [o.text for o in outs]


def _served(url: str, models: list[str]) -> list[str]:
    with httpx.Client(timeout=120) as client:
        texts = []
        for model in models:
            for prompt in PROMPTS:
                body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
                r = client.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
    return texts


@pytest.mark.parametrize("prefill_workers", [0, 1], ids=["colocated", "1P+1D"])
def test_each_adapter_and_the_base_serve_the_offline_engines_text(ray_cluster, tiny_model, adapters, prefill_workers):
    served = {"qv": adapters["qv"], "mlp": adapters["mlp"]}
    want = _offline(tiny_model, served, ["qv", None, "mlp"])
    engine = {"num_kv_blocks": 256, "max_loras": 2, "lora_adapters": served}
    with running_service(tiny_model, prefill_workers=prefill_workers, engine=engine) as service:
        base = model_name(tiny_model)
        assert _served(service.http_url, ["qv", base, "mlp"]) == want
        listed = httpx.get(f"{service.http_url}/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [(base, None), ("mlp", base), ("qv", base)]
        r = httpx.post(f"{service.http_url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404 and "'qv'" in r.json()["error"]["message"]
        assert_blocks_freed(service)


def test_a_prefill_worker_with_other_files_under_the_name_refuses_and_the_decode_worker_recomputes(
        ray_cluster, tiny_model, adapters):
    want = _offline(tiny_model, {"qv": adapters["qv"]}, ["qv"])
    with running_service(tiny_model, engine={"num_kv_blocks": 256, "max_loras": 1},
                         prefill_engine={"lora_adapters": {"qv": adapters["other-qv"]}},
                         decode_engine={"lora_adapters": {"qv": adapters["qv"]}}) as service:
        assert _served(service.http_url, ["qv"]) == want, "the decode worker's adapter decides the text"
        assert_blocks_freed(service)
