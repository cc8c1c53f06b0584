"""Training an EAGLE head on a frozen target: `specdecode train eagle`.

    specdecode train eagle --model smollm2-135m --data sharegpt.json --out runs/eagle --self-distill

Pipeline (`pipeline.prepare`): ShareGPT conversations -> the target's features over the
dataset's answers or, with `--self-distill`, over its own greedy answers (cached under
OUT/cache) -> the head trained with AdamW on whole sequences -> OUT/eagle.safetensors +
OUT/config.json with the static tree fitted to its held-out accuracy -> a report: held-out top-1
accuracy of the drafted token per depth, and τ of real greedy EAGLE decoding on held-out prompts.

Recipe (EAGLE, Sec. 4): for a sequence x_0..x_{L-1} with features f_0..f_{L-2}, the head reads
pairs (x_{t+1}, f_t) causally and its output g_{t+1} is trained towards f_{t+1} by smooth-L1
(feature regression, mean over channels) plus `ce_weight` (0.1) x the cross-entropy of the
target's LM head on g_{t+1} against x_{t+2}, on positions whose x_{t+2} the assistant wrote.
Self-distilled answers are the target's greedy tokens, so x_{t+2} is exactly the argmax of its
LM head on f_{t+1}: the hard label stands for the target distribution EAGLE distils. The input
features get uniform noise of width `noise` (EAGLE's U(-0.1, 0.1)): at drafting time the head
reads its own, imperfect guesses.

`--unroll n` trains what drafting does after depth 1 too (HASS; EAGLE-3's training-time test):
from every position the head runs n-1 more steps, each reading its previous guess with the right
next token and attending the true pairs plus its own earlier steps (`unroll_pairs`), and each
step's guess is scored like the first against the target's feature and token it stands for.
The loss is the steps' mean; a step costs about as much as the teacher-forced pass.
`--init DIR` starts from a saved head (fine-tuning, keeping its draft vocabulary).

The cross-entropy runs over the head's draft vocabulary (`--draft-vocab`, the V' ids it will
draft from; chosen from the training answers before training): drafting takes a softmax over those
columns only, so training does too, and a label outside them is not trained on.

Cost on a CPU: the LM head (V' x C, 16384 x 576 for SmolLM2 by default) on every trained position
dominates; matmuls run in bfloat16 (autocast; float32 master weights), as for Medusa.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.drafters.eagle import EagleDrafter, EagleHead, check_fits, load_head, save_head
from specdecode.layers.linear import Embedding
from specdecode.models.transformer import Transformer
from specdecode.train import pipeline
from specdecode.train.features import Features
from specdecode.train.pipeline import IGNORE, MAX_RANK


@dataclass(frozen=True)
class TrainSettings(pipeline.Common):
    """Everything a run depends on; `specdecode train eagle --help` describes each."""

    epochs: int = 10
    batch_size: int = 8  # sequences per step
    save_every: int = 50
    ce_weight: float = pipeline.flag(0.1, "weight of the LM-head cross-entropy", least=0, steps=True)
    noise: float = pipeline.flag(0.2, "width of the uniform noise on input features", least=0, steps=True)
    tree_nodes: int = pipeline.flag(11, "nodes of the fitted EAGLE-1 tree", least=1)
    tree_depth: int = pipeline.flag(5, "depths measured for the tree fit", least=1)
    draft_vocab: int = pipeline.flag(16384, "token ids the head drafts from (0: all)", least=0, steps=True)
    unroll: int = pipeline.flag(
        1,
        "drafting steps trained from each position: 1 teacher-forces (EAGLE); n > 1 also trains "
        "n-1 steps that read the head's own guesses, as drafting does (n times the work)",
        least=1,
        steps=True,
    )
    init: str | None = pipeline.flag(
        None, "start from this head directory (fine-tuning; its draft vocabulary is kept)", steps=True
    )


@dataclass
class Batch:
    """Right-padded pairs of B sequences; row t of sequence i is the pair (x_{t+1}, f_t)."""

    tokens: Tensor  # (B, T) long: x_{t+1}
    features: Tensor  # (B, T, C) float: f_t
    next_features: Tensor  # (B, T, C) float: f_{t+1}, the regression target
    labels: Tensor  # (B, T) long: x_{t+2}
    trained: Tensor  # (B, T) bool: x_{t+2} written by the assistant (and not padding)
    lengths: list[int] | None = None  # pairs of each row before its padding (None: all T)


def batch(features: Features, index: list[int], device: torch.device) -> Batch:
    """The pairs of the sequences `index` (each of L tokens gives L-2 pairs), right-padded."""
    picked = [i for i in index if features.ids[i].shape[0] >= 3]
    width = max((features.ids[i].shape[0] - 2 for i in picked), default=0)
    b, c = len(picked), features.hidden[picked[0]].shape[1] if picked else 0
    tokens = torch.zeros(b, width, dtype=torch.long)
    labels = torch.zeros(b, width, dtype=torch.long)
    trained = torch.zeros(b, width, dtype=torch.bool)
    feats = torch.zeros(b, width, c, dtype=torch.float16)
    nexts = torch.zeros(b, width, c, dtype=torch.float16)
    for row, i in enumerate(picked):
        ids, mask, hidden = features.ids[i], features.mask[i], features.hidden[i]  # (L,), (L,), (L-1, C)
        n = ids.shape[0] - 2
        tokens[row, :n] = ids[1:-1]
        labels[row, :n] = ids[2:]
        trained[row, :n] = mask[2:]
        feats[row, :n] = hidden[:-1]
        nexts[row, :n] = hidden[1:]
    lengths = [features.ids[i].shape[0] - 2 for i in picked]
    return Batch(
        tokens.to(device), feats.to(device), nexts.to(device), labels.to(device), trained.to(device), lengths
    )


def unroll_pairs(
    head: EagleHead, embed: Embedding, tokens: Tensor, features: Tensor, steps: int
) -> list[Tensor]:
    """One sequence's head outputs for `steps` drafting steps from every start, differentiably.

    tokens (n,) x_{t+1}, features (n, C) f_t. Step 0 is teacher-forced: g_0 (n, C), row t the
    guess of f_{t+1}. Step d feeds each start t the pair (x_{t+1+d}, g_{d-1}[t]) at position
    t+d, attending the true pairs 0..t and its own pairs of the earlier steps, as drafting along
    a right path does: g_d (n-d, C), row t the guess of f_{t+1+d}. (`depth_rank_counts` scores
    these passes without gradients.) Each step writes a fresh cache that copies the earlier
    steps' keys, so no tensor that autograd saved is written again."""
    n = tokens.shape[0]
    x = embed(tokens).detach().to(features.dtype)  # (n, C); the frozen embedding: no (V, C) gradient
    cache = head.new_cache(n, features.dtype, features.device)
    outs = [head.run(cache, x, features, torch.arange(n, device=tokens.device))]  # causal from slot 0
    for d in range(1, min(steps, n)):
        m = n - d  # starts whose step-d pair and target exist
        grown = head.new_cache(cache.length + m, features.dtype, features.device)
        grown.k = torch.cat([cache.k[:, :, :, : cache.length], grown.k[:, :, :, :m]], dim=3)
        grown.v = torch.cat([cache.v[:, :, :, : cache.length], grown.v[:, :, :, :m]], dim=3)
        grown.length = cache.length
        at = torch.arange(m, device=tokens.device)
        blocks = [torch.arange(n, device=tokens.device)[None] <= at[:, None]]  # (m, n): true pairs 0..t
        blocks += [torch.eye(m, n - j, dtype=torch.bool, device=tokens.device) for j in range(1, d + 1)]
        mask = torch.cat(blocks, dim=1)  # (m, cache.length + m): + own pairs of steps 1..d
        outs.append(head.run(grown, x[d:], outs[-1][:m], at + d, mask))
        cache = grown
    return outs


