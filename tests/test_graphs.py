"""The fixed-size forward that CUDA graphs replay (`engine.graphs`, `attention.StaticPlan`), run
eagerly here so that any machine checks it: the same rows as the usual forward (the same bits
where the row kernel attends), nothing written outside the step's slots, every method through it
still reproducing plain greedy decoding; and the GPU's Triton row attention, interpreted on the
CPU where Triton is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.attention import AttentionPlan, Segment, tree_mask
from specdecode.engine.config import EngineConfig
from specdecode.engine.graphs import MIN_COLUMNS, ROW_BUCKETS, GraphRunner
from specdecode.engine.llm_engine import LLMEngine
from specdecode.engine.paged_cache import PagedCache, PagedKVStorage
from specdecode.kernels import REFERENCE, build
from specdecode.kernels.cpu_isa import row_ops
from specdecode.kernels.reference import apply_rotary, rms_norm, silu_mul
from specdecode.models.transformer import Transformer
from specdecode.tree import DraftTree
from tests.test_speculative_api import PROMPTS, methods, tiny_paths  # noqa: F401 (a fixture)
from tests.tiny import load_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS = ROW_BUCKETS[-1]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    return load_tiny_hf(tmp_path_factory.mktemp("graphs"), "qwen2")


def by_rows(model: Transformer) -> bool:
    """Whether the buffers lay each row's slots out for the kernels' row attention."""
    head = model.config.head_dim
    return model.kernels.attends(torch.empty(1, 1, 0, head, dtype=model.dtype, device=model.device))


@pytest.mark.parametrize("kernels", ["bound", "reference"])
@torch.inference_mode()
def test_static_plan_rows_equal_the_attention_plans(model: Transformer, kernels: str, tmp_path: Path) -> None:
    """Two sequences in one step, a chain after a 7-token prefix and a tree after a 3-token one:
    the buffers' forward gives the usual forward's rows (bitwise, where both go through the row
    kernel; SDPA over padded columns otherwise) and writes only the step's slots."""
    if kernels == "reference":  # no row kernel: the buffers' columns layout, for SDPA
        model = load_tiny_hf(tmp_path, "qwen2")
        model.bind_kernels(REFERENCE)
    storage = PagedKVStorage(model.config, num_blocks=16, block_size=4)
    a, b = PagedCache(storage, 64), PagedCache(storage, 64)
    for cache, prompt in ((a, [5, 6, 7, 8, 9, 10, 11]), (b, [20, 21, 22])):
        plan = AttentionPlan([Segment.append(cache, len(prompt))])
        model.forward_plan(torch.tensor([prompt]), torch.arange(len(prompt))[None], plan)
        plan.commit()
    tree = DraftTree(torch.tensor([30, 31, 32]), torch.tensor([0, 0, 1]))  # root, two children, a grandchild
    chain = Segment.append(a, 3)
    branch = Segment.append(b, 4, tree_mask(b.length, tree.ancestor_mask()))
    ids = torch.tensor([12, 13, 14, 23, 30, 31, 32])
    positions = torch.cat([7 + torch.arange(3), 3 + tree.depths()])
    segments = [chain, branch]

    want = model.forward_plan(ids[None], positions[None], AttentionPlan(segments, prefill_from=7))[0]
    before_k = storage.k.clone()
    runner = GraphRunner(model, storage, capture=False)
    got = runner.forward(ids, positions, segments)
    assert got.shape == want.shape == (7, model.config.hidden_size)
    if by_rows(model):
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(runner.graphs) == {(ROWS, MIN_COLUMNS)}  # 7 rows padded, 14 slots in the least bucket

    step = torch.cat([a.slot_table(10)[7:], b.slot_table(7)[3:]])  # the slots the step wrote
    others = torch.ones(storage.k.shape[2], dtype=torch.bool)
    others[step] = False
    others[storage.scratch] = False  # the padded rows'
    bits = storage.k.view(torch.int32)  # bit patterns: slots never written may hold NaNs
    assert torch.equal(bits[:, :, others], before_k.view(torch.int32)[:, :, others])


