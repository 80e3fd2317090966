"""What the test packages share, as plain functions; the fixtures built on them are in
``tests/conftest.py``.

Waiting: a test never sleeps a fixed time and then looks. It polls for the condition
with ``wait_for`` (or ``async_wait_for``), whose default deadline is generous, since a
loaded 2-CPU machine is slow, not broken, and whose failure names what it waited for.
A leak or a hang never comes, so a long deadline costs only the time a failure takes to
show. Bounds on behaviour (how many, how fast when fast is the point) stay as the tests
state them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PATIENCE_S = 60.0  # the default deadline of every wait
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ON_CI = os.environ.get("CI", "").lower() == "true"
PROMETHEUS_SOURCE = "Debian's prometheus package, which ships promtool too; scripts/test installs it"


# -- the offline engine ----------------------------------------------------------------

# Prompts for batches on the offline engine: short and long (one spans several KV
# blocks of 16 tokens), so a small pool is squeezed as the outputs grow.
ENGINE_PROMPTS = [
    "Once upon a time", "The cat sat on the", "Give me JSON:", "1 2 3 4", "Hello world, this is a longer "
    "prompt than the others, long enough to span several KV blocks of sixteen tokens each, and then some more",
    "a", "Zebra crossing", "{", "Write a poem about the sea", "The answer is", "Q: what? A:", "tandem",
]


def assert_engine_idle(llm) -> None:
    """The offline engine ``llm`` holds no KV blocks and no requests."""
    stats = llm.stats()
    assert stats.num_blocks_in_use == 0, f"{stats.num_blocks_in_use} KV blocks still held"
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0), f"requests left behind: {stats}"
    assert not llm.engine.has_unfinished_requests()


# -- waiting ---------------------------------------------------------------------------


def engine_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """An ``LLMEngine``'s greedy tokens for each prompt, stepping until every request finishes."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(engine.encode_prompt(p), params) for p in prompts]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def _describe(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str | Callable[[], str],
             every_s: float = 0.05) -> float:
    """Poll ``predicate()`` until it is true; the seconds that took.

    Fails after ``timeout_s`` saying it waited for ``what`` (a string, or a function
    giving one, called at the failure so that it can show the last state seen).
    """
    t0 = time.monotonic()
    while not predicate():
        waited = time.monotonic() - t0
        assert waited < timeout_s, f"waited {waited:.1f}s for {_describe(what)}"
        time.sleep(every_s)
    return time.monotonic() - t0


async def async_wait_for(predicate: Callable[[], object], timeout_s: float, what: str | Callable[[], str],
                         every_s: float = 0.01) -> float:
    """``wait_for`` inside an event loop: ``predicate()`` may return an awaitable."""
    t0 = time.monotonic()
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - t0
        waited = time.monotonic() - t0
        assert waited < timeout_s, f"waited {waited:.1f}s for {_describe(what)}"
        await asyncio.sleep(every_s)


def tokens_generated(service) -> int:
    """Output tokens the decode workers of ``service`` have sampled so far."""
    return sum(s["generation_tokens"] for wid, s in service.stats().items() if wid.startswith("decode"))


def assert_stopped_early(service, generated_before: int, max_tokens: int) -> None:
    """The one request since ``generated_before`` was stopped, not run to ``max_tokens``:
    what a deadline on freeing its blocks would otherwise have to tell apart."""
    generated = tokens_generated(service) - generated_before
    assert generated < max_tokens, (
        f"{generated} tokens were generated: the request ran to its max_tokens={max_tokens} instead of being stopped"
    )


def assert_blocks_freed(service, within_s: float = PATIENCE_S) -> float:
    """Wait until every worker of ``service`` holds no KV blocks; returns the wait."""
    in_use: dict[str, int] = {}

    def freed() -> bool:
        in_use.update(service.blocks_in_use())
        return all(v == 0 for v in in_use.values())

    return wait_for(freed, within_s, lambda: f"every worker to hold no KV blocks (last seen: {in_use})")


