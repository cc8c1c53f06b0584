"""The kernels: the few-row CPU kernels give the same products as `x @ W`, each row independent of
its batch, and a model bound to them decodes exactly as one bound to PyTorch's."""

from __future__ import annotations

import subprocess

import pytest
import torch

from specdecode.kernels import REFERENCE, build, cpu_isa, tiles
from specdecode.kernels.cpu import cpu_kernels
from specdecode.kernels.cpu_isa import HEAD_DIMS, RowOps, attention_prefetch, bf16_tiles, float_tiles, row_ops
from specdecode.layers.linear import Dense
from specdecode.models.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

needs_bf16 = pytest.mark.skipif(bf16_tiles() is None, reason="no AVX512_BF16 CPU or C++ compiler here")


def isa_ops() -> list[object]:
    """Each instruction set's build of our kernels, skipped where it cannot run here."""
    return [
        pytest.param(isa, marks=pytest.mark.skipif(row_ops(isa) is None, reason=f"no {isa} build here"))
        for isa in build.ISAS
    ]


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize("m", [1, 2, 5, 12, 13, 16, 24, 25, 40, 64, 65])
@pytest.mark.parametrize(("k", "n"), [(64, 96), (576, 960), (1536, 576)])
def test_tiled_matmul_equals_matmul(isa: str, m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    kernel = cpu_kernels(isa).linear_for(w)
    assert kernel.name == "cpu-f32-tiles"
    tiled = kernel.pack(w)
    assert tiled.shape == (n // tiles.TILE, k, tiles.TILE)
    assert torch.equal(kernel.unpack(tiled), w)
    # sums of k products of N(0, 1) values: rounding differs from MKL by ~1e-7 * sqrt(k) * |terms|
    torch.testing.assert_close(kernel.matmul(x, tiled), x @ w, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize("m", [2, 7, 12, 16, 24, 40, 64])
def test_kernel_rows_do_not_depend_on_the_batch(isa: str, m: int) -> None:
    """Bitwise: a row multiplied alone equals the same row inside any batch (any row block)."""
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=gen), torch.randn(576, 960, generator=gen)
    product = float_tiles(isa)
    assert product is not None
    tiled = tiles.tile_weight(w)
    batch = product(x, tiled)
    alone = torch.cat([product(x[i : i + 1], tiled) for i in range(m)])
    assert torch.equal(batch, alone)


@pytest.mark.parametrize("isa", isa_ops())
def test_fallback_when_gradients_are_needed(isa: str) -> None:
    """Training reads the same module: the kernel cannot backpropagate, so autograd takes the
    batched-matmul path and gradients flow."""
    w = torch.randn(64, 96)
    kernel = cpu_kernels(isa).linear_for(w)
    tiled = kernel.pack(w).requires_grad_()
    x = torch.randn(3, 64)
    kernel.matmul(x, tiled).sum().backward()
    assert tiled.grad is not None
    torch.testing.assert_close(tiles.untile_weight(tiled.grad), x.sum(0, keepdim=True).T.expand(64, 96))


@pytest.mark.parametrize("kernels", ["reference", *isa_ops()])
def test_dense_bound_to_kernels_keeps_its_function_and_bias(kernels: str) -> None:
    chosen = REFERENCE if kernels == "reference" else cpu_kernels(kernels)
    dense = Dense(64, 96, bias=True)
    with torch.no_grad():
        dense.bias.normal_()
    x = torch.randn(2, 3, 64)
    before, matrix = dense(x), dense.weight_t.detach().clone()
    dense.bind_kernels(chosen)
    assert dense.kernel is chosen.linears[0]
    assert torch.equal(dense.matrix(), matrix)
    torch.testing.assert_close(dense(x), before, rtol=1e-5, atol=1e-5)
    narrow = Dense(64, 100)  # 100 columns do not split into tiles: the reference kernel takes it
    narrow.bind_kernels(chosen)
    assert narrow.kernel is chosen.linears[-1] and narrow.kernel.name == "torch"


def test_tiled_model_matches_untiled(tiny_model_dir) -> None:
    """Loading binds a CPU float32 model to the CPU kernels; its forward equals the forward of
    the same model bound to PyTorch's."""
    tiled = Transformer.from_dir(tiny_model_dir)
    if tiled.kernels.linears[0].name != "cpu-f32-tiles":
        pytest.skip("no CPU kernels of ours here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    assert tiled.layers[0].qkv.weight_packed is not None
    plain = Transformer.from_dir(tiny_model_dir)
    plain.bind_kernels(REFERENCE)
    assert plain.layers[0].qkv.kernel.name == "torch"
    ids = torch.randint(0, tiled.config.vocab_size, (1, 20))
    pos = torch.arange(20)[None]
    with torch.inference_mode():
        a = tiled(ids, pos, tiled.new_cache(32))
        b = plain(ids, pos, plain.new_cache(32))
        c1, c2 = tiled.new_cache(32), plain.new_cache(32)
        steps_a = [tiled(ids[:, i : i + 1], pos[:, i : i + 1], c1) for i in range(20)]
        steps_b = [plain(ids[:, i : i + 1], pos[:, i : i + 1], c2) for i in range(20)]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps_a, 1), torch.cat(steps_b, 1), rtol=1e-4, atol=1e-4)


@needs_bf16
@pytest.mark.parametrize("m", [1, 4, 13, 30, 100, 800])
def test_bf16_kernel_sums_bf16_products_in_float32(m: int) -> None:
    """The screening head's product: inputs and weights rounded to bfloat16, then float32 sums
    (so within float32 rounding of the exact product of the rounded operands)."""
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=gen), torch.randn(576, 960, generator=gen) * 0.05
    product = bf16_tiles()
    assert product is not None
    tiled = tiles.tile_weight_bf16(w)
    got = product(x, tiled)  # (M, N)
    want = x.bfloat16().double() @ w.bfloat16().double()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    # and each row alone equals the row in the batch
    alone = torch.cat([product(x[i : i + 1], tiled) for i in range(m)])
    assert torch.equal(alone, got)


