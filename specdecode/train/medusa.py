"""Training Medusa heads on a frozen target (Medusa-1): `specdecode train medusa`.

    specdecode train medusa --model smollm2-135m --data sharegpt.json --out runs/medusa --self-distill

Pipeline: ShareGPT conversations (`data`) -> the target's hidden states over the dataset's answers
or, with `--self-distill`, over its own greedy answers (`features`, cached under OUT/cache) ->
heads trained with AdamW -> OUT/medusa.safetensors + OUT/config.json, with the tree fitted to
the heads' held-out accuracy -> a report of held-out acceptance: top-1 accuracy per head and τ of
real Medusa decoding on held-out prompts.

Loss: at position t the target's state h_t (whose LM-head output is the token at t+1) trains
head k to predict the token at t+2+k by cross-entropy, on tokens the assistant wrote; head k's
loss is weighted 0.8^k, since a later head's guess only counts when the earlier ones were right.

Cost on a CPU: the heads' own weights are tiny; the time goes into the shared, frozen LM head
(V x C, 49152 x 576 for SmolLM2), applied to K rows per position and back-propagated through
(not into). It runs in bfloat16 (float32 master weights), ~5x faster than float32 on CPUs with
AVX512-BF16/AMX and the usual choice on GPUs. Each step samples positions across the dataset.

Interruption: a checkpoint (heads, optimizer, step) is written every `save_every` steps and on
Ctrl-C; `--resume` continues from it, and from the feature shards already written. Batches are
a function of (seed, epoch, step), so a resumed run takes exactly the steps an uninterrupted
run would, and ends with the same weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.drafters.medusa import MedusaDrafter, MedusaHeads, best_tree, load_heads, save_heads
from specdecode.errors import SpecDecodeError
from specdecode.models.transformer import Transformer
from specdecode.train.data import Sample, prompt, read_sharegpt, render, split
from specdecode.train.features import Features, extract

IGNORE = -100  # label of a (position, head) pair that is not trained
HEAD_DECAY = 0.8
MAX_RANK = 10  # ranks tracked for the tree fit; deeper ranks are never worth a node
STATE = "train_state.pt"


@dataclass(frozen=True)
class TrainSettings:
    """Everything a run depends on; `specdecode train medusa --help` describes each."""

    data: str
    out: str
    model: str = "smollm2-135m"
    num_heads: int = 4
    num_layers: int = 1
    max_conversations: int = 1000
    max_len: int = 384
    epochs: int = 2
    lr: float = 1e-3
    batch_size: int = 256
    self_distill: bool = False
    resume: bool = False
    heldout: float = 0.04
    seed: int = 0
    save_every: int = 100
    dtype: str = "bfloat16"
    device: str | None = None
    feature_batch_size: int = 32
    tree_nodes: int = 32
    eval_prompts: int = 4
    eval_tokens: int = 128
    max_steps: int | None = None
    progress: bool = True


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


def head_weights(num_heads: int) -> Tensor:
    return torch.tensor([HEAD_DECAY**k for k in range(num_heads)])  # (K,)


def medusa_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Weighted cross-entropy of logits (K, B, V) against labels (B, K) -> scalar.

    Computed in the logits' dtype (bfloat16 when training on a CPU: the softmax over V
    dominates a step and bfloat16 halves it; its sums accumulate in float32 all the same)."""
    k = logits.shape[0]
    target = labels.T  # (K, B)
    valid = target != IGNORE  # (K, B)
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="none")
    per_head = ce.float().view(k, -1).sum(1) / valid.sum(1).clamp(min=1)  # (K,)
    return (head_weights(k).to(per_head.device) * per_head).sum()


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps (at most 50), then cosine down to 10% of peak."""
    warm = max(1, min(50, total // 20))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _fingerprint(settings: TrainSettings, data: Positions, total: int) -> str:
    """What a checkpoint must agree with to be resumed: the settings that shape the steps."""
    keys = ("model", "num_heads", "num_layers", "lr", "batch_size", "seed", "dtype")
    fields = {k: getattr(settings, k) for k in keys}
    fields.update(positions=len(data), total=total)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def fit(
    heads: MedusaHeads,
    lm_weight: Tensor,
    data: Positions,
    settings: TrainSettings,
    state_file: Path,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Train `heads` in place on `data`, checkpointing to `state_file`; returns final figures.

    `lm_weight` (C, V) is the target's LM head (`head_weight_t()`) in the compute dtype. Resumes
    from `state_file` when it exists (the caller decides whether that is wanted). `on_step(step)`
    runs after each step; an exception from it, or Ctrl-C, saves a checkpoint first. Returns the
    mean loss of the last 50 steps and the last batch's head-0 accuracy.
    """
    from tqdm import tqdm

    device = lm_weight.device
    if lm_weight.is_inference():  # made under inference_mode (a cached tied head): autograd needs a copy
        lm_weight = lm_weight.clone()
    steps_per_epoch = math.ceil(len(data) / settings.batch_size)
    total = settings.epochs * steps_per_epoch
    if settings.max_steps is not None:
        total = min(total, settings.max_steps)
    fingerprint = _fingerprint(settings, data, total)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=settings.lr, weight_decay=0.0)
    step = 0
    if state_file.is_file():
        state = torch.load(state_file, map_location=device, weights_only=True)
        if state.get("fingerprint") != fingerprint:
            raise SpecDecodeError(
                f"{state_file} comes from a run with other settings or data; use another --out"
            )
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])

    def save() -> None:
        from specdecode.models.cache import atomic_file

        state = {"step": step, "heads": heads.state_dict(), "optimizer": optimizer.state_dict()}
        state["fingerprint"] = fingerprint
        with atomic_file(state_file) as tmp:
            torch.save(state, tmp)

    def order(epoch: int) -> Tensor:
        g = torch.Generator().manual_seed(settings.seed * 1_000_003 + epoch)
        return torch.randperm(len(data), generator=g)  # (P,)

    # Ctrl-C sets a flag that ends the run after the current step, so the checkpoint never holds
    # half-updated weights; a second Ctrl-C interrupts at once.
    stop: list[bool] = []

    def on_sigint(signum: int, frame: object) -> None:
        if stop:
            raise KeyboardInterrupt
        stop.append(True)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    heads.train()
    recent: list[float] = []  # losses of the last 50 steps
    figures = {"loss": float("nan"), "acc0": float("nan")}
    epoch_order = (-1, torch.empty(0, dtype=torch.long))
    bar = tqdm(total=total, initial=step, desc="medusa", unit="step", disable=not settings.progress)
    try:
        while step < total:
            epoch, i = divmod(step, steps_per_epoch)
            if epoch_order[0] != epoch:
                epoch_order = (epoch, order(epoch))
            idx = epoch_order[1][i * settings.batch_size : (i + 1) * settings.batch_size]  # (B,)
            x = data.hidden[idx].to(device, torch.float32)  # (B, C)
            y = data.labels[idx].to(device)  # (B, K)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total, settings.lr)
            logits = heads(x, lm_weight)  # (K, B, V)
            loss = medusa_loss(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            valid0 = y[:, 0] != IGNORE  # (B,)
            hits0 = int((logits[0].detach().argmax(-1) == y[:, 0])[valid0].sum())
            recent = [*recent[-49:], float(loss.detach())]
            figures = {"loss": sum(recent) / len(recent), "acc0": hits0 / max(int(valid0.sum()), 1)}
            bar.update(1)
            bar.set_postfix(loss=f"{recent[-1]:.3f}", acc0=f"{figures['acc0']:.2f}")
            if step % settings.save_every == 0 or step == total:
                save()
            if stop:
                raise KeyboardInterrupt
            if on_step is not None:
                on_step(step)
    except BaseException as exc:
        save()  # after Ctrl-C or a failure between steps: keep every finished step
        if isinstance(exc, KeyboardInterrupt):
            print(f"\ncheckpoint saved at step {step}/{total}; continue with --resume", file=sys.stderr)
        raise
    finally:
        bar.close()
        heads.eval()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return figures


@torch.no_grad()
def rank_counts(heads: MedusaHeads, lm_weight: Tensor, data: Positions, chunk: int = 512) -> Tensor:
    """(K, MAX_RANK + 1) counts: [k, r] positions where the right token is head k's r-th guess
    (r < MAX_RANK), [k, MAX_RANK] where it ranks lower."""
    k = heads.num_heads
    counts = torch.zeros(k, MAX_RANK + 1, dtype=torch.long)
    for s in range(0, len(data), chunk):
        x = data.hidden[s : s + chunk].to(lm_weight.device, torch.float32)  # (B, C)
        y = data.labels[s : s + chunk].T.to(lm_weight.device)  # (K, B)
        logits = heads(x, lm_weight)  # (K, B, V)
        valid = y != IGNORE
        right = logits.gather(-1, y.clamp(min=0)[..., None])  # (K, B, 1)
        rank = (logits > right).sum(-1).clamp(max=MAX_RANK)  # (K, B)
        for head in range(k):
            counts[head] += torch.bincount(rank[head][valid[head]].cpu(), minlength=MAX_RANK + 1)
    return counts


def measure_tau(
    target: Transformer, heads: MedusaHeads, prompts: list[list[int]], max_tokens: int, eos: list[int]
) -> float:
    """τ (tokens per target forward) of greedy Medusa decoding over `prompts`."""
    from specdecode.engine import Engine, Request
    from specdecode.sampling import SamplingParams

    engine = Engine(target)
    tokens = forwards = 0
    for ids in prompts:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        req = Request(target, ids, params, eos, MedusaDrafter(heads, target))
        for _ in engine.generate(req):
            pass
        tokens += req.stats.num_generated_tokens
        forwards += req.stats.num_target_forwards
    return tokens / max(forwards, 1)


def train(settings: TrainSettings) -> dict[str, Any]:
    """The whole pipeline; returns (and writes to OUT/report.json) what it measured."""
    from specdecode.llm import resolve_device, resolve_dtype
    from specdecode.models.loader import resolve_model
    from specdecode.models.tokenizer import Tokenizer

    started = time.perf_counter()
    out = Path(settings.out).expanduser()
    state_file = out / "cache" / STATE
    if state_file.is_file() and not settings.resume:
        raise SpecDecodeError(
            f"{out} holds an unfinished or finished run: pass --resume, or choose another --out"
        )
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype)
    path = resolve_model(settings.model, progress=settings.progress)
    tokenizer = Tokenizer.from_dir(path)
    target = Transformer.from_dir(path, dtype=dtype, device=device)
    cfg = target.config
    if settings.max_len < 4:
        raise SpecDecodeError(f"max_len must be >= 4, got {settings.max_len}")

    conversations = read_sharegpt(settings.data, settings.max_conversations)
    train_convs, held_convs = split(conversations, settings.heldout, settings.seed)
    limit = settings.max_len // 2 if settings.self_distill else settings.max_len

    def samples(convs: list[list[dict[str, str]]]) -> list[Sample]:
        make = prompt if settings.self_distill else render
        return [s for s in (make(tokenizer, c, limit) for c in convs) if s is not None]

    train_samples, held_samples = samples(train_convs), samples(held_convs)
    if not train_samples or not held_samples:
        raise SpecDecodeError(
            f"{len(train_samples)} training and {len(held_samples)} held-out samples fit max_len "
            f"{settings.max_len}; use more conversations, a larger --max-len or --heldout"
        )
    eos = tokenizer.eos_token_ids

    def features(name: str, items: list[Sample]) -> Features:
        return extract(
            target,
            items,
            generate=settings.self_distill,
            max_len=settings.max_len,
            eos_ids=eos,
            cache_dir=out / "cache" / name,
            model_tag=str(path),
            batch_size=settings.feature_batch_size,
            progress=settings.progress,
        )

    train_feats, held_feats = features("train", train_samples), features("heldout", held_samples)
    features_s = time.perf_counter() - started
    train_set = positions(train_feats, settings.num_heads)
    held_set = positions(held_feats, settings.num_heads)
    print(
        f"data: {len(train_samples)} training samples ({train_feats.num_tokens} tokens, {len(train_set)} "
        f"positions), {len(held_samples)} held out ({len(held_set)} positions); features {features_s:.0f} s"
    )

    torch.manual_seed(settings.seed)
    heads = MedusaHeads(settings.num_heads, settings.num_layers, cfg.hidden_size, cfg.vocab_size).to(device)
    lm_weight = target.head_weight_t().detach().to(dtype)  # (C, V), frozen
    t0 = time.perf_counter()
    figures = fit(heads, lm_weight, train_set, settings, state_file)
    train_s = time.perf_counter() - t0

    counts = rank_counts(heads, lm_weight, held_set)  # (K, MAX_RANK + 1)
    totals = counts.sum(1).clamp(min=1)  # (K,)
    rank_probs = (counts[:, :MAX_RANK] / totals[:, None]).tolist()
    top1 = [round(p[0], 4) for p in rank_probs]
    top5 = [round(sum(p[:5]), 4) for p in rank_probs]
    heads.choices = best_tree(rank_probs, settings.tree_nodes)
    report: dict[str, Any] = {
        "heldout_top1": top1,
        "heldout_top5": top5,
        "heldout_positions": len(held_set),
        "train_positions": len(train_set),
        "train_samples": len(train_samples),
        "train_loss": round(figures["loss"], 4) if math.isfinite(figures["loss"]) else None,
        "features_s": round(features_s, 1),
        "train_s": round(train_s, 1),
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("resume", "progress", "out")},
    }
    save_heads(heads, out, target=settings.model, extra={"training": report})

    # τ of real decoding with the saved (float16) heads on the float32 target, as users run it.
    t0 = time.perf_counter()
    eval_target = target if dtype == torch.float32 else Transformer.from_dir(path, torch.float32, device)
    shipped = load_heads(out, torch.float32, device)
    held_prompts = [s for s in (prompt(tokenizer, c, settings.max_len // 2) for c in held_convs) if s]
    chosen = [s.ids for s in held_prompts[: settings.eval_prompts]]
    tau = measure_tau(eval_target, shipped, chosen, settings.eval_tokens, eos) if chosen else float("nan")
    report.update(
        heldout_tau=round(tau, 3), tau_prompts=len(chosen), eval_s=round(time.perf_counter() - t0, 1)
    )
    report["total_s"] = round(time.perf_counter() - started, 1)
    save_heads(heads, out, target=settings.model, extra={"training": report})
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"held-out top-1 accuracy per head: {' '.join(f'{a:.3f}' for a in top1)}")
    print(f"held-out top-5 accuracy per head: {' '.join(f'{a:.3f}' for a in top5)}")
    print(
        f"held-out τ (greedy Medusa decoding, {len(chosen)} prompts, {settings.eval_tokens} tokens, "
        f"fitted tree of {len(heads.choices)} nodes): {tau:.3f}"
    )
    print(f"time: features {features_s:.0f} s, training {train_s:.0f} s, total {report['total_s']:.0f} s")
    print(f"heads written to {out}")
    return report


def add_args(p: argparse.ArgumentParser) -> None:
    d = TrainSettings(data="", out="")
    p.add_argument("--model", default=d.model, help="target: short name, .gguf file or HF directory")
    p.add_argument("--data", required=True, help="ShareGPT JSON file (a cut-off file is fine)")
    p.add_argument("--out", required=True, help="output directory: heads, config, report, cache/")
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="residual blocks per head")
    p.add_argument("--max-conversations", type=int, default=d.max_conversations)
    p.add_argument("--max-len", type=int, default=d.max_len, help="tokens per sample (prompt + answer)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="positions per step")
    p.add_argument(
        "--self-distill", action="store_true", help="train on the target's own greedy answers to the prompts"
    )
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--heldout", type=float, default=d.heldout, help="held-out share (< 1) or count")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32"], help="target and matmuls")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--feature-batch-size", type=int, default=d.feature_batch_size)
    p.add_argument("--tree-nodes", type=int, default=d.tree_nodes, help="nodes of the fitted tree")
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help="held-out prompts for τ")
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens, help="tokens per τ prompt")


def main_args(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for name in ("num_heads", "max_conversations", "max_len", "epochs", "batch_size", "save_every"):
        if getattr(args, name) < 1:
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_layers < 0:
        raise SpecDecodeError(f"--num-layers must be >= 0, got {args.num_layers}")
    settings = TrainSettings(
        data=args.data,
        out=args.out,
        model=args.model,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        max_conversations=args.max_conversations,
        max_len=args.max_len,
        epochs=args.epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        self_distill=args.self_distill,
        resume=args.resume,
        heldout=args.heldout,
        seed=args.seed,
        save_every=args.save_every,
        dtype=args.dtype,
        device=args.device,
        feature_batch_size=args.feature_batch_size,
        tree_nodes=args.tree_nodes,
        eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        max_steps=args.max_steps,
    )
    train(settings)
