"""The target's final hidden states over training samples, in batches, cached on disk.

Every drafter we train learns from token sequences and the target's hidden state at each
position (after the final norm: what `Transformer.forward` returns and the LM head reads).
`extract` runs the target over many samples at once: left-padded so that every row's next token
lands in the same cache slot, with a per-row mask that hides the padding. With `generate`, it
then continues each prompt greedily until an end-of-sequence token or `max_len`, recording each
new token's hidden state as it goes: self-distillation and feature extraction in one pass, a
batch of rows per forward instead of one (`LLM.generate` decodes one request at a time, ~5x
fewer tokens per second on a CPU), and no second pass to re-read the answers.

Greedy answers from a batch can differ from one-request decoding where two logits are within
rounding of each other (other matmul shapes); for training data that does not matter.

Hidden states are stored as float16 (half the disk and memory; the heads are trained in
bfloat16 matmuls anyway). The cache is a directory of shards, one per batch, written
atomically, so an interrupted extraction resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specdecode.errors import SpecDecodeError
from specdecode.models.cache import atomic_file
from specdecode.models.transformer import Transformer
from specdecode.train.data import Sample


@dataclass
class Features:
    """Samples with the target's hidden states; row t of `hidden[i]` predicts `ids[i][t+1]`."""

    ids: list[Tensor]  # (L_i,) long each
    mask: list[Tensor]  # (L_i,) bool each: True where the assistant (or the target) wrote the token
    hidden: list[Tensor]  # (L_i - 1, C) float16 each: the last token's state is never needed

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return sum(int(t.numel()) for t in self.ids)


@torch.inference_mode()
def run_batch(
    model: Transformer,
    batch: Sequence[Sample],
    generate: bool,
    max_len: int,
    eos_ids: Sequence[int],
    max_new: int | None = None,
) -> list[tuple[list[int], list[bool], Tensor]]:
    """(ids, mask, hidden (L-1, C)) per sample, the target's greedy answer appended if `generate`:
    up to an end-of-sequence token, `max_len` tokens in all, or `max_new` new tokens.

    Row i is left-padded by pad_i slots; its token at position p sits in cache slot pad_i + p, so
    all rows decode their next token into the same slot. Queries see real keys only (a padding
    query sees itself, so its softmax is defined; its output is never read).
    """
    device = model.device
    b = len(batch)
    lengths = [len(s.ids) for s in batch]
    width = max(lengths)
    cap = [max_len if max_new is None else min(max_len, n + max_new) for n in lengths]  # tokens per row
    slots = width + max(0, max(c - n for c, n in zip(cap, lengths, strict=True))) if generate else width
    pad = torch.tensor([width - n for n in lengths], device=device)  # (B,)
    ids = torch.zeros(b, width, dtype=torch.long, device=device)  # (B, T)
    for i, sample in enumerate(batch):
        ids[i, width - lengths[i] :] = torch.tensor(sample.ids, device=device)
    positions = (torch.arange(width, device=device)[None] - pad[:, None]).clamp(min=0)  # (B, T)
    real = torch.arange(slots, device=device)[None] >= pad[:, None]  # (B, S) slots of real tokens
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (T, T)
    own = torch.eye(width, dtype=torch.bool, device=device)  # (T, T)
    mask = (causal[None] & real[:, None, :width]) | own[None]  # (B, T, T)
    cache = model.new_cache(slots, batch_size=b)
    # The model documents a (T, S) mask; SDPA broadcasts this (B, 1, T, S) one per row as well.
    hidden = model(ids, positions, cache, mask[:, None])  # (B, T, C)

    tokens = [list(s.ids) for s in batch]
    masks = [list(s.mask) for s in batch]
    states: list[list[Tensor]] = [[hidden[i, width - lengths[i] :]] for i in range(b)]  # (L_i, C)
    if generate:
        eos = set(eos_ids)
        live = [n < c for n, c in zip(lengths, cap, strict=True)]
        last = hidden[:, -1]  # (B, C)
        slot = width  # where the next token goes
        while slot < slots and any(live):
            chosen = model.logits(last).argmax(-1).tolist()  # B ints
            for i, token in enumerate(chosen):
                if live[i]:
                    tokens[i].append(token)
                    masks[i].append(True)
                    live[i] = token not in eos and len(tokens[i]) < cap[i]
            if slot + 1 >= slots or not any(live):
                break  # the tokens just chosen are never fed: nothing would read their states
            x = torch.tensor(chosen, device=device)[:, None]  # (B, 1)
            step_mask = real[:, None, None, : slot + 1]  # (B, 1, 1, slot+1)
            last = model(x, (slot - pad)[:, None], cache, step_mask)[:, 0]  # (B, C)
            for i in range(b):
                if live[i]:  # its token was just fed (a row ends at its end-of-sequence token)
                    states[i].append(last[i : i + 1])
            slot += 1
    out = []
    for i in range(b):
        rows = torch.cat(states[i])[: len(tokens[i]) - 1]  # (L_i - 1, C)
        out.append((tokens[i], masks[i], rows.to("cpu", torch.float16)))
    return out


