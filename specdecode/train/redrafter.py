"""Training a ReDrafter on a frozen target: `specdecode train redrafter`.

    specdecode train redrafter --model smollm2-135m --data sharegpt.json --out runs/redrafter --self-distill

Pipeline as for Medusa (`train/medusa.py`; all but the positions, drafter and loss come from
`pipeline`): ShareGPT conversations -> the target's hidden states over the answers, or over its
own greedy answers with `--self-distill` (cached under OUT/cache) -> the drafter trained with
AdamW -> OUT/redrafter.safetensors + OUT/config.json -> held-out figures: per-position top-1
accuracy (teacher-forced) and τ of real greedy ReDrafter decoding.

Loss, at a position t whose state h_t produced the token x_{t+1} (the root when decoding): the
recurrent state is fed x_{t+1}, x_{t+2}, ... (the true tokens: teacher forcing, as beam search
feeds each beam its own tokens) and step k (k = 1..D) predicts x_{t+1+k} by cross-entropy,
weighted 0.8^(k-1) since a later token only counts when the earlier ones were right. Only
tokens the assistant wrote, in one run, are targets. `distill` > 0 mixes in the cross-entropy
against the target's own distribution at that place (its LM head on the stored h_{t+k}), the
reference implementation's knowledge distillation; with self-distilled data the hard labels
already are the target's greedy tokens.

With a shared LM head and `--draft-vocab` K (chosen from the training answers before training),
the logits are the head's K columns, as in drafting, and a label outside them is not trained on.

Cost on a CPU: the time goes into the shared, frozen LM head (its K drafted columns) over D rows
per position (forward and backward through it), in bfloat16 as for Medusa.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.drafters.redrafter import ReDrafter, ReDrafterHead, load_head, save_head
from specdecode.errors import SpecDecodeError
from specdecode.train import pipeline
from specdecode.train.features import Features
from specdecode.train.pipeline import IGNORE


@dataclass(frozen=True)
class TrainSettings(pipeline.Common):
    """Everything a run depends on; `specdecode train redrafter --help` describes each."""

    num_layers: int = pipeline.flag(2, "residual blocks", least=0, steps=True)
    depth: int = pipeline.flag(4, "tokens predicted per position (beam_length - 1)", least=1, steps=True)
    distill: float = pipeline.flag(
        0.0, "weight in [0, 1] of the target's soft targets", least=0, most=1, steps=True
    )
    beam_width: int = pipeline.flag(4, "beams for the held-out τ", least=1)
    draft_vocab: int = pipeline.flag(8192, "tokens it may draft, most frequent (0: all)", least=0, steps=True)


@dataclass
class Positions:
    """Training positions over the flattened hidden states of all samples.

    Row r of `hidden` is some sample's state at some t; the rows of one sample are consecutive,
    so the state at t+k is row r+k (used for distillation, only where the label exists)."""

    hidden: Tensor  # (R, C) float16: every sample's states, concatenated
    rows: Tensor  # (P,) long: row of h_t for each position
    tokens: Tensor  # (P, D+1) long: x_{t+1} (fed first), then labels x_{t+2..t+1+D} or IGNORE

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @property
    def depth(self) -> int:
        return int(self.tokens.shape[1]) - 1


def positions(features: Features, depth: int) -> Positions:
    """Every t whose token t+2 the assistant wrote; label k (1..D) is x_{t+1+k} while the tokens
    t+2..t+1+k are all assistant tokens of one run (later labels are IGNORE once one is)."""
    hidden, rows, tokens = [], [], []
    offset = 0
    for ids, mask, states in zip(features.ids, features.mask, features.hidden, strict=True):
        n = int(ids.shape[0])
        flags = mask.tolist()
        run = [0] * n  # run[i]: assistant tokens in a row ending at i
        for i in range(n):
            run[i] = run[i - 1] + 1 if flags[i] and i else int(flags[i])
        picked = [t for t in range(n - 2) if flags[t + 2]]
        if picked:
            table = torch.full((len(picked), depth + 1), IGNORE, dtype=torch.long)  # (R_i, D+1)
            for r, t in enumerate(picked):
                table[r, 0] = int(ids[t + 1])
                for k in range(1, depth + 1):
                    if t + 1 + k < n and run[t + 1 + k] >= k:
                        table[r, k] = int(ids[t + 1 + k])
            rows.append(torch.tensor(picked) + offset)
            tokens.append(table)
        hidden.append(states)
        offset += int(states.shape[0])
    if not rows:
        raise SpecDecodeError("no training positions: the samples have no assistant tokens")
    return Positions(torch.cat(hidden), torch.cat(rows), torch.cat(tokens))


def drafter_logits(
    head: ReDrafterHead, context: Tensor, tokens: Tensor, embedding: Tensor, lm_weight: Tensor
) -> Tensor:
    """Teacher-forced logits: context (B, C), fed tokens (B, D) (the first is x_{t+1}),
    embedding (V, C), lm_weight (C, V) -> (B, D, V) in lm_weight's dtype (own head: float32)."""
    state = torch.zeros_like(context)  # (B, C)
    feats = []
    for k in range(tokens.shape[1]):
        state = head.step(state, embedding[tokens[:, k]])
        feats.append(head.features(context, state))
    stacked = torch.stack(feats, dim=1)  # (B, D, E)
    if head.lm_head is None:
        return stacked.to(lm_weight.dtype) @ lm_weight
    return head.lm_head(stacked)


