"""GGUF checkpoints load as transformers loads them: weights, tokenizer, greedy output.

The files are written here from small random HF checkpoints the way llama.cpp's
converter writes them (llama.cpp's tensor names and metadata, Q/K rows permuted for
llama, experts stacked, Phi-3's LongRoPE factors as tensors, Gemma 3's norm weights plus
1), in every tensor type the loader supports. transformers' own GGUF loader, which has its own dequantization code,
is the reference for what the engine must read back where it reads the architecture;
transformers on the original checkpoint is the reference for greedy output.
SentencePiece vocabularies are built here too, with tokens, scores and token types as
llama.cpp stores them.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.model.gguf_checkpoint import SUPPORTED_TYPES
from engine.model.loader import load_model
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
    """Our parameter ``name`` as transformers' tensors would make it: its separate
    projections fused, its stacked experts under their names."""
    name = name.replace("mlp.experts_gate_up", "mlp.experts.gate_up_proj")
    name = name.replace("mlp.experts_down", "mlp.experts.down_proj")
    if name in hf_state:  # Phi-3's, fused in transformers too
        return hf_state[name]
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
    path = build_gguf(tmp_path / f"llama-{qtype}.gguf", hf_llama, qtype)
    _assert_same_weights(load_model(path, pack=False), _transformers_gguf(path), f"llama {qtype}")


@pytest.mark.parametrize("qtype", ["F32", "Q4_K"])
def test_qwen2_files_read_back_as_transformers_reads_them(tmp_path, hf_qwen2, qtype):
    path = build_gguf(tmp_path / f"qwen2-{qtype}.gguf", hf_qwen2, qtype)
    model = load_model(path, pack=False)
    assert model.config.qkv_bias and model.config.tie_word_embeddings
    _assert_same_weights(model, _transformers_gguf(path), f"qwen2 {qtype}")


def test_an_f32_file_gives_back_the_original_checkpoint_exactly(tmp_path, hf_llama):
    # Independent of transformers: the Q/K rows the converter permuted come back in HF order.
    from safetensors.torch import load_file

    original = load_file(hf_llama / "model.safetensors")
    model = load_model(build_gguf(tmp_path / "llama.gguf", hf_llama), pack=False)
    q, k, v = model.layers[0].self_attn.qkv_proj.weight.split([256, 128, 128])
    assert torch.equal(q, original["model.layers.0.self_attn.q_proj.weight"]), "q rows not un-permuted"
    assert torch.equal(k, original["model.layers.0.self_attn.k_proj.weight"]), "k rows not un-permuted"
    assert torch.equal(v, original["model.layers.0.self_attn.v_proj.weight"])


def test_the_reader_sees_what_ggufs_own_reader_sees(tmp_path, hf_llama):
    """``GGUFFile`` reads through a plain view of the memory map (fast): every field's
    parts and every tensor's bytes are those of gguf's own reader."""
    import gguf
    import numpy as np

    from engine.model.gguf_checkpoint import GGUFFile

    path = build_gguf(tmp_path / "llama.gguf", hf_llama, "Q8_0")
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

    path = build_gguf(tmp_path / "tok.gguf", hf_llama)
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
    plain = Tokenizer.from_pretrained(build_gguf(tmp_path / "plain.gguf", hf_llama))
    digits = Tokenizer.from_pretrained(build_gguf(tmp_path / "smollm.gguf", hf_llama, pre="smollm"))
    merged = [t for t in plain.convert_ids_to_tokens(plain.encode(text)) if sum(c.isdigit() for c in t) > 1]
    assert merged, "the test tokenizer should merge some digits, or this test shows nothing"
    pieces = digits.convert_ids_to_tokens(digits.encode(text))
    assert all(sum(c.isdigit() for c in t) <= 1 for t in pieces), pieces
    assert digits.decode(digits.encode(text)) == text


def test_user_defined_tokens_are_matched_whole_as_llama_cpp_and_transformers_do(tmp_path, hf_llama):
    # Qwen3's <think> is an added token that is not special: llama.cpp stores it as
    # USER_DEFINED and matches it whole; split into pieces, a chat template's <think>
    # would not be the token the model was trained on.
    import shutil

    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_llama, hf_dir)
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": len(spec["model"]["vocab"]), "content": "<think>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False, "special": False})  # fmt: skip
    (hf_dir / "tokenizer.json").write_text(json.dumps(spec))
    path = build_gguf(tmp_path / "think.gguf", hf_dir)
    ours, theirs = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    think = ours.token_to_id("<think>")
    for text in ("<think>\nhmm\n</think>\n\nHi", "a<think>b"):
        ids = ours.encode(text, add_special_tokens=False)
        assert think in ids and ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text, "a user-defined token is text, kept when decoding"


PROMPTS = [[5, 17, 300, 41], list(range(100, 160)), [7] * 23]


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    return want


def _engine_greedy(path, prompts: list[list[int]]):
    from engine import LLM, SamplingParams

    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=16)
    got = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return llm, [o.token_ids for o in got]


def test_greedy_output_on_a_quantized_gguf_matches_transformers(tmp_path, default_model):
    hf_dir = build_hf_checkpoint(tmp_path / "hf", "llama", default_model, seed=8, initializer_range=0.2)
    path = build_gguf(tmp_path / "model.gguf", hf_dir, "Q8_0")
    want = _hf_greedy(_transformers_gguf(path), PROMPTS)
    llm, got = _engine_greedy(path, PROMPTS)
    assert got == want
    assert llm.engine.model_name == "model", "a GGUF file is served under its stem"


# The families beyond Llama and Qwen2, as tests.helpers builds them. Qwen3-MoE without
# dense layers: llama.cpp's qwen3moe has no place for them (no mlp_only_layers).
FAMILIES = {"qwen3": {}, "phi3": {}, "mixtral": {}, "qwen3_moe": dict(mlp_only_layers=[])}
CONFIG_FIELDS = (
    "architecture", "vocab_size", "intermediate_size", "num_kv_heads", "head_dim", "rotary_dims", "qk_norm",
    "moe", "rope_type", "rope_original_positions", "sliding_window", "tie_word_embeddings",
)  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_f32_file_of_each_family_loads_as_its_checkpoint_does(tmp_path, default_model, family):
    """Names, fused and stacked tensors, Q/K row order, q/k norms, partial rotary,
    LongRoPE's factors, experts and routers: bit for bit the model of the checkpoint."""
    hf_dir = build_hf_checkpoint(tmp_path / "hf", family, default_model, seed=9, **FAMILIES[family])
    ours = load_model(build_gguf(tmp_path / f"{family}.gguf", hf_dir), pack=False)
    want = load_model(hf_dir, pack=False)
    for field in CONFIG_FIELDS:
        assert getattr(ours.config, field) == getattr(want.config, field), field
    expected = dict(want.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, expected[name]), name
    assert torch.equal(ours.rotary.cos, want.rotary.cos) and torch.equal(ours.rotary.sin, want.rotary.sin)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_output_on_each_familys_file_matches_transformers_on_its_checkpoint(tmp_path, default_model, family):
    from transformers import AutoModelForCausalLM

    hf_dir = build_hf_checkpoint(tmp_path / "hf", family, default_model, seed=8, initializer_range=0.2,
                                 **FAMILIES[family])  # fmt: skip
    want = _hf_greedy(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), PROMPTS)
    assert _engine_greedy(build_gguf(tmp_path / "model.gguf", hf_dir), PROMPTS)[1] == want


