"""Batch generation over a Ray Data dataset, in the spirit of `ray.data.llm`: each worker holds
one `LLM` and runs `LLM.generate` (the batched engine) on the batches it is given.

    import ray
    from specdecode import SamplingParams
    from specdecode.distributed.data import generate_dataset

    ds = ray.data.from_items([{"prompt": q} for q in questions])
    out = generate_dataset(ds, "smollm2-135m", SamplingParams(max_tokens=128, temperature=0),
                           speculative={"method": "prompt_lookup"}, num_workers=2)
    for row in out.iter_rows(): print(row["generated_text"])

Each output row is its input row plus `generated_text`, `num_generated_tokens`,
`mean_accepted_length` (τ) and `decode_tokens_per_s`. Rows come back as the workers finish their
batches, as with any Ray Data transform: carry an id column to match them to their inputs (or set
`ray.data.DataContext.get_current().execution_options.preserve_order = True`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray.data

from specdecode.llm import LLM, Speculative
from specdecode.models.loader import resolve_model
from specdecode.sampling import SamplingParams
from specdecode.spec_config import parse_speculative


class _Generator:
    """A Ray Data worker: one model, `LLM.generate` over each batch's prompts."""

    def __init__(
        self,
        model: str,
        params: SamplingParams,
        speculative: Speculative,
        prompt_column: str,
        llm_args: dict[str, Any],
    ) -> None:
        self.llm = LLM(model=model, speculative=speculative, progress=False, **llm_args)
        self.params = params
        self.prompt_column = prompt_column

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in batch[self.prompt_column]]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        return {
            **batch,
            "generated_text": [o.text for o in outputs],
            "num_generated_tokens": [len(o.token_ids) for o in outputs],
            "mean_accepted_length": [o.stats.mean_accepted_length for o in outputs],
            "decode_tokens_per_s": [o.timing.decode_tokens_per_s for o in outputs],
        }


def generate_dataset(
    ds: ray.data.Dataset,
    model: str,
    params: SamplingParams | None = None,
    speculative: Speculative = None,
    *,
    num_workers: int = 1,
    threads_per_worker: int = 1,
    batch_size: int = 64,
    prompt_column: str = "prompt",
    **llm_args: Any,
) -> ray.data.Dataset:
    """`ds` with each row's generation added, computed by `num_workers` workers of
    `threads_per_worker` CPUs, `batch_size` prompts per `LLM.generate` call. `llm_args` go to
    `LLM` (dtype, device, max_num_seqs, ...)."""
    parse_speculative(speculative)  # bad settings fail here, not in every worker
    resolve_model(model)  # fetch or convert once, before the workers start
    if prompt_column not in ds.columns():
        raise ValueError(f"the dataset has no {prompt_column!r} column (it has {ds.columns()})")
    return ds.map_batches(
        _Generator,
        fn_constructor_kwargs={
            "model": model,
            "params": params or SamplingParams(),
            "speculative": speculative,
            "prompt_column": prompt_column,
            "llm_args": {"num_threads": threads_per_worker, **llm_args},
        },
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=num_workers),
        num_cpus=threads_per_worker,
    )
