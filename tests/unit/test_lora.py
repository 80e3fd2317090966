"""LoRA adapters offline (``engine.model.lora``): PEFT's files in, many adapters in a step.

Three random adapters made with PEFT (ranks 4, 8 and 16; attention only, MLP only, every
projection; rsLoRA on one) over a random Llama. Greedy outputs of a batch mixing the
three and the base model equal each one's PEFT-merged transformers model token for
token, under a small step budget (chunked prefill), with prefix caching (the same prompt
under two adapters and the base computes three times: its blocks never serve another),
and under preemption; a Qwen3-MoE's adapter on attention alone likewise. More adapters
than slots take turns (LRU), and the bad ones are refused at load naming why, changing
nothing. Every block is back at the end.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.lora import AdapterError
from engine.model.model_config import ModelConfig
from tests.helpers import build_hf_checkpoint
from tests.unit.test_hf_parity import _hf_greedy, _hf_model

ADAPTERS = {  # name: (rank, alpha, targets, rsLoRA)
    "attn": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp": (8, 32, ["gate_proj", "up_proj", "down_proj"], True),
    "all": (16, 16, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}


def make_adapter(base_dir, out_dir, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int):
    """A PEFT LoRA adapter with random A and B (B is zero at PEFT's init: no effect), saved
    in PEFT's format; returns the PEFT-merged transformers model, the reference."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(_hf_model(base_dir), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                           use_rslora=rslora, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()


def _workload(vocab: int, seed: int, n: int = 10) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 100))] for _ in range(n)]
    return prompts, [rng.randint(1, 32) for _ in range(n)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory, default_model):
    """A Llama checkpoint, its adapters on disk, and each adapter's (and the base's) greedy
    outputs for one workload, from transformers."""
    root = tmp_path_factory.mktemp("lora")
    base = build_hf_checkpoint(root / "base", "llama", default_model, initializer_range=0.2)
    prompts, lengths = _workload(ModelConfig.from_pretrained(str(base)).vocab_size, 1)
    paths, want = {}, {None: _hf_greedy(_hf_model(base), prompts, lengths)}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        paths[name] = root / name
        want[name] = _hf_greedy(make_adapter(base, paths[name], *spec, seed=10 + i), prompts, lengths)
        assert want[name] != want[None], f"adapter {name} should change the outputs"
    return base, paths, prompts, lengths, want


def _greedy(llm: LLM, prompts, lengths, adapters) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    return [o.token_ids for o in llm.generate(prompts, params, adapter=adapters)]


@pytest.mark.parametrize("schedule", [
    dict(), dict(max_num_batched_tokens=16), dict(num_kv_blocks=12, preemption_mode="recompute"),
    dict(num_kv_blocks=12, preemption_mode="swap", swap_space=1 << 20),
], ids=["default", "16-token-budget", "preempt-recompute", "preempt-swap"])
def test_a_batch_mixing_adapters_and_the_base_gives_each_merged_models_greedy_tokens(llama, schedule):
    base, paths, prompts, lengths, want = llama
    names = [None, *ADAPTERS]
    adapters = [names[i % len(names)] for i in range(len(prompts))]
    with LLM(model=str(base), max_loras=3, lora_adapters={n: str(p) for n, p in paths.items()}, **schedule) as llm:
        got = _greedy(llm, prompts, lengths, adapters)
        for i, (g, a) in enumerate(zip(got, adapters)):
            assert g == want[a][i], f"prompt {i} under {a}: {g} vs the merged model's {want[a][i]}"
        stats = llm.stats()
        if "preemption_mode" in schedule:
            assert stats.num_preemptions > 0, "the small pool should have preempted"
        assert stats.num_blocks_in_use == 0


def test_one_prompt_under_two_adapters_and_the_base_computes_three_times(llama):
    base, paths, prompts, lengths, want = llama
    prompt, n = prompts[0] * 3, 4  # several full blocks
    order = ["attn", None, "all", "attn"]
    with LLM(model=str(base), max_loras=2, lora_adapters={n: str(p) for n, p in paths.items()}) as llm:
        outs = [_greedy(llm, [prompt], [n], a)[0] for a in order]
        stats = llm.stats()
        # Another adapter loaded later under the same name is another adapter: no hit either.
        llm.engine.unload_adapter("attn")
        llm.engine.load_adapter("attn", str(paths["mlp"]))
        outs.append(_greedy(llm, [prompt], [n], "attn")[0])
        hits_after = llm.stats().prefix_cache_hits
    assert outs[0] == outs[3], "the same adapter and prompt give the same tokens"
    assert len({tuple(o) for o in outs[:3]}) == 3, "each adapter's (and the base's) own tokens"
    full = (len(prompt) - 1) // 16
    assert stats.prefix_cache_hits == full * 16, (
        f"only the last run may hit the cache (its own adapter's blocks): {stats.prefix_cache_hits} tokens hit")
    assert hits_after == stats.prefix_cache_hits, "a reloaded name must not hit the old adapter's blocks"
    assert outs[4] == _greedy_under_mlp(llama, prompt, n)


def _greedy_under_mlp(llama, prompt, n) -> list[int]:
    base, paths, *_ = llama
    with LLM(model=str(base), max_loras=1, lora_adapters={"mlp": str(paths["mlp"])}) as llm:
        return _greedy(llm, [prompt], [n], "mlp")[0]