# Checkpoints transformers' own GGUF loader reads back whole: it takes no head_dim from a
# qwen3 file (Qwen3Config's default, 128, must be right) nor the experts' width from a
# qwen3moe one (its default, 768), and reads neither partial rotary nor LongRoPE from a
# phi3 one (whose weights alone it gets right).
READABLE = {
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "qwen3_moe": dict(mlp_only_layers=[], moe_intermediate_size=768),
    "phi3": {},
}


@pytest.mark.parametrize(("family", "qtype"), [("qwen3", "Q4_K"), ("qwen3", "Q8_0"), ("qwen3_moe", "Q8_0"),
                                               ("phi3", "Q8_0")])  # fmt: skip
def test_family_files_read_back_as_transformers_reads_them(tmp_path, default_model, family, qtype):
    hf_dir = build_hf_checkpoint(tmp_path / "hf", family, default_model, seed=10, **READABLE[family])
    path = build_gguf(tmp_path / f"{family}-{qtype}.gguf", hf_dir, qtype)
    _assert_same_weights(load_model(path, pack=False), _transformers_gguf(path), f"{family} {qtype}")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_greedy_output_on_a_quantized_family_file_matches_transformers(tmp_path, default_model, family):
    hf_dir = build_hf_checkpoint(tmp_path / "hf", family, default_model, seed=8, initializer_range=0.2,
                                 **READABLE[family])  # fmt: skip
    path = build_gguf(tmp_path / "model.gguf", hf_dir, "Q8_0")
    assert _engine_greedy(path, PROMPTS)[1] == _hf_greedy(_transformers_gguf(path), PROMPTS)