# -- programs the tests run --------------------------------------------------------------


def random_step_layout(block_size: int, decode_lens: list[int], chunks: list[tuple[int, int]], rng, num_blocks: int):
    """One step's ``StepLayout`` at random: decode rows of the given context lengths, then
    (start, num_tokens) prefill chunks, each request on shuffled blocks (block 0 unused)."""
    from engine.model.step_layout import StepLayout

    free = list(range(1, num_blocks))
    rng.shuffle(free)
    return StepLayout.on_blocks(decode_lens, chunks, block_size, free)


@contextlib.contextmanager
def paged_pair(make_backend: Callable[[], object], layout, src_blocks: int, dst_blocks: int) -> Iterator[tuple]:
    """Two transfer backends with paged caches attached: (sender, its cache of random KV,
    receiver, its cache of zeros); both closed at the end."""
    import torch

    from kv_transfer.peer import make_kv

    sender, receiver = make_backend(), make_backend()
    src = make_kv(layout, src_blocks, seed=3)
    dst = tuple(torch.zeros(layout.packed_shape(dst_blocks), dtype=src[0].dtype) for _ in range(2))
    sender.attach_cache(*src)
    receiver.attach_cache(*dst)
    try:
        yield sender, src, receiver, dst
    finally:
        sender.close()
        receiver.close()


def cache_blocks(cache: tuple, ids: list[int]) -> tuple:
    """K and V of blocks ``ids`` of a paged cache (``[layers, blocks, ...]`` each)."""
    k, v = cache
    return k[:, ids], v[:, ids]


def require_tool(name: str, source: str, *, allow_module_level: bool = False) -> None:
    """Skip unless the program ``name`` (from ``source``) is on PATH; under ``CI=true`` fail.

    CI installs every program the tests use (scripts/test), so there a missing one is a
    broken setup that a quiet skip would let pass.
    """
    if shutil.which(name) is not None:
        return
    message = f"{name} is not installed ({source})"
    if ON_CI:
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message, allow_module_level=allow_module_level)


# -- checkpoints -------------------------------------------------------------------------