def _place(
    record: dict, ids: list[Tensor | None], masks: list[Tensor | None], hidden: list[Tensor | None]
) -> None:
    """Put a shard's samples at their indices (the samples' order) in the three lists."""
    for j, i in enumerate(record["index"]):
        ids[i], masks[i], hidden[i] = record["ids"][j].long(), record["mask"][j], record["hidden"][j]


def load_cache(cache_dir: str | Path) -> Features:
    """Every sample of a finished feature cache (another run's `OUT/cache/train`), in its order:
    how one run trains on the answers another run generated (`--more-features`)."""
    root = Path(cache_dir).expanduser()
    meta = root / "meta.json"
    if not meta.is_file():
        raise SpecDecodeError(f"{root} is not a feature cache (no meta.json): pass a run's OUT/cache/train")
    count = int(json.loads(meta.read_text())["samples"])
    ids: list[Tensor | None] = [None] * count
    masks: list[Tensor | None] = [None] * count
    hidden: list[Tensor | None] = [None] * count
    for shard in sorted(root.glob("shard-*.pt")):
        _place(torch.load(shard, weights_only=True), ids, masks, hidden)
    missing = sum(t is None for t in ids)
    if missing:
        raise SpecDecodeError(f"{root} is unfinished: {missing} of {count} samples have no features yet")
    return Features(ids, masks, hidden)  # type: ignore[arg-type]


def _key(
    model_tag: str,
    samples: Sequence[Sample],
    generate: bool,
    max_len: int,
    batch_size: int,
    max_new: int | None,
) -> str:
    answer_cap = [] if max_new is None else [max_new]  # absent when unset: earlier caches keep their key
    text = json.dumps([model_tag, generate, max_len, *answer_cap, batch_size, [s.ids for s in samples]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def extract(
    model: Transformer,
    samples: Sequence[Sample],
    *,
    generate: bool,
    max_len: int,
    eos_ids: Sequence[int],
    cache_dir: str | Path,
    max_new: int | None = None,
    model_tag: str,
    batch_size: int = 32,
    progress: bool = True,
) -> Features:
    """Features of `samples` (in their order), computed or read back from `cache_dir`.

    `model_tag` names the target and its dtype in the cache key; the samples, `generate`,
    `max_len`, `max_new` (see `run_batch`) and `batch_size` (batch composition moves rounding)
    complete it. A cache with another key is replaced. Samples are batched by length, so padding
    stays small.
    """
    from tqdm import tqdm

    root = Path(cache_dir)
    key = _key(f"{model_tag}|{model.dtype}", samples, generate, max_len, batch_size, max_new)
    meta = root / "meta.json"
    if root.is_dir() and (not meta.is_file() or json.loads(meta.read_text()).get("key") != key):
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"key": key, "samples": len(samples), "generate": generate}))

    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].ids), i))
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    ids: list[Tensor | None] = [None] * len(samples)
    masks: list[Tensor | None] = [None] * len(samples)
    hidden: list[Tensor | None] = [None] * len(samples)
    bar = tqdm(total=len(batches), desc="target features", unit="batch", disable=not progress)
    made = 0
    for n, batch in enumerate(batches):
        shard = root / f"shard-{n:05d}.pt"
        if not shard.is_file():
            rows = run_batch(model, [samples[i] for i in batch], generate, max_len, eos_ids, max_new)
            record = {
                "index": batch,
                "ids": [torch.tensor(t, dtype=torch.int32) for t, _, _ in rows],
                "mask": [torch.tensor(m, dtype=torch.bool) for _, m, _ in rows],
                "hidden": [h for _, _, h in rows],
            }
            with atomic_file(shard) as tmp:
                torch.save(record, tmp)
            made += sum(len(t) for t, _, _ in rows)
        else:
            record = torch.load(shard, weights_only=True)
        _place(record, ids, masks, hidden)
        bar.update(1)
        bar.set_postfix(tokens=made)
    bar.close()
    return Features(ids, masks, hidden)  # type: ignore[arg-type]