def redrafter_loss(
    logits: Tensor, labels: Tensor, soft: Tensor | None = None, distill: float = 0.0
) -> Tensor:
    """Weighted cross-entropy of logits (B, D, V) against labels (B, D) -> scalar; with `soft`
    (B, D, V) target probabilities, (1 - distill) x that + distill x the soft cross-entropy."""
    b, d, v = logits.shape
    valid = labels != IGNORE  # (B, D)
    ce = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), ignore_index=IGNORE, reduction="none")
    per_token = ce.float().view(b, d)  # (B, D)
    if soft is not None and distill > 0:
        soft_ce = -(soft * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B, D)
        per_token = (1 - distill) * per_token + distill * torch.where(valid, soft_ce, 0.0)
    per_depth = per_token.sum(0) / valid.sum(0).clamp(min=1)  # (D,)
    return (pipeline.depth_weights(d).to(per_depth.device) * per_depth).sum()


def objective(
    head: ReDrafterHead, embedding: Tensor, lm_weight: Tensor, data: Positions, settings: TrainSettings
) -> pipeline.Objective:
    """Training `head` on `data` (`pipeline.train_loop` runs it): `redrafter_loss` (with
    `settings.distill`), and depth 1's accuracy as the step's figure ("acc1"). `embedding` (V, C)
    and `lm_weight` (C, V) are the target's, frozen, `lm_weight` in the compute dtype."""
    device = lm_weight.device
    lm_weight, column = pipeline.draft_columns(lm_weight, head.draft_vocab if head.lm_head is None else None)
    embedding = embedding.detach().float()

    def loss_fn(idx: Tensor) -> tuple[Tensor, float]:
        rows = data.rows[idx]  # (B,)
        tokens = data.tokens[idx].to(device)  # (B, D+1)
        context = data.hidden[rows].to(device, torch.float32)  # (B, C)
        fed, labels = tokens[:, :-1].clamp(min=0), tokens[:, 1:]  # (B, D) each
        if column is not None:
            labels = torch.where(labels == IGNORE, IGNORE, column[labels.clamp(min=0)])  # (B, D) columns
        soft = None
        if settings.distill > 0:
            later = rows[:, None] + torch.arange(1, data.depth + 1)  # (B, D) rows of h_{t+k}
            later = later.clamp(max=data.hidden.shape[0] - 1)  # past the end only where IGNORE
            with torch.no_grad():
                target_logits = data.hidden[later].to(device, lm_weight.dtype) @ lm_weight
                soft = torch.softmax(target_logits.float(), dim=-1)  # (B, D, V)
        logits = drafter_logits(head, context, fed, embedding, lm_weight)  # (B, D, V)
        loss = redrafter_loss(logits, labels, soft, settings.distill)
        return loss, pipeline.top1(logits[:, 0], labels[:, 0])

    return pipeline.Objective(head, loss_fn, len(data), settings, metric="acc1", desc="redrafter")


