"""Speculative methods through the public API: greedy equality, stats, bad settings, and trained
heads loaded once per directory."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.drafters.medusa import save_heads
from specdecode.drafters.redrafter import save_head
from specdecode.engine.drafter_factory import draft_vocab
from specdecode.models.loader import resolve_model
from specdecode.models.transformer import Transformer
from specdecode.spec_config import LookaheadConfig, parse_speculative
from tests.test_draft_model import tiny_transformer
from tests.test_medusa import random_heads
from tests.test_redrafter import random_head
from tests.tiny import copy_with_chat_tokenizer
from tests.tiny_gguf import write_tiny_gguf

PROMPTS = ["the the tea in the tea", "in 12 12 12 in", "the a the a the a"]


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny target, a different tiny draft with the same vocabulary, and one with another vocabulary."""
    root = tmp_path_factory.mktemp("spec_api")
    target = write_tiny_gguf(root / "target.gguf", "llama", seed=0).path
    draft = write_tiny_gguf(root / "draft.gguf", "llama", seed=1).path
    other = write_tiny_gguf(root / "other.gguf", "qwen2", pre="qwen2", seed=2).path
    return target, draft, other


@pytest.fixture(scope="module")
def llm(tiny_paths, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    import os

    os.environ["SPECDECODE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    return LLM(model=str(tiny_paths[0]), device="cpu", progress=False)


def methods(draft: Path) -> list[dict]:
    return [
        {"method": "prompt_lookup"},
        {"method": "prompt_lookup", "prompt_lookup_num_tokens": 6, "max_matching_ngram_size": 3},
        {"method": "prompt_lookup", "num_candidates": 3, "max_matching_ngram_size": 3},
        {"method": "draft_model", "draft_model": str(draft), "num_draft_tokens": 3},
        {"method": "draft_model", "draft_model": str(draft), "max_draft_len": 5, "use_draft_logits": False},
        {"method": "prompt_lookup", "draft_model": str(draft)},
        {"method": "lookahead", "window_size": 3, "ngram_size": 3, "verification_set_size": 3},
        {"method": "lookahead", "window_size": 1, "ngram_size": 1, "verification_set_size": 0},
    ]


def test_every_method_reproduces_plain_greedy(llm: LLM, tiny_paths) -> None:
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, params, speculative=None)]
    for spec in methods(tiny_paths[1]):
        outs = llm.generate(PROMPTS, params, speculative=spec)
        assert [o.token_ids for o in outs] == plain, spec
        for o in outs:
            s = o.stats
            assert s.num_generated_tokens == 48
            assert s.mean_accepted_length == pytest.approx(48 / s.num_target_forwards)
            assert s.num_accepted_tokens <= s.num_draft_tokens


def test_llm_default_and_per_call_override(tiny_paths) -> None:
    llm = LLM(model=str(tiny_paths[0]), speculative={"method": "prompt_lookup"}, progress=False)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    spec_out = llm.generate(["the the the the"], params)[0]
    plain_out = llm.generate(["the the the the"], params, speculative=None)[0]
    assert spec_out.token_ids == plain_out.token_ids
    assert plain_out.stats.num_draft_tokens == 0 and plain_out.stats.mean_accepted_length == 1.0
    assert spec_out.stats.num_draft_tokens > 0


