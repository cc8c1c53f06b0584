"""Where a decoding step's time goes: one request's plain greedy decoding under torch.profiler,
the device's kernels (or, on a CPU, the ops) by total time, with their counts per step.

    python scripts/gpu_profile.py --model smollm2-135m --device cuda --tokens 64

Run by `scripts/gpu_check.sh bench`; on a CPU it profiles the ops instead (a check that it runs).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from specdecode import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=25, help="kernels listed")
    args = ap.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, progress=False)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], params)  # first launches, graphs, workspaces
    on_gpu = llm.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        out = llm.generate([PROMPT], params)[0]
        if on_gpu:
            torch.cuda.synchronize()
    steps = len(out.token_ids)
    key = "device_time_total" if on_gpu else "cpu_time_total"
    events = prof.key_averages()
    kernels = [e for e in events if (e.device_type.name == "CUDA") == on_gpu and getattr(e, key) > 0]
    kernels.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in kernels)
    what = "kernels" if on_gpu else "ops"
    print(f"{llm.model.kernels.name} on {args.device}, {args.dtype}: {steps} tokens, ", end="")
    print(f"{total / 1e3:.1f} ms of {what} ({total / 1e3 / steps:.3f} ms a token)")
    print(f"{'kernel' if on_gpu else 'op':<72} {'ms':>8} {'share':>6} {'per token':>9}")
    for e in kernels[: args.rows]:
        t = getattr(e, key)
        print(f"{e.key[:72]:<72} {t / 1e3:8.2f} {t / total:6.1%} {e.count / steps:9.1f}")
    launches = sum(e.count for e in kernels)
    print(f"all: {len(kernels)} distinct, {launches / steps:.0f} launches a token")


if __name__ == "__main__":
    main()
