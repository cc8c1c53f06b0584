"""Training Medusa heads on a frozen target (Medusa-1): `specdecode train medusa`.

    specdecode train medusa --model smollm2-135m --data sharegpt.json --out runs/medusa --self-distill

Pipeline: ShareGPT conversations (`data`) -> the target's hidden states over the dataset's answers
or, with `--self-distill`, over its own greedy answers (`features`, cached under OUT/cache) ->
heads trained with AdamW -> OUT/medusa.safetensors + OUT/config.json, with the tree fitted to
the heads' held-out accuracy -> a report of held-out acceptance: top-1 accuracy per head and τ of
real Medusa decoding on held-out prompts.

Heads draft from `--draft-vocab` ids (`pipeline.draft_vocabulary`: those the assistant wrote most
often; 16384 by default, as EAGLE's; 0: all): the loss softmaxes over their columns and the fitted
tree counts a token outside them as missed, as drafting reads them.

Loss: at position t the target's state h_t (whose LM-head output is the token at t+1) trains
head k to predict the token at t+2+k by cross-entropy, on tokens the assistant wrote; head k's
loss is weighted 0.8^k, since a later head's guess only counts when the earlier ones were right.

Cost on a CPU: the heads' own weights are tiny; the time goes into the shared, frozen LM head
(V x C, 49152 x 576 for SmolLM2), applied to K rows per position and back-propagated through
(not into). It runs in bfloat16 (float32 master weights), ~5x faster than float32 on CPUs with
AVX512-BF16/AMX and the usual choice on GPUs. Each step samples positions across the dataset.

Data, features, the loop, checkpoints, `--resume`, writing the heads and measuring their τ come
from `pipeline` (shared by every method's training).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.drafters.medusa import MedusaDrafter, MedusaHeads, load_heads, save_heads
from specdecode.errors import SpecDecodeError
from specdecode.train import pipeline
from specdecode.train.features import Features
from specdecode.train.pipeline import IGNORE, MAX_RANK


@dataclass(frozen=True)
class TrainSettings(pipeline.Common):
    """Everything a run depends on; `specdecode train medusa --help` describes each."""

    num_heads: int = pipeline.flag(4, "heads, one per future token", least=1, steps=True)
    num_layers: int = pipeline.flag(1, "residual blocks per head", least=0, steps=True)
    tree_nodes: int = pipeline.flag(32, "nodes of the fitted tree", least=1)
    draft_vocab: int = pipeline.flag(16384, "token ids the heads draft from (0: all)", least=0, steps=True)


@dataclass
class Positions:
    """Training positions: the target's state at each and the token each head must predict."""

    hidden: Tensor  # (P, C) float16
    labels: Tensor  # (P, K) long: token at t+2+k, or IGNORE

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def positions(features: Features, num_heads: int) -> Positions:
    """Every position t whose token t+2 the assistant wrote, with labels for each head.

    Head k's label at t is the token at t+2+k when the tokens t+2..t+2+k are all assistant
    tokens of one turn (else IGNORE): the heads are asked only what decoding asks them, the
    continuation of the answer being written.
    """
    hidden, labels = [], []
    for ids, mask, states in zip(features.ids, features.mask, features.hidden, strict=True):
        n = int(ids.shape[0])
        if n < 3:
            continue
        run = [0] * n  # run[i]: assistant tokens in a row ending at i
        flags = mask.tolist()
        for i in range(n):
            run[i] = run[i - 1] + 1 if flags[i] and i else int(flags[i])
        rows = [t for t in range(n - 2) if flags[t + 2]]
        if not rows:
            continue
        table = torch.full((len(rows), num_heads), IGNORE, dtype=torch.long)  # (R, K)
        for r, t in enumerate(rows):
            for k in range(num_heads):
                if t + 2 + k < n and run[t + 2 + k] >= k + 1:
                    table[r, k] = int(ids[t + 2 + k])
        hidden.append(states[rows])
        labels.append(table)
    if not labels:
        raise SpecDecodeError("no training positions: the samples have no assistant tokens")
    return Positions(torch.cat(hidden), torch.cat(labels))


