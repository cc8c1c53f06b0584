"""The target's final hidden states over training samples, in batches, cached on disk.

Every drafter we train learns from token sequences and the target's hidden state at each
position (after the final norm: what `Transformer.forward` returns and the LM head reads).
`extract` runs the target over many samples at once on the engine, which keeps each position's
hidden state. With `generate`, it continues each prompt greedily until an end-of-sequence token
or `max_len`: self-distillation and feature extraction in one pass, the batch decoding together,
and no second pass to re-read the answers.

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

from specdecode.engine.config import EngineConfig
from specdecode.engine.llm_engine import EngineRequest, LLMEngine
from specdecode.errors import SpecDecodeError
from specdecode.models.cache import atomic_file
from specdecode.models.transformer import Transformer
from specdecode.sampling import SamplingParams
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

    The samples run together on the engine, which keeps every position's hidden state
    (`EngineRequest.return_hidden`); a sample that is not to be continued still takes one decoding
    step (its last position's row, which no answer token follows), whose token is dropped.
    """
    engine = LLMEngine(
        model,
        EngineConfig(max_num_seqs=len(batch), policy=False, prefix_caching=False),
        eos_token_ids=eos_ids,
    )
    seqs, answers = [], []  # answers: the most answer tokens each sample may get
    for i, sample in enumerate(batch):
        n = len(sample.ids)
        cap = max_len if max_new is None else min(max_len, n + max_new)  # tokens in all
        answers.append(cap - n if generate and n < cap else 0)
        params = SamplingParams(max_tokens=max(answers[-1], 1), temperature=0.0, ignore_eos=not answers[-1])
        request = EngineRequest(str(i), list(sample.ids), params, None, return_hidden=True)
        seqs.append(engine.add_request(request))
    while engine.has_unfinished():
        engine.step()
    out = []
    for sample, seq, answer in zip(batch, seqs, answers, strict=True):
        req = seq.req
        tokens, mask = list(sample.ids), list(sample.mask)
        if answer:
            tokens += req.output_ids
            mask += [True] * len(req.output_ids)
        assert req.hidden_states is not None
        out.append((tokens, mask, req.hidden_states[: len(tokens) - 1].to("cpu", torch.float16)))
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