@torch.no_grad()
def top1_by_depth(
    head: ReDrafterHead, embedding: Tensor, lm_weight: Tensor, data: Positions, chunk: int = 256
) -> list[float]:
    """Teacher-forced top-1 accuracy of each depth's guess on `data`, among the draft vocabulary
    (a token outside it counts as missed)."""
    hits = torch.zeros(data.depth)
    counts = torch.zeros(data.depth)
    embedding = embedding.float()
    lm_weight, column = pipeline.draft_columns(lm_weight, head.draft_vocab if head.lm_head is None else None)
    for s in range(0, len(data), chunk):
        tokens = data.tokens[s : s + chunk].to(lm_weight.device)  # (B, D+1)
        context = data.hidden[data.rows[s : s + chunk]].to(lm_weight.device, torch.float32)  # (B, C)
        logits = drafter_logits(head, context, tokens[:, :-1].clamp(min=0), embedding, lm_weight)
        labels = tokens[:, 1:]
        valid = labels != IGNORE  # (B, D)
        if column is not None:
            labels = column[labels.clamp(min=0)]  # IGNORE (never an argmax) outside the vocabulary
        hits += ((logits.argmax(-1) == labels) & valid).sum(0).cpu()
        counts += valid.sum(0).cpu()
    return (hits / counts.clamp(min=1)).tolist()


def train(settings: TrainSettings) -> dict[str, Any]:
    """The whole pipeline; returns (and writes to OUT/report.json) what it measured."""
    prep = pipeline.prepare(settings)
    target, out, device = prep.target, prep.out, prep.device
    cfg = target.config
    train_set, held_set = positions(prep.train, settings.depth), positions(prep.heldout, settings.depth)
    print(
        f"data: {len(prep.train)} training samples ({prep.train.num_tokens} tokens, {len(train_set)} "
        f"positions), {len(prep.heldout)} held out ({len(held_set)} positions); "
        f"features {prep.features_s:.0f} s"
    )

    torch.manual_seed(settings.seed)
    head = ReDrafterHead(cfg.hidden_size, cfg.vocab_size, settings.num_layers).to(device)
    lm_weight = target.head_weight_t().detach().to(target.dtype)  # (C, V), frozen
    embedding = target.embed.matrix().detach()  # (V, C), frozen
    vocab_share = 1.0
    vocab = pipeline.draft_vocabulary(prep.train, settings.draft_vocab, cfg.vocab_size)
    if vocab is not None:
        head.draft_vocab = vocab.to(device)
        vocab_share = pipeline.coverage(prep.heldout, vocab)
    t0 = time.perf_counter()
    task = objective(head, embedding, lm_weight, train_set, settings)
    figures = pipeline.train_loop(task, out / "cache" / pipeline.STATE)
    train_s = time.perf_counter() - t0

    top1 = [round(a, 4) for a in top1_by_depth(head, embedding, lm_weight, held_set)]
    beam_length = settings.depth + 1
    report: dict[str, Any] = {
        "heldout_top1": top1,
        "heldout_draft_vocab_coverage": round(vocab_share, 4),
        "heldout_positions": len(held_set),
        "train_positions": len(train_set),
        "train_samples": len(prep.train),
        **pipeline.run_figures(prep, settings, figures, train_s),
    }
    print(f"held-out top-1 accuracy per depth (teacher-forced): {' '.join(f'{a:.3f}' for a in top1)}")
    size = head.draft_vocab.numel() or cfg.vocab_size
    print(f"draft vocabulary: {size} tokens, {vocab_share:.1%} of the held-out answers' tokens")
    # τ of real decoding with the saved (float16) drafter on the float32 target, as users run it.
    makers = {"heldout_tau": lambda h, t: ReDrafter(h, t, settings.beam_width, beam_length)}
    prompts = pipeline.ship(prep, settings, report, head, save_head, load_head, makers)
    print(
        f"held-out τ (greedy ReDrafter decoding, {prompts} prompts, {settings.eval_tokens} tokens, "
        f"beam_width {settings.beam_width}, beam_length {beam_length}): {report['heldout_tau']:.3f}"
    )
    pipeline.print_done(prep, report, train_s, "drafter")
    return report