# -- Gemma 3 -------------------------------------------------------------------------------

# What llama.cpp's gemma3 can hold (tests.helpers refuses the rest): every sixth layer
# global, here the last of six, and queries scaled by head_dim (16 in HF_FAMILIES).
GEMMA3 = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
              query_pre_attn_scalar=16)  # fmt: skip


@pytest.fixture(scope="module")
def hf_gemma3(tmp_path_factory, default_model):
    # At transformers' default init Gemma's greedy output repeats itself (test_hf_parity).
    return build_hf_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", default_model, seed=8,
                               initializer_range=0.05, **GEMMA3)  # fmt: skip


def test_an_f32_gemma3_file_loads_as_its_checkpoint_does(tmp_path, hf_gemma3):
    """The settings llama.cpp implies (sliding layers and their rotary base, the global
    ones' linear scaling, the attention scale, GELU, tied embeddings), the norms around
    both sublayers under their names, each with the 1 its converter added taken off."""
    import dataclasses

    ours = load_model(build_gguf(tmp_path / "gemma3.gguf", hf_gemma3), pack=False)
    want = load_model(hf_gemma3, pack=False)
    # The file's own: epsilon as float32, the tokenizer's BOS and EOS.
    own = ("rms_norm_eps", "bos_token_id", "eos_token_ids")
    assert dataclasses.replace(ours.config, **{f: getattr(want.config, f) for f in own}) == want.config
    assert ours.config.rms_norm_eps == pytest.approx(want.config.rms_norm_eps)
    expected = dict(want.named_parameters())
    for name, param in ours.named_parameters():
        if name.endswith("norm.weight"):
            # The file holds fl(1 + w); less 1 it is w to the last bit, and scales by 1 + w exactly.
            assert torch.equal(1 + param, 1 + expected[name]), name
            torch.testing.assert_close(param, expected[name], rtol=0, atol=2**-23)
        else:
            assert torch.equal(param, expected[name]), name
    for rotary in ("rotary", "local_rotary"):
        assert torch.equal(getattr(ours, rotary).cos, getattr(want, rotary).cos), rotary


def test_greedy_output_on_a_gemma3_file_matches_transformers_on_its_checkpoint(tmp_path, hf_gemma3):
    from transformers import AutoModelForCausalLM

    want = _hf_greedy(AutoModelForCausalLM.from_pretrained(hf_gemma3, dtype=torch.float32).eval(), PROMPTS)
    assert len({t for out in want for t in out}) > 6, f"degenerate reference outputs: {want}"
    assert _engine_greedy(build_gguf(tmp_path / "gemma3.gguf", hf_gemma3), PROMPTS)[1] == want


