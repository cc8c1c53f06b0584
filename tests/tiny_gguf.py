"""Tiny random GGUF files (llama, qwen2) written with `gguf.GGUFWriter`, for fast conversion tests.

The weights are made in Hugging Face layout first and written the way llama.cpp's converter writes
them (Q/K rows of llama permuted for its rotary layout), so a test can check that conversion gives
back exactly the Hugging Face weights. The permutation is written out here by index, independently
of the converter's reshape-based code, so a shared mistake cannot hide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from specdecode.models.gguf_tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, byte_alphabet

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, CONTEXT = 16, 4, 2, 2, 24, 128
HEAD_DIM = HIDDEN // HEADS

# (left, right) merges of a small byte-level BPE vocabulary; "Ġ" is the byte alphabet's space.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("1", "2"), ("Ċ", "Ċ")]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens (256 byte symbols, merged tokens, specials) and their llama.cpp token types."""
    tokens = [byte_alphabet()[b] for b in range(256)] + [a + b for a, b in MERGES]
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += CONTROL + USER_DEFINED
    types += [TOKEN_CONTROL] * len(CONTROL) + [TOKEN_USER_DEFINED] * len(USER_DEFINED)
    return tokens, types


VOCAB = len(vocabulary()[0])


def token_id(token: str) -> int:
    return vocabulary()[0].index(token)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row order: within each head, row j*half+i (half j of pair i) moves to row 2*i+j."""
    head_dim = w.shape[0] // n_head
    half = head_dim // 2
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(half):
            for j in range(2):
                out[h * head_dim + 2 * i + j] = w[h * head_dim + j * half + i]
    return out


@dataclass
class TinyGGUF:
    """A written tiny GGUF and the Hugging Face weights its conversion must reproduce."""

    path: Path
    arch: str
    tied: bool
    hf_weights: dict[str, np.ndarray] = field(default_factory=dict)


def hf_weights(arch: str, tied: bool, seed: int = 0, width: int = 1) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face names and shapes (`width` times the hidden and
    feed-forward sizes, heads as many)."""
    rng = np.random.default_rng(seed)
    hidden, ffn = HIDDEN * width, FFN * width

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(VOCAB, hidden), "model.norm.weight": rand(hidden)}
    if not tied:
        w["lm_head.weight"] = rand(VOCAB, hidden)
    kv = KV_HEADS * (HEAD_DIM * width)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rand(hidden)
        w[p + "post_attention_layernorm.weight"] = rand(hidden)
        w[p + "self_attn.q_proj.weight"] = rand(hidden, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv, hidden)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, hidden)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rand(hidden)
            w[p + "self_attn.k_proj.bias"] = rand(kv)
            w[p + "self_attn.v_proj.bias"] = rand(kv)
        w[p + "mlp.gate_proj.weight"] = rand(ffn, hidden)
        w[p + "mlp.up_proj.weight"] = rand(ffn, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, ffn)
    return w


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    tied: bool = False,
    pre: str = "gpt2",
    seed: int = 0,
    declared_arch: str | None = None,
    width: int = 1,
    formats: dict[str, str] | None = None,
) -> TinyGGUF:
    """Write a tiny GGUF of `arch` to `path`; `declared_arch` overrides `general.architecture`.
    `width` multiplies the hidden and feed-forward sizes; `formats` maps GGUF tensor-name endings
    (".attn_q.weight") to the block format they are stored in (else float32)."""
    weights = hf_weights(arch, tied, seed, width)
    name = declared_arch or arch
    writer = gguf.GGUFWriter(path, name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN * width)
    writer.add_feed_forward_length(FFN * width)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(token_id("<|im_start|>"))
    writer.add_eos_token_id(token_id("<|im_end|>"))
    writer.add_pad_token_id(token_id("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for hf, w in weights.items():
        data = w
        if arch == "llama" and "q_proj" in hf:
            data = llama_cpp_permute(w, HEADS)
        elif arch == "llama" and "k_proj" in hf:
            data = llama_cpp_permute(w, KV_HEADS)
        name = gguf_name(hf)
        fmt = next((f for end, f in (formats or {}).items() if name.endswith(end)), None)
        if fmt is None:
            writer.add_tensor(name, np.ascontiguousarray(data))
        else:
            kind = gguf.GGMLQuantizationType[fmt]
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, arch, tied, weights)
