"""The GPU path: every method, the engine's captured CUDA graphs and lossless sampling on CUDA, in
float32, bfloat16 and float16 (skipped where no CUDA GPU is present: CI has none)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import save_head as save_eagle
from specdecode.drafters.medusa import save_heads as save_medusa
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.redrafter import save_head as save_redrafter
from specdecode.models.transformer import Transformer
from specdecode.spec_config import PromptLookupConfig
from specdecode.verify import verify_sampling
from tests.test_draft_model import SMALL_V, config, sampled_check, small  # noqa: F401 (a fixture)
from tests.test_eagle import random_head as random_eagle
from tests.test_graphs import row_alone_and_among_others
from tests.test_medusa import random_heads as random_medusa
from tests.test_redrafter import random_head as random_redrafter
from tests.test_speculative_api import PROMPTS, methods, tiny_paths  # noqa: F401 (a fixture)
from tests.test_verify import CASES, check_lossless, looks_lossless

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def on_cuda(model: Transformer) -> Transformer:
    """A copy of a CPU model on the GPU, computing through the kernels chosen there."""
    moved = copy.deepcopy(model).to("cuda")
    moved.bind_kernels()
    return moved


def head_methods(llm: LLM, root: Path) -> list[dict]:
    """Medusa, ReDrafter and EAGLE with random heads for `llm`'s target, saved under `root`."""
    save_medusa(random_medusa(llm.model), root / "medusa", target="tiny", dtype=torch.float32)
    save_redrafter(random_redrafter(llm.model), root / "redrafter", target="tiny", dtype=torch.float32)
    save_eagle(random_eagle(llm.model), root / "eagle", target="tiny", dtype=torch.float32)
    return [
        {"method": "medusa", "heads": str(root / "medusa")},
        {"method": "redrafter", "head": str(root / "redrafter"), "beam_width": 3},
        {"method": "eagle", "head": str(root / "eagle")},
        {"method": "eagle2", "head": str(root / "eagle")},
    ]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_method_reproduces_plain_greedy_on_cuda(
    tiny_paths,  # noqa: F811 (the fixture)
    tmp_path: Path,
    dtype: str,
    graphs: bool,
) -> None:
    llm = LLM(model=str(tiny_paths[0]), device="cuda", dtype=dtype, progress=False)
    if not graphs:
        llm.engine = llm.new_engine(dataclasses.replace(llm.engine.config, cuda_graphs=False))
    assert llm.model.device.type == "cuda" and llm.model.dtype == getattr(torch, dtype)
    assert (llm.engine.graphs is not None) == graphs
    plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, speculative=None)]
    for spec in methods(tiny_paths[1]) + head_methods(llm, tmp_path):
        outs = llm.generate(PROMPTS, GREEDY, speculative=spec)
        assert [o.token_ids for o in outs] == plain, spec
        assert llm.generate(PROMPTS[:1], GREEDY, speculative=spec)[0].token_ids == plain[0], spec
    if graphs:
        assert llm.engine.graphs.graphs  # captured


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_rows_bits_do_not_depend_on_its_step_on_cuda(tiny_paths, dtype: str) -> None:  # noqa: F811
    """Through the captured graphs a row comes out with the same bits alone or beside another
    request's tree (padded products, the Triton row attention): what makes verification agree
    with plain decoding on every near-tie."""
    llm = LLM(model=str(tiny_paths[0]), device="cuda", dtype=dtype, progress=False)
    assert llm.model.kernels.attend_rows is not None  # Triton runs here
    alone, together = row_alone_and_among_others(llm.model, llm.engine.graphs)
    assert torch.equal(alone, together)


def test_graphs_give_the_eager_tokens_in_float32(tiny_paths) -> None:  # noqa: F811
    llm = LLM(model=str(tiny_paths[0]), device="cuda", dtype="float32", progress=False)
    eager = llm.new_engine(dataclasses.replace(llm.engine.config, cuda_graphs=False))
    with_graphs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.engine = eager
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == with_graphs


@pytest.mark.parametrize("method", ["prompt lookup", "draft model"])
def test_sampling_is_lossless_on_cuda(small, method: str) -> None:  # noqa: F811
    target, draft, exact = small
    target, draft = on_cuda(target), on_cuda(draft)
    make = {
        "prompt lookup": lambda: PromptLookupDrafter(PromptLookupConfig(2, 2)),
        "draft model": lambda: DraftModelDrafter(config(2, True), draft, SMALL_V),
    }[method]
    result, tau = sampled_check(target, exact, make, 2000)
    assert result.ok, (result, tau)
    assert tau > 1.0


def test_tree_verifier_is_lossless_on_cuda() -> None:
    case, trials = CASES[-1]

    def verifier(tree, probs, generator):  # the draws on the GPU's own generator
        gen = torch.Generator("cuda").manual_seed(int(torch.randint(1 << 30, (1,), generator=generator)))
        return verify_sampling(tree.to("cuda"), probs.cuda(), gen)

    report = check_lossless(verifier, case, trials // 3, seed=7)
    assert looks_lossless(report), [c for c in report if not c.ok]