def build_hf_checkpoint(out_dir: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight HF model of the given family (``HF_FAMILIES``), with the
    default tokenizer.

    Biases and norm weights are random too: transformers starts them at 0 and 1, the
    values a loader that dropped them would also leave.
    """
    import torch
    import transformers

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
    )
    if arch not in HF_FAMILIES:
        raise ValueError(f"unknown family {arch!r}; known: {sorted(HF_FAMILIES)}")
    name, family = HF_FAMILIES[arch]
    common.update(family)
    common.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, f"{name}Config")(**common)
    model = getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")(config)  # Gemma3TextConfig
    _randomise_biases_and_norms(model)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


# The families tests build, each as small as it can be while keeping what sets it apart:
# transformers' class prefix and the settings on top of the common ones.
HF_FAMILIES = {
    "llama": ("Llama", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # Every layer attends to its 48 latest tokens.
    "mistral": ("Mistral", dict(num_key_value_heads=2, sliding_window=48)),
    # A window of 40 on the second layer only (use_sliding_window from max_window_layers on).
    "qwen2_window": ("Qwen2", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=40,
                                   max_window_layers=1)),
    # Per-head q/k norms, a head_dim that is not hidden / heads.
    "qwen3": ("Qwen3", dict(num_key_value_heads=2, head_dim=24)),
    # Fused q/k/v and gate/up in the checkpoint; rotary over 3/4 of each head, LongRoPE
    # factors (the short ones apply below 512 positions).
    "phi3": ("Phi3", dict(
        num_key_value_heads=2, pad_token_id=0, max_position_embeddings=1024, original_max_position_embeddings=512,
        partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(6)],
                      "long_factor": [2.0 + 0.5 * i for i in range(6)]},
    )),
    # Gemma 3 text: sliding layers (window 32, rotary base 1e4) around a global one (base
    # 1e6, linear scaling), (1 + weight) norms on both sides of each sublayer, scaled
    # embeddings, an attention scale from query_pre_attn_scalar, not head_dim.
    "gemma3": ("Gemma3Text", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=32, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
    )),
    # Top-2 of 4 experts, renormalised.
    "mixtral": ("Mixtral", dict(num_key_value_heads=2, intermediate_size=96, num_local_experts=4,
                                num_experts_per_tok=2)),
    # Top-2 of 8, renormalised, the middle layer dense.
    "qwen3_moe": ("Qwen3Moe", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=24, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
    )),
}


# A Qwen2.5-style template (Hermes tool calls) in the default tokenizer's own role tokens:
# the tools as JSON in a system turn, an assistant's calls as <tool_call> blocks (their
# arguments must come as objects), a tool's answer as <tool_response>.
TOOL_CHAT_TEMPLATE = """\
{%- if tools %}<|system|>
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|end|>
{% elif messages[0].role == 'system' %}<|system|>
{{ messages[0].content }}<|end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|assistant|>
{{ message.content }}
{%- for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|end|>
{% elif message.role == 'tool' %}<|user|>
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|end|>
{% else %}<|{{ message.role }}|>
{{ message.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""


def with_chat_template(checkpoint: Path, out_dir: Path, template: str) -> Path:
    """A copy of ``checkpoint`` whose tokenizer has ``template`` as its chat template."""
    shutil.copytree(checkpoint, out_dir, dirs_exist_ok=True)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return out_dir


def _randomise_biases_and_norms(model) -> None:
    import torch

    std = model.config.initializer_range
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)


# -- GGUF files for tests ----------------------------------------------------------------


# HF tensor name pieces -> llama.cpp's, for writing test GGUF files (the inverse of
# engine/model/gguf_tensors.py's tables, spelled out again so a mistake there shows here).
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's, fused
    "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",  # routers
}  # fmt: skip
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# The stack of every expert's projection, by the projection's name in Mixtral and Qwen3-MoE.
_GGUF_EXPERTS = {
    "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
}  # fmt: skip
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
# Gemma 3's norms around both sublayers: the one before the MLP is llama.cpp's ffn_norm.
_GGUF_GEMMA3_LAYER = {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
# The architecture llama.cpp's converter writes each family as (Mixtral: a llama with experts).
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3",
             "mixtral": "llama", "gemma3_text": "gemma3"}  # fmt: skip
# Where each K-quant block keeps its fp16 scales (ggml-common.h): random bytes there could be inf/nan.
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _gguf_name(hf: str, arch: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    names = {**_GGUF_LAYER, **_GGUF_GEMMA3_LAYER} if arch == "gemma3" else _GGUF_LAYER
    return f"blk.{layer}.{names[part]}.{kind}"


def _llama_cpp_permute(w, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensor(values, qtype, rng):
    """``values`` stored as ``qtype``: quantized by the gguf package where it can, else
    (K-quants) random blocks with sane scales, since only the file's decoding is tested."""
    import gguf
    import numpy as np

    if qtype.name not in _K_SCALES:
        data = gguf.quants.quantize(values, qtype)
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (*values.shape[:-1], values.shape[-1] // block, size), dtype=np.uint8)
        for at in _K_SCALES[qtype.name]:
            scale = rng.uniform(1e-3, 4e-3, data.shape[:-1]).astype(np.float16)
            data[..., at : at + 2] = scale[..., None].view(np.uint8)
        data = data.reshape(*values.shape[:-1], -1)
    return data


def build_gguf(path: Path, hf_dir: Path, matrix_type: str = "F32", pre: str = "default") -> Path:
    """Write the HF checkpoint in ``hf_dir`` (with the default model's byte-level BPE
    tokenizer) as one GGUF file as llama.cpp's converter (convert_hf_to_gguf.py) would:
    its architecture (``GGUF_ARCH``) and metadata, its tensor names, Q/K rows permuted for
    llama, experts stacked, Phi-3's LongRoPE factors as tensors, Gemma 3's norms plus 1;
    matrices stored as ``matrix_type``, norms, biases and routers as F32."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    _add_gguf_parameters(w, cfg)
    _add_gguf_tokenizer(w, hf_dir, pre)
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    tensors, experts = {}, {}
    for name, t in load_file(hf_dir / "model.safetensors").items():
        values = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = _llama_cpp_permute(values, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            values = _llama_cpp_permute(values, cfg["num_key_value_heads"])
        elif arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1  # Gemma3Model.modify_tensors: llama.cpp's norms scale by the weight
        if m := _EXPERT.fullmatch(name):
            experts.setdefault(f"blk.{m[1]}.{_GGUF_EXPERTS[m[3]]}.weight", {})[int(m[2])] = values
        else:
            tensors[_gguf_name(name, arch)] = values
    for name, stack in experts.items():
        tensors[name] = np.stack([stack[e] for e in range(len(stack))])
    tensors.update(_gguf_rope_factors(w, cfg))
    for name, values in tensors.items():
        if values.ndim >= 2 and ".ffn_gate_inp." not in name:
            # The writer takes a quantized tensor's shape in bytes, as quantize returns it.
            w.add_tensor(name, _gguf_tensor(values, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_gguf_parameters(w, cfg: dict) -> None:
    """The hyper-parameters as the converter writes them: TextModel's for every family,
    then LlamaModel's, Qwen2MoeModel's, Phi3MiniModel's or Gemma3Model's own."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if experts := cfg.get("num_local_experts") or cfg.get("num_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if GGUF_ARCH[cfg["model_type"]] == "llama":
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    if cfg["model_type"] == "phi3":
        partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(partial * hidden) // heads)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    if cfg["model_type"] == "gemma3_text":
        _add_gguf_gemma3(w, cfg)


def _add_gguf_gemma3(w, cfg: dict) -> None:
    """Gemma3Model's own parameters: the window, the global layers' linear scaling, the
    logits' soft-capping if any. llama.cpp takes the rest from its code (every sixth layer
    global, a rotary base of 10000 on the others, queries scaled by head_dim): a checkpoint
    that differs would run otherwise there, so it is refused rather than written."""
    import gguf

    layers, rope = cfg["num_hidden_layers"], cfg["rope_parameters"]
    implied = dict(
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)],
        local_rope_theta=10000.0, query_pre_attn_scalar=cfg["head_dim"],
    )  # fmt: skip
    given = dict(layer_types=cfg["layer_types"], local_rope_theta=rope["sliding_attention"]["rope_theta"],
                 query_pre_attn_scalar=cfg["query_pre_attn_scalar"])  # fmt: skip
    if given != implied:
        raise ValueError(f"llama.cpp's gemma3 cannot hold this checkpoint: {given} where it implies {implied}")
    w.add_sliding_window(cfg["sliding_window"])
    if rope["full_attention"].get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def _gguf_rope_factors(w, cfg: dict) -> dict:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's factors as tensors, and the
    attention factor it computes from the context lengths."""
    import math

    import numpy as np

    rope = cfg.get("rope_parameters") or {}
    if cfg["model_type"] != "phi3" or rope.get("rope_type") != "longrope":
        return {}
    scale = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
    original = rope["original_max_position_embeddings"]
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    return {
        "rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.array(rope["short_factor"], np.float32),
    }


def _add_gguf_tokenizer(w, hf_dir: Path, pre: str) -> None:
    """The tokenizer.json of ``hf_dir`` as llama.cpp stores a byte-level BPE."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    # CONTROL (3) for special added tokens, USER_DEFINED (4) for the others, NORMAL (1).
    added = {a["content"]: 3 if a["special"] else 4 for a in tok["added_tokens"]}
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([added.get(t, 1) for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    # SpecialVocab falls back on config.json for ids the tokenizer config does not give.
    if (pad := json.loads((hf_dir / "config.json").read_text()).get("pad_token_id")) is not None:
        w.add_pad_token_id(pad)
    w.add_add_bos_token(True)
    w.add_chat_template(tok_cfg["chat_template"])


# -- a local Ray and a live service ------------------------------------------------------


@contextlib.contextmanager
def local_ray(tandem_home: Path, metrics_dir: str, num_cpus: int = 2) -> Iterator:
    """A local Ray with ``num_cpus`` CPUs and no dashboard, shut down on exit whatever happens.

    Its processes find the test's ``TANDEM_HOME`` and write their Prometheus metrics
    into ``metrics_dir`` (the driver's own environment points there already: see the
    ``metrics_dir`` fixture).
    """
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    env = {"TANDEM_HOME": str(tandem_home), "OMP_NUM_THREADS": "1", "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env})
    try:
        yield ray
    finally:
        ray.shutdown()


def clear_ray(timeout_s: float = PATIENCE_S) -> None:
    """Leave the shared Ray as a module found it: no Serve application, every named actor
    (detached controllers included) killed, and no actor alive but Serve's own.

    Serve's controller and ingress stay up for the next module (``running_service``).
    Unnamed actors die with their last handle; one still alive after ``timeout_s`` is a
    leak, reported by class name so the module that made it can be found.
    """
    import gc

    import ray
    from ray._private.state import actors  # Ray's GCS actor table; the state API needs the dashboard

    serve_actors = _serve_actor_names()
    if serve_actors:
        from ray import serve

        for app in serve.status().applications:
            serve.delete(app)
        serve_actors = _serve_actor_names()
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "serve":
            continue
        with contextlib.suppress(ValueError):  # gone meanwhile
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
    gc.collect()  # handles in reference cycles keep their actors

    def alive() -> list[str]:
        return sorted(a["ActorClassName"] for a in actors().values()
                      if a["State"] != "DEAD" and a["Name"] not in serve_actors)

    wait_for(lambda: not alive(), timeout_s, lambda: f"no actor left alive; still alive: {alive()}", every_s=0.2)


def _serve_actor_names() -> set[str]:
    """The names of Serve's own actors (controller, proxies) running in this Ray."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and not a["name"].startswith("SERVE_REPLICA")}


# The Serve that services started by the tests run on, one after another: starting
# Serve's controller and ingress costs about 10 s of CPU and stopping them a few more,
# once per service otherwise. A service on another ingress restarts it.
_serve: dict = {}  # "ingress": what it runs; "ports": (HTTP, gRPC)


def _session_serve(ingress: str) -> tuple[int, int]:
    """The (HTTP, gRPC) ports of the session's Serve for ``ingress``: those of the Serve
    running now if it runs ``ingress``, else new ones (a Serve on another ingress is
    shut down first; the service's start starts the new one)."""
    from cluster.service import free_ports, wait_for_serve_actors_gone

    running = bool(_serve_actor_names())
    if running and _serve.get("ingress") == ingress:
        return _serve["ports"]
    if running:
        from ray import serve

        serve.shutdown()
        wait_for_serve_actors_gone()
    _serve.update(ingress=ingress, ports=tuple(free_ports("127.0.0.1", 2)))
    return _serve["ports"]


def free_port() -> int:
    """A port free now, outside the ephemeral range (see ``cluster.service.SPARE_PORTS``):
    the service binds it tens of seconds later, after its workers opened connections."""
    from cluster.service import free_ports

    return free_ports("127.0.0.1", 1)[0]


@contextlib.contextmanager
def running_service(
    model: str,
    router=None,
    prefill_workers: int = 1,
    num_kv_blocks: int = 512,
    decode_workers: int = 1,
    ingress: str | None = None,
    **cluster,
):
    """The whole service (workers, controller, Serve app) on the session's Serve
    (``_session_serve``); its workers, controller and app go on exit, Serve stays.

    ``cluster`` overrides topology settings (``transfer``, ``restart_workers``, ...).
    ``ingress``: Serve's ingress (cluster/ingress.py); by default ``$TANDEM_TEST_INGRESS``,
    else the service's default, so the same tests run on either.
    """
    from cluster.config import ClusterConfig
    from cluster.service import ServiceConfig, TandemService
    from router.server import RouterConfig

    settings = {
        "model": model,
        "prefill_workers": prefill_workers,
        "decode_workers": decode_workers,
        "transfer": {"backend": "object_store", "checksums": True},  # tests check every block's sum
        "engine": {"num_kv_blocks": num_kv_blocks},
        "restart_workers": False,
        **cluster,
    }
    ingress = ingress or os.environ.get("TANDEM_TEST_INGRESS") or ServiceConfig.ingress
    http_port, grpc_port = _session_serve(ingress)
    cfg = ServiceConfig(
        cluster=ClusterConfig.from_dict(settings),
        router=router or RouterConfig(),
        http_port=http_port,
        grpc_port=grpc_port,
        ingress=ingress,
    )
    svc = TandemService(cfg).start()
    try:
        wait_for(lambda: answers_health_checks(svc), PATIENCE_S,
                 "the service to answer /health and the gRPC health check on new connections", every_s=0.5)
        yield svc
    finally:
        svc.shutdown(keep_serve=True)


def answers_health_checks(svc) -> bool:
    """Whether ``svc`` answers GET /health and grpc.health.v1 Check, each on a new connection.

    The service is started once Serve calls the app ready, but the ingress may still be
    taking the router replica in (HAProxy reloads its configuration then): a connection
    made in that moment can wait on a server without the backend.
    """
    import grpc
    import httpx

    from protos.grpc.health.v1 import health_pb2, health_pb2_grpc

    try:
        if httpx.get(f"{svc.http_url}/health", timeout=5).status_code != 200:
            return False
        with grpc.insecure_channel(svc.grpc_target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except (httpx.HTTPError, grpc.RpcError):
        return False


# -- metrics -----------------------------------------------------------------------------


def scrape(metrics_dir: str) -> dict[tuple, float]:
    """The node's merged metrics, as the scrape endpoint serves them: (name, labels) -> value."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    out: dict[tuple, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "pid"))
            out[(sample.name, labels)] = out.get((sample.name, labels), 0.0) + sample.value
    return out


def metric_sum(samples: dict[tuple, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


# -- reports -----------------------------------------------------------------------------


def tally(cases: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """(test, outcome) -> count, grouped by test."""
    by_test: dict[str, dict[str, int]] = {}
    for (test, outcome), n in sorted(cases.items()):
        by_test.setdefault(test, {})[outcome] = n
    return by_test


def write_report(tmp_path_factory, filename: str, figures: dict) -> Path:
    """Write a module's figures as JSON into the session's temp folder; the file's path."""
    path = Path(tmp_path_factory.getbasetemp()) / filename
    path.write_text(json.dumps(figures, indent=1))
    return path


def DispatchedPools(config):  # noqa: N802 (a class made on first use: it needs Ray's modules)
    """``cluster.pools.TandemCluster`` with a dispatcher over its pools (as a router replica
    runs one, from the deployment's settings) in ``.dispatcher``, closed at shutdown."""
    from cluster.pools import TandemCluster
    from router.dispatch import DispatchConfig, Dispatcher

    class _Pools(TandemCluster):
        dispatcher = None

        def start(self):
            super().start()
            settings = DispatchConfig(**self.config.dispatch_settings())
            self.dispatcher = Dispatcher(self.prefill_refs, self.decode_refs, settings)
            return self

        def shutdown(self):
            if self.dispatcher is not None:
                self.dispatcher.close()
            super().shutdown()

    return _Pools(config)
