"""The engine's counters in the Prometheus text exposition format (`GET /metrics`).

Counters end in `_total` and only grow; gauges (queue length, running batch, KV blocks in use)
go up and down. Speculation figures carry a `method` label, and per-position acceptance a
`position` label (1 = the first draft token after the last decided one):

    specdecode_draft_tokens_accepted_total{method="prompt_lookup"} 412
    specdecode_draft_accepted_by_position_total{method="prompt_lookup",position="1"} 180
"""

from __future__ import annotations

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


def _histogram(name: str, help_text: str, h: Histogram) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for bound, n in zip(h.bounds, h.counts, strict=True):
        lines.append(f'{name}_bucket{{le="{bound:g}"}} {n}')
    lines += [f'{name}_bucket{{le="+Inf"}} {h.count}', f"{name}_sum {h.total:g}", f"{name}_count {h.count}"]
    return lines


def render(stats: EngineStats) -> str:
    """Every metric of `stats`, one family after another."""
    families = [
        ("requests_total", "counter", "Requests accepted by the engine.", stats.num_requests),
        (
            "requests_finished_total",
            "counter",
            "Requests that finished (stop or length).",
            stats.num_finished,
        ),
        (
            "requests_aborted_total",
            "counter",
            "Requests aborted (client gone, stop string).",
            stats.num_aborted,
        ),
        (
            "preemptions_total",
            "counter",
            "Running requests preempted for lack of KV blocks.",
            stats.num_preemptions,
        ),
        ("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", stats.num_prompt_tokens),
        ("generation_tokens_total", "counter", "Tokens generated.", stats.num_generated_tokens),
        ("num_requests_waiting", "gauge", "Requests queued for admission.", stats.num_waiting),
        ("num_requests_running", "gauge", "Requests in the running batch.", stats.num_running),
        ("kv_blocks_total", "gauge", "KV cache blocks of the target model.", stats.kv_blocks_total),
        ("kv_blocks_used", "gauge", "KV cache blocks held by requests.", stats.kv_blocks_used),
        ("draft_kv_blocks_total", "gauge", "KV cache blocks of draft models.", stats.draft_kv_blocks_total),
        (
            "draft_kv_blocks_used",
            "gauge",
            "Draft models' KV blocks held by requests.",
            stats.draft_kv_blocks_used,
        ),
        (
            "kv_blocks_reused_total",
            "counter",
            "KV blocks found by prefix and reused instead of computed.",
            stats.kv_blocks_reused,
        ),
    ]
    lines: list[str] = []
    for name, kind, help_text, value in families:
        lines += _family(f"specdecode_{name}", kind, help_text, [({}, value)])
    lines += _family(
        "specdecode_draft_tokens_proposed_total",
        "counter",
        "Draft tokens verified, per method.",
        _by_method(stats.drafts_proposed),
    )
    lines += _family(
        "specdecode_draft_tokens_accepted_total",
        "counter",
        "Draft tokens accepted, per method.",
        _by_method(stats.drafts_accepted),
    )
    lines += _family(
        "specdecode_draft_proposed_by_position_total",
        "counter",
        "Steps that offered a draft token at this depth, per method.",
        _by_position(stats.proposed_by_position),
    )
    lines += _family(
        "specdecode_draft_accepted_by_position_total",
        "counter",
        "Steps that accepted a draft token at this depth, per method.",
        _by_position(stats.accepted_by_position),
    )
    lines += _histogram(
        "specdecode_time_to_first_token_seconds",
        "Seconds from a request's arrival to its first token.",
        stats.time_to_first_token,
    )
    lines += _histogram(
        "specdecode_time_per_output_token_seconds",
        "Seconds per output token after the first, per finished request.",
        stats.time_per_output_token,
    )
    return "\n".join(lines) + "\n"