def test_more_adapters_than_slots_take_turns_least_recently_used_out(llama):
    base, paths, prompts, lengths, want = llama
    with LLM(model=str(base), max_loras=1, lora_adapters={n: str(p) for n, p in paths.items()}) as llm:
        for name in ["attn", "mlp", "attn", "all"]:
            assert _greedy(llm, prompts[:2], lengths[:2], name) == want[name][:2]
        lora = llm.engine.lora
        assert (lora.loads, lora.evictions) == (4, 3) and list(lora.resident) == [lora.loaded["all"].key]
        # Submitted together, more adapters than slots take turns: a step holds one of them.
        mixed = ["attn", None, "mlp", "attn", "all", None]
        got = _greedy(llm, prompts[:6], lengths[:6], mixed)
        assert got == [want[a][i] for i, a in enumerate(mixed)]
        assert llm.stats().num_blocks_in_use == 0


def test_bad_adapters_are_refused_at_load_naming_why_and_change_nothing(llama, tmp_path):
    base, paths, prompts, lengths, want = llama
    with LLM(model=str(base), max_loras=2, max_lora_rank=8, lora_adapters={"attn": str(paths["attn"])}) as llm:
        cases = {
            "rank": (paths["all"], "rank 16"),
            "missing": (tmp_path / "nowhere", "adapter_config.json"),
        }
        corrupt = tmp_path / "corrupt"
        shutil.copytree(paths["attn"], corrupt)
        (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        cases["corrupt"] = (corrupt, "cannot read")
        dora = tmp_path / "dora"
        shutil.copytree(paths["attn"], dora)
        config = json.loads((dora / "adapter_config.json").read_text())
        (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        cases["dora"] = (dora, "DoRA")
        for name, (path, why) in cases.items():
            with pytest.raises(AdapterError, match=why):
                llm.engine.load_adapter(name, str(path))
        with pytest.raises(AdapterError, match="loaded already"):
            llm.engine.load_adapter("attn", str(paths["mlp"]))  # a loaded name is kept until unloaded
        assert sorted(llm.engine.lora.loaded) == ["attn"]
        assert _greedy(llm, prompts[:2], lengths[:2], "attn") == want["attn"][:2]
        with pytest.raises(ValueError, match="unknown LoRA adapter 'mlp'"):
            _greedy(llm, prompts[:1], lengths[:1], "mlp")
        llm.engine.unload_adapter("attn")
        with pytest.raises(ValueError, match="unknown LoRA adapter"):
            _greedy(llm, prompts[:1], lengths[:1], "attn")


def test_an_adapter_on_a_mixtures_attention_gives_the_merged_models_tokens(tmp_path, default_model):
    base = build_hf_checkpoint(tmp_path / "moe", "qwen3_moe", default_model, initializer_range=0.2)
    prompts, lengths = _workload(ModelConfig.from_pretrained(str(base)).vocab_size, 2, n=4)
    merged = make_adapter(base, tmp_path / "attn", 8, 16, ["q_proj", "o_proj"], False, seed=5)
    want = _hf_greedy(merged, prompts, lengths)
    # PEFT itself will not target a fused mixture's experts; a file that names an MLP projection does.
    from safetensors.torch import load_file, save_file

    shutil.copytree(tmp_path / "attn", tmp_path / "experts")
    weights = load_file(str(tmp_path / "experts" / "adapter_model.safetensors"))
    mlp = "base_model.model.model.layers.0.mlp.gate_proj"
    weights |= {f"{mlp}.lora_A.weight": torch.zeros(8, 64), f"{mlp}.lora_B.weight": torch.zeros(32, 8)}
    save_file(weights, str(tmp_path / "experts" / "adapter_model.safetensors"))
    with LLM(model=str(base), max_loras=1, lora_adapters={"attn": str(tmp_path / "attn")}) as llm:
        assert _greedy(llm, prompts, lengths, "attn") == want
        with pytest.raises(AdapterError, match="cannot adapt"):
            llm.engine.load_adapter("experts", str(tmp_path / "experts"))


def test_adapters_need_max_loras_and_one_rank():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(lora_adapters={"a": "/x"})
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(max_loras=1, max_lora_rank=0)


def test_at_tp2_each_rank_holds_its_cut_and_the_batch_gives_the_merged_models_tokens(llama):
    base, paths, prompts, lengths, want = llama
    names = [None, *ADAPTERS]
    adapters = [names[i % len(names)] for i in range(len(prompts))]
    at_start = {n: str(p) for n, p in paths.items() if n != "mlp"}
    with LLM(model=str(base), tensor_parallel_size=2, max_loras=3, lora_adapters=at_start,
             max_num_batched_tokens=16) as llm:
        llm.engine.load_adapter("mlp", str(paths["mlp"]))  # at run time: every rank reads its cut
        got = _greedy(llm, prompts, lengths, adapters)
        for i, (g, a) in enumerate(zip(got, adapters)):
            assert g == want[a][i], f"prompt {i} under {a} at TP 2: {g} vs the merged model's {want[a][i]}"
        assert llm.stats().num_blocks_in_use == 0