def test_every_method_through_the_buffers_reproduces_plain_greedy(tiny_paths) -> None:  # noqa: F811
    """The engine's steps through an eager runner (its CUDA path without a GPU): each method's
    greedy output is still plain decoding's, several requests in a step and one alone."""
    llm = LLM(model=str(tiny_paths[0]), device="cpu", progress=False)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    usual = [o.token_ids for o in llm.generate(PROMPTS, params, speculative=None)]
    llm.engine.graphs = runner = GraphRunner(llm.model, llm.engine.storage, capture=False)
    steps = 0
    forward = runner.forward

    def counted(*args: object) -> torch.Tensor:
        nonlocal steps
        steps += 1
        return forward(*args)  # type: ignore[arg-type]

    runner.forward = counted  # type: ignore[method-assign]
    plain = [o.token_ids for o in llm.generate(PROMPTS, params, speculative=None)]
    assert plain == usual and steps >= 39  # every decoding step went through the buffers
    for spec in methods(tiny_paths[1]):
        assert [o.token_ids for o in llm.generate(PROMPTS, params, speculative=spec)] == plain, spec
        assert llm.generate(PROMPTS[:1], params, speculative=spec)[0].token_ids == plain[0], spec


@torch.inference_mode()
def row_alone_and_among_others(model: Transformer, runner: GraphRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden row of one sequence's next token computed alone, then again in a step beside
    another sequence's five-token tree (as verification batches it)."""
    storage, device = runner.storage, model.device
    a, b = PagedCache(storage, 64), PagedCache(storage, 64)
    for cache, prompt in ((a, [5, 6, 7, 8, 9, 10, 11]), (b, [20, 21, 22, 23])):
        plan = AttentionPlan([Segment.append(cache, len(prompt))])
        model.forward_plan(
            torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device)[None], plan
        )
        plan.commit()
    one = torch.tensor([12], device=device)
    alone = runner.forward(one, torch.tensor([7], device=device), [Segment.append(a, 1)])
    tree = DraftTree(torch.tensor([31, 32, 33, 34]), torch.tensor([0, 0, 1, 1])).to(device)
    others = Segment.append(b, 5, tree_mask(b.length, tree.ancestor_mask()))
    ids = torch.cat([torch.tensor([30], device=device), tree.tokens, one])
    positions = torch.cat([4 + tree.depths(), torch.tensor([7], device=device)])
    together = runner.forward(ids, positions, [others, Segment.append(a, 1)])
    for cache in (a, b):
        cache.release()
    return alone[0], together[-1]


def test_a_rows_bits_do_not_depend_on_its_step(model: Transformer) -> None:
    storage = PagedKVStorage(model.config, num_blocks=16, block_size=4)
    alone, together = row_alone_and_among_others(model, GraphRunner(model, storage, capture=False))
    assert torch.equal(alone, together)


def test_capture_makes_every_bucket_up_to_the_columns_asked(model: Transformer) -> None:
    runner = GraphRunner(model, PagedKVStorage(model.config, num_blocks=8, block_size=4), capture=False)
    runner.capture_all(1024)
    assert set(runner.graphs) == {(r, c) for r in ROW_BUCKETS for c in (MIN_COLUMNS, 512, 1024)}


def test_runner_declines_what_no_bucket_holds(model: Transformer) -> None:
    storage = PagedKVStorage(model.config, num_blocks=40, block_size=4)
    runner = GraphRunner(model, storage, capture=False)
    cache = PagedCache(storage, 128)
    assert runner.takes([Segment.append(cache, ROWS)])
    assert not runner.takes([Segment.append(cache, ROWS + 1)])  # more rows than the largest bucket
    other = PagedKVStorage(model.config, num_blocks=4, block_size=4)
    assert not runner.takes([Segment.append(PagedCache(other, 16), 1)])  # another storage


def test_the_policys_curve_is_timed_as_the_engine_steps(model: Transformer) -> None:
    """`LLMEngine.forward_seconds` times the widths its graphs hold through them (here run
    eagerly) and the others through the model's forward, and gives its blocks back."""
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22, policy=False))
    engine.graphs = GraphRunner(model, engine.storage, capture=False)
    seconds = engine.forward_seconds([1, 4, 128], context=16, repeats=2)
    assert set(seconds) == {1, 4, 128} and all(len(s) == 2 and min(s) > 0 for s in seconds.values())
    assert set(engine.graphs.graphs) == {(ROWS, MIN_COLUMNS)}  # 128 rows: no bucket, the model's forward
    assert engine.pool.num_used == 0


