"""A KV cache kept in float16 (`kv_cache_dtype="float16"`): the row kernels widen what they read
and round what they store as torch's `.half()` does, every path of the engine reads the same
rounded keys and values, so every method still reproduces plain greedy decoding, and a block
takes half the bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.config import EngineConfig
from specdecode.engine.paged_cache import PagedKVStorage
from specdecode.errors import SpecDecodeError
from specdecode.kernels import REFERENCE, select
from tests.test_cuda import head_methods
from tests.test_kernels import LENGTHS, _attention_case, isa_ops, ops_of
from tests.test_quant import FORMATS
from tests.test_speculative_api import PROMPTS, methods
from tests.tiny_gguf import write_tiny_gguf

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _attend(case: dict, ops, cache_k: torch.Tensor, cache_v: torch.Tensor, **rotary) -> torch.Tensor:
    sees = case["sees"]
    out = torch.full((5, case["q"].shape[0], case["q"].shape[2]), float("nan"))
    ops(
        case["q"], case["k"], case["v"], cache_k, cache_v, torch.arange(5), case["new_slots"],
        torch.tensor([0] + [len(s) for s in sees]).cumsum(0), torch.cat(sees), out, *rotary.values(),
    )  # fmt: skip
    return out


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize(("a", "b"), LENGTHS)
def test_a_half_cache_gives_the_bits_of_its_widened_copy(isa: str, d: int, a: int, b: int) -> None:
    """The kernel over a float16 cache stores the new keys and values rounded as `.half()` rounds
    them, and its result is, bit for bit, the float32 kernel's over the cache widened (with the
    new keys and values rounded the same way)."""
    ops = ops_of(isa)
    case = _attention_case(d, seed=d + a, a=a, b=b)
    half_k, half_v = case["cache_k"].half(), case["cache_v"].half()
    got = _attend(case, ops, half_k, half_v)
    new = case["new_slots"]
    assert torch.equal(half_k[:, new].view(torch.int16), case["k"].half().view(torch.int16))
    assert torch.equal(half_v[:, new].view(torch.int16), case["v"].half().view(torch.int16))
    widened = dict(case, k=case["k"].half().float(), v=case["v"].half().float())
    want = _attend(widened, ops, case["cache_k"].half().float(), case["cache_v"].half().float())
    assert torch.equal(got, want)


@pytest.mark.parametrize("isa", isa_ops())
def test_a_half_cache_stores_rotated_keys_as_torch_rounds_them(isa: str) -> None:
    from specdecode.attention import apply_rotary

    ops = ops_of(isa)
    case = _attention_case(64, seed=11)
    angles = torch.rand(5, 32, generator=torch.Generator().manual_seed(3)) * 6  # (T, D/2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # (T, D)
    half_k, half_v = case["cache_k"].half(), case["cache_v"].half()
    _attend(case, ops, half_k, half_v, cos=cos, sin=sin)
    want = apply_rotary(case["k"], cos, sin).half()
    assert torch.equal(half_k[:, case["new_slots"]].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("isa", isa_ops())
def test_stored_halves_round_as_torch_at_the_edges(isa: str) -> None:
    """Subnormals, the largest finite half and what rounds past it, ties, signed zeros, infinities:
    the generic build's own conversion and F16C's both round as `.half()` does."""
    ops = ops_of(isa)
    case = _attention_case(16, seed=1)
    edges = torch.tensor(
        [0.0, -0.0, 1e-8, -3e-8, 2.98e-8, 5.96e-8, 6.0e-5, 6.1e-5, 6.1035e-5, 1.0 + 2**-11, 1.0 + 3 * 2**-11,
         65504.0, 65519.0, 65520.0, -70000.0, float("inf"), float("-inf"), 0.1, -2.5e-6, 1e-30]
    )  # fmt: skip
    values = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)) * 1000
    values.view(-1)[: edges.numel()] = edges
    case = dict(case, k=values, v=values.flip(-1))
    half_k, half_v = case["cache_k"].half(), case["cache_v"].half()
    _attend(case, ops, half_k, half_v)
    new = case["new_slots"]
    assert torch.equal(half_k[:, new].view(torch.int16), values.half().view(torch.int16))
    assert torch.equal(half_v[:, new].view(torch.int16), values.flip(-1).half().view(torch.int16))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target whose heads the row kernel takes (head size 32) stored in block formats (the
    one-call decoder runs it), and a draft model for it."""
    root = tmp_path_factory.mktemp("kv16")
    target = write_tiny_gguf(root / "target.gguf", "llama", seed=0, width=8, formats=FORMATS).path
    draft = write_tiny_gguf(root / "draft.gguf", "llama", seed=1, width=8).path
    return target, draft


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_every_method_reproduces_plain_greedy_with_a_half_cache(tiny, tmp_path: Path, dtype: str) -> None:
    llm = LLM(model=str(tiny[0]), dtype=dtype, device="cpu", kv_cache_dtype="float16", progress=False)
    assert llm.engine.storage.k.dtype == llm.engine.storage.v.dtype == torch.float16
    assert llm.engine.storage.h is not None and llm.engine.storage.h.dtype == llm.model.dtype
    plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, speculative=None)]
    for spec in methods(tiny[1]) + head_methods(llm, tmp_path):
        outs = llm.generate(PROMPTS, GREEDY, speculative=spec)
        assert [o.token_ids for o in outs] == plain, spec
        assert llm.generate(PROMPTS[:1], GREEDY, speculative=spec)[0].token_ids == plain[0], spec


def test_the_kernels_and_the_reference_read_a_half_cache_alike(tiny) -> None:
    """The same float32 model through the row kernels and through PyTorch's ops (SDPA, which reads
    the cache widened) gives the same greedy tokens with a float16 cache: both see the keys and
    values rounded once, when stored."""
    if select("cpu").attend_rows is None:
        pytest.skip("no row kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    fast = LLM(model=str(tiny[0]), dtype="float32", device="cpu", kv_cache_dtype="float16", progress=False)
    slow = LLM(model=str(tiny[0]), dtype="float32", device="cpu", kv_cache_dtype="float16", progress=False)
    slow.model.bind_kernels(REFERENCE)
    assert fast.model.kernels.attend_rows is not None and slow.model.kernels.attend_rows is None
    want = [o.token_ids for o in slow.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == want


def test_a_half_cache_holds_twice_the_tokens(tiny) -> None:
    llm = LLM(model=str(tiny[0]), device="cpu", progress=False, kv_cache_memory=1 << 20)
    half = LLM(
        model=str(tiny[0]), device="cpu", progress=False, kv_cache_memory=1 << 20, kv_cache_dtype="float16"
    )
    config = llm.model.config
    full = PagedKVStorage.block_bytes(config, 16, torch.float32)
    kv16 = PagedKVStorage.block_bytes(config, 16, torch.float32, kv_dtype=torch.float16)
    hidden = 16 * config.hidden_size * 4
    assert kv16 - hidden == (full - hidden) // 2
    assert llm.engine.pool.num_blocks == (1 << 20) // full
    assert half.engine.pool.num_blocks == (1 << 20) // kv16


def test_a_kv_cache_dtype_not_offered_is_named() -> None:
    with pytest.raises(SpecDecodeError, match="kv_cache_dtype must be one of auto, float32, float16"):
        EngineConfig(kv_cache_dtype="int8")
