"""Greedy output on real pretrained models equals Hugging Face transformers' on the same weights.

transformers loads the original GGUF file itself (its own dequantization and name mapping), so
this also checks our conversion. 8 varied prompts, 128 tokens, float32, and with the weights
run as stored (quantized blocks, float32 sums).
"""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.models.registry import gguf_path

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue to a ten-year-old.",
    "Translate into German: The weather is nice today and we are going to the park.",
    "Summarize: The Industrial Revolution began in Britain in the late 18th century and spread to "
    "Europe and North America, transforming economies from agrarian to industrial.",
    "List three tips for writing clean code.",
    "If a train travels 60 km in 45 minutes, what is its average speed in km/h? Think step by step.",
    "Tell me a short story about a robot who learns to paint.",
]


@pytest.mark.real
@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the GGUF's weights as stored
@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow)])
def test_greedy_equals_transformers(name: str, dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(model=name, dtype=dtype, device="cpu", progress=False)
    gguf = gguf_path(name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    eos = llm.tokenizer.eos_token_ids
    params = SamplingParams(max_tokens=128, temperature=0.0)
    mismatches = []
    for prompt in PROMPTS:
        ids = llm.chat_prompt([{"role": "user", "content": prompt}])
        ours = llm.generate([ids], params)[0].token_ids
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=128, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
        )[0, len(ids) :].tolist()
        ends = [i for i, t in enumerate(ref) if t in eos]
        ref = ref[: ends[0] + 1] if ends else ref
        if ours != ref:
            mismatches.append((prompt, ours, ref))
    assert not mismatches, f"{len(mismatches)} of {len(PROMPTS)} prompts differ; first: {mismatches[0]}"