def test_a_quantized_gemma3_file_reads_and_generates_as_transformers_does(tmp_path, hf_gemma3):
    """transformers' GGUF loader reads gemma3's weights (its norms less 1 as well) but not
    all of its settings: it keeps Gemma3TextConfig's query_pre_attn_scalar (256) and no
    rotary scaling. The greedy reference is therefore transformers under the checkpoint's
    config with the weights its GGUF loader read."""
    from transformers import AutoModelForCausalLM

    path = build_gguf(tmp_path / "gemma3-Q8_0.gguf", hf_gemma3, "Q8_0")
    theirs = _transformers_gguf(path)
    _assert_same_weights(load_model(path, pack=False), theirs, "gemma3 Q8_0")
    reference = AutoModelForCausalLM.from_pretrained(hf_gemma3, dtype=torch.float32).eval()
    reference.load_state_dict(theirs.state_dict())
    assert _engine_greedy(path, PROMPTS)[1] == _hf_greedy(reference, PROMPTS)


def test_a_gemma3_file_with_soft_capped_logits_is_refused_as_its_checkpoint_is(tmp_path, default_model):
    hf_dir = build_hf_checkpoint(tmp_path / "hf", "gemma3", default_model, final_logit_softcapping=30.0, **GEMMA3)
    for checkpoint in (hf_dir, build_gguf(tmp_path / "capped.gguf", hf_dir)):
        with pytest.raises(ValueError, match="unsupported final_logit_softcapping 30.0"):
            load_model(checkpoint)


# -- SentencePiece vocabularies ---------------------------------------------------------