def eagle_loss(
    head: EagleHead,
    embed: Embedding,
    lm_weight: Tensor,
    data: Batch,
    ce_weight: float,
    noise: float,
    generator: torch.Generator | None = None,
    probe: int = 128,
    unroll: int = 1,
) -> tuple[Tensor, float]:
    """(loss, top-1 accuracy): smooth-L1 + ce_weight x CE on the trained positions, and how
    often the drafted token (argmax) is right on the first `probe` of them (a full argmax over
    V' costs as much as the softmax). `lm_weight` (C, V') is frozen: the draft vocabulary's
    columns, and `data.labels` index them (IGNORE: outside it). The head's matmuls run in
    its dtype (autocast to bfloat16 when it is), and so do the logits and their softmax.

    `unroll` > 1 also trains drafting steps 2..unroll, where the head reads its own guesses
    (`unroll_pairs`; HASS and EAGLE-3's training-time test): the loss is the mean of the
    steps' losses, and the accuracy is step 1's."""
    feats = data.features.float()
    if noise > 0:
        u = torch.rand(feats.shape, generator=generator, device=feats.device)
        feats = feats + (u - 0.5) * noise
    low = lm_weight.dtype != torch.float32
    keep = data.trained  # (B, T)
    b, t = keep.shape
    lengths = data.lengths or [t] * b
    # Each row runs alone over its own pairs: padded to the batch's longest row, a batch with
    # one 1000-token prompt among 200-token chats would cost five times as much.
    with torch.autocast(feats.device.type, dtype=lm_weight.dtype, enabled=low):
        runs = [
            unroll_pairs(head, embed, data.tokens[i, :n], feats[i, :n], unroll) for i, n in enumerate(lengths)
        ]  # runs[i][d]: (n_i - d, C)
    losses, hits = [], float("nan")
    for d in range(unroll):
        picked = [(i, run[d], keep[i, d : d + run[d].shape[0]]) for i, run in enumerate(runs) if len(run) > d]
        if not any(bool(k.any()) for _, _, k in picked):
            continue
        g = torch.cat([out[k] for _, out, k in picked]).float()  # (P, C): trained positions, in order
        at = [(i, d + k.nonzero().squeeze(1)) for i, _, k in picked]  # pair index of each target
        nexts = torch.cat([data.next_features[i, j] for i, j in at]).float()  # (P, C) f_{t+1+d}
        labels = torch.cat([data.labels[i, j] for i, j in at])  # (P,) x_{t+2+d}
        regression = F.smooth_l1_loss(g, nexts)
        logits = g.to(lm_weight.dtype) @ lm_weight  # (P, V)
        ce = F.cross_entropy(logits, labels, ignore_index=IGNORE).float()
        if not bool((labels != IGNORE).any()):
            ce = logits.sum() * 0.0  # nothing to classify (cross_entropy would give NaN)
        losses.append(regression + ce_weight * ce)
        if d == 0:
            hits = float((logits[:probe].detach().float().argmax(-1) == labels[:probe]).float().mean())
    if not losses:  # no trained position at all
        return sum(run[0].sum() for run in runs) * 0.0, float("nan")
    return torch.stack(losses).mean(), hits


