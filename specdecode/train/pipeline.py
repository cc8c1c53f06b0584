"""What every drafter's training run shares: data and features in, a resumable training loop.

A method's `train` does three things; the first and the last are here:

1. `prepare(settings)`: load the target and its tokenizer, read the ShareGPT file, split it into
   training and held-out conversations, build samples (whole conversations, or only their
   prompts with `self_distill`), and get the target's features for both sets from
   `OUT/cache/{train,heldout}` (computed in batches the first time, `features.extract`).
2. the method's own positions, module and loss (Medusa, EAGLE, ReDrafter): its `Objective`;
3. `train_loop(objective, ...)`: AdamW steps on the objective's loss over shuffled batches with a
   warm-up + cosine schedule, a progress bar, a checkpoint every `save_every` steps and on Ctrl-C,
   and `--resume`; then `ship`: the trained drafter written, and its held-out τ measured as users
   will run it.

Settings: each method's frozen `TrainSettings` dataclass subclasses `Common` with its own fields,
declared with `flag` where they have a command-line flag; `add_args` declares the flags (the common
ones, then the method's) and `settings_from_args` reads them back into the method's settings.

Determinism: batches are a function of (seed, epoch, step) and the loop checkpoints whole steps
only, so a resumed run takes exactly the steps an uninterrupted one would and ends with the same
weights.
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
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from specdecode.drafters.base import Drafter
from specdecode.drafters.medusa import best_tree
from specdecode.errors import SpecDecodeError, require_positive
from specdecode.layers import bind_kernels
from specdecode.models.tokenizer import Tokenizer
from specdecode.models.transformer import Transformer
from specdecode.train.data import Conversation, Sample, prompt, read_sharegpt, render, split
from specdecode.train.features import Features, extract, load_cache

STATE = "train_state.pt"  # the loop's checkpoint, under OUT/cache/
IGNORE = -100  # a label the cross-entropy skips
MAX_RANK = 10  # ranks tracked for a tree fit; deeper ranks are never worth a node
Settings = TypeVar("Settings", bound="Common")
T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """A method's own setting on the command line: `--field-name`, typed as its default, with
    this help and the range of values `settings_from_args` accepts."""

    help: str
    least: float | None = None
    most: float | None = None
    steps: bool = False  # it shapes the training steps: a checkpoint resumes only under the same value


def flag(
    default: T, help: str, *, least: float | None = None, most: float | None = None, steps: bool = False
) -> T:
    """A method's `TrainSettings` field that has a command-line flag: its default, and the flag's
    help, range and whether it shapes the steps (`Flag`), declared with the field."""
    return field(default=default, metadata={"flag": Flag(help, least, most, steps)})


@dataclass(frozen=True)
class Common:
    """The settings every training run has (see `add_args` for their meaning); a method's
    `TrainSettings` subclasses it with its own fields and, where it needs them, other defaults.
    A checkpoint resumes only under the same values of the settings that shape the steps: these
    common ones and the method's flags marked `steps` (`resume_keys`)."""

    STEP_KEYS: ClassVar[tuple[str, ...]] = ("model", "lr", "batch_size", "seed", "dtype")

    @classmethod
    def flags(cls) -> dict[str, Flag]:
        """The method's own fields with a command-line flag (declared with `flag`), in order."""
        return {f.name: f.metadata["flag"] for f in fields(cls) if "flag" in f.metadata}

    @classmethod
    def resume_keys(cls) -> tuple[str, ...]:
        return (*cls.STEP_KEYS, *(name for name, flag in cls.flags().items() if flag.steps))

    data: str
    out: str
    model: str = "smollm2-135m"
    max_conversations: int = 1000
    skip_conversations: int = 0
    more_features: tuple[str, ...] = ()
    max_len: int = 384
    min_prompt_len: int = 0
    prompt_turn: int = 1
    max_answer_len: int | None = None
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
    eval_prompts: int = 4
    eval_tokens: int = 128
    max_steps: int | None = None
    progress: bool = True