SPM_CORPUS = [
    "Hello world, this is a small test of the tokenizer.", "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in 1984, there were two  spaces and a newline.", "naïve café résumé",
    "thinking about the weather",
]  # fmt: skip
# Spaces leading, doubled and trailing, letters outside the pieces (byte fallback, emoji
# included), control and user-defined tokens mid-text, and none at all.
SPM_TEXTS = [
    "Hello world", "  two  spaces ", " lead", "naïve café ☕ 😀", "line\nbreak\ttab", "<|user|>Hi there<|end|>",
    "<think>ok</think> done", "a</s>b", "<unk>", "", "thinking about the weather in 1984",
]  # fmt: skip
# Token types as llama.cpp's converter writes a SentencePiece vocabulary.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def _sentencepiece_gguf(path, arch: str = "phi3", add_space_prefix: bool | None = None):
    """A GGUF holding a SentencePiece BPE vocabulary as llama.cpp stores one: <unk>, <s>,
    </s>, the 256 byte-fallback tokens <0x00>..<0xFF>, ``▁``-prefixed pieces (learned
    here by tokenizers' BPE trainer) scored by merge order, then added tokens."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace()
    learner.train_from_iterator(SPM_CORPUS * 10, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    spec = json.loads(learner.to_str())["model"]
    merged = list(dict.fromkeys("".join(m.split(" ") if isinstance(m, str) else m) for m in spec["merges"]))
    pieces = merged + [t for t in spec["vocab"] if len(t) == 1 and t not in merged]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<|user|>", "<|end|>", "<think>"]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces) + [CONTROL, CONTROL, USER_DEFINED]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-1000.0] * 3
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _pieces(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_builds_it(tmp_path):
    # A phi3 file: transformers gives the text its leading space as llama.cpp does there.
    from transformers import AutoTokenizer

    from engine.tokenizer import IncrementalDetokenizer, Tokenizer

    path = _sentencepiece_gguf(tmp_path / "spm.gguf")
    ours, theirs = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), f"{text!r}: {ours.convert_ids_to_tokens(ids)}"
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
        detok = IncrementalDetokenizer(ours, [])
        streamed = "".join(detok.update([i]) or detok.take_delta() for i in ids) + detok.take_delta(finished=True)
        assert streamed == ours.decode(ids), f"{text!r}: streamed text differs from the whole decode"
    assert ours.encode("Hi")[0] == ours.bos_token_id == 1 and ours.eos_token_id == 2, "llama.cpp adds BOS by default"
    assert _pieces(ours, "café ☕") == ["▁café", "▁", "<0xE2>", "<0x98>", "<0x95>"], "byte fallback"
    assert ours.decode(ours.encode("café ☕ 😀")) == "café ☕ 😀"
    assert _pieces(ours, "<|user|>Hi<think>") == ["<|user|>", "▁", "H", "i", "<think>"]
    assert ours.decode(ours.encode("<|user|>Hi<think>")) == "Hi<think>", "control tokens skipped, user-defined kept"


def test_a_sentencepiece_text_gets_its_leading_space_where_llama_cpp_gives_it(tmp_path):
    """llama.cpp (llama-vocab.cpp, SPM) puts a space before the text and after every added
    token, whatever the architecture, unless the file says add_space_prefix false.
    transformers does the same for phi3 files but prefixes only the start of the text
    for llama ones: the two agree on text without leading spaces and added tokens."""
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    path = _sentencepiece_gguf(tmp_path / "llama.gguf", "llama")
    llama = Tokenizer.from_pretrained(path)
    phi3 = Tokenizer.from_pretrained(_sentencepiece_gguf(tmp_path / "phi3.gguf"))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in SPM_TEXTS:
        assert llama.encode(text) == phi3.encode(text), text
    for text in ("Hello world", "naïve café ☕ 😀", "thinking about the weather in 1984"):
        assert llama.encode(text) == theirs.encode(text), text
    assert _pieces(llama, " Hello") == ["▁", "▁Hello"]
    assert _pieces(llama, "<|user|>Hello") == ["<|user|>", "▁Hello"]
    bare = Tokenizer.from_pretrained(_sentencepiece_gguf(tmp_path / "bare.gguf", "llama", add_space_prefix=False))
    assert _pieces(bare, "Hello world") == ["He", "llo", "▁wor", "l", "d"]
    assert bare.decode(bare.encode("Hello world")) == "Hello world"


def test_a_gemma3_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path):
    # Gemma3Model writes add_space_prefix false: no space before the text or added tokens.
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    path = _sentencepiece_gguf(tmp_path / "gemma3.gguf", "gemma3", add_space_prefix=False)
    ours, theirs = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), f"{text!r}: {ours.convert_ids_to_tokens(ids)}"
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert _pieces(ours, "<|user|>Hello world") == ["<|user|>", "He", "llo", "▁wor", "l", "d"]


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

    from engine.model.gguf_checkpoint import GGUFFile

    f32 = (np.zeros((2, 32), np.float32), gguf.GGMLQuantizationType.F32)
    for arch in ("gpt2", "gemma2"):
        with pytest.raises(ValueError, match=rf"unsupported architecture '{arch}'.*llama"):
            GGUFFile(_write_gguf(tmp_path / f"{arch}.gguf", arch, {"token_embd.weight": f32}))
    q2k = (np.zeros((2, 84), np.uint8), gguf.GGMLQuantizationType.Q2_K)
    with pytest.raises(ValueError, match=r"unsupported tensor type\(s\) \['Q2_K'\]"):
        GGUFFile(_write_gguf(tmp_path / "q2k.gguf", "llama", {"token_embd.weight": q2k})).tensors(torch.float32, 1, 1)
    with pytest.raises(ValueError, match="unsupported tokenizer model 'bert'"):
        GGUFFile(_write_gguf(tmp_path / "bert.gguf", "llama", {"token_embd.weight": f32}, "bert")).tokenizer_parts()
    with pytest.raises(ValueError, match="SentencePiece vocabulary without scores"):
        GGUFFile(_write_gguf(tmp_path / "spm.gguf", "llama", {"token_embd.weight": f32}, "llama")).tokenizer_parts()
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_qkv.weight' has no place"):
        GGUFFile(_write_gguf(tmp_path / "qkv.gguf", "llama", {"blk.0.attn_qkv.weight": f32})).tensors(torch.float32, 1, 1)
