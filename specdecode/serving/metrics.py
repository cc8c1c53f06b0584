"""The engine's counters in the Prometheus text exposition format (`GET /metrics`).

Counters end in `_total` and only grow; gauges (queue length, running batch, KV blocks in use)
go up and down. Speculation figures carry a `method` label, and per-position acceptance a
`position` label (1 = the first draft token after the last decided one):

    specdecode_draft_tokens_accepted_total{method="prompt_lookup"} 412
    specdecode_draft_accepted_by_position_total{method="prompt_lookup",position="1"} 180

Several engines (Ray Serve replicas) are rendered together, each sample labelled by its
`replica`; a lone engine's samples carry no replica label.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from specdecode.engine.llm_engine import EngineStats, Histogram

Sample = tuple[dict[str, str], float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, kind: str, help_text: str, samples: list[Sample]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {value:g}" if labels else f"{name} {value:g}")
    return lines


def _by_method(counts: dict[str, int]) -> list[Sample]:
    return [({"method": method}, n) for method, n in sorted(counts.items())]


def _by_position(counts: dict[str, list[int]]) -> list[Sample]:
    return [
        ({"method": method, "position": str(k + 1)}, n)
        for method, per_position in sorted(counts.items())
        for k, n in enumerate(per_position)
    ]


def _histogram(name: str, help_text: str, by_replica: list[tuple[dict[str, str], Histogram]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]

    def sample(suffix: str, labels: dict[str, str], value: float) -> str:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        return f"{name}{suffix}{{{text}}} {value:g}" if text else f"{name}{suffix} {value:g}"

    for labels, h in by_replica:
        for bound, n in zip(h.bounds, h.counts, strict=True):
            lines.append(sample("_bucket", {**labels, "le": f"{bound:g}"}, n))
        lines += [
            sample("_bucket", {**labels, "le": "+Inf"}, h.count),
            sample("_sum", labels, h.total),
            sample("_count", labels, h.count),
        ]
    return lines


def render(stats: EngineStats | Mapping[str, EngineStats]) -> str:
    """Every metric of `stats`, one family after another: one engine's, or several engines' by
    replica name (a sample of replica "" has no replica label)."""
    engines = {"": stats} if isinstance(stats, EngineStats) else dict(sorted(stats.items()))
    replicas = [({"replica": name} if name else {}, s) for name, s in engines.items()]

    def each(samples_of: Callable[[EngineStats], list[Sample]]) -> list[Sample]:
        return [({**labels, **own}, v) for labels, s in replicas for own, v in samples_of(s)]

    families = [  # (name, kind, help, EngineStats field)
        ("requests_total", "counter", "Requests accepted by the engine.", "num_requests"),
        ("requests_finished_total", "counter", "Requests that finished (stop or length).", "num_finished"),
        ("requests_aborted_total", "counter", "Requests aborted (client gone, stop string).", "num_aborted"),
        (
            "preemptions_total",
            "counter",
            "Running requests preempted for lack of KV blocks.",
            "num_preemptions",
        ),
        ("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", "num_prompt_tokens"),
        ("generation_tokens_total", "counter", "Tokens generated.", "num_generated_tokens"),
        ("num_requests_waiting", "gauge", "Requests queued for admission.", "num_waiting"),
        ("num_requests_running", "gauge", "Requests in the running batch.", "num_running"),
        ("kv_blocks_total", "gauge", "KV cache blocks of the target model.", "kv_blocks_total"),
        ("kv_blocks_used", "gauge", "KV cache blocks held by requests.", "kv_blocks_used"),
        ("draft_kv_blocks_total", "gauge", "KV cache blocks of draft models.", "draft_kv_blocks_total"),
        (
            "draft_kv_blocks_used",
            "gauge",
            "Draft models' KV blocks held by requests.",
            "draft_kv_blocks_used",
        ),
        (
            "kv_blocks_reused_total",
            "counter",
            "KV blocks found by prefix and reused instead of computed.",
            "kv_blocks_reused",
        ),
    ]
    lines: list[str] = []
    for name, kind, help_text, attr in families:
        lines += _family(f"specdecode_{name}", kind, help_text, each(lambda s, a=attr: [({}, getattr(s, a))]))
    speculation = [  # (name, help, samples of one engine's figures by method / position)
        (
            "draft_tokens_proposed_total",
            "Draft tokens verified, per method.",
            lambda s: _by_method(s.drafts_proposed),
        ),
        (
            "draft_tokens_accepted_total",
            "Draft tokens accepted, per method.",
            lambda s: _by_method(s.drafts_accepted),
        ),
        (
            "draft_proposed_by_position_total",
            "Steps that offered a draft token at this depth, per method.",
            lambda s: _by_position(s.proposed_by_position),
        ),
        (
            "draft_accepted_by_position_total",
            "Steps that accepted a draft token at this depth, per method.",
            lambda s: _by_position(s.accepted_by_position),
        ),
    ]
    for name, help_text, samples_of in speculation:
        lines += _family(f"specdecode_{name}", "counter", help_text, each(samples_of))
    histograms = [
        (
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
            "time_to_first_token",
        ),
        (
            "time_per_output_token_seconds",
            "Seconds per output token after the first, per finished request.",
            "time_per_output_token",
        ),
    ]
    for name, help_text, attr in histograms:
        lines += _histogram(
            f"specdecode_{name}", help_text, [(labels, getattr(s, attr)) for labels, s in replicas]
        )
    return "\n".join(lines) + "\n"
