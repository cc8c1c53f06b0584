"""How far copy drafts (prompt lookup) can go on a Spec-Bench category: bounds on τ.

    python scripts/lookup_bound.py --model smollm2-135m --category summarization --questions 8

For each question (first turn), the target's plain greedy answer is decoded once; then, replaying
that answer, every step may verify copies of the text that followed earlier occurrences of the
last n tokens (prompt and answer so far), up to `k` tokens each, and accepts the longest prefix
any of them shares with the answer, plus the target's own token. "up to m" keeps the m nearest
distinct copies (a lookup tree of m branches), "all" every one of them. This is an oracle: the
best of the copies is taken for free, so no copy drafter with those candidates reaches a higher
τ, and a speculative step never costs less than a plain one, so speedup <= τ. The real prompt
lookup's τ (one candidate, longest n first) is printed alongside.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode import LLM, SamplingParams


def copies(context: list[int], n: int, k: int, limit: int | None) -> list[list[int]]:
    """The distinct k-token continuations of earlier occurrences of context's last n tokens,
    nearest first, at most `limit` (None: all)."""
    suffix = context[-n:]
    found: list[list[int]] = []
    for j in range(len(context) - 1, n - 1, -1):
        if context[j - n : j] == suffix:
            cont = context[j : j + k]
            if cont not in found:
                found.append(cont)
                if limit is not None and len(found) == limit:
                    break
    return found


def oracle_tau(prompt: list[int], answer: list[int], n: int, k: int, limit: int | None) -> tuple[int, int]:
    """(tokens, steps) of replaying `answer` with the best of the copies at every step."""
    i = steps = 0
    while i < len(answer):
        best = 0
        for cont in copies(prompt + answer[:i], n, k, limit):
            run = 0
            while run < len(cont) and i + run < len(answer) and cont[run] == answer[i + run]:
                run += 1
            best = max(best, run)
        i += best + 1  # the accepted copy and the target's own next token
        steps += 1
    return len(answer), steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    default_file = Path(__file__).parents[2] / "shared/data/spec_bench/question.jsonl"
    p.add_argument("--questions-file", default=str(default_file))
    p.add_argument("--category", default="summarization")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()

    rows = [json.loads(line) for line in Path(args.questions_file).read_text().splitlines() if line.strip()]
    chosen = [q for q in rows if q["category"] == args.category][: args.questions]
    llm = LLM(args.model, progress=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    settings = [(n, k, m) for n in (1, 2) for k in (4, 8) for m in (1, 3, None)]
    totals = {s: [0, 0] for s in settings}
    lookup = [0, 0]
    for q in chosen:
        prompt = llm.chat_prompt([{"role": "user", "content": q["turns"][0]}])
        answer = list(llm.generate([prompt], params, speculative=None)[0].token_ids)
        real = llm.generate([prompt], params, speculative={"method": "prompt_lookup"})[0]
        if list(real.token_ids) != answer:
            raise SystemExit(f"question {q['question_id']}: prompt lookup changed the output")
        lookup[0] += len(answer)
        lookup[1] += real.stats.num_target_forwards
        for s in settings:
            tokens, steps = oracle_tau(list(prompt), answer, *s)
            totals[s][0] += tokens
            totals[s][1] += steps
    print(f"{len(chosen)} {args.category} questions, {lookup[0]} answer tokens")
    print(f"prompt lookup (k=4, n=2, one candidate): tau {lookup[0] / lookup[1]:.3f}")
    for (n, k, m), (tokens, steps) in totals.items():
        which = "all" if m is None else f"up to {m}"
        print(f"oracle: last {n} token(s), copies of {k}, {which}: tau {tokens / steps:.3f}")


if __name__ == "__main__":
    main()