def objective(
    head: EagleHead, target: Transformer, data: Features, settings: TrainSettings
) -> pipeline.Objective:
    """Training `head` on the training sequences (`pipeline.train_loop` runs it): `eagle_loss`
    (with the settings' weights, noise and unrolled steps) and its top-1 accuracy as the step's
    figure ("acc"), gradients clipped to norm 0.5. Matmuls run in the target's dtype (see
    `eagle_loss`); the cross-entropy runs over `head.draft_vocab` (all ids if None)."""
    device = target.device
    lm_weight, column = pipeline.draft_columns(target.head_weight_t(), head.draft_vocab)  # (C, V')
    embed = target.embed

    def loss_fn(idx: Tensor) -> tuple[Tensor, float]:
        chunk = batch(data, idx.tolist(), device)
        if column is not None:
            chunk.labels = column[chunk.labels]
        g = torch.Generator(device=device).manual_seed(int(idx[0]) * 7919 + settings.seed)
        return eagle_loss(
            head, embed, lm_weight, chunk, settings.ce_weight, settings.noise, g, unroll=settings.unroll
        )

    return pipeline.Objective(head, loss_fn, len(data), settings, metric="acc", desc="eagle", clip_norm=0.5)


@torch.no_grad()
def depth_rank_counts(
    head: EagleHead, target: Transformer, data: Features, depth: int, vocab: Tensor | None = None
) -> Tensor:
    """(depth, MAX_RANK + 1) counts: [d, r] positions where the right token at depth d+1 is the
    head's r-th guess (r < MAX_RANK; [d, MAX_RANK]: lower), given the d tokens before it right.

    Depth 1 is teacher-forced (true features); depth d+1 feeds the head its own guess from depth
    d with the right token, as drafting along a correct path does: the passes of
    `unroll_pairs`, all starts of a sequence at once. With a draft `vocab` (V',)
    the ranks are among its tokens, and a token outside it counts as ranked too low.
    """
    lm_weight = target.head_weight_t().float()  # (C, V)
    vocab_size = lm_weight.shape[1]
    if vocab is not None:
        vocab = vocab.to(lm_weight.device)
        lm_weight = lm_weight[:, vocab]  # (C, V')
    # position of each token id among the drafted logits' columns; -1: not drafted
    column = torch.full((vocab_size,), -1, dtype=torch.long, device=lm_weight.device)
    column[vocab if vocab is not None else torch.arange(vocab_size, device=lm_weight.device)] = torch.arange(
        lm_weight.shape[1], device=lm_weight.device
    )
    counts = torch.zeros(depth, MAX_RANK + 1, dtype=torch.long)
    for ids, mask, hidden in zip(data.ids, data.mask, data.hidden, strict=True):
        n = int(ids.shape[0]) - 2  # pairs (starts)
        if n < 1:
            continue
        ids, mask = ids.to(target.device), mask.to(target.device)
        feats = hidden[:-1].to(target.device, torch.float32)  # (n, C) f_t
        outs = unroll_pairs(head, target.embed, ids[1:-1], feats, depth)  # outs[d]: (n-d, C)
        ok = torch.ones(n, dtype=torch.bool, device=target.device)  # path right so far
        for d, g in enumerate(outs):
            labels = ids[2 + d :]  # (n-d,) x_{t+2+d}: the token drafted at depth d+1
            ok = ok[: n - d] & mask[2 + d :]
            logits = g @ lm_weight  # (n-d, V')
            col = column[labels]  # (n-d,)
            right = logits.gather(-1, col.clamp(min=0)[:, None])  # (n-d, 1)
            rank = (logits > right).sum(-1).clamp(max=MAX_RANK)  # (n-d,)
            rank[col < 0] = MAX_RANK
            counts[d] += torch.bincount(rank[ok].cpu(), minlength=MAX_RANK + 1)
            ok = ok & (rank == 0)  # deeper depths count only along a right path
    return counts


