"""Convert a GGUF file (llama.cpp's format) into the canonical Hugging Face model directory.

The model code reads only one form of model, a Hugging Face directory, so a GGUF is converted once:
weights are dequantized to float32 and renamed to Hugging Face names, the architecture metadata
becomes `config.json`, and the tokenizer is rebuilt from the metadata. The result is cached, keyed by
the file's size and mtime, so a second load costs only a `stat`.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.cache import atomic_dir, cache_root
from specdecode.models.config import SUPPORTED_ARCHS, ModelConfig
from specdecode.models.gguf_tokenizer import build_tokenizer

if TYPE_CHECKING:
    import torch

# Bump when the converted directory's content changes, so old conversions are not reused.
CONVERTER_VERSION = 1
GGUF_MAGIC = b"GGUF"
GGUF_ARCHS = ("llama", "qwen2")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_REQUIRED_LAYER = [k for k in _LAYER_TENSORS if k.endswith(".weight")]
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if it is not one of a llama/qwen2 model's."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of Q/K rows (HF -> GGUF): per head, interleave the two rotary halves."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo `permute_rotary` (GGUF -> HF), so Q/K rows are in Hugging Face's rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class _Tensor:
    """A GGUF tensor, where it goes, and what must be done to it on the way."""

    source: Any  # gguf.ReaderTensor
    name: str
    shape: tuple[int, ...]
    unpermute_heads: int | None = None


def _open(path: Path) -> Any:
    """A `gguf.GGUFReader` for `path`; a file that is not a complete GGUF is a user error naming it."""
    import gguf

    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise SpecDecodeError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise SpecDecodeError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:
        raise SpecDecodeError(f"{path} is truncated or corrupt: cannot read it as GGUF ({exc})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise SpecDecodeError(
                f"{path} is truncated or corrupt: tensor {t.name} runs past the end of the file"
            )
    return reader


def read_metadata(reader: Any, path: Path) -> dict[str, Any]:
    """Every key/value field of the GGUF, decoded to Python values."""
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        try:
            meta[key] = fld.contents()
        except Exception as exc:
            raise SpecDecodeError(f"{path} is corrupt: cannot decode metadata field {key} ({exc})") from None
    return meta


def _float32_repr(value: float) -> float:
    """A float stored as float32, written back with the fewest digits (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise SpecDecodeError(f"unsupported rope scaling type {kind!r} in the GGUF")


def model_config(meta: dict[str, Any], path: Path) -> ModelConfig:
    """The model's `ModelConfig` from the GGUF's architecture metadata."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS or arch not in SUPPORTED_ARCHS:
        raise SpecDecodeError(
            f"unsupported architecture {arch!r} in {path}: specdecode converts GGUF models of "
            f"architecture {', '.join(GGUF_ARCHS)}"
        )

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise SpecDecodeError(f"{path} lacks the metadata {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        max_position_embeddings=int(meta.get(f"{arch}.context_length") or 2048),
        rms_norm_eps=_float32_repr(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_float32_repr(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        tie_word_embeddings=False,  # decided from the tensors by the caller
        attention_bias=arch == "qwen2",
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
    )


def plan_tensors(reader: Any, cfg: ModelConfig, path: Path) -> list[_Tensor]:
    """Map each GGUF tensor to its Hugging Face name and shape, checking that the model is complete."""
    plan: list[_Tensor] = []
    seen: set[str] = set()
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise SpecDecodeError(
                f"{path} uses Llama-3 style rope frequency factors (rope_freqs), which are not supported"
            )
        name = hf_tensor_name(t.name)
        if name is None:
            raise SpecDecodeError(f"{path} has a tensor {t.name!r} that a {cfg.arch} model does not have")
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
        heads = None
        if cfg.arch == "llama" and ".attn_q." in t.name:
            heads = cfg.num_heads
        elif cfg.arch == "llama" and ".attn_k." in t.name:
            heads = cfg.num_kv_heads
        plan.append(_Tensor(t, name, shape, heads))
        seen.add(t.name)
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{k}" for i in range(cfg.num_layers) for k in _REQUIRED_LAYER
    }
    missing = sorted(expected - seen)
    if missing:
        raise SpecDecodeError(f"{path} is incomplete: it lacks tensor {missing[0]} ({len(missing)} missing)")
    embed = next(p for p in plan if p.name == "model.embed_tokens.weight")
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise SpecDecodeError(
            f"{path}: token_embd has shape {embed.shape}, but the metadata says vocab {cfg.vocab_size} "
            f"x hidden {cfg.hidden_size}"
        )
    return plan


def _dequantize(t: _Tensor, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        data = dequantize(t.source.data, t.source.tensor_type)
    except NotImplementedError:
        raise SpecDecodeError(
            f"{path}: tensor {t.source.name} has quantization {t.source.tensor_type.name}, which the gguf "
            "package cannot dequantize"
        ) from None
    data = np.asarray(data, dtype=np.float32)
    if data.size != int(np.prod(t.shape)):
        raise SpecDecodeError(f"{path} is corrupt: tensor {t.source.name} has the wrong number of values")
    data = data.reshape(t.shape)
    if t.unpermute_heads is not None:
        data = unpermute_rotary(data, t.unpermute_heads)
    return np.ascontiguousarray(data, dtype="<f4")


def _write_safetensors(out: BinaryIO, plan: list[_Tensor], path: Path, bar: tqdm) -> None:
    """Stream float32 tensors into safetensors format, one at a time (a 1.5B model never sits in memory).

    The layout is fixed before any tensor is dequantized (all are float32, shapes are known), so the
    header goes first and each tensor is written as soon as it is ready.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "gguf"}}
    offset = 0
    for t in plan:
        nbytes = 4 * int(np.prod(t.shape))
        header[t.name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    out.write(struct.pack("<Q", len(blob)))
    out.write(blob)
    for t in plan:
        bar.set_postfix_str(t.name, refresh=False)
        out.write(memoryview(_dequantize(t, path)).cast("B"))
        bar.update(1)


def convert_gguf(path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write the Hugging Face directory for the GGUF at `path` to `out_dir` (atomically) and return it."""
    path = Path(path)
    out_dir = Path(out_dir)
    reader = _open(path)
    meta = read_metadata(reader, path)
    cfg = model_config(meta, path)
    plan = plan_tensors(reader, cfg, path)
    tied = not any(t.name == "lm_head.weight" for t in plan)
    biased = any(t.name.endswith("q_proj.bias") for t in plan)
    tok = build_tokenizer(meta, cfg.max_position_embeddings)
    stop = tok.eos_token_ids or ([cfg.eos_token_id] if isinstance(cfg.eos_token_id, int) else [])

    hf = replace(cfg, tie_word_embeddings=tied, attention_bias=cfg.attention_bias or biased).to_hf()
    generation = {"bos_token_id": tok.bos_token_id, "eos_token_id": stop[0] if len(stop) == 1 else stop}
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tok.config, indent=2, ensure_ascii=False) + "\n"
        )
        tok.tokenizer.save(str(tmp / "tokenizer.json"))
        with (
            tqdm(total=len(plan), unit="tensor", desc=f"converting {path.name}", disable=not progress) as bar,
            open(tmp / "model.safetensors", "wb") as out,
        ):
            _write_safetensors(out, plan, path, bar)
        (tmp / "specdecode_source.json").write_text(
            json.dumps({"gguf": str(path.resolve()), "converter_version": CONVERTER_VERSION}, indent=2) + "\n"
        )
    return out_dir


def converted_dir(path: str | Path) -> Path:
    """Where the conversion of this GGUF is cached: keyed by name, size and mtime, not by a slow hash."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SpecDecodeError(f"no such file: {path}") from None
    key = hashlib.sha256(f"{CONVERTER_VERSION}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)
    return cache_root() / "converted" / f"{stem}-{key}"


def load_gguf(path: str | Path, progress: bool = True) -> Path:
    """The cached Hugging Face directory for a GGUF, converting it on first use."""
    target = converted_dir(path)
    if (target / "config.json").is_file():
        return target
    return convert_gguf(path, target, progress=progress)


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted directory was made from, where it still exists (None for a
    directory that did not come from a GGUF)."""
    info = Path(model_dir) / "specdecode_source.json"
    if not info.is_file():
        return None
    source = Path(json.loads(info.read_text()).get("gguf", ""))
    return source if source.is_file() else None


def bits_per_weight(path: str | Path) -> float:
    """Bits a forward reads per weight of the GGUF's matrices (the input embedding, read a row a
    token, left out): 4.5 for Q4_0 or Q4_K throughout, 8.5 for Q8_0."""
    reader = _open(Path(path))
    matrices = [t for t in reader.tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    weights = sum(int(t.n_elements) for t in matrices)
    return 8 * sum(int(t.n_bytes) for t in matrices) / weights if weights else 0.0


def stored_weights(path: str | Path) -> dict[str, tuple[str, np.ndarray]]:
    """The GGUF's 2-D weights as stored: Hugging Face name -> (format name, (rows, row_bytes)
    uint8 blocks), Q/K rows put back in Hugging Face's order. Float tensors are left out. The
    blocks are read-only views of the mapped file where they can be (the caller copies or lays
    out what it keeps)."""
    path = Path(path)
    reader = _open(path)
    cfg = model_config(read_metadata(reader, path), path)
    out: dict[str, tuple[str, np.ndarray]] = {}
    for t in plan_tensors(reader, cfg, path):
        fmt = t.source.tensor_type.name
        if len(t.shape) != 2 or fmt in ("F32", "F16", "BF16", "F64"):
            continue
        data = np.asarray(t.source.data)  # (rows, row_bytes) uint8, a view of the file
        if data.ndim != 2 or data.shape[0] != t.shape[0]:
            raise SpecDecodeError(f"{path} is corrupt: tensor {t.source.name} has the wrong number of rows")
        if t.unpermute_heads is not None:
            data = unpermute_rotary(data, t.unpermute_heads)
        # A view of the file, not a copy: the kernels lay it out anew when the model binds them
        # (copying it first, then packing, left ~35 MB of a 98 MB model's heap fragmented).
        out[t.name] = fmt, np.ascontiguousarray(data)
    return out


QUANTIZATIONS = ("q4_0", "q4_1", "q5_0", "q8_0")  # formats floats are quantized to on load


def quantized_weights(
    tensors: Mapping[str, torch.Tensor], names: Iterable[str], quantization: str
) -> dict[str, tuple[str, np.ndarray]]:
    """Float weights quantized on load into the blocks of `quantization` (one of QUANTIZATIONS),
    with gguf-py's quantizer, the one llama.cpp's conversion script writes files with: the
    mapping `stored_weights` reads from a GGUF. A matrix whose rows are not whole blocks of 32
    stays float (as GGUF converters leave such tensors unquantized)."""
    from specdecode.kernels import quantize

    fmt = quantization.upper()
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name in names:
        if name not in tensors:
            continue
        weight = tensors[name]  # (out, in)
        if weight.dim() != 2 or weight.shape[1] % 32:
            continue
        out[name] = fmt, quantize(weight.t(), fmt).parts[0].data.numpy()
    return out