BAD = [
    ({"method": "medusa2"}, "unknown speculative method 'medusa2'"),
    ({"method": "prompt_lookup", "num_draft_tokenz": 3}, "unknown option num_draft_tokenz"),
    ({"method": "lookahead", "prompt_lookup_num_tokens": 3}, "unknown option prompt_lookup_num_tokens"),
    ({"method": "draft_model"}, "draft_model"),
    (
        {"method": "draft_model", "draft_model": "x", "num_draft_tokens": 0},
        "num_draft_tokens must be a positive",
    ),
    (
        {"method": "draft_model", "draft_model": "x", "max_draft_len": -2},
        "num_draft_tokens must be a positive",
    ),
    ({"method": "prompt_lookup", "prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens"),
    ({"method": "prompt_lookup", "max_matching_ngram_size": 0}, "max_matching_ngram_size"),
    ({"method": "lookahead", "window_size": 0}, "window_size"),
    ({"method": "lookahead", "window_size": 3, "ngram_size": 1, "verification_set_size": 2}, "(1, 1, 0)"),
    ("prompt_lookup", "must be a dictionary"),
    ({"method": "draft_model", "draft_model": "x", "draft_dtype": "fp8"}, "draft_dtype must be one of"),
    (
        {"method": "draft_model", "draft_model": "x", "draft_vocab_size": 0},
        'draft_vocab_size must be "auto", "all" or a positive',
    ),
    (
        {"method": "prompt_lookup", "draft_vocab_size": "32k"},
        'draft_vocab_size must be "auto", "all" or a positive',
    ),
]


@pytest.mark.parametrize(("spec", "words"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_settings_name_the_setting(spec, words: str) -> None:
    with pytest.raises(SpecDecodeError) as err:
        parse_speculative(spec)
    assert words in str(err.value)


def test_lookahead_limits() -> None:
    assert LookaheadConfig(7, 7, 7).max_draft_len == 83
    assert LookaheadConfig(1, 1, 0).max_draft_len == 0
    assert LookaheadConfig(4, 3, 4).max_draft_len == 1 + 7 * 2
    LookaheadConfig(3, 3, 2).check_within(LookaheadConfig(4, 4, 4))
    LookaheadConfig(1, 1, 0).check_within(LookaheadConfig(4, 4, 4))
    with pytest.raises(SpecDecodeError, match=r"exceeds the engine's configured \(4, 4, 4\)"):
        LookaheadConfig(5, 3, 3).check_within(LookaheadConfig(4, 4, 4))


def test_request_lookahead_beyond_engine_is_an_error(tiny_paths) -> None:
    spec = {"method": "lookahead", "window_size": 3, "ngram_size": 3, "verification_set_size": 3}
    llm = LLM(model=str(tiny_paths[0]), speculative=spec, progress=False)
    with pytest.raises(SpecDecodeError, match="exceeds"):
        llm.generate(["the"], SamplingParams(max_tokens=4), speculative={**spec, "window_size": 4})


def test_draft_model_with_another_vocabulary_is_an_error(llm: LLM, tiny_paths, tmp_path: Path) -> None:
    import json
    import shutil

    from specdecode.models.loader import resolve_model

    other = tmp_path / "other"
    shutil.copytree(resolve_model(str(tiny_paths[2]), progress=False), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "Ġt", "he"  # swap two ids: same size, different meaning
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    spec = {"method": "draft_model", "draft_model": str(other)}
    with pytest.raises(SpecDecodeError, match="does not share the vocabulary"):
        llm.generate(["the"], SamplingParams(max_tokens=4), speculative=spec)


def test_cli_method_flags(tiny_paths, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from specdecode.cli import main

    base = [
        "generate",
        "--model",
        str(tiny_paths[0]),
        "--prompt",
        "the the the the",
        "--max-tokens",
        "24",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--method", "prompt_lookup", "--prompt-lookup-num-tokens", "3"]) == 0
    lookup = json.loads(capsys.readouterr().out)
    assert lookup["token_ids"] == plain["token_ids"]
    assert lookup["stats"]["num_draft_tokens"] > 0
    assert main([*base, "--lookahead", "2,2,1"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    window = ["--method", "draft_model", "--draft-model", str(tiny_paths[1]), "--draft-window", "2"]
    assert main([*base, *window]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    for vocab in ("64", "all"):
        assert main([*base, *window[:4], "--draft-vocab-size", vocab]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    assert main([*base, *window[:4], "--draft-vocab-size", "many"]) == 2
    assert 'draft_vocab_size must be "auto", "all" or a positive integer' in capsys.readouterr().err
    assert main([*base, "--method", "lookahead", "--num-draft-tokens", "3"]) == 2
    assert "unknown option num_draft_tokens" in capsys.readouterr().err


def test_draft_dtype(llm: LLM, tiny_paths, tmp_path: Path) -> None:
    """auto: a GGUF draft runs through the target's quantized kernels where they run stored
    weights, re-quantized to Q4_0 when it stores more than 5.5 bits a weight, else as stored
    ("stored" asks for that); another draft of a float32 target on a CPU with the bf16 kernel in
    bfloat16; or as asked, a block format quantized on load. Greedy output stays plain's."""
    draft = str(tiny_paths[1])
    if llm.model.kernels.quant is not None:
        quant = llm.model.kernels.quant
        layers = (".attn_q", ".attn_k", ".attn_v", ".attn_output", ".ffn_gate", ".ffn_up", ".ffn_down")
        q8 = {f"{name}.weight": "Q8_0" for name in [*layers, "output"]}
        q8_path = write_tiny_gguf(tiny_paths[1].parent / "q8.gguf", "llama", seed=1, width=4, formats=q8).path
        q4 = {f"{name}.weight": "Q4_0" for name in [*layers, "output"]}
        q4_path = write_tiny_gguf(tiny_paths[1].parent / "q4.gguf", "llama", seed=1, width=4, formats=q4).path

        def formats(model: Transformer) -> set[str]:  # runs on the target's kernels for drafts
            assert model.dtype == torch.float32 and model.kernels.name == f"{llm.model.kernels.name}-int8"
            draft_quant = model.kernels.quant  # the int8 products' layout (AVX2: not the float one's)
            assert model.layers[0].qkv.kernel is draft_quant
            assert model.layers[0].qkv.quantized.layout == draft_quant.layout == quant.approximate().layout
            return {p.format for layer in model.layers for p in layer.qkv.quantized.parts}

        assert formats(llm.drafters.draft_model(str(q8_path), "auto")) == {"Q4_0"}
        assert formats(llm.drafters.draft_model(str(q8_path), "stored")) == {"Q8_0"}
        assert formats(llm.drafters.draft_model(str(q4_path), "auto")) == {"Q4_0"}  # as stored
        assert formats(llm.drafters.draft_model(str(q4_path), "q5_0")) == {"Q5_0"}
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        plain = llm.generate(["a b c"], params)[0].token_ids
        for dtype in ("auto", "stored", "q5_0"):
            spec = {"method": "draft_model", "draft_model": str(q8_path), "draft_dtype": dtype}
            assert llm.generate(["a b c"], params, speculative=spec)[0].token_ids == plain
    else:  # no quantized kernels here (SPECDECODE_CPU_ISA=off, no compiler)
        auto = torch.bfloat16 if llm.model.kernels.fast_bf16 else torch.float32
        assert llm.drafters.draft_model(draft, "auto").dtype == auto
    # A Hugging Face directory (the draft's converted copy without its source GGUF): none stored.
    checkpoint = shutil.copytree(resolve_model(draft), tmp_path / "hf")
    (checkpoint / "specdecode_source.json").unlink()
    with pytest.raises(SpecDecodeError, match="draft_dtype=stored"):
        llm.drafters.draft_model(str(checkpoint), "stored")
    assert llm.drafters.draft_model(draft, "float32").dtype == torch.float32
    assert llm.drafters.draft_model(draft, "bfloat16").dtype == torch.bfloat16


def test_draft_vocab_size(tiny_paths) -> None:
    """`draft_vocab_size` N: the draft reads its LM head's first N columns, made once and shared
    by requests; for a head run as stored, the head's own blocks (a view, the same logits), else
    a float copy of the columns. Greedy output stays plain's (every step drafts: policy off)."""
    llm = LLM(model=str(tiny_paths[0]), device="cpu", progress=False, speculation_policy=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, params)]
    drafts = [str(tiny_paths[1])]
    if llm.model.kernels.quant is not None:
        formats = {f"{name}.weight": "Q4_0" for name in (".attn_q", ".ffn_down", "output")}
        q4 = write_tiny_gguf(tiny_paths[1].parent / "q4_head.gguf", "llama", seed=1, width=4, formats=formats)
        drafts.append(str(q4.path))
    hidden = torch.randn(2, 1, generator=torch.Generator().manual_seed(0))
    stored = []
    for draft in drafts:
        spec = {"method": "draft_model", "draft_model": draft, "draft_vocab_size": 64}
        outs = llm.generate(PROMPTS, params, speculative=spec)
        assert [o.token_ids for o in outs] == plain, draft
        assert sum(o.stats.num_draft_tokens for o in outs) > 0
        drafter = llm.drafters.build(parse_speculative(spec))
        again = llm.drafters.build(parse_speculative(spec))
        assert drafter is not again and drafter.head is not None and drafter.head is again.head
        model = llm.drafters.draft_model(draft)
        x = hidden.expand(2, model.config.hidden_size).contiguous()  # (2, C)
        got, whole = drafter.head(x), model.logits(x)  # (2, 64), (2, V)
        assert got.shape == (2, 64)
        stored.append(model.head.stored)
        if model.head.stored:  # a view of the stored head: the same bits
            assert torch.equal(got, whole[:, :64])
            held = model.lm_head.quantized.parts[0].data.data_ptr()
            assert drafter.head.dense.quantized.parts[0].data.data_ptr() == held
        else:
            torch.testing.assert_close(got, whole[:, :64], rtol=0.02, atol=0.02)
    assert stored == [False, True][: len(drafts)]  # the Q4_0 head runs as stored where it can
    for whole in (10_000, "all", "auto"):  # past the vocabulary; all; auto for a small one
        spec = {"method": "draft_model", "draft_model": drafts[0], "draft_vocab_size": whole}
        assert llm.drafters.build(parse_speculative(spec)).head is None
    assert draft_vocab("auto", 151_936) == 32_768 and draft_vocab("auto", 65_536) is None
    assert draft_vocab("all", 151_936) is None and draft_vocab(1000, 151_936) == 1000


def test_draft_dtypes_name_every_quantization() -> None:
    from specdecode.models.gguf import QUANTIZATIONS
    from specdecode.spec_config import DRAFT_DTYPES

    assert set(QUANTIZATIONS) <= set(DRAFT_DTYPES)


# Trained heads through `LLM`: per method, the setting naming the head's directory, a random head
# for a target, how a head is saved, the error when none ship for the model, and other settings.
HEAD_KINDS: dict[str, tuple[str, Callable[[Transformer], nn.Module], Callable[..., Path], str, dict]] = {
    "medusa": ("heads", random_heads, save_heads, "no Medusa heads ship for model", {}),
    "redrafter": ("head", random_head, save_head, "specdecode train redrafter --model", {"beam_width": 3}),
}


@pytest.mark.parametrize("method", HEAD_KINDS)
def test_llm_loads_heads_once_and_names_missing_ones(
    tiny_model_dir: Path, tmp_path: Path, method: str
) -> None:
    key, random, save, missing, options = HEAD_KINDS[method]
    model_dir = copy_with_chat_tokenizer(tiny_model_dir, tmp_path / "model")
    llm = LLM(model=str(model_dir), progress=False)
    save(random(llm.model), tmp_path / "heads", target="tiny", dtype=torch.float32)
    spec = {"method": method, key: str(tmp_path / "heads"), **options}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7, 8]], params, speculative=None)[0]
    out = llm.generate([[5, 6, 7, 8]], params, speculative=spec)[0]
    assert out.token_ids == plain.token_ids and out.stats.num_draft_tokens > 0
    heads = llm.drafters.head(method, str(tmp_path / "heads"))
    assert llm.drafters.head(method, str(tmp_path / "heads/")) is heads  # loaded once
    save(random(tiny_transformer(96, seed=1, hidden=32)), tmp_path / "narrow", target="other")
    with pytest.raises(SpecDecodeError, match="trained for another target"):
        llm.generate([[5, 6]], params, speculative={"method": method, key: str(tmp_path / "narrow")})
    with pytest.raises(SpecDecodeError, match=missing):
        LLM(model=str(model_dir), speculative={"method": method}, progress=False)