@dataclass
class Prepared:
    """The target, its tokenizer and the features of the training and held-out samples."""

    out: Path
    model_path: Path  # the target's model directory
    target: Transformer  # in the training dtype
    tokenizer: Tokenizer
    train: Features
    heldout: Features
    held_conversations: list[Conversation]
    features_s: float
    started: float  # when the run began (`time.perf_counter()`)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def eval_target(self) -> Transformer:
        """The target in float32, as users run it: what held-out τ is measured on."""
        if self.target.dtype == torch.float32:
            return self.target
        return Transformer.from_dir(self.model_path, torch.float32, self.target.device)

    def eval_prompts(self, settings: Common) -> list[list[int]]:
        """Token ids of the first `eval_prompts` held-out prompts (for τ of real decoding)."""
        found = (run_prompt(self.tokenizer, c, settings) for c in self.held_conversations)
        return [s.ids for s in found if s is not None][: settings.eval_prompts]


def run_prompt(tokenizer: Tokenizer, conversation: Conversation, settings: Common) -> Sample | None:
    """The prompt a run answers (self-distillation) and measures τ on: the conversation's
    `prompt_turn`-th question (the first by default, earlier turns as context), of at most
    `max_len - max_answer_len` tokens (`max_len // 2` without an answer cap) and at least
    `min_prompt_len`; None when it has no such prompt."""
    answer = settings.max_answer_len
    limit = settings.max_len - answer if answer else settings.max_len // 2
    sample = prompt(tokenizer, conversation, limit, settings.prompt_turn)
    return sample if sample is not None and sample.prompt_len >= settings.min_prompt_len else None


def make_sample(tokenizer: Tokenizer, conversation: Conversation, settings: Common) -> Sample | None:
    """The sample a run makes of one conversation (None: it does not fit the run's lengths).

    Self-distillation takes the prompt of `run_prompt`; otherwise the whole conversation, cut
    to `max_len`. Either way a sample whose prompt is shorter than `min_prompt_len` is left out
    (a run on long prompts only: documents to summarize, code to fix, passages to answer from)."""
    if settings.self_distill:
        return run_prompt(tokenizer, conversation, settings)
    sample = render(tokenizer, conversation, settings.max_len)
    return sample if sample is not None and sample.prompt_len >= settings.min_prompt_len else None


def prepare(settings: Common) -> Prepared:
    """Step 1 of every run: target, samples and features (cached under OUT/cache/)."""
    from specdecode.models.loader import resolve_device, resolve_dtype, resolve_model

    started = time.perf_counter()
    out = Path(settings.out).expanduser()
    if (out / "cache" / STATE).is_file() and not settings.resume:
        raise SpecDecodeError(
            f"{out} holds an unfinished or finished run: pass --resume, or choose another --out"
        )
    if settings.max_len < 4:
        raise SpecDecodeError(f"max_len must be >= 4, got {settings.max_len}")
    answer = settings.max_answer_len
    if answer is not None and not 1 <= answer < settings.max_len:
        raise SpecDecodeError(f"max_answer_len must be in [1, max_len), got {answer}")
    if settings.min_prompt_len < 0:
        raise SpecDecodeError(f"min_prompt_len must be >= 0, got {settings.min_prompt_len}")
    if settings.prompt_turn < 1:
        raise SpecDecodeError(f"prompt_turn must be >= 1, got {settings.prompt_turn}")
    if settings.prompt_turn > 1 and not settings.self_distill:
        raise SpecDecodeError("prompt_turn picks the question that --self-distill answers: pass it too")
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype)
    path = resolve_model(settings.model, progress=settings.progress)
    tokenizer = Tokenizer.from_dir(path)
    target = Transformer.from_dir(path, dtype=dtype, device=device)

    skip = settings.skip_conversations
    conversations = read_sharegpt(settings.data, skip + settings.max_conversations)[skip:]
    if not conversations:
        raise SpecDecodeError(f"{settings.data} has no conversations after the first {skip}")
    train_convs, held_convs = split(conversations, settings.heldout, settings.seed)

    def samples(convs: list[Conversation]) -> list[Sample]:
        return [s for s in (make_sample(tokenizer, c, settings) for c in convs) if s is not None]

    train_samples, held_samples = samples(train_convs), samples(held_convs)
    if not train_samples or not held_samples:
        raise SpecDecodeError(
            f"{len(train_samples)} training and {len(held_samples)} held-out samples fit max_len "
            f"{settings.max_len} (prompts of at least {settings.min_prompt_len} tokens); use more "
            "conversations, a larger --max-len or --heldout"
        )

    def features(name: str, items: list[Sample]) -> Features:
        return extract(
            target,
            items,
            generate=settings.self_distill,
            max_len=settings.max_len,
            max_new=settings.max_answer_len,
            eos_ids=tokenizer.eos_token_ids,
            cache_dir=out / "cache" / name,
            model_tag=str(path),
            batch_size=settings.feature_batch_size,
            progress=settings.progress,
        )

    train_feats, held_feats = features("train", train_samples), features("heldout", held_samples)
    for extra in settings.more_features:
        more = load_cache(extra)
        width = more.hidden[0].shape[-1] if len(more) else target.config.hidden_size
        if width != target.config.hidden_size:
            raise SpecDecodeError(f"{extra} holds features of width {width}, not {settings.model}'s")
        train_feats = Features(
            train_feats.ids + more.ids, train_feats.mask + more.mask, train_feats.hidden + more.hidden
        )
    return Prepared(
        out=out,
        model_path=path,
        target=target,
        tokenizer=tokenizer,
        train=train_feats,
        heldout=held_feats,
        held_conversations=held_convs,
        features_s=time.perf_counter() - started,
        started=started,
    )


