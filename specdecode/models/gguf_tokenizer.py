"""Rebuild a `tokenizer.json` from the tokenizer a GGUF file describes in its metadata.

A GGUF carries no tokenizer file, only llama.cpp's description of one: the vocabulary, the merges,
each token's type and the name of the pre-tokenizer (`tokenizer.ggml.pre`), which stands for a split
regex hard-coded in llama.cpp. We turn that back into a `tokenizers.Tokenizer` so that the canonical
model directory tokenizes exactly as llama.cpp (and transformers' GGUF loader) do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from specdecode.errors import SpecDecodeError

# llama.cpp's token types (`tokenizer.ggml.token_type`).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# The split regexes llama.cpp uses for the `tokenizer.ggml.pre` names of byte-level BPE vocabularies.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}

# Control tokens that end a turn or a document: llama.cpp stops on these as well as on the eos id,
# and so do the models' own generation configs (Qwen2.5 lists both <|im_end|> and <|endoftext|>).
_END_OF_GENERATION = frozenset(
    {
        "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
        "<end_of_turn>", "<EOT>", "<|end▁of▁sentence|>",
    }
)  # fmt: skip


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters: byte-level vocabularies are spelled in it.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    shifted to code points from 256 upwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@dataclass
class GGUFTokenizer:
    """What the converter writes for the tokenizer: `tokenizer.json`, the config and the stop ids."""

    tokenizer: Tokenizer
    config: dict[str, Any]
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer that llama.cpp's `tokenizer.ggml.pre` name stands for."""
    if pre == "smollm":
        # SmolLM's vocabulary was trained with every digit on its own, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    split = _SPLITS.get(pre or "")
    if split is None:  # "gpt2", "default" and names we do not know: GPT-2's own regex
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _token(tokens: list[str], key: str, meta: dict[str, Any]) -> tuple[int | None, str | None]:
    index = meta.get(f"tokenizer.ggml.{key}")
    if index is None:
        return None, None
    if not 0 <= int(index) < len(tokens):
        raise SpecDecodeError(f"tokenizer.ggml.{key} = {index} is outside the vocabulary of {len(tokens)}")
    return int(index), tokens[int(index)]


def build_tokenizer(meta: dict[str, Any], context_length: int | None = None) -> GGUFTokenizer:
    """Build the tokenizer from GGUF metadata (`meta` maps GGUF keys to decoded values)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SpecDecodeError(
            f"unsupported GGUF tokenizer {kind!r}: only byte-level BPE ('gpt2', used by Llama-3, Qwen2 "
            "and SmolLM) is supported"
        )
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    if not tokens:
        raise SpecDecodeError("the GGUF has no tokenizer.ggml.tokens")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise SpecDecodeError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")

    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens are stored already spelled in the byte alphabet; a rare one that is not (written as raw
    # text) is respelled so the BPE model can reach it.
    vocab_tokens = [t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()) for t in tokens]
    vocab = {t: i for i, t in enumerate(vocab_tokens)}
    if len(vocab) != len(tokens):
        raise SpecDecodeError("the GGUF vocabulary has duplicate tokens")
    try:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=False)  # type: ignore[arg-type]
    except Exception as exc:
        raise SpecDecodeError(f"the GGUF's BPE merges are invalid: {exc}") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>) are special; user-defined ones (<tool_call>) are matched whole in
    # text too, but kept when decoding. A "control" token outside the byte alphabet is a mislabel.
    control = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_CONTROL and set(t) <= spelled]
    user = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    bos_id, bos = _token(tokens, "bos_token_id", meta)
    eos_id, eos = _token(tokens, "eos_token_id", meta)
    _, unk = _token(tokens, "unknown_token_id", meta)
    _, pad = _token(tokens, "padding_token_id", meta)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise SpecDecodeError("the GGUF asks to add a bos/eos token but does not say which")
    if add_bos or add_eos:

        def wrap(seq: str, type_id: int) -> list[str]:
            head = [f"{bos}:{type_id}"] if add_bos else []
            return [*head, f"{seq}:{type_id}", *([f"{eos}:{type_id}"] if add_eos else [])]

        specials = {t: i for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None and i is not None}
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(wrap("$A", 0)), pair=" ".join(wrap("$A", 0) + wrap("$B", 1)),
            special_tokens=list(specials.items()),
        )  # fmt: skip

    stop: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        index, _ = _token(tokens, key, meta)
        if index is not None and index not in stop:
            stop.append(index)
    stop += [i for i, (t, k) in enumerate(zip(tokens, types, strict=True))
             if k == TOKEN_CONTROL and t in _END_OF_GENERATION and i not in stop]  # fmt: skip

    specials_set = set(control)
    added = {
        str(vocab[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in specials_set,
        }
        for t in [*control, *user]
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length or 1_000_000_000,
        "added_tokens_decoder": added,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return GGUFTokenizer(tokenizer=tok, config=config, eos_token_ids=stop, bos_token_id=bos_id)