# ---- the GPU's row attention, interpreted ---------------------------------------------------------


def test_triton_row_attention_interpreted() -> None:
    """`check_triton_rows` in a process of its own: Triton's interpreter must be chosen before
    Triton is first imported (it builds its language's functions for it then), and torch may
    import Triton early."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    checks = ("check_triton_rows", "check_triton_rows_ops", "check_triton_model")
    code = "import tests.test_graphs as t; " + "; ".join(f"t.{c}()" for c in checks)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def attend(rows_kernel, q, k, v, cache, slots_of_rows, new_slots, cos, sin):  # type: ignore[no-untyped-def]
    """Run an AttendRows over rows whose visible slots are `slots_of_rows`: out (T, H, D) and the
    cache after."""
    ck, cv = (c.clone() for c in cache)
    t, (h, _, d) = q.shape[1], q.shape
    out = torch.zeros(t, h, d, dtype=q.dtype)
    ptr = torch.tensor([0] + [len(s) for s in slots_of_rows]).cumsum(0)
    idx = torch.tensor([s for row in slots_of_rows for s in row])
    rows_kernel(q, k, v, ck, cv, torch.arange(t), torch.tensor(new_slots), ptr, idx, out, cos, sin)
    return out, ck, cv


def check_triton_rows() -> None:
    """`kernels.cuda.TritonRows` on CPU tensors (under TRITON_INTERPRET=1): against SDPA row by
    row (a chain over a prefix, then a tree's rows), and a row's result the same bits whatever
    else the call holds or where its slots sit in the cache."""
    from specdecode.kernels.cuda import TritonRows

    triton_rows = TritonRows()
    g = torch.Generator().manual_seed(0)
    h, h_kv, d, s = 4, 2, 32, 80
    cache = (torch.randn(h_kv, s, d, generator=g), torch.randn(h_kv, s, d, generator=g))
    q = torch.randn(h, 3, d, generator=g)
    k, v = torch.randn(h_kv, 3, d, generator=g), torch.randn(h_kv, 3, d, generator=g)
    prefix = list(range(40))  # 40 cached slots, then the rows at 70, 71, 72: a root and two children
    rows = [[*prefix, 70], [*prefix, 70, 71], [*prefix, 70, 72]]
    angle = torch.randn(3, d, generator=g)
    cos, sin = angle.cos(), angle.sin()
    out, ck, cv = attend(triton_rows, q, k, v, cache, rows, [70, 71, 72], cos, sin)
    half = d // 2
    rotated_k = k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin
    assert torch.equal(ck[:, 70:73], rotated_k) and torch.equal(cv[:, 70:73], v)
    qr = q * cos + torch.cat([-q[..., half:], q[..., :half]], -1) * sin
    for r, slots in enumerate(rows):
        keys = ck[:, slots].repeat_interleave(h // h_kv, 0)  # (H, n, D)
        values = cv[:, slots].repeat_interleave(h // h_kv, 0)
        want = torch.nn.functional.scaled_dot_product_attention(qr[:, r : r + 1], keys, values)[:, 0]
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)
    # Row 2 alone, its own slots moved elsewhere in the cache: the same bits.
    moved = [*range(5, 45), 60, 75]  # the prefix, the root, the row itself
    ck2, cv2 = torch.zeros_like(ck), torch.zeros_like(cv)
    ck2[:, moved], cv2[:, moved] = ck[:, rows[2]], cv[:, rows[2]]
    alone, *_ = attend(triton_rows, q[:, 2:], k[:, 2:], v[:, 2:], (ck2, cv2), [moved], [75], cos[2:], sin[2:])
    assert torch.equal(alone[0], out[2])
    # In half precision the keys are rotated with PyTorch's roundings (each product, then the sum).
    half_k, half_cos, half_sin = k.half(), cos.half(), sin.half()
    half_cache = [c.half() for c in cache]
    _, ck16, _ = attend(
        triton_rows, q.half(), half_k, v.half(), half_cache, rows, [70, 71, 72], half_cos, half_sin
    )
    assert torch.equal(ck16[:, 70:73], apply_rotary(half_k, half_cos, half_sin))


@pytest.mark.parametrize("isa", build.ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_rows_in_half_precision_give_a_row_its_own_bits(isa: str, dtype: torch.dtype) -> None:
    """The CPU's row attention on bfloat16 and float16 rows (widened to float32 for the kernel):
    keys rotated as PyTorch rotates them, SDPA's values, and a row's result the same bits alone
    (its slots moved in the cache) as among a tree's rows."""
    ops = row_ops(isa)
    if ops is None:
        pytest.skip(f"no {isa} build here")
    g = torch.Generator().manual_seed(2)
    h, h_kv, d = 4, 2, 32
    cache = tuple(torch.randn(h_kv, 80, d, generator=g).to(dtype) for _ in range(2))
    q, k, v = (torch.randn(n, 3, d, generator=g).to(dtype) for n in (h, h_kv, h_kv))
    angle = torch.randn(3, d, generator=g)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    prefix = list(range(40))
    rows = [[*prefix, 70], [*prefix, 70, 71], [*prefix, 70, 72]]  # a root and two children
    out, ck, cv = attend(ops, q, k, v, cache, rows, [70, 71, 72], cos, sin)
    assert torch.equal(ck[:, 70:73], apply_rotary(k, cos, sin)) and torch.equal(cv[:, 70:73], v)
    qr = apply_rotary(q, cos, sin)
    for r, slots in enumerate(rows):
        keys, values = (c[:, slots].float().repeat_interleave(h // h_kv, 0) for c in (ck, cv))
        want = torch.nn.functional.scaled_dot_product_attention(qr[:, r : r + 1].float(), keys, values)[:, 0]
        torch.testing.assert_close(out[r].float(), want, rtol=2e-2, atol=2e-2)
    moved = [*range(5, 45), 60, 75]
    ck2, cv2 = torch.zeros_like(ck), torch.zeros_like(cv)
    ck2[:, moved], cv2[:, moved] = ck[:, rows[2]], cv[:, rows[2]]
    alone, *_ = attend(ops, q[:, 2:], k[:, 2:], v[:, 2:], (ck2, cv2), [moved], [75], cos[2:], sin[2:])
    assert torch.equal(alone[0], out[2])


def check_triton_rows_ops() -> None:
    """The GPU's RMS norm and SiLU * up (`kernels.cuda`) on CPU tensors, interpreted: the
    reference's values, and a row's bits the same alone as among others."""
    from specdecode.kernels.cuda import launch_rms_norm, launch_silu_mul

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16):
        x, w = torch.randn(5, 96, generator=g).to(dtype), (1 + torch.randn(96, generator=g) / 4).to(dtype)
        normed = launch_rms_norm(x.view(1, 5, 96), w, 1e-5)
        assert normed.shape == (1, 5, 96) and normed.dtype == dtype
        torch.testing.assert_close(normed[0], rms_norm(x, w, 1e-5))
        assert torch.equal(launch_rms_norm(x[3:4], w, 1e-5), normed[0, 3:4])
        gate_up = torch.randn(5, 2 * 1500, generator=g).to(dtype)  # two programs a row
        torch.testing.assert_close(launch_silu_mul(gate_up), silu_mul(gate_up))
        assert torch.equal(launch_silu_mul(gate_up[2:3]), launch_silu_mul(gate_up)[2:3])


def check_triton_model() -> None:
    """A tiny model computing through the GPU's kernel set with its Triton kernels interpreted on
    CPU tensors, through the graphs' buffers run eagerly: the reference kernels' hidden rows, and
    a row's bits the same alone as beside another request's tree."""
    import dataclasses
    import tempfile

    from specdecode.kernels.cuda import PADDED, TritonRows, launch_rms_norm, launch_silu_mul

    class CpuTritonRows(TritonRows):
        device_type = "cpu"

    kernels = dataclasses.replace(
        REFERENCE, name="triton-interpreted", linears=(PADDED,), approx=(), head=PADDED,
        rms_norm=launch_rms_norm, silu_mul=launch_silu_mul, attend_rows=CpuTritonRows(),
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model, reference = load_tiny_hf(Path(tmp), "qwen2"), Transformer.from_dir(Path(tmp))
    reference.bind_kernels(REFERENCE)
    model.bind_kernels(kernels)
    storage = PagedKVStorage(model.config, num_blocks=16, block_size=4)
    runner = GraphRunner(model, storage, capture=False)
    alone, together = row_alone_and_among_others(model, runner)
    assert torch.equal(alone, together)
    with torch.inference_mode():
        ids, positions = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]), torch.arange(8)[None]
        got, want = (
            m.forward_plan(ids, positions, AttentionPlan([Segment.append(m.new_cache(16), 8)]))
            for m in (model, reference)
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


SHAPES = [("bf16", 3, 64), ("bf16", 6, 128), ("fp16", 1, 64), ("fp32", 2, 16), ("fp32", 2, 8)]


@pytest.mark.parametrize(("dtype", "group", "head_dim"), SHAPES)
def test_triton_kernels_build_for_hopper(dtype: str, group: int, head_dim: int) -> None:
    """The kernels compile for an H100/H200 (sm_90) without a GPU, to machine code with no local
    memory (no spilled registers): SmolLM2's heads and width, Qwen2.5-1.5B's, one query head a
    group, and the tiny test models'."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from specdecode.kernels.cuda import SILU_BLOCK, _triton, triton_pow2

    k = _triton()
    store_rows, row_attention, rms_norm_rows, silu_mul_rows = (
        k.store_rows,
        k.row_attention,
        k.rms_norm_rows,
        k.silu_mul_rows,
    )
    width = {8: 64, 16: 64, 64: 576, 128: 1536}[head_dim]  # the model's hidden size
    builds = [
        (store_rows, {"D": head_dim}),
        (row_attention, {"GROUP": group, "GP": triton_pow2(group), "D": head_dim, "BLOCK": 32 if head_dim <= 64 else 16}),  # noqa: E501
        (rms_norm_rows, {"LOW": dtype != "fp32", "BLOCK": triton_pow2(width)}),
        (silu_mul_rows, {"BLOCK": SILU_BLOCK}),
    ]  # fmt: skip
    pointers = {"rows", "new_slots", "row_ptr", "idx"}  # int64; every other pointer: the dtype
    floats = {"q", "k", "v", "kc", "vc", "out", "cos", "sin", "x", "w", "y"}
    for kernel, consts in builds:
        signature = {
            n: "constexpr" if n in consts
            else "*i64" if n in pointers
            else f"*{dtype}" if n in floats
            else "fp32" if n in ("scale", "eps")
            else "i32"
            for n in kernel.arg_names
        }  # fmt: skip
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts)
        built = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert built.asm["cubin"] and ".local" not in built.asm["ptx"], kernel


def test_padded_products_give_a_row_the_same_bits_in_any_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's linear kernel (here on CPU tensors): x @ W (+ bias), computed in blocks of 64
    rows, so a row's bits do not depend on how many rows came with it, past 64 rows too (a step
    verifying several requests' trees): every product it asks of PyTorch has 64 rows."""
    from specdecode.kernels.cuda import PADDED
    from specdecode.kernels.reference import TorchLinear

    shapes = []
    product = TorchLinear.matmul

    def counted(self, x, packed, bias=None):  # type: ignore[no-untyped-def]
        shapes.append(x.shape[0])
        return product(self, x, packed, bias)

    monkeypatch.setattr(TorchLinear, "matmul", counted)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(150, 96, generator=g), torch.randn(96, 40, generator=g)
    bias = torch.randn(40, generator=g)
    torch.testing.assert_close(PADDED.matmul(x, w, bias), x @ w + bias)
    assert PADDED.matmul(x[:130], w).shape == (130, 40)
    for row in (0, 1, 63, 64, 100):
        alone = PADDED.matmul(x[row : row + 1], w, bias)
        for rows in (2, 5, 64, 70, 130, 150):
            start = max(0, row + 1 - rows)  # the row at another place among `rows` rows
            assert torch.equal(PADDED.matmul(x[start : start + rows], w, bias)[row - start], alone[0])
    assert set(shapes) == {64}