def draft_columns(lm_weight: Tensor, vocab: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """lm_weight (C, V) -> (its draft-vocabulary columns (C, V'), the column of each token id
    (V,), IGNORE outside `vocab`); all columns and None without a vocabulary (None or empty).
    A drafter with a draft vocabulary softmaxes over those columns only, so training does too.
    The weight comes back usable by autograd (a copy when it was made under inference mode, as a
    cached tied head is)."""
    lm_weight = lm_weight.detach()
    if lm_weight.is_inference():
        lm_weight = lm_weight.clone()
    if vocab is None or vocab.numel() == 0:
        return lm_weight, None
    vocab = vocab.to(lm_weight.device)
    column = torch.full((lm_weight.shape[1],), IGNORE, dtype=torch.long, device=lm_weight.device)
    column[vocab] = torch.arange(vocab.numel(), device=lm_weight.device)
    return lm_weight[:, vocab], column


def draft_vocabulary(data: Features, size: int, vocab_size: int) -> Tensor | None:
    """The `size` token ids a head drafts from (None: all): every token the assistant wrote in
    the training data, most frequent first, then the lowest unseen ids (BPE vocabularies put
    their most common merges first). Sorted ascending."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(data.ids, data.mask, strict=True):
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    seen = counts.argsort(descending=True, stable=True)[: int((counts > 0).sum())]
    unseen = (counts == 0).nonzero().squeeze(1)
    return torch.cat([seen, unseen])[:size].sort().values


def coverage(data: Features, vocab: Tensor | None) -> float:
    """Share of the assistant's tokens in `data` that `vocab` holds."""
    if vocab is None:
        return 1.0
    tokens = torch.cat([ids[mask] for ids, mask in zip(data.ids, data.mask, strict=True)])
    return float(torch.isin(tokens, vocab).float().mean()) if tokens.numel() else float("nan")


# ------------------------------------------------------------------------------------------------
# The loop


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps (at most 50), then cosine down to 10% of peak."""
    warm = max(1, min(50, total // 20))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def total_steps(settings: Common, num_items: int) -> int:
    """Steps of a run: `epochs` passes over `num_items` in batches, capped by `max_steps`."""
    total = settings.epochs * math.ceil(num_items / settings.batch_size)
    return total if settings.max_steps is None else min(total, settings.max_steps)


def fingerprint(settings: Common, keys: Iterable[str], **extra: Any) -> str:
    """What a checkpoint must agree with to be resumed: the settings named by `keys` (those that
    shape the steps) and `extra` facts about the data."""
    fields = {k: getattr(settings, k) for k in keys}
    fields.update(extra)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Objective:
    """What a method trains (`train_loop` runs it): `module`'s parameters, under `settings`, to
    lower `loss(indices)` -> (the loss, the step's `metric`, an accuracy) over batches of indices
    (B,) into its `num_items` training items. `desc` labels the progress bar; `clip_norm`, when
    given, bounds the gradient norm."""

    module: nn.Module
    loss: Callable[[Tensor], tuple[Tensor, float]]
    num_items: int
    settings: Common
    metric: str
    desc: str
    clip_norm: float | None = None


def train_loop(
    objective: Objective, state_file: Path, on_step: Callable[[int], None] | None = None
) -> dict[str, float]:
    """Train the objective's module in place with AdamW for `total_steps(settings, num_items)`
    steps, resumably; returns `{"loss": ..., metric: ...}`, the means over the last 50 steps.

    Each step draws the next batch of item indices (B,) from a seeded per-epoch permutation of
    `num_items`, sets the learning rate (`learning_rate`), calls `objective.loss(indices)` for
    the loss and the step's metric, back-propagates (clipping the gradient norm to `clip_norm`
    when given) and steps the optimizer. `module` and the optimizer are restored from
    `state_file` when it exists (it must come from the same `settings.resume_keys()` and data)
    and saved to it every `save_every` steps, at the end, and on Ctrl-C (which ends the run after
    the step under way, so a checkpoint never holds half-updated weights; a second Ctrl-C
    interrupts at once). `on_step(step)` runs after each step; an exception from it saves first
    too."""
    from tqdm import tqdm

    from specdecode.models.cache import atomic_file

    module, settings, num_items = objective.module, objective.settings, objective.num_items
    steps_per_epoch = math.ceil(num_items / settings.batch_size)
    total = total_steps(settings, num_items)
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings.lr, weight_decay=0.0)
    run_id = fingerprint(settings, settings.resume_keys(), items=num_items, total=total)
    losses, metrics = RecentMean(), RecentMean()

    def step_fn(idx: Tensor) -> dict[str, float]:
        loss, value = objective.loss(idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if objective.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), objective.clip_norm)
        optimizer.step()
        losses.add(float(loss.detach()))
        metrics.add(value)
        return {"loss": losses.values[-1], objective.metric: value}

    step = 0
    if state_file.is_file():
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        if state.get("fingerprint") != run_id:
            raise SpecDecodeError(
                f"{state_file} comes from a run with other settings or data; use another --out"
            )
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])

    def save() -> None:
        state = {"step": step, "module": module.state_dict(), "optimizer": optimizer.state_dict()}
        state["fingerprint"] = run_id
        state_file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(state_file) as tmp:
            torch.save(state, tmp)

    def order(epoch: int) -> Tensor:
        g = torch.Generator().manual_seed(settings.seed * 1_000_003 + epoch)
        return torch.randperm(num_items, generator=g)  # (num_items,)

    stop: list[bool] = []

    def on_sigint(signum: int, frame: object) -> None:
        if stop:
            raise KeyboardInterrupt
        stop.append(True)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    module.train()
    epoch_order = (-1, torch.empty(0, dtype=torch.long))
    bar = tqdm(total=total, initial=step, desc=objective.desc, unit="step", disable=not settings.progress)
    try:
        while step < total:
            epoch, i = divmod(step, steps_per_epoch)
            if epoch_order[0] != epoch:
                epoch_order = (epoch, order(epoch))
            idx = epoch_order[1][i * settings.batch_size : (i + 1) * settings.batch_size]  # (B,)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total, settings.lr)
            figures = step_fn(idx)
            step += 1
            bar.update(1)
            bar.set_postfix({k: f"{v:.3f}" for k, v in figures.items()})
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
        module.eval()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return {"loss": losses.mean, objective.metric: metrics.mean}


def measure_tau(
    target: Transformer,
    make_drafter: Callable[[], Drafter],
    prompts: list[list[int]],
    max_tokens: int,
    eos: list[int],
) -> float:
    """τ (tokens per target forward) of greedy decoding over `prompts`, a fresh drafter each, all
    decoded together on the engine; NaN without prompts."""
    from specdecode.engine.config import EngineConfig
    from specdecode.engine.llm_engine import EngineRequest, LLMEngine
    from specdecode.sampling import SamplingParams

    if not prompts:
        return float("nan")
    engine = LLMEngine(target, EngineConfig(policy=False, prefix_caching=False), eos_token_ids=eos)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seqs = [
        engine.add_request(EngineRequest(str(i), ids, params, None), make_drafter())
        for i, ids in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
    tokens = sum(seq.req.stats.num_generated_tokens for seq in seqs)
    forwards = sum(seq.req.stats.num_target_forwards for seq in seqs)
    return tokens / max(forwards, 1)


def ship(
    prep: Prepared,
    settings: Common,
    report: dict[str, Any],
    trained: nn.Module,
    save: Callable[..., Path],
    load: Callable[[Path, torch.dtype, torch.device], nn.Module],
    drafters: dict[str, Callable[[Any, Transformer], Drafter]],
    since: float | None = None,
) -> int:
    """The end of every run: write `trained` to OUT (`save`, with `report` as its training
    record) and measure τ of real greedy decoding over the held-out prompts for each of
    `drafters` (report key: maker of a drafter from the head and the target) as users run it:
    the head `load`ed back from what was written, in float32, with the float32 target's kernels
    bound, on that target. Then `report` (with the τ, the prompt count and the evaluation's time
    from `since`, default now) is written (`write_report`) and saved with the head again.
    Returns the number of prompts."""
    save(trained, prep.out, target=settings.model, extra={"training": report})
    since = time.perf_counter() if since is None else since
    target = prep.eval_target()
    shipped = load(prep.out, torch.float32, target.device)
    bind_kernels(shipped, target.kernels)
    chosen = prep.eval_prompts(settings)
    eos = prep.tokenizer.eos_token_ids
    for name, make in drafters.items():
        tau = measure_tau(target, lambda make=make: make(shipped, target), chosen, settings.eval_tokens, eos)
        report[name] = round(tau, 3)
    report.update(tau_prompts=len(chosen), eval_s=round(time.perf_counter() - since, 1))
    write_report(prep, report)
    save(trained, prep.out, target=settings.model, extra={"training": report})
    return len(chosen)


@dataclass(frozen=True)
class Ranks:
    """Held-out top-1 and top-5 accuracy per depth (a Medusa head, an EAGLE drafting step),
    rounded for the report, and the static tree fitted to the ranks (`best_tree`)."""

    top1: list[float]  # (D,)
    top5: list[float]  # (D,)
    tree: list[list[int]]


def fit_tree(counts: Tensor, tree_nodes: int) -> Ranks:
    """From (D, MAX_RANK + 1) counts ([d, r]: positions where the right token at depth d+1 is the
    drafter's r-th guess; [d, MAX_RANK]: lower), the accuracies and the best tree of
    `tree_nodes` nodes."""
    totals = counts.sum(1).clamp(min=1)  # (D,)
    rank_probs = (counts[:, :MAX_RANK] / totals[:, None]).tolist()
    return Ranks(
        top1=[round(p[0], 4) for p in rank_probs],
        top5=[round(sum(p[:5]), 4) for p in rank_probs],
        tree=best_tree(rank_probs, tree_nodes),
    )


def run_figures(
    prep: Prepared, settings: Common, figures: dict[str, float], train_s: float
) -> dict[str, Any]:
    """The report entries every method's run has: its final training loss (None if it never
    stepped), its times and the settings that shape the result."""
    loss = figures["loss"]
    return {
        "train_loss": round(loss, 4) if math.isfinite(loss) else None,
        "features_s": round(prep.features_s, 1),
        "train_s": round(train_s, 1),
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("resume", "progress", "out")},
    }


def write_report(prep: Prepared, report: dict[str, Any]) -> None:
    """Add the run's total time to `report` and write it to OUT/report.json."""
    report["total_s"] = round(time.perf_counter() - prep.started, 1)
    (prep.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")


def print_done(prep: Prepared, report: dict[str, Any], train_s: float, what: str) -> None:
    """A run's last lines: where its time went (after `ship`, which measures the total)
    and where `what` (the trained drafter) was written."""
    print(
        f"time: features {prep.features_s:.0f} s, training {train_s:.0f} s, total {report['total_s']:.0f} s"
    )
    print(f"{what} written to {prep.out}")


def depth_weights(depth: int, decay: float = 0.8) -> Tensor:
    """(depth,) loss weights decay^k of the guesses k = 0.. a drafter makes ahead (Medusa's heads,
    ReDrafter's steps): a later guess only counts when the earlier ones were right."""
    return torch.tensor([decay**k for k in range(depth)])


def top1(logits: Tensor, labels: Tensor) -> float:
    """Share of the labelled positions (not IGNORE) whose label is the logits' argmax:
    `logits` (B, V), `labels` (B,)."""
    valid = labels != IGNORE  # (B,)
    hits = int((logits.detach().argmax(-1) == labels)[valid].sum())
    return hits / max(int(valid.sum()), 1)


class RecentMean:
    """Mean of the last `size` values (the loss shown and reported at the end of a run)."""

    def __init__(self, size: int = 50) -> None:
        self.size = size
        self.values: list[float] = []

    def add(self, value: float) -> float:
        self.values = [*self.values[-(self.size - 1) :], value]
        return self.mean

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else float("nan")


# ------------------------------------------------------------------------------------------------
# Command line


def add_args(p: argparse.ArgumentParser, settings: type[Common]) -> None:
    """The flags of `specdecode train METHOD`: those every method takes, then the method's own
    (`settings.flags()`), with the defaults of its `settings` class."""
    d = settings(data="", out="")
    p.add_argument("--model", default=d.model, help="target: short name, .gguf file or HF directory")
    p.add_argument("--data", required=True, help="ShareGPT JSON file (a cut-off file is fine)")
    p.add_argument("--out", required=True, help="output directory: head, config, report, cache/")
    p.add_argument("--max-conversations", type=int, default=d.max_conversations)
    p.add_argument(
        "--skip-conversations", type=int, default=d.skip_conversations,
        help="start after this many conversations of the file (another run took them)",
    )  # fmt: skip
    p.add_argument("--max-len", type=int, default=d.max_len, help="tokens per sample (prompt + answer)")
    p.add_argument(
        "--min-prompt-len", type=int, default=d.min_prompt_len,
        help="leave out samples whose prompt (chat template included) is shorter",
    )  # fmt: skip
    p.add_argument(
        "--prompt-turn", type=int, default=d.prompt_turn,
        help="with --self-distill: answer each conversation's N-th question, its earlier turns as "
        "context (2: second turns, as MT-Bench's; conversations with fewer questions are left out)",
    )  # fmt: skip
    p.add_argument(
        "--max-answer-len", type=int, default=d.max_answer_len,
        help="with --self-distill: answers of at most this many tokens, prompts of up to max-len minus it "
        "(default: prompts of up to max-len / 2, answers filling max-len)",
    )  # fmt: skip
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="positions per step")
    p.add_argument(
        "--self-distill", action="store_true", help="train on the target's own greedy answers to the prompts"
    )
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument(
        "--more-features", action="append", default=[], metavar="DIR",
        help="also train on another run's features (its OUT/cache/train; repeatable)",
    )  # fmt: skip
    p.add_argument("--heldout", type=float, default=d.heldout, help="held-out share (< 1) or count")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32"], help="target and matmuls")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--feature-batch-size", type=int, default=d.feature_batch_size)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help="held-out prompts for τ")
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens, help="tokens per τ prompt")
    for name, flag in settings.flags().items():
        default = getattr(d, name)
        kind = str if default is None else type(default)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=flag.help)


def settings_from_args(cls: type[Settings], args: argparse.Namespace) -> Settings:
    """A method's settings from its parsed flags (the common ones checked; every field of `cls`
    with a flag of the same name), after applying --threads."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    require_positive(args, "max_conversations", "max_len", "epochs", "batch_size", "save_every")
    if args.skip_conversations < 0:
        raise SpecDecodeError(f"--skip-conversations must be >= 0, got {args.skip_conversations}")
    for name, flag in cls.flags().items():
        value = getattr(args, name)
        if value is None or isinstance(value, str):
            continue
        if (flag.least is not None and value < flag.least) or (flag.most is not None and value > flag.most):
            bounds = f">= {flag.least:g}" if flag.most is None else f"in [{flag.least:g}, {flag.most:g}]"
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be {bounds}, got {value}")
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    if "more_features" in values:
        values["more_features"] = tuple(values["more_features"])
    return cls(**values)


def run_method(module: ModuleType, args: argparse.Namespace) -> None:
    """`specdecode train METHOD`: the method `module`'s `train` under the settings of its flags."""
    module.train(settings_from_args(module.TrainSettings, args))