@needs_bf16
def test_bf16_dense_tiles_for_few_rows_and_untiles_for_many() -> None:
    dense = Dense(64, 96, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        dense.bias.normal_()
    matrix = dense.weight_t.detach().clone()
    kernels = cpu_kernels("avx512")
    dense.bind_kernels(kernels)
    assert dense.weight_packed is not None and dense.weight_packed.dim() == 4
    assert torch.equal(dense.matrix(), matrix)
    for m in (3, 40):  # the kernel, then the untiled bf16 matmul
        x = torch.randn(m, 64).bfloat16()
        want = (x.double() @ matrix.double() + dense.bias.double()).bfloat16()
        torch.testing.assert_close(dense(x), want, rtol=2e-2, atol=2e-2)


def _attention_case(d: int, seed: int, a: int = 19, b: int = 16) -> dict:
    """A paged layer (slots shuffled) holding two sequences' prefixes (a and b positions), and a
    batch of new rows: sequence A decodes one token, sequence B verifies a 4-node tree. Rows of
    more than 256 slots are attended in spans, merged after."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv, slots = 6, 2, a + b + 28
    perm = torch.randperm(slots, generator=gen)
    seq_a, seq_b = perm[: a + 1], perm[a + 1 : a + b + 5]  # slot of each position
    cache_k, cache_v = torch.randn(hkv, slots, d, generator=gen), torch.randn(hkv, slots, d, generator=gen)
    q = torch.randn(h, 5, d, generator=gen)
    k, v = torch.randn(hkv, 5, d, generator=gen), torch.randn(hkv, 5, d, generator=gen)
    # A: new token at position a. B: tree 0 <- {1, 2}, 1 <- 3 at b..b+3.
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    sees = [seq_a] + [torch.cat([seq_b[:b], seq_b[b : b + 4][row]]) for row in ancestors]
    new_slots = torch.cat([seq_a[a : a + 1], seq_b[b : b + 4]])
    return dict(q=q, k=k, v=v, cache_k=cache_k, cache_v=cache_v, sees=sees, new_slots=new_slots)


def ops_of(isa: str) -> RowOps:
    ops = row_ops(isa)
    assert ops is not None
    return ops


def _run_attention(case: dict, rows: list[int], ops: RowOps) -> torch.Tensor:
    cache_k, cache_v = case["cache_k"].clone(), case["cache_v"].clone()
    sees = [case["sees"][r] for r in rows]
    row_ptr = torch.tensor([0] + [len(s) for s in sees]).cumsum(0)
    out = torch.full((case["q"].shape[1], case["q"].shape[0], case["q"].shape[2]), float("nan"))
    ops(
        case["q"], case["k"], case["v"], cache_k, cache_v, torch.tensor(rows),
        case["new_slots"][rows], row_ptr, torch.cat(sees), out,
    )  # fmt: skip
    assert torch.equal(cache_k[:, case["new_slots"][rows]], case["k"][:, rows])
    assert torch.equal(cache_v[:, case["new_slots"][rows]], case["v"][:, rows])
    return out


# rows of one span of slots; several, the last one short (A: 3 spans, B's rows 3 each, the last
# of 9 to 12 slots)
LENGTHS = [(19, 16), (600, 520)]


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize(("a", "b"), LENGTHS)
def test_attention_kernel_equals_sdpa_over_each_rows_slots(isa: str, d: int, a: int, b: int) -> None:
    case = _attention_case(d, seed=d, a=a, b=b)
    out = _run_attention(case, [0, 1, 2, 3, 4], ops_of(isa))
    cache_k, cache_v = case["cache_k"].clone(), case["cache_v"].clone()
    cache_k[:, case["new_slots"]], cache_v[:, case["new_slots"]] = case["k"], case["v"]
    group = case["q"].shape[0] // cache_k.shape[0]
    for r, slots in enumerate(case["sees"]):
        keys = cache_k[:, slots].repeat_interleave(group, 0)  # (H, L, D)
        values = cache_v[:, slots].repeat_interleave(group, 0)
        want = torch.nn.functional.scaled_dot_product_attention(case["q"][:, r : r + 1], keys, values)
        torch.testing.assert_close(out[r], want[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize(("a", "b"), LENGTHS)
def test_attention_kernel_rows_do_not_depend_on_the_batch(isa: str, a: int, b: int) -> None:
    case = _attention_case(64, seed=1, a=a, b=b)
    ops = ops_of(isa)
    together = _run_attention(case, [0, 1, 2, 3, 4], ops)
    # B's rows need their ancestors' new keys: run B's tree alone, and A's row alone.
    assert torch.equal(_run_attention(case, [0], ops)[0], together[0])
    assert torch.equal(_run_attention(case, [1, 2, 3, 4], ops)[1:], together[1:])


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize(("a", "b"), LENGTHS)
def test_attention_rows_sharing_their_prefix_give_their_own_bits(isa: str, a: int, b: int) -> None:
    """A tree's rows share the spans of their common prefix (one task reads its keys once for all
    of them): each row's result is the bits it has when attended alone."""
    case = _attention_case(64, seed=7, a=a, b=b)
    ops = ops_of(isa)
    together = _run_attention(case, [1, 2, 3, 4], ops)
    # Alone, a node needs its ancestors' keys in the cache already: write every new key first.
    case["cache_k"][:, case["new_slots"]], case["cache_v"][:, case["new_slots"]] = case["k"], case["v"]
    for r in (1, 2, 3, 4):
        assert torch.equal(_run_attention(case, [r], ops)[r], together[r])


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize("prefix", [40, 300])
def test_attention_rows_of_a_chain_share_their_last_span_with_their_own_bits(isa: str, prefix: int) -> None:
    """A verified chain's rows (each row's slots the row before's and its own new one) share
    every span, the last too although each row has its own number of slots there: each row's
    result is the bits it has when attended alone, and close to SDPA over its slots."""
    gen = torch.Generator().manual_seed(prefix)
    h, hkv, d, t = 6, 2, 64, 5
    slots = torch.randperm(prefix + t + 7, generator=gen)[: prefix + t]  # position -> slot
    cache_k = torch.randn(hkv, prefix + t + 7, d, generator=gen)
    cache_v = torch.randn(hkv, prefix + t + 7, d, generator=gen)
    q, k, v = (torch.randn(n, t, d, generator=gen) for n in (h, hkv, hkv))
    k *= 10  # the new keys' scores the largest: a row that weighed a later row's would show it
    sees = [slots[: prefix + r + 1] for r in range(t)]
    case = dict(q=q, k=k, v=v, cache_k=cache_k, cache_v=cache_v, sees=sees, new_slots=slots[prefix:])
    ops = ops_of(isa)
    together = _run_attention(case, list(range(t)), ops)
    cache_k[:, slots[prefix:]], cache_v[:, slots[prefix:]] = k, v  # alone, a row needs the rows before
    for r in range(t):
        assert torch.equal(_run_attention(case, [r], ops)[r], together[r])
        keys = cache_k[:, sees[r]].repeat_interleave(h // hkv, 0)  # (H, L, D)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, r : r + 1], keys, cache_v[:, sees[r]].repeat_interleave(h // hkv, 0)
        )
        torch.testing.assert_close(together[r], want[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", isa_ops())
def test_attention_splits_its_tasks_between_threads_with_the_same_bits(isa: str) -> None:
    """The threads take runs of tasks (key/value head, span, rows) of equal work, a different
    split for each thread count and for a row alone or eight of a chain: every way gives the
    same bits, close to SDPA. (SmolLM2's shape: 3 key/value heads of 3 queries.)"""
    gen = torch.Generator().manual_seed(3)
    h, hkv, d, t, prefix = 9, 3, 64, 8, 250
    slots = torch.randperm(prefix + t, generator=gen)
    cache_k, cache_v = (torch.randn(hkv, prefix + t, d, generator=gen) for _ in range(2))
    q, k, v = (torch.randn(n, t, d, generator=gen) for n in (h, hkv, hkv))
    sees = [slots[: prefix + r + 1] for r in range(t)]
    case = dict(q=q, k=k, v=v, cache_k=cache_k, cache_v=cache_v, sees=sees, new_slots=slots[prefix:])
    ops, threads = ops_of(isa), torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_run_attention(case, list(range(t)), ops))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    cache_k[:, slots[prefix:]], cache_v[:, slots[prefix:]] = k, v
    for r in (0, t - 1):
        assert torch.equal(_run_attention(case, [r], ops)[r], outs[0][r])
        keys, values = (c[:, sees[r]].repeat_interleave(h // hkv, 0) for c in (cache_k, cache_v))
        want = torch.nn.functional.scaled_dot_product_attention(q[:, r : r + 1], keys, values)
        torch.testing.assert_close(outs[0][r], want[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", isa_ops())
def test_attention_asks_ahead_or_not_with_the_same_bits(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for keys and values ahead is the machine's choice (timed when the library loads, or
    forced by SPECDECODE_ATTENTION_PREFETCH): it never changes a result."""
    ops = ops_of(isa)
    monkeypatch.setenv("SPECDECODE_ATTENTION_PREFETCH", "0")
    assert attention_prefetch(ops) is False
    monkeypatch.setenv("SPECDECODE_ATTENTION_PREFETCH", "1")
    assert attention_prefetch(ops) is True
    monkeypatch.delenv("SPECDECODE_ATTENTION_PREFETCH")
    chosen = attention_prefetch(ops)  # timed
    case = _attention_case(64, seed=5, a=150, b=126)
    try:
        outs = []
        for on in (0, 1):
            ops._lib.specdecode_attention_prefetch(on)
            outs.append(_run_attention(case, [0, 1, 2, 3, 4], ops))
    finally:
        ops._lib.specdecode_attention_prefetch(int(chosen))
    assert torch.equal(outs[0], outs[1])


def test_row_kernels_give_the_same_bits_on_avx2_and_avx512() -> None:
    wide, narrow = row_ops("avx512"), row_ops("avx2")
    if wide is None or narrow is None:
        pytest.skip("needs both the AVX-512 and the AVX2 build")
    for a, b in LENGTHS:
        case = _attention_case(64, seed=3, a=a, b=b)
        assert torch.equal(
            _run_attention(case, [0, 1, 2, 3, 4], wide), _run_attention(case, [0, 1, 2, 3, 4], narrow)
        )
    x, w = torch.randn(3, 576), torch.randn(576)
    assert torch.equal(wide.rms_norm(x, w, 1e-5), narrow.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize(("m", "c"), [(1, 576), (7, 64), (3, 40)])
def test_rms_norm_kernel_equals_torch_and_ignores_the_batch(isa: str, m: int, c: int) -> None:
    ops = ops_of(isa)
    gen = torch.Generator().manual_seed(c)
    x, w = torch.randn(m, c, generator=gen) * 3, torch.randn(c, generator=gen)
    got = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (c,), w, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([ops.rms_norm(x[i : i + 1], w, 1e-5) for i in range(m)]), got)
    # other dtypes: torch's
    torch.testing.assert_close(
        ops.rms_norm(x.double(), w.double(), 1e-5),
        torch.nn.functional.rms_norm(x.double(), (c,), w.double(), 1e-5),
    )


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_attention_kernel_rotates_queries_and_keys_bitwise_as_torch(isa: str, d: int) -> None:
    """Rotary inside the kernel (decode rows) must equal torch's (SDPA segments) to the bit: both
    write keys into the same caches."""
    from specdecode.attention import apply_rotary

    case = _attention_case(d, seed=2 * d)
    angles = torch.rand(5, d // 2, generator=torch.Generator().manual_seed(d)) * 6  # (T, D/2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # (T, D)
    rotated = dict(case, q=apply_rotary(case["q"], cos, sin), k=apply_rotary(case["k"], cos, sin))
    ops = ops_of(isa)
    want = _run_attention(rotated, [0, 1, 2, 3, 4], ops)  # also checks the rotated keys went into the cache
    cache_k, cache_v = case["cache_k"].clone(), case["cache_v"].clone()
    sees = case["sees"]
    out = torch.full_like(want, float("nan"))
    ops(
        case["q"], case["k"], case["v"], cache_k, cache_v, torch.arange(5), case["new_slots"],
        torch.tensor([0] + [len(s) for s in sees]).cumsum(0), torch.cat(sees), out, cos, sin,
    )  # fmt: skip
    assert torch.equal(out, want)
    assert torch.equal(cache_k[:, case["new_slots"]], rotated["k"])


@pytest.mark.parametrize("m", [1, 24, 25, 64, 200])
def test_approximate_product_keeps_float32_sums_at_any_row_count(m: int) -> None:
    """The greedy screen's error bound assumes the approximate product rounds only its operands:
    at every row count (a batch of 64 decoding requests too), never its outputs."""
    if bf16_tiles() is None:
        pytest.skip("no AVX512_BF16 CPU kernels here")
    kernels = cpu_kernels("avx512")
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=gen), torch.randn(576, 960, generator=gen) * 0.05
    kernel = kernels.approx_for(w)
    assert not kernel.rounds_output
    got = kernel.matmul(x, kernel.pack(w))
    want = x.bfloat16().double() @ w.bfloat16().double()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("isa", isa_ops())
@pytest.mark.parametrize("m", [1, 3, 7, 64])
def test_float_tiles_of_every_build_ignore_the_batch(isa: str, m: int) -> None:
    """`cpu_isa.FloatTiles`, the float32 few-row product of every build: x @ W up to rounding, a
    row's result the same bits alone, and on builds with fused multiply-add (AVX2, AVX-512) the
    same bits as AVX-512's."""
    product, wide = float_tiles(isa), float_tiles("avx512")
    assert product is not None
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 96, generator=gen), torch.randn(96, 960, generator=gen)  # 30 tiles: in groups
    tiled = tiles.tile_weight(w)
    got = product(x, tiled)
    torch.testing.assert_close(got, x @ w, rtol=1e-5, atol=1e-4)
    assert torch.equal(torch.cat([product(x[i : i + 1], tiled) for i in range(m)]), got)
    if isa != "generic" and wide is not None:
        assert torch.equal(got, wide(x, tiled))


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_sets_below_avx512_multiply_float_and_bf16_weights_row_by_row(isa: str) -> None:
    """Below AVX-512 a float32 or bfloat16 checkpoint's layers go through the float tiles (not
    MKL's or oneDNN's products, which round a row by the step's row count)."""
    if row_ops(isa) is None:
        pytest.skip(f"no {isa} build here")
    kernels = cpu_kernels(isa)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(64, 96, generator=gen).to(dtype)
        kernel = kernels.linear_for(w)
        assert kernel.name in ("cpu-f32-tiles", "cpu-bf16-widened")
        packed = kernel.pack(w)
        assert torch.equal(kernel.unpack(packed), w)
        got = kernel.matmul(x.to(dtype), packed)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), x.to(dtype).float() @ w.float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(kernel.matmul(x[4:5].to(dtype), packed)[0], got[4])


def test_a_compiler_without_an_extensions_flag_gets_the_build_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The optional extensions (AVX512-VNNI and VBMI, AVX-VNNI) are compiled in where the CPU has
    them; a compiler that refuses their flags (-mavxvnni needs GCC 11) must not cost the whole
    instruction set: the build is made again without them."""
    from specdecode.kernels import cpu_isa

    isa = next((i for i in ("avx512", "avx2") if cpu_isa._OPTIONAL[i] and build.isa_runs_here(i)), None)
    wanted = {
        flag for cpu_flag, flag in cpu_isa._OPTIONAL.get(isa or "", ()) if cpu_flag in build.cpu_flags()
    }
    if isa is None or not wanted:
        pytest.skip("needs a CPU with one of the builds' optional extensions")
    real = build.load
    asked: list[tuple[str, ...]] = []

    def old_compiler(name: str, sources: tuple, flags: tuple[str, ...]) -> object:
        asked.append(flags)
        return None if wanted & set(flags) else real(name, sources, flags)

    monkeypatch.setattr(build, "load", old_compiler)
    lib = cpu_isa.library.__wrapped__(isa)
    assert lib is not None and len(asked) == 2
    assert wanted <= set(asked[0]) and not wanted & set(asked[1])
    plain = cpu_isa.library(isa, optional=False)
    assert plain is not None and lib._name == plain._name  # the same library file: no extensions


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_a_build_takes_the_extensions_the_cpu_has(isa: str) -> None:
    """Where the CPU lists a build's optional extensions (VNNI, VBMI, AVX-VNNI) and the compiler
    takes their flags, the build the kernels load has them: a source that does not compile with
    them would otherwise fall back, without a word, to the slower build without them."""
    if not build.isa_runs_here(isa) or build.compiler() is None:
        pytest.skip(f"the {isa} build does not run here")
    flags = [flag for cpu_flag, flag in cpu_isa._OPTIONAL.get(isa, ()) if cpu_flag in build.cpu_flags()]
    if not flags:
        pytest.skip(f"the CPU lists none of the {isa} build's optional extensions")
    probe = subprocess.run(
        [str(build.compiler()), "-x", "c++", "-fsyntax-only", *cpu_isa._BUILDS[isa], *flags, "-"],
        input="int main() { return 0; }\n", capture_output=True, text=True, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"the compiler does not take {' '.join(flags)}")
    with_them, without = cpu_isa.library(isa), cpu_isa.library(isa, optional=False)
    assert with_them is not None and without is not None
    assert with_them._name != without._name


@pytest.mark.parametrize("isa", build.ISAS)
def test_every_build_the_cpu_runs_compiles(isa: str) -> None:
    """Each build this CPU can run compiles and loads wherever there is a compiler. The kernel
    tests skip a build that is not there, so a source that fails to compile for one instruction
    set (the portable build once did, from a name defined only for x86) would otherwise read as
    a skip, not as a failure."""
    if not build.isa_runs_here(isa) or build.compiler() is None:
        pytest.skip(f"the {isa} build does not run here")
    assert cpu_isa.library(isa) is not None, f"the {isa} build does not compile"
    bare = cpu_isa.library(isa, optional=False)
    assert bare is not None, f"the {isa} build without its extensions does not compile"
