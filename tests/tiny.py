"""Tiny random-weight Llama and Qwen2 checkpoints, written by transformers, for fast exact checks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from specdecode.models.transformer import Transformer

M = TypeVar("M", bound=nn.Module)


def hf_sizes(vocab: int = 96, hidden: int = 64, layers: int = 2, context: int = 256) -> dict[str, int]:
    """A tiny model's sizes, as transformers configs name them: heads of 16 channels, two query
    heads per key/value head, an MLP twice as wide as the model; ids 1 and 2 are BOS and EOS."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 16,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
    )


# Both architectures share the sizes (`hf_sizes`): the differences are the ones each family's real
# configs have.
TINY = {
    "llama": dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
}


def randomized(make: Callable[[], M], seed: int, std: float, matrices_only: bool = False) -> M:
    """`make()` under `seed`, its parameters (or only its matrices) redrawn from N(0, std^2), in
    eval mode: larger weights than the default init, so outputs are far from uniform (and drafter
    heads draft something other than the target's next token)."""
    torch.manual_seed(seed)
    module = make()
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2 or not matrices_only:
                p.normal_(0, std)
    return module.eval()


def make_tiny_hf(arch: str, out: Path, seed: int = 0, std: float = 0.2, sizes: dict[str, int] | None = None):
    """Write a random tiny HF model of `arch` (`sizes`: `hf_sizes()` unless given) to `out` and
    return the transformers model; its matrices and biases are drawn from N(0, std^2)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**TINY[arch], **(sizes or hf_sizes()))
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init so the logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.normal_(0, std)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


def load_tiny_hf(
    out: Path, arch: str = "llama", seed: int = 0, std: float = 0.2, sizes: dict[str, int] | None = None
) -> Transformer:
    """`make_tiny_hf`'s model, written to `out` and loaded as ours."""
    make_tiny_hf(arch, out, seed, std, sizes)
    return Transformer.from_dir(out)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,!?'-:"


def write_chat_tokenizer(out: Path) -> None:
    """A character-level tokenizer with a ChatML template: ids 0-2 are <unk>, <|im_start|> and
    <|im_end|> (the tiny models' end-of-sequence id 2), then one id per character in CHARS."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(CHARS)})
    backend = Backend(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]
    )
    backend.save(str(out / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def copy_with_chat_tokenizer(model_dir: Path, out: Path) -> Path:
    """A copy of the tiny checkpoint `model_dir` at `out` with `write_chat_tokenizer`'s tokenizer
    (what `LLM` needs to load it by path)."""
    out.mkdir()
    for f in model_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    write_chat_tokenizer(out)
    return out