def train(settings: TrainSettings) -> dict[str, Any]:
    """The whole pipeline; returns (and writes to OUT/report.json) what it measured."""
    prep = pipeline.prepare(settings)
    target, out = prep.target, prep.out
    positions = sum(int(m[2:].sum()) for m in prep.train.mask)
    print(
        f"data: {len(prep.train)} training sequences ({prep.train.num_tokens} tokens, {positions} trained "
        f"positions), {len(prep.heldout)} held out; features {prep.features_s:.0f} s"
    )
    torch.manual_seed(settings.seed)
    if settings.init is not None:
        head = load_head(settings.init, torch.float32, target.device).train()
        check_fits(head, target, f"--init {settings.init}")
        print(f"starting from the head in {settings.init}")
    else:
        head = EagleHead.for_target(target.config).to(target.device)
        vocab_size = target.config.vocab_size
        head.draft_vocab = pipeline.draft_vocabulary(prep.train, settings.draft_vocab, vocab_size)
    t0 = time.perf_counter()
    task = objective(head, target, prep.train, settings)
    figures = pipeline.train_loop(task, out / "cache" / pipeline.STATE)
    train_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    counts = depth_rank_counts(head, prep.eval_target(), prep.heldout, settings.tree_depth, head.draft_vocab)
    ranks = pipeline.fit_tree(counts, settings.tree_nodes)
    head.choices = ranks.tree
    report: dict[str, Any] = {
        "heldout_top1_by_depth": ranks.top1,
        "heldout_top5_by_depth": ranks.top5,
        "heldout_positions": int(counts[0].sum()),
        "draft_vocab_heldout_coverage": round(pipeline.coverage(prep.heldout, head.draft_vocab), 4),
        "train_sequences": len(prep.train),
        "train_positions": positions,
        "train_top1": round(figures["acc"], 4) if math.isfinite(figures["acc"]) else None,
        **pipeline.run_figures(prep, settings, figures, train_s),
    }
    print(
        f"held-out top-1 accuracy of the drafted token by depth: {' '.join(f'{a:.3f}' for a in ranks.top1)}"
    )
    print(f"held-out top-5 accuracy by depth: {' '.join(f'{a:.3f}' for a in ranks.top5)}")
    if head.draft_vocab is not None:
        print(
            f"draft vocabulary: {head.draft_vocab.numel()} ids, holding "
            f"{report['draft_vocab_heldout_coverage']:.3f} of the held-out answer tokens"
        )
    # τ of real decoding with the saved (float16) head on the float32 target, as users run it.
    makers = {"heldout_tau_eagle": EagleDrafter.static, "heldout_tau_eagle2": EagleDrafter.dynamic}
    prompts = pipeline.ship(prep, settings, report, head, save_head, load_head, makers, since=t0)
    print(
        f"held-out τ (greedy decoding, {prompts} prompts, {settings.eval_tokens} tokens): EAGLE-1 "
        f"(fitted tree of {len(head.choices)} nodes) {report['heldout_tau_eagle']:.3f}, "
        f"EAGLE-2 (defaults) {report['heldout_tau_eagle2']:.3f}"
    )
    pipeline.print_done(prep, report, train_s, "head")
    return report
