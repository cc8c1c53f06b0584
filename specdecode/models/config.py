"""Architecture settings of the one transformer, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from specdecode.errors import SpecDecodeError

Arch = Literal["llama", "qwen2"]
SUPPORTED_ARCHS: dict[str, Arch] = {
    # Hugging Face `model_type` -> our family name. Mistral-style models are Llama with GQA.
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only Llama/Qwen2 transformer.

    `attention_bias` is True for Qwen2 (q/k/v projections carry a bias). `rope_scaling` is the
    Hugging Face dictionary (only the Llama-3 "llama3" type changes the frequencies).
    """

    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise SpecDecodeError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dictionary of a Hugging Face `config.json`."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_ARCHS:
            raise SpecDecodeError(
                f"unsupported architecture {model_type!r}: specdecode runs "
                f"{', '.join(sorted(SUPPORTED_ARCHS))}"
            )
        arch = SUPPORTED_ARCHS[model_type]
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        # transformers >= 5 nests rotary settings in `rope_parameters`; older files use
        # `rope_theta` and `rope_scaling` at the top level.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else rope
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", arch == "qwen2"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            return cls.from_hf(json.loads(file.read_text()))
        except FileNotFoundError:
            raise SpecDecodeError(f"{path} has no config.json: not a Hugging Face model directory") from None
        except (json.JSONDecodeError, KeyError) as exc:
            raise SpecDecodeError(f"{file} is not a valid model config ({exc})") from None

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dictionary (so transformers can load our converted copies)."""
        hf: dict[str, Any] = {
            "model_type": self.arch,
            "architectures": ["LlamaForCausalLM" if self.arch == "llama" else "Qwen2ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if self.arch == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        return hf

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
