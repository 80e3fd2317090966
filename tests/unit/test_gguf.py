"""GGUF checkpoints load as transformers loads them: weights, tokenizer, greedy output.

The files are written here from small random HF checkpoints the way llama.cpp's
converter writes them (llama.cpp's tensor names, Q/K rows permuted for llama), in every
tensor type the loader supports. transformers' own GGUF loader, which has its own
dequantization code, is the reference for what the engine must read back.
"""

from __future__ import annotations

import pytest
import torch

from engine.gguf_checkpoint import SUPPORTED_TYPES
from engine.loader import load_model
from tests.helpers import build_gguf, build_hf_checkpoint

# Rows of 256 (the K-quants' block) so that every type can store every matrix.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4)
TYPES = sorted(SUPPORTED_TYPES)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory, default_model):
    return build_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", default_model, seed=5, **SHAPE)


@pytest.fixture(scope="module")
def hf_qwen2(tmp_path_factory, default_model):
    return build_hf_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", default_model, seed=6, **SHAPE)


def _transformers_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _expected(hf_state: dict, name: str) -> torch.Tensor:
    """Our parameter ``name`` as transformers' separate tensors would make it."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return torch.cat([hf_state[name.replace(fused, p)] for p in parts])
    return hf_state[name]


def _assert_same_weights(ours, theirs, label: str) -> None:
    hf_state = {k if k.startswith(("model.", "lm_head")) else f"model.{k}": v for k, v in theirs.state_dict().items()}
    for name, param in ours.named_parameters():
        want = _expected(hf_state, name if name.startswith("lm_head") else f"model.{name}")
        torch.testing.assert_close(param, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{label}: {name}: {m}")


@pytest.mark.parametrize("qtype", TYPES)
def test_every_supported_type_reads_back_as_transformers_reads_it(tmp_path, hf_llama, qtype):
    path = build_gguf(tmp_path / f"llama-{qtype}.gguf", hf_llama, "llama", qtype)
    _assert_same_weights(load_model(path, pack=False), _transformers_gguf(path), f"llama {qtype}")


@pytest.mark.parametrize("qtype", ["F32", "Q4_K"])
def test_qwen2_files_read_back_as_transformers_reads_them(tmp_path, hf_qwen2, qtype):
    path = build_gguf(tmp_path / f"qwen2-{qtype}.gguf", hf_qwen2, "qwen2", qtype)
    model = load_model(path, pack=False)
    assert model.config.qkv_bias and model.config.tie_word_embeddings
    _assert_same_weights(model, _transformers_gguf(path), f"qwen2 {qtype}")


def test_an_f32_file_gives_back_the_original_checkpoint_exactly(tmp_path, hf_llama):
    # Independent of transformers: the Q/K rows the converter permuted come back in HF order.
    from safetensors.torch import load_file

    original = load_file(hf_llama / "model.safetensors")
    model = load_model(build_gguf(tmp_path / "llama.gguf", hf_llama, "llama", "F32"), pack=False)
    q, k, v = model.layers[0].self_attn.qkv_proj.weight.split([256, 128, 128])
    assert torch.equal(q, original["model.layers.0.self_attn.q_proj.weight"]), "q rows not un-permuted"
    assert torch.equal(k, original["model.layers.0.self_attn.k_proj.weight"]), "k rows not un-permuted"
    assert torch.equal(v, original["model.layers.0.self_attn.v_proj.weight"])


def test_the_reader_sees_what_ggufs_own_reader_sees(tmp_path, hf_llama):
    """``GGUFFile`` reads through a plain view of the memory map (fast): every field's
    parts and every tensor's bytes are those of gguf's own reader."""
    import gguf
    import numpy as np

    from engine.gguf_checkpoint import GGUFFile

    path = build_gguf(tmp_path / "llama.gguf", hf_llama, "llama", "Q8_0")
    ours, theirs = GGUFFile(path)._reader, gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types and mine.data == field.data, key
        assert len(mine.parts) == len(field.parts) and all(map(np.array_equal, mine.parts, field.parts)), key
    assert [(t.name, t.tensor_type) for t in ours.tensors] == [(t.name, t.tensor_type) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_the_gguf_tokenizer_encodes_like_tokenizer_json_and_transformers(tmp_path, hf_llama):
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    path = build_gguf(tmp_path / "tok.gguf", hf_llama, "llama", "F32")
    ours, original = Tokenizer.from_pretrained(path), Tokenizer.from_pretrained(hf_llama)
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    chat = ours.apply_chat_template([{"role": "user", "content": "Hi there!"}])
    assert chat == original.apply_chat_template([{"role": "user", "content": "Hi there!"}])
    texts = [chat, "Once upon a time, in 1984,  two  spaces\nand a newline.", "naïve café ☕ <|end|>", " lead"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == original.encode(text), f"{text!r}: GGUF tokenizer differs from tokenizer.json"
        assert ids == theirs.encode(text), f"{text!r}: GGUF tokenizer differs from transformers' GGUF one"
        assert ours.decode(ids) == original.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_id) == (original.bos_token_id, original.eos_token_id)
    assert ours.eos_token_id in ours.all_special_ids and ours.encode("<|end|>", False) == [5]


def test_the_smollm_pre_tokenizer_puts_every_digit_on_its_own(tmp_path, hf_llama):
    from engine.tokenizer import Tokenizer

    text = "In 2020 and 1999 there were 100 of them."
    plain = Tokenizer.from_pretrained(build_gguf(tmp_path / "plain.gguf", hf_llama, "llama", "F32"))
    digits = Tokenizer.from_pretrained(build_gguf(tmp_path / "smollm.gguf", hf_llama, "llama", "F32", pre="smollm"))
    merged = [t for t in plain.convert_ids_to_tokens(plain.encode(text)) if sum(c.isdigit() for c in t) > 1]
    assert merged, "the test tokenizer should merge some digits, or this test shows nothing"
    pieces = digits.convert_ids_to_tokens(digits.encode(text))
    assert all(sum(c.isdigit() for c in t) <= 1 for t in pieces), pieces
    assert digits.decode(digits.encode(text)) == text


def test_greedy_output_on_a_quantized_gguf_matches_transformers(tmp_path, default_model):
    from engine import LLM, SamplingParams

    hf_dir = build_hf_checkpoint(tmp_path / "hf", "llama", default_model, seed=8, initializer_range=0.2)
    path = build_gguf(tmp_path / "model.gguf", hf_dir, "llama", "Q8_0")
    prompts = [[5, 17, 300, 41], list(range(100, 160)), [7] * 23]
    model = _transformers_gguf(path)
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=16)
    got = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == want
    assert llm.engine.model_name == "model", "a GGUF file is served under its stem"


def _write_gguf(path, arch: str, tensors: dict, tokenizer: str = "gpt2"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(["a", "b"])
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architectures_types_and_tokenizers_are_refused_naming_them(tmp_path):
    import gguf
    import numpy as np

    from engine.gguf_checkpoint import GGUFFile

    f32 = (np.zeros((2, 32), np.float32), gguf.GGMLQuantizationType.F32)
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'.*llama"):
        GGUFFile(_write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": f32}))
    q2k = (np.zeros((2, 84), np.uint8), gguf.GGMLQuantizationType.Q2_K)
    with pytest.raises(ValueError, match=r"unsupported tensor type\(s\) \['Q2_K'\]"):
        GGUFFile(_write_gguf(tmp_path / "q2k.gguf", "llama", {"token_embd.weight": q2k})).tensors(torch.float32, 1, 1)
    with pytest.raises(ValueError, match="unsupported tokenizer model 'llama'"):
        GGUFFile(_write_gguf(tmp_path / "spm.gguf", "llama", {"token_embd.weight": f32}, "llama")).tokenizer_parts()
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_qkv.weight' has no place"):
        GGUFFile(_write_gguf(tmp_path / "qkv.gguf", "llama", {"blk.0.attn_qkv.weight": f32})).tensors(torch.float32, 1, 1)
