"""Losslessness on real models across Spec-Bench (slow: minutes; run with `-m slow`).

Every method's greedy output equals plain greedy decoding token for token on SmolLM2-135M in
float32, 128 tokens, two questions (both turns of MT-Bench ones) from every Spec-Bench category;
and the draft-target pair Qwen2.5-Coder 0.5B -> 1.5B on coding prompts. The Spec-Bench runner
(`specdecode bench`) does the comparing: plain decoding first, then each method on the same
conversation, and it counts every output that differs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import specdecode
from specdecode import LLM
from specdecode.bench.specbench import DEFAULT_QUESTIONS, category_of, load_questions, run
from specdecode.spec_config import parse_speculative

pytestmark = pytest.mark.slow

SMOLLM_METHODS = [
    {"method": "prompt_lookup"},
    {
        "method": "prompt_lookup",
        "prompt_lookup_num_tokens": 8,
        "max_matching_ngram_size": 3,
        "num_candidates": 3,
    },
    {"method": "lookahead"},
    {"method": "medusa"},
    {"method": "eagle"},
    {"method": "eagle2"},
    {"method": "redrafter"},
    # SmolLM2 has no smaller sibling here: itself as the draft still runs the draft-model loop
    {"method": "draft_model", "draft_model": "smollm2-135m", "num_draft_tokens": 4},
]


HEADS = Path(specdecode.__file__).parent / "heads" / "smollm2-135m"
TRAINED = {"medusa": "medusa", "eagle": "eagle", "eagle2": "eagle", "redrafter": "redrafter"}


def _available(spec: dict) -> bool:
    """Trained methods run where their heads for SmolLM2 are shipped in this checkout."""
    method = spec["method"]
    return method not in TRAINED or (HEADS / TRAINED[method]).is_dir()


def test_every_method_is_lossless_on_smollm2_across_specbench() -> None:
    # The load policy off: every step verifies the method's whole draft (with it on, a method
    # whose drafts do not pay here would take plain steps, and its verifier would go untested).
    llm = LLM(model="smollm2-135m", dtype="float32", speculation_policy=False)
    questions = load_questions(DEFAULT_QUESTIONS, per_category=2, categories=None)
    assert len({category_of(q) for q in questions}) >= 6  # every Spec-Bench category is present
    specs = [parse_speculative(s) for s in SMOLLM_METHODS if _available(s)]
    methods = run(llm, [None, *specs], questions, max_tokens=128, temperature=0.0, peer=False, progress=False)
    for m in methods[1:]:
        total = m.total()
        assert total.outputs == methods[0].total().outputs
        assert total.mismatches == 0, (m.label, {c: t.mismatches for c, t in m.tallies.items()})
        assert total.tau > 1.0, m.label  # drafts were accepted: the verifier really ran on them


def test_qwen_coder_draft_target_is_lossless_on_coding_prompts() -> None:
    llm = LLM(model="qwen2.5-coder-1.5b", dtype="float32", speculation_policy=False)
    questions = [
        {"category": "coding", "turns": [turn]}
        for turn in (
            "Write a Python function that returns the n-th Fibonacci number iteratively.",
            "Implement binary search over a sorted list in Python, with a docstring.",
            "Write a JavaScript function that debounces another function.",
        )
    ]
    spec = parse_speculative(
        {"method": "draft_model", "draft_model": "qwen2.5-coder-0.5b", "num_draft_tokens": 4}
    )
    _, dm = run(llm, [None, spec], questions, max_tokens=128, temperature=0.0, peer=False, progress=False)
    assert dm.total().mismatches == 0
    assert dm.total().tau > 1.5
