"""Tiny random-weight Llama and Qwen2 checkpoints, written by transformers, for fast exact checks."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = {
    "llama": dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def make_tiny_hf(arch: str, out: Path, seed: int = 0):
    """Write a random tiny HF model of `arch` to `out` and return the transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    spec = dict(TINY[arch])
    config = AutoConfig.for_model(**spec)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init so the logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    return model
