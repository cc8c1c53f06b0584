"""The speculation load policy: how many draft tokens each running request may verify this step.

Verifying a draft token is never free: it widens the one target forward every request shares.
Alone on a CPU, 1 token costs about as much as 4 (the weights are read once either way), so a
draft that is accepted half the time pays; with 64 requests in the batch the forward is already
wide and every extra row costs nearly its full share, so the same draft loses throughput.

The policy maximises the batch's expected tokens per second under two measured models:

- cost: `step_seconds(T) = latency(T) + overhead + sum of drafting costs`, with `latency` the
  target's forward-latency curve over T tokens (measured on this model and machine when the
  engine starts), `overhead` a running average of what a step costs beyond it (scheduling,
  per-request Python, cache gathers; one average for plain steps and one for steps that verify
  drafts, whose trees, masks, walks and cache compaction cost more, kept for each T: see
  `SpeculationPolicy.overhead_at`), and each request's drafting
  cost per draft token (a running average of its drafter's `propose` time: nearly zero for prompt
  lookup, a draft model's forwards for draft_model; before it has one, its method's: the lower
  median of the method's last COST_SAMPLES proposals, which one slow proposal does not move),
  kept apart for each way a drafter drafts (`Drafter.source`: a trained head's lookup branch
  copies from the text for next to nothing, where the head's chain costs a head forward a token;
  a copy's ways are its match lengths, the surer the longer) and taken for the way this step's
  proposal will take. The acceptance counts below are kept per way too.
- gain: a request's d-th draft token adds `p_d` expected tokens, the chance that its draft's
  first d tokens are accepted: a product of per-depth conditional rates (the request's own
  counts, shrunk towards its method's engine-wide rates, which start from an optimistic 0.8),
  each taken at an upper confidence bound (`accept_rates`). A method the policy never let draft
  could never show what it is worth, so it starts out drafting, a few unlucky drafts do not stop
  it while its counts are few, and the counts decide. p_d never increases with d. A tree
  drafter is weighed as its chain (`Drafter.max_chain`): granted fewer tokens than its tree
  holds, it drafts its top path, so its d-th token is at depth d, as p_d assumes.

Every request emits one token per step whatever its draft, so with draft budgets k_i the
expected tokens are `n + sum_i sum_{d<k_i} p_{i,d}`. Gains fall with depth, so the best
allocation of X extra rows takes the X largest gains over all requests; the policy scores every
X from 0 up and keeps the best. One request alone gets the draft the curve pays for, a wide batch
gets drafts only for its requests whose drafts are nearly always accepted, and when nothing pays
every request takes a plain step (its drafter is not even asked). A request kept plain for
PROBE_STEPS steps drafts one token all the same (the engine's probe): its cost and acceptance are
measured anew, so estimates gone wrong (one `propose` slowed by a pause read as what every draft
costs kept a method plain for a whole benchmark run) cannot stop it for good.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from specdecode.models.latency import forward_seconds
from specdecode.models.transformer import Transformer

PRIOR_STRENGTH = 4.0  # pseudo-steps a request's own acceptance counts are shrunk with
METHOD_PRIOR = 8.0  # pseudo-steps of the prior a method's engine-wide counts are shrunk with
PRIOR_RATE = 0.8  # acceptance rate of draft position 1 assumed before any count (optimistic)
EMA = 0.1  # weight of the newest sample in the running averages
EXPLORE = 1.0  # standard errors of optimism in the acceptance estimates (`accept_rates`)
FORGET = 0.9  # per step without drafting, how much of a request's own acceptance counts remain
PROBE_STEPS = 32  # steps a request is kept plain before it drafts one token to measure anew
COST_SAMPLES = 9  # proposals a method's drafting cost is the lower median of
WIDE_STEP = 17  # drafting steps of this many rows or more share one overhead average

# (widths, context, repeats) -> each width's timed seconds, as `models.latency.forward_seconds`
Timer = Callable[[list[int], int, int], dict[int, list[float]]]


class LatencyCurve:
    """Seconds of one target forward over T new tokens, interpolated between measured points
    (and extended linearly past the last one)."""

    def __init__(self, points: tuple[tuple[int, float], ...]) -> None:
        self.tokens = [t for t, _ in points]
        self.seconds = [s for _, s in points]

    def __call__(self, tokens: int) -> float:
        ts, ss = self.tokens, self.seconds
        if len(ts) == 1 or tokens <= ts[0]:
            return ss[0] * max(tokens, 1) / ts[0] if tokens > ts[0] else ss[0]
        i = min(bisect.bisect_left(ts, tokens), len(ts) - 1)
        t0, t1, s0, s1 = ts[i - 1], ts[i], ss[i - 1], ss[i]
        return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)

    @classmethod
    @torch.inference_mode()
    def measure(
        cls, model: Transformer, max_tokens: int, context: int = 64, timer: Timer | None = None
    ) -> LatencyCurve:
        """Time forwards of 1, 2, 4, ... `max_tokens` new tokens after a `context`-token prefix
        (best of two after a warm-up each): a few seconds on a CPU for a small model. `timer`
        times them as the engine runs them (`LLMEngine.forward_seconds`: on a GPU its graphs);
        by default the model's forward, as `models.latency.forward_seconds`."""
        # A model with a short context cannot hold `max_tokens` rows after a prefix: measure
        # what fits (the curve is extended linearly past its last point).
        max_tokens = max(1, min(max_tokens, model.config.max_position_embeddings // 2))
        sizes = sorted({min(2**i, max_tokens) for i in range(max_tokens.bit_length() + 1)})
        context = max(1, min(context, model.config.max_position_embeddings - max_tokens))
        seconds = (timer or partial(forward_seconds, model))(sizes, context, 2)
        points = [(t, min(seconds[t])) for t in sizes]
        # A forward over more rows never takes less time: a point above a later one was slowed
        # by something else on the machine, so each keeps the least of itself and those after it.
        for i in range(len(points) - 2, -1, -1):
            points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
        return cls(tuple(points))


@dataclass
class Candidate:
    """One decoding request as the policy sees it."""

    max_draft: int  # the most draft tokens its drafter may propose (tree nodes + side tokens)
    accept_rates: list[float]  # estimated p_d for d = 0 .. max_draft-1 (non-increasing)
    draft_cost: float  # seconds of drafting per draft token


class SpeculationPolicy:
    """Chooses per-request draft budgets from the latency curve and acceptance estimates.

    `curve` may be a function that measures it: it is then called when a budget is first asked
    for, so an engine that never speculates never spends the measurement's second or so."""

    def __init__(self, curve: LatencyCurve | Callable[[], LatencyCurve]) -> None:
        self._curve = curve
        self.overhead = 0.0  # seconds per plain step beyond the forward (running average)
        self.draft_overheads: dict[int, float] = {}  # the same for drafting steps, by their rows
        # (up to WIDE_STEP: a lone request's widths each get their own; a batch's share one)

    def overhead_at(self, rows: int) -> float:
        """What a drafting step of `rows` rows costs beyond its forward and drafts: the running
        average of the steps that wide, or, before one was seen, a plain step's (optimistic: the
        width is tried, then judged by what it cost).

        One average for every width had two steady states for the Qwen 0.5B drafting for the
        1.5B: the measured curve overstates a wide forward's cost against a narrow one's (beyond
        it, 1.9 ms at 2 rows, 0.1 at 4), so a policy that had granted one token a step charged
        that step's overhead to 3 tokens too, and kept granting one (decoding alone 1.22-1.24x
        plain in 3 runs of 10, against 1.39-1.46x granting 3)."""
        return self.draft_overheads.get(min(rows, WIDE_STEP), self.overhead)

    @property
    def measured(self) -> bool:
        return isinstance(self._curve, LatencyCurve)

    @property
    def curve(self) -> LatencyCurve:
        if not isinstance(self._curve, LatencyCurve):
            self._curve = self._curve()
        return self._curve

    def budgets(self, candidates: list[Candidate], base_tokens: int, max_tokens: int) -> list[int]:
        """Draft tokens for each candidate, given `base_tokens` rows the forward carries anyway
        (every candidate's root and any prefill chunk) and at most `max_tokens` rows in all."""
        gains = sorted(
            (
                (p, d, i)
                for i, c in enumerate(candidates)
                for d, p in enumerate(c.accept_rates[: c.max_draft])
            ),
            key=lambda x: (-x[0], x[1]),
        )
        gains = gains[: max(0, max_tokens - base_tokens)]
        tokens = float(len(candidates))
        best_x, best_rate = 0, tokens / (self.curve(base_tokens) + self.overhead)
        draft_seconds = 0.0
        for x, (p, _, i) in enumerate(gains, start=1):
            tokens += p
            draft_seconds += candidates[i].draft_cost
            rate = tokens / (self.curve(base_tokens + x) + self.overhead_at(base_tokens + x) + draft_seconds)
            if rate > best_rate:
                best_x, best_rate = x, rate
        out = [0] * len(candidates)
        for _, _, i in gains[:best_x]:
            out[i] += 1
        return out

    def observe_step(self, seconds: float, tokens: int, draft_seconds: float, drafted: bool) -> None:
        """Update the overhead estimate of plain steps, or of steps that verified drafts
        (`drafted`), from one that took `seconds` over `tokens` rows (nothing before the curve is
        measured: no budget was asked for yet)."""
        if not self.measured:
            return
        extra = max(0.0, seconds - self.curve(tokens) - draft_seconds)
        if drafted:
            before = self.overhead_at(tokens)
            self.draft_overheads[min(tokens, WIDE_STEP)] = before + EMA * (extra - before)
        else:
            self.overhead += EMA * (extra - self.overhead)
            # Unmeasured while nothing drafts: drift back to the plain steps' figure, so that one
            # slow drafting step (a pause) cannot keep every request from drafting for good.
            for rows, value in self.draft_overheads.items():
                self.draft_overheads[rows] = value + EMA * (self.overhead - value)


def accept_rates(
    own_reached: list[int],
    own_accepted: list[int],
    method_reached: list[int],
    method_accepted: list[int],
    depth: int,
    weight: float = 1.0,
) -> list[float]:
    """Optimistic acceptance rates p_d of draft positions 0..depth-1 for one request (the chance
    that its draft's first d+1 tokens are accepted), non-increasing by construction.

    p_d is a product of conditional rates: how often depth d was accepted when every depth before
    it was (`accepted[d] / reached[d]`). Each is the request's own counts, worth `weight` each,
    shrunk towards its method's engine-wide rate (itself from a prior worth METHOD_PRIOR steps:
    0.8 at depth 1, deeper the rate of the depth before it, so a depth the method never reached
    continues the one before; two failed steps of a warm-up prompt do not decide a method), plus
    EXPLORE standard errors, the evidence being the request's counts, the prior's and the
    method's (an upper confidence bound).

    Why the bound and the conditional rates: with plain means of unconditional rates, a method
    whose first drafts were unlucky never drafted again, so its counts never changed; and a
    depth offered once in a step that failed at depth 1 read as a depth that fails, so it was
    never granted again (the Qwen 0.5B draft then verified 1-2 tokens a step where 4 pay). Now a
    method with few counts drafts again, one with many is judged by them, and only what happens
    at a depth counts against it.

    The engine lowers `weight` (FORGET per step) while the policy keeps a request from drafting:
    its counts then say nothing new, and a text that turns repetitive later (where prompt lookup
    starts to pay) would never be noticed. As they fade, the estimate returns to the method's
    rate, and a request whose drafts pay at that rate drafts again and measures anew."""
    out: list[float] = []
    p, rate = 1.0, PRIOR_RATE
    for d in range(depth):
        m_n = method_reached[d] if d < len(method_reached) else 0
        m_a = method_accepted[d] if d < len(method_accepted) else 0
        prior = (m_a + METHOD_PRIOR * rate) / (m_n + METHOD_PRIOR)
        n = weight * (own_reached[d] if d < len(own_reached) else 0)
        a = weight * (own_accepted[d] if d < len(own_accepted) else 0)
        rate = (a + PRIOR_STRENGTH * prior) / (n + PRIOR_STRENGTH)
        bound = rate + EXPLORE * math.sqrt(rate * (1.0 - rate) / (n + PRIOR_STRENGTH + m_n))
        p *= min(1.0, bound)
        out.append(p)
    return out