def medusa_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Weighted cross-entropy of logits (K, B, V) against labels (B, K) -> scalar.

    Computed in the logits' dtype (bfloat16 when training on a CPU: the softmax over V
    dominates a step and bfloat16 halves it; its sums accumulate in float32 all the same)."""
    k = logits.shape[0]
    target = labels.T  # (K, B)
    valid = target != IGNORE  # (K, B)
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="none")
    per_head = ce.float().view(k, -1).sum(1) / valid.sum(1).clamp(min=1)  # (K,)
    return (pipeline.depth_weights(k).to(per_head.device) * per_head).sum()


def in_columns(labels: Tensor, column: Tensor | None) -> Tensor:
    """Token-id labels -> their columns of the draft vocabulary (`pipeline.draft_columns`): IGNORE
    where they were, and for a token outside it (no draft can name it)."""
    if column is None:
        return labels
    return torch.where(labels == IGNORE, IGNORE, column[labels.clamp(min=0)])


def objective(
    heads: MedusaHeads, lm_weight: Tensor, data: Positions, settings: TrainSettings
) -> pipeline.Objective:
    """Training `heads` on `data` (`pipeline.train_loop` runs it): `medusa_loss`, and head 0's
    accuracy as the step's figure ("acc0"). `lm_weight` (C, V) is the target's LM head
    (`head_weight_t()`) in the compute dtype, frozen; heads with a draft vocabulary softmax over
    its columns, as they draft."""
    device = lm_weight.device
    lm_weight, column = pipeline.draft_columns(lm_weight, heads.draft_vocab)  # usable by autograd

    def loss_fn(idx: Tensor) -> tuple[Tensor, float]:
        x = data.hidden[idx].to(device, torch.float32)  # (B, C)
        y = in_columns(data.labels[idx].to(device), column)  # (B, K)
        logits = heads(x, lm_weight)  # (K, B, V)
        return medusa_loss(logits, y), pipeline.top1(logits[0], y[:, 0])

    return pipeline.Objective(heads, loss_fn, len(data), settings, metric="acc0", desc="medusa")


@torch.no_grad()
def rank_counts(heads: MedusaHeads, lm_weight: Tensor, data: Positions, chunk: int = 512) -> Tensor:
    """(K, MAX_RANK + 1) counts: [k, r] positions where the right token is head k's r-th guess
    (r < MAX_RANK), [k, MAX_RANK] where it ranks lower or lies outside the draft vocabulary."""
    k = heads.num_heads
    counts = torch.zeros(k, MAX_RANK + 1, dtype=torch.long)
    lm_weight, column = pipeline.draft_columns(lm_weight, heads.draft_vocab)  # (C, V')
    for s in range(0, len(data), chunk):
        x = data.hidden[s : s + chunk].to(lm_weight.device, torch.float32)  # (B, C)
        y = data.labels[s : s + chunk].T.to(lm_weight.device)  # (K, B)
        valid = y != IGNORE
        y = in_columns(y, column)
        logits = heads(x, lm_weight)  # (K, B, V')
        right = logits.gather(-1, y.clamp(min=0)[..., None])  # (K, B, 1)
        rank = (logits > right).sum(-1).clamp(max=MAX_RANK)  # (K, B)
        rank[y == IGNORE] = MAX_RANK  # outside the draft vocabulary: never drafted
        for head in range(k):
            counts[head] += torch.bincount(rank[head][valid[head]].cpu(), minlength=MAX_RANK + 1)
    return counts


def train(settings: TrainSettings) -> dict[str, Any]:
    """The whole pipeline; returns (and writes to OUT/report.json) what it measured."""
    prep = pipeline.prepare(settings)
    target, out, device = prep.target, prep.out, prep.device
    cfg = target.config
    train_set = positions(prep.train, settings.num_heads)
    held_set = positions(prep.heldout, settings.num_heads)
    print(
        f"data: {len(prep.train)} training samples ({prep.train.num_tokens} tokens, {len(train_set)} "
        f"positions), {len(prep.heldout)} held out ({len(held_set)} positions); "
        f"features {prep.features_s:.0f} s"
    )

    torch.manual_seed(settings.seed)
    heads = MedusaHeads(settings.num_heads, settings.num_layers, cfg.hidden_size, cfg.vocab_size).to(device)
    heads.draft_vocab = pipeline.draft_vocabulary(prep.train, settings.draft_vocab, cfg.vocab_size)
    lm_weight = target.head_weight_t().detach().to(target.dtype)  # (C, V), frozen
    t0 = time.perf_counter()
    task = objective(heads, lm_weight, train_set, settings)
    figures = pipeline.train_loop(task, out / "cache" / pipeline.STATE)
    train_s = time.perf_counter() - t0

    ranks = pipeline.fit_tree(rank_counts(heads, lm_weight, held_set), settings.tree_nodes)
    heads.choices = ranks.tree
    report: dict[str, Any] = {
        "heldout_top1": ranks.top1,
        "heldout_top5": ranks.top5,
        "heldout_positions": len(held_set),
        "draft_vocab_heldout_coverage": round(pipeline.coverage(prep.heldout, heads.draft_vocab), 4),
        "train_positions": len(train_set),
        "train_samples": len(prep.train),
        **pipeline.run_figures(prep, settings, figures, train_s),
    }
    print(f"held-out top-1 accuracy per head: {' '.join(f'{a:.3f}' for a in ranks.top1)}")
    print(f"held-out top-5 accuracy per head: {' '.join(f'{a:.3f}' for a in ranks.top5)}")
    size = cfg.vocab_size if heads.draft_vocab is None else heads.draft_vocab.numel()
    share = report["draft_vocab_heldout_coverage"]
    print(f"draft vocabulary: {size} ids, holding {share:.3f} of the held-out answer tokens")
    # τ of real decoding with the saved (float16) heads on the float32 target, as users run it.
    prompts = pipeline.ship(
        prep, settings, report, heads, save_heads, load_heads, {"heldout_tau": MedusaDrafter}
    )
    print(
        f"held-out τ (greedy Medusa decoding, {prompts} prompts, {settings.eval_tokens} tokens, "
        f"fitted tree of {len(heads.choices)} nodes): {report['heldout_tau']:.3f}"
    )
    pipeline.print_done(prep, report, train_s, "heads")
    return report
