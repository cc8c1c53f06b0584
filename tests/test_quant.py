"""Weights kept in GGUF block formats: every instruction set's build that runs here dequantizes
exactly as gguf-py does, keeps each row independent of its batch, and a GGUF model run as stored
decodes as the same model dequantized, plain and speculative."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.bench import runtime
from specdecode.errors import SpecDecodeError
from specdecode.kernels import (
    GGUF_LAYOUT,
    QUANT_FORMATS,
    REFERENCE,
    QuantPart,
    QuantWeight,
    build,
    cpu_isa,
    dequantize,
    select,
)
from specdecode.kernels.quant import QuantCPU, quant_kernel
from tests.tiny_gguf import CONTEXT, write_tiny_gguf

# Formats whose decoding rows a model run with int8 activations reads in int8 (AVX-512, AVX2).
INT8_DECODED = ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0")

pytestmark = pytest.mark.usefixtures("one_thread")


def isa_params() -> list[object]:
    return [
        pytest.param(isa, marks=pytest.mark.skipif(quant_kernel(isa) is None, reason=f"no {isa} build here"))
        for isa in build.ISAS
    ]


def random_weight(fmt: str, rows: int, cols: int, seed: int) -> QuantWeight:
    """Random blocks of `fmt` with small, finite float16 scales (any bytes are valid quants)."""
    rng = np.random.default_rng(seed)
    _, per, size = QUANT_FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    scales = (rng.random((rows, cols // per, 2)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    at = {"Q4_K": (0, 2), "Q6_K": (208,)}.get(fmt, (0, 2) if fmt == "Q4_1" else (0,))
    for i, offset in enumerate(at):
        raw[:, :, offset : offset + 2] = scales[:, :, 2 * i : 2 * i + 2]
    return QuantWeight(cols, (QuantPart(fmt, torch.from_numpy(raw.reshape(rows, -1))),))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
@pytest.mark.parametrize("outputs", [37, 64])  # a unit of 32 outputs padded, and whole ones
def test_products_of_stored_weights(isa: str, fmt: str, outputs: int) -> None:
    kernel = quant_kernel(isa)
    assert kernel is not None
    weight = kernel.pack(random_weight(fmt, outputs, 512, seed=len(fmt)))
    reference = dequantize(random_weight(fmt, outputs, 512, seed=len(fmt)))  # (in, out), by gguf-py
    assert torch.equal(kernel.rows(weight, torch.arange(outputs)), reference.t())  # the same values, bitwise
    assert torch.equal(kernel.rows(weight, torch.tensor([outputs - 1, 3])), reference.t()[[outputs - 1, 3]])
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1))
    y = kernel.matmul(x, weight)  # 40 rows: through scratch (AVX2: in registers, half tiles)
    want = x.double() @ reference.double()
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-6 * float(want.abs().max()))
    # a row alone, in register blocks of each size, several passes of them, and through scratch
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 23):
        assert torch.equal(kernel.matmul(x[:m], weight), y[:m]), m
    assert torch.equal(torch.cat([kernel.matmul(x[i : i + 1], weight) for i in range(40)]), y)
    # a prompt's rows: their own arithmetic, as close to the reference, each row on its own too
    pre = kernel.matmul(x, weight, prefill=True)
    torch.testing.assert_close(pre.double(), want, rtol=0, atol=1e-6 * float(want.abs().max()))
    for m in (1, 5, 7, 13):
        assert torch.equal(kernel.matmul(x[:m], weight, prefill=True), pre[:m]), m


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_avx2_and_avx512_give_the_same_bits(fmt: str) -> None:
    """Both builds keep the same quants and scales (AVX-512 its 4-bit quants in words, AVX2 in
    GGUF's byte pairs for float rows and in words for int8 rows, the very bytes of AVX-512's, and
    there Q6_K's too) and the same 16 lanes of fused multiply-adds in the same order, so a model
    decodes the same tokens on a CPU with AVX-512 and on one with only AVX2."""
    wide, narrow = quant_kernel("avx512"), quant_kernel("avx2")
    if wide is None or narrow is None:
        pytest.skip("needs both the AVX-512 and the AVX2 build")
    stored = random_weight(fmt, 21, 768, seed=7)
    weight, again = wide.pack(stored), narrow.pack(stored)
    assert wide.layout != narrow.layout and torch.equal(wide.dequantize(weight), narrow.dequantize(again))
    with pytest.raises(ValueError, match="packed by it"):  # one build's layout is not read as the other's
        narrow.matmul(torch.ones(1, 768), weight)
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(2))
    for m in (1, 2, 3, 5, 12, 24, 40):  # in registers (AVX2: at every count) and through AVX-512's scratch
        assert torch.equal(wide.matmul(x[:m], weight), narrow.matmul(x[:m], again))
        prompt = wide.matmul(x[:m], weight, prefill=True)
        assert torch.equal(prompt, narrow.matmul(x[:m], again, prefill=True))
    wide8, narrow8 = wide.approximate(), narrow.approximate()
    weight8, again8 = wide8.pack(weight), narrow8.pack(again)  # AVX2's 4-bit quants laid out anew
    assert wide8.layout == wide.layout and narrow8.layout == "tiles32-words4-words6"
    assert torch.equal(wide8.dequantize(weight8), narrow8.dequantize(again8))
    for a, b in zip(weight8.parts, again8.parts, strict=True):
        assert torch.equal(a.data, b.data) == (fmt != "Q6_K")  # Q6_K: AVX-512's triples, AVX2's words
    for m in (1, 2, 3, 5, 12, 24, 40):
        draft = wide8.matmul(x[:m], weight8, prefill=True)  # integer sums, then the same floats
        assert torch.equal(draft, narrow8.matmul(x[:m], again8, prefill=True))
        decoding = wide8.matmul(x[:m], weight8)  # int8 (words, quads)
        assert torch.equal(decoding, narrow8.matmul(x[:m], again8))


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_pairing_tiles_or_not_gives_the_same_bits(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether few rows pair a unit's two tiles is the machine's choice (timed when the AVX-512
    build loads, or forced by SPECDECODE_PAIR_TILES): it never changes a result, at any row count
    through either path."""
    kernel = quant_kernel("avx512")
    if kernel is None:
        pytest.skip("needs the AVX-512 build")
    lib = kernel._lib
    monkeypatch.setenv("SPECDECODE_PAIR_TILES", "0")
    assert cpu_isa.tile_pairing(lib) is False
    monkeypatch.setenv("SPECDECODE_PAIR_TILES", "1")
    assert cpu_isa.tile_pairing(lib) is True
    monkeypatch.delenv("SPECDECODE_PAIR_TILES")
    chosen = cpu_isa.tile_pairing(lib)  # timed
    weight = kernel.pack(random_weight(fmt, 80, 512, seed=11))  # two units and a padded one
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(12))
    try:
        outs = []
        for on in (0, 1):
            lib.specdecode_pair_tiles(on)
            outs.append([kernel.matmul(x[:m], weight) for m in (1, 2, 3, 4, 5, 6, 7, 12, 13, 20, 32, 33)])
    finally:
        lib.specdecode_pair_tiles(int(chosen))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(outs[0][-2], torch.cat([kernel.matmul(x[i : i + 1], weight) for i in range(32)]))


def on_int8_grid(rows: int, cols: int, seed: int) -> torch.Tensor:
    """x (rows, cols) that int8 rounding per group of 32 keeps exactly: integers in [-127, 127]
    times a power of two per group, each group's largest magnitude 127."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g).float()
    q[:, :, 0] = 127.0 * torch.where(torch.rand(rows, cols // 32, generator=g) < 0.5, -1.0, 1.0)
    scale = 2.0 ** torch.randint(-9, -3, (rows, cols // 32, 1), generator=g).float()
    return (q * scale).reshape(rows, cols)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_a_drafts_prompt_rows_in_int8(isa: str, fmt: str) -> None:
    """`approximate()`'s prefill rows round x to int8 per group of 32 and sum x q in integers:
    exact (to float rounding) where that rounding keeps x, close elsewhere; each row on its own.
    Its decoding rows are the same int8 products for the 4-bit formats, Q6_K and Q8_0 (signed
    quants) on AVX-512 and AVX2 (Q4_0, Q4_1 and Q4_K read from their words, and on AVX2 Q6_K),
    bit for bit those of the prompt rows, one row or several; elsewhere (Q5_0, the portable build)
    they are the exact kernel's, bit for bit. Its layout may hold the quants another way than the
    exact kernel's (AVX2: words, not byte pairs or triples): a weight packed by one is laid out
    for the other, the same values, and back to the same bytes. (61 outputs: a unit and one
    with a tile and 13 outputs; 768 inputs: AVX2's prompt rows take a tile's groups 16 at a
    time, `TILE_GROUPS`, so two runs of them.)"""
    exact = quant_kernel(isa)
    assert exact is not None
    draft = exact.approximate()
    assert draft.name != exact.name and draft.layout == (
        exact.layout if isa != "avx2" else "tiles32-words4-words6"
    )
    packed = exact.pack(random_weight(fmt, 61, 768, seed=3))  # a unit padded
    weight = draft.pack(packed)
    assert draft.repacks(exact.layout) == (draft.layout != exact.layout) and exact.repacks(GGUF_LAYOUT)
    assert torch.equal(draft.dequantize(weight), exact.dequantize(packed))
    back = exact.pack(weight)
    assert all(torch.equal(a.data, b.data) for a, b in zip(back.parts, packed.parts, strict=True))
    if draft.layout != exact.layout:  # each reads its own layout only
        with pytest.raises(ValueError, match="packed by it"):
            exact.matmul(torch.ones(1, 768), weight)
    w = dequantize(random_weight(fmt, 61, 768, seed=3)).double()  # (in, out)
    x = on_int8_grid(140, 768, seed=4)  # past 128: Q8_0 too takes the prompt rows
    want = x.double() @ w
    pre = draft.matmul(x, weight, prefill=True)
    torch.testing.assert_close(pre.double(), want, rtol=0, atol=1e-6 * float(want.abs().max()))
    for m in (1, 5, 6, 7, 13):  # each register block size and a remainder
        assert torch.equal(draft.matmul(x[:m], weight, prefill=True), pre[:m]), m
    noisy = torch.randn(70, 768, generator=torch.Generator().manual_seed(5))  # past 64: prompt rows
    off = draft.matmul(noisy, weight, prefill=True).double() - noisy.double() @ w
    assert float(off.norm() / (noisy.double() @ w).norm()) < 0.02
    decoding = draft.matmul(noisy, weight)
    if isa in ("avx512", "avx2") and fmt in INT8_DECODED:
        assert torch.equal(decoding, draft.matmul(noisy, weight, prefill=True))
        assert not torch.equal(decoding, exact.matmul(noisy, packed))
        for m in (*range(1, 10), 13):  # each pass's rows (up to 8), and several passes of them
            assert torch.equal(draft.matmul(noisy[:m], weight), decoding[:m]), m
        alone = [draft.matmul(noisy[i : i + 1], weight) for i in range(20)]
        assert torch.equal(torch.cat(alone), decoding[:20])
    else:
        assert torch.equal(decoding, exact.matmul(noisy, packed))


def identity_q8_0(n: int) -> QuantWeight:
    """Q8_0 blocks holding the n x n identity: every scale 1.0, quant 1 on the diagonal."""
    raw = np.zeros((n, n // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    for i in range(n):
        raw[i, i // 32, 2 + i % 32] = 1
    return QuantWeight(n, (QuantPart("Q8_0", torch.from_numpy(raw.reshape(n, -1))),))


@pytest.mark.parametrize("isa", isa_params())
def test_int8_rows_round_x_to_nearest_even(isa: str) -> None:
    """The int8 rows round x per group of 32 to round(x * (127 / max|x|)), ties to even, with
    scale max|x| / 127 (float32 throughout): through the identity each output is its int8 x times
    the group's scale, the same bits as torch computes them, for decoding rows (a few, from the
    AVX-512 and AVX2 builds' vector rounding) and prompt rows alike. Ties are made exact: each
    group's largest magnitude is 127 / 2^e, so x * (127 / max|x|) = x * 2^e lands on k + 0.5."""
    draft = quant_kernel(isa)
    assert draft is not None
    draft = draft.approximate()
    n = 256
    weight = draft.pack(identity_q8_0(n))
    g = torch.Generator().manual_seed(21)
    rows = 9
    e = torch.randint(-3, 6, (rows, n // 32, 1), generator=g).float()
    ties = (torch.randint(-127, 127, (rows, n // 32, 32), generator=g).float() + 0.5) * 2.0**-e
    noise = torch.randn(rows, n // 32, 32, generator=g) * 2.0**-e * 40
    x = torch.where(torch.rand(rows, n // 32, 32, generator=g) < 0.5, ties, noise)
    signs = torch.where(torch.rand(rows, n // 32, generator=g) < 0.5, -1.0, 1.0)
    x[:, :, 0] = 127.0 * 2.0 ** -e[:, :, 0] * signs
    x[0, 1] = 0.0  # a group of zeros: scale 0, quants 0
    amax = x.abs().amax(-1, keepdim=True)  # (rows, groups, 1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(x * inv)  # half to even
    assert bool((q.abs() <= 127).all()) and bool(((x * inv).frac().abs() == 0.5).any())
    want = (q * (amax / 127.0)).reshape(rows, n)
    assert torch.equal(draft.matmul(x.reshape(rows, n), weight, prefill=True), want)
    if isa in ("avx512", "avx2"):  # their decoding rows are int8 too (Q8_0's)
        for m in (1, 2, 3, 9):
            assert torch.equal(draft.matmul(x.reshape(rows, n)[:m], weight), want[:m]), m


@pytest.mark.parametrize("isa, flag", [("avx512", "avx512_vnni"), ("avx2", "avx_vnni")])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_builds_without_vnni_give_the_same_int8_sums(isa: str, flag: str, fmt: str) -> None:
    """Where the CPU has AVX512-VNNI the AVX-512 build sums a draft's int8 rows with `vpdpbusd`
    (and, with AVX512-VBMI, spreads Q6_K's quads with byte permutes and multishifts, and
    takes Q8_0's quants from three rows on as unsigned q + 128 with -128 sum(x) added back); where
    it has AVX-VNNI the AVX2 build does with its 256-bit `vpdpbusd`. Built without them (a CPU that
    lacks them), with `vpmaddubsw` pairs added in int16 and shifts and masks: the same integer
    sums, so the same bits. Prompt rows take the decoding rows up to a number of rows that depends
    on the build and the format (`PROMPT_AS_DECODING`), the prompt rows' own kernel past it: 70
    rows take that kernel in some builds and formats and the decoding rows in others (AVX2 with
    VNNI: always the decoding rows), so the two kernels are held to the same bits here too."""
    vnni = quant_kernel(isa)
    if vnni is None or flag not in build.cpu_flags():
        pytest.skip(f"needs a CPU that runs the {isa} build and has {flag}")
    lib = cpu_isa.library(isa, optional=False)
    assert lib is not None
    plain = QuantCPU(isa, lib).approximate()
    weight = vnni.approximate().pack(random_weight(fmt, 40, 768, seed=11))
    x = torch.randn(70, 768, generator=torch.Generator().manual_seed(12))
    want = vnni.approximate().matmul(x, weight, prefill=True)
    assert torch.equal(plain.matmul(x, weight, prefill=True), want)
    assert torch.equal(plain.matmul(x[:9], weight, prefill=True), want[:9])
    for m in (1, 2, 3, 9):  # decoding rows (Q4_0's: int8 from its words)
        assert torch.equal(plain.matmul(x[:m], weight), vnni.approximate().matmul(x[:m], weight)), m


@pytest.mark.parametrize("isa", isa_params())
def test_fused_parts_in_several_formats(isa: str) -> None:
    kernel = quant_kernel(isa)
    assert kernel is not None
    shapes = (("Q8_0", 5), ("Q4_K", 7), ("Q6_K", 3))
    parts = [kernel.pack(random_weight(f, n, 256, seed=n)) for f, n in shapes]
    fused = QuantWeight(256, tuple(p.parts[0] for p in parts))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(15)
    got = kernel.matmul(x, fused, bias)
    assert torch.equal(got, torch.cat([kernel.matmul(x, p) for p in parts], dim=1) + bias)
    assert torch.equal(kernel.dequantize(fused), torch.cat([kernel.dequantize(p) for p in parts], dim=1))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K"])
def test_first_outputs_are_a_view_of_the_weight(isa: str, fmt: str) -> None:
    """A weight's first n outputs (whole units of 32) share its memory and multiply to the first
    n columns of its product, bit for bit (a draft reading part of its LM head); a cut inside a
    unit, or past the weight, is refused."""
    kernel = quant_kernel(isa)
    assert kernel is not None
    weight = kernel.pack(random_weight(fmt, 100, 512, seed=3))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
    whole = kernel.matmul(x, weight)  # (5, 100)
    for n in (32, 64, 100):
        first = kernel.first_outputs(weight, n)
        assert first is not None and first.out_features == n
        assert first.parts[0].data.data_ptr() == weight.parts[0].data.data_ptr()
        assert first.nbytes <= weight.nbytes
        for m in (1, 5):
            assert torch.equal(kernel.matmul(x[:m], first), whole[:m, :n])
    assert kernel.first_outputs(weight, 32).nbytes * 2 == kernel.first_outputs(weight, 64).nbytes
    for n in (0, 20, 101):
        assert kernel.first_outputs(weight, n) is None


def test_a_kernel_takes_only_weights_in_its_layout() -> None:
    kernel = select("cpu").quant
    if kernel is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    stored = random_weight("Q4_0", 32, 64, seed=0)
    with pytest.raises(ValueError, match="not laid out as gguf"):
        kernel.matmul(torch.randn(1, 64), stored)
    packed = kernel.pack(stored)
    assert kernel.pack(packed) is packed  # its own layout: as it is
    other = QuantWeight(64, (QuantPart("Q4_0", packed.parts[0].data, "tiles16", 32),))  # no build's
    with pytest.raises(ValueError, match="cannot pack a weight laid out as tiles16"):
        kernel.pack(other)
    with pytest.raises(ValueError, match="gguf-py cannot read"):
        dequantize(kernel.pack(stored))


def test_forced_instruction_set_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.ENV_ISA, "neon")
    with pytest.raises(SpecDecodeError, match="must be one of avx512, avx2, generic, off"):
        select("cpu")
    monkeypatch.setenv(build.ENV_ISA, "avx2")
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse2"}))
    with pytest.raises(SpecDecodeError, match="cannot run it"):
        select("cpu")
    monkeypatch.setenv(build.ENV_ISA, "off")
    assert select("cpu") is REFERENCE


FORMATS = {  # mixed formats, as Q4_K_M files mix them: q|k|v is fused over three
    ".attn_q.weight": "Q8_0",
    ".attn_k.weight": "Q4_0",
    ".attn_v.weight": "Q4_1",
    ".attn_output.weight": "Q5_0",
    ".ffn_gate.weight": "Q4_0",
    ".ffn_up.weight": "Q8_0",
    ".ffn_down.weight": "Q4_1",
    "token_embd.weight": "Q8_0",
}


@pytest.fixture(scope="module")
def quant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(
        tmp_path_factory.mktemp("q") / "q.gguf", "llama", tied=True, width=4, formats=FORMATS
    ).path


def test_gguf_as_stored_decodes_as_dequantized(quant_gguf: Path) -> None:
    if select("cpu").quant is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    stored = LLM(str(quant_gguf), progress=False)  # dtype "auto": as stored
    plain = LLM(str(quant_gguf), dtype="float32", progress=False)
    layer = stored.model.layers[0]
    assert layer.qkv.quantized is not None and [p.format for p in layer.qkv.quantized.parts] == [
        "Q8_0",
        "Q4_0",
        "Q4_1",
    ]
    assert stored.model.lm_head is not None and stored.model.lm_head.quantized is not None
    torch.testing.assert_close(layer.qkv.matrix(), plain.model.layers[0].qkv.matrix(), rtol=0, atol=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[200 + i, 5, 17, 200 + i, 5] for i in range(4)]
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.token_ids for o in stored.generate(prompts, params, use_tqdm=False)]
    assert got == want
    for spec in (
        {"method": "prompt_lookup"},
        {"method": "lookahead", "window_size": 3, "ngram_size": 3, "verification_set_size": 3},
    ):
        assert [
            o.token_ids for o in stored.generate(prompts, params, use_tqdm=False, speculative=spec)
        ] == got


# ---- float checkpoints quantized on load --------------------------------------------------------


def round_trip(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """`weight` (out, in) through gguf-py's quantizer and back: the values a quantized layer holds."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize

    kind = GGMLQuantizationType[fmt]
    return torch.from_numpy(gguf_dequantize(quantize(weight.float().numpy(), kind), kind))


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_checkpoint_quantized_on_load_decodes_as_its_round_trip(
    fmt: str, arch: str, tmp_path: Path
) -> None:
    """`quantization=` holds every linear weight and the LM head in `fmt` blocks, and greedy
    decoding gives the tokens of a float model whose weights are those blocks dequantized (the
    input embedding stays float)."""
    from tests.tiny import make_tiny_hf, write_chat_tokenizer

    if select("cpu").quant is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    hf = make_tiny_hf(arch, tmp_path / "float")
    with torch.no_grad():
        embed = hf.model.embed_tokens.weight
        if hf.config.tie_word_embeddings:  # the reference unties: its input embedding stays float
            hf.config.tie_word_embeddings = False
            hf.lm_head.weight = torch.nn.Parameter(embed.detach().clone())
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(round_trip(p, fmt.upper()))
    hf.save_pretrained(tmp_path / "round_trip")
    for out in ("float", "round_trip"):
        write_chat_tokenizer(tmp_path / out)

    quantized = LLM(str(tmp_path / "float"), quantization=fmt, progress=False)
    reference = LLM(str(tmp_path / "round_trip"), dtype="float32", progress=False)
    for layer in quantized.model.layers:
        for dense in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert dense.quantized is not None and {p.format for p in dense.quantized.parts} == {fmt.upper()}
    head = quantized.model.lm_head
    assert head is not None and head.quantized is not None
    torch.testing.assert_close(
        quantized.model.layers[0].gate_up.matrix(), reference.model.layers[0].gate_up.matrix(), rtol=0, atol=0
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 5, 17, 3 + i, 5] for i in range(4)]
    want = [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in quantized.generate(prompts, params, use_tqdm=False)] == want


def test_quantization_on_load_is_checked(quant_gguf: Path, tmp_path: Path) -> None:
    from tests.tiny import make_tiny_hf, write_chat_tokenizer

    make_tiny_hf("llama", tmp_path)
    write_chat_tokenizer(tmp_path)
    with pytest.raises(SpecDecodeError, match="unknown quantization 'q3_k'"):
        LLM(str(tmp_path), quantization="q3_k", progress=False)
    with pytest.raises(SpecDecodeError, match="computes in float32"):
        LLM(str(tmp_path), quantization="q8_0", dtype="bfloat16", progress=False)
    with pytest.raises(SpecDecodeError, match="already quantized"):
        LLM(str(quant_gguf), quantization="q8_0", progress=False)


def test_the_whole_decoder_in_one_call_gives_the_layers_bits(quant_gguf: Path) -> None:
    """`Kernels.decoder` runs every layer in one call with the kernels the layers call one by
    one: a prompt, a decoding chain and a tree give the same hidden states bit for bit either
    way, and so do an engine's steps that decode one request beside another's prompt chunks."""
    from specdecode.attention import AttentionPlan, Segment, tree_mask
    from specdecode.engine.config import EngineConfig
    from specdecode.engine.llm_engine import EngineRequest

    llm = LLM(str(quant_gguf), progress=False)
    model = llm.model
    if model.one_call.decoder is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    decoder, prepared = model.one_call.decoder
    calls: list[tuple[int, int]] = []  # (rows, prefill_from) of each one-call forward

    class Counting:  # the decoder, counting its calls
        def prepare(self, layers):  # type: ignore[no-untyped-def]
            return decoder.prepare(layers)

        def run(self, *args):  # type: ignore[no-untyped-def]
            calls.append((args[1].shape[0], args[-1]))
            return decoder.run(*args)

    def forwards() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            cache = model.new_cache(64)
            out.append(model(torch.tensor([[200, 5, 17, 200, 5, 9, 31, 8]]), torch.arange(8)[None], cache))
            chain = AttentionPlan([Segment.append(cache, 3)])
            out.append(model.forward_plan(torch.tensor([[4, 7, 9]]), torch.arange(8, 11)[None], chain))
            parents = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]])
            tree = AttentionPlan([Segment.append(cache, 4, tree_mask(8, parents))])
            out.append(model.forward_plan(torch.tensor([[4, 7, 9, 2]]), torch.tensor([[8, 9, 9, 10]]), tree))
        return out

    def engine_tokens() -> dict[str, list[int]]:
        engine = llm.new_engine(EngineConfig(block_size=4, max_batch_tokens=6, policy=False))
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest("a", [200, 5, 17], params, None))
        engine.step()  # "a" is decoding when "b"'s long prompt arrives: it prefills in chunks beside
        engine.add_request(EngineRequest("b", [(7 * i) % 90 + 3 for i in range(20)], params, None))
        out: dict[str, list[int]] = {"a": [], "b": []}
        while engine.has_unfinished():
            for d in engine.step():
                out[d.request_id] += d.new_token_ids
        return out

    try:
        model.one_call.decoder = (Counting(), prepared)  # type: ignore[assignment]
        fused, fused_tokens = forwards(), engine_tokens()
        model.one_call.decoder = None
        by_layer, layer_tokens = forwards(), engine_tokens()
    finally:
        model.one_call.decoder = (decoder, prepared)
    assert calls[:3] == [(8, 8), (3, 3), (4, 4)]  # each forward above ran as one call
    assert any(0 < p < rows for rows, p in calls[3:])  # decoding rows beside prefill rows
    for a, b in zip(fused, by_layer, strict=True):
        assert torch.equal(a, b)
    assert fused_tokens == layer_tokens


# ---- drafter heads beside a target run as stored -------------------------------------------------


def test_a_draft_model_reads_its_prompt_in_int8(quant_gguf: Path) -> None:
    """A draft model runs on `Kernels.int8_activations()`: its prompt's rows take the int8 products,
    in one decoder call as layer by layer (the same bits), close to the target's float ones; so
    do its decoding rows of Q4_0, Q4_1, Q4_K and Q6_K on AVX-512 and AVX2, else they are the target's, bit
    for bit; and speculation with it stays exact."""
    llm = LLM(str(quant_gguf), progress=False)
    if llm.model.kernels.quant is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    target, draft = llm.model, llm.drafters.draft_model(str(quant_gguf), "stored")
    assert draft is not target and draft.kernels.name == f"{target.kernels.name}-int8"
    ids = torch.tensor([[(7 * i) % 90 + 3 for i in range(40)]])

    def hidden(model: torch.nn.Module, prompt: bool) -> torch.Tensor:
        with torch.inference_mode():
            return model(ids, torch.arange(40)[None], model.new_cache(64), prompt=prompt)[0]

    one_call, decoding = hidden(draft, prompt=True), hidden(draft, prompt=False)
    decoder, draft.one_call.decoder = draft.one_call.decoder, None  # the layers one by one
    try:
        assert torch.equal(hidden(draft, prompt=True), one_call)
        assert torch.equal(hidden(draft, prompt=False), decoding)
    finally:
        draft.one_call.decoder = decoder
    exact = hidden(target, prompt=True)
    assert not torch.equal(one_call, exact)
    # (a random model's 2 layers magnify the rounding: 20% of the norm here; each product is
    # checked against its exact sum in test_a_drafts_prompt_rows_in_int8)
    assert float(torch.nn.functional.cosine_similarity(one_call, exact).mean()) > 0.9
    exact_decoding = hidden(target, prompt=False)
    if draft.kernels.quant.isa in ("avx512", "avx2"):  # its 4-bit rows in int8
        assert float(torch.nn.functional.cosine_similarity(decoding, exact_decoding).mean()) > 0.9
    else:
        assert torch.equal(decoding, exact_decoding)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = llm.generate([ids[0].tolist()], params, use_tqdm=False)[0].token_ids
    spec = {"method": "draft_model", "draft_model": str(quant_gguf), "draft_dtype": "stored"}
    assert llm.generate([ids[0].tolist()], params, use_tqdm=False, speculative=spec)[0].token_ids == plain


def test_a_target_with_int8_activations_speculates_exactly(quant_gguf: Path) -> None:
    """`activations="int8"` runs the target on `Kernels.int8_activations()`, as llama.cpp computes:
    its logits move a little from the float32 run's, but a row's result is still the same alone
    or in any batch (a verified draft's rows are those plain decoding computes one at a time),
    so every method's greedy output equals its own plain decoding's, token for token."""
    exact = LLM(str(quant_gguf), progress=False)
    if exact.model.kernels.quant is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    llm = LLM(str(quant_gguf), activations="int8", progress=False)
    model = llm.model
    assert model.kernels.name == f"{exact.model.kernels.name}-int8"
    ids = torch.tensor([[(5 * i) % 80 + 7 for i in range(30)]])  # (1, 30)
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(ids[:, :24], torch.arange(24)[None], cache, prompt=True)
        rows = model(ids[:, 24:], torch.arange(24, 30)[None], cache)[0]  # (6, C): a verified draft's
        cache.truncate(24)
        alone = torch.cat([model(ids[:, t : t + 1], torch.tensor([[t]]), cache)[0] for t in range(24, 30)])
        assert torch.equal(rows, alone)
        float_rows = exact.model(ids, torch.arange(30)[None], exact.model.new_cache(64))[0, 24:]
    quant = model.kernels.quant
    for layer in model.layers:  # laid out anew for the int8 rows where that differs, not dequantized
        for dense in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert dense.quantized is not None and dense.kernel is quant
            assert dense.quantized.layout == quant.layout
    assert model.one_call.decoder is not None
    assert not torch.equal(rows, float_rows)
    assert float(torch.nn.functional.cosine_similarity(rows, float_rows).mean()) > 0.9
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[200 + i, 5, 17, 200 + i, 5] for i in range(4)]
    plain = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    for spec in (
        {"method": "prompt_lookup"},
        {"method": "lookahead", "window_size": 3, "ngram_size": 3, "verification_set_size": 3},
        {"method": "draft_model", "draft_model": str(quant_gguf), "draft_dtype": "stored"},
    ):
        got = llm.generate(prompts, params, use_tqdm=False, speculative=spec)
        assert [o.token_ids for o in got] == plain, spec


def test_bench_runtime_times_int8_activations(quant_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`specdecode bench-runtime --activations int8 --depth 256 --depth 16`: the forward-latency
    curve of the int8 rows after each depth (a model with fewer positions than 256 cached tokens
    and the widest forward: timed after as many as it holds), the first read against the bounds,
    the second printed with what it costs beyond the first."""
    if select("cpu").quant is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    report = runtime.run(str(quant_gguf), "auto", 8, 1, None, activations="int8", depths=(256, 16))
    held = CONTEXT - max(runtime.LATENCY_WIDTHS)
    assert report.activations == "int8" and report.context == held
    assert list(report.forward_ms_by_context) == [held, 16]
    for curve in report.forward_ms_by_context.values():
        assert set(curve) == set(runtime.LATENCY_WIDTHS) and all(ms > 0 for ms in curve.values())
    assert report.forward_ms == report.forward_ms_by_context[held]
    shallow = report.forward_ms_by_context[16]
    assert report.depth_cost_ms(16) == {t: round(shallow[t] - report.forward_ms[t], 2) for t in shallow}
    assert report.as_dict()["forward_ms_by_context"] == report.forward_ms_by_context
    m = report.machine
    assert m is not None and m.kernels.endswith("-int8")
    # the compute bound is the int8 dot products' rate where the build has them (not the portable one)
    if m.kernels.startswith(("cpu-avx2", "cpu-avx512")):
        assert m.peak_int8_ops is not None and m.peak_int8_ops > 0
        bound = report.bounds_ms(4)
        assert bound is not None and bound[1] == pytest.approx(
            1000 * 4 * 2 * m.weight_params / m.peak_int8_ops
        )
    else:
        assert m.peak_int8_ops is None
    runtime.print_report(report)
    out = capsys.readouterr().out
    assert "activations int8" in out and f"over a {report.context}-token context" in out
    assert f"the same over a 16-token context, and beyond the {held}-token one" in out
    assert ("G int8 ops/s (the bound)" in out) == (m.peak_int8_ops is not None)


def test_int8_activations_need_weights_in_block_formats(quant_gguf: Path) -> None:
    with pytest.raises(SpecDecodeError, match="unknown activations 'int4'"):
        LLM(str(quant_gguf), activations="int4", progress=False)
    with pytest.raises(SpecDecodeError, match="activations=int8 needs weights in block formats"):
        LLM(str(quant_gguf), dtype="float32", activations="int8", progress=False)


def test_a_float_dense_quantized_holds_the_round_trip() -> None:
    """`Dense.quantize` holds the blocks gguf-py writes; bound to the quantized kernel, its product
    is that of the round trip (a drafter head's layers beside a stored target)."""
    from specdecode.kernels import quantize
    from specdecode.layers.linear import Dense

    kernels = select("cpu")
    if kernels.quant is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    dense = Dense(64, 40, bias=True)
    with torch.no_grad():
        dense.bias.normal_()  # type: ignore[union-attr]
    want = round_trip(dense.weight_t.detach().t(), "Q8_0").t()  # (in, out)
    assert torch.equal(dequantize(quantize(dense.weight_t, "q8_0")), want)
    dense.quantize("Q8_0")
    dense.bind_kernels(kernels)
    assert dense.kernel is kernels.quant and torch.equal(dense.matrix(), want)
    x = torch.randn(3, 64)
    torch.testing.assert_close(dense(x), x @ want + dense.bias, rtol=1e-5, atol=1e-5)
    odd = Dense(48, 8)  # inputs that are not whole blocks of 32 stay float
    odd.quantize("Q8_0")
    assert odd.quantized is None


def test_an_eagle_head_runs_its_layer_in_one_call(quant_gguf: Path, tmp_path: Path) -> None:
    """EAGLE's draft layer (no norm before attention) beside a stored target runs through the
    one-call decoder, with the same bits as its layer called op by op: prompt pairs, then a
    draft tree's depth over them."""
    from specdecode.drafters.eagle import EagleHead, save_head

    llm = LLM(str(quant_gguf), progress=False)
    target = llm.model
    if target.one_call.decoder is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    torch.manual_seed(0)
    path = save_head(EagleHead(target.config), tmp_path / "eagle", target="tiny", dtype=torch.float32)
    head = llm.drafters.head("eagle", str(path))
    assert not head.input_norm
    kernels, c = head.layer.kernels, target.config.hidden_size
    with torch.inference_mode():  # lays the layer out for the one-call decoder
        zero = torch.zeros(1, c)
        head.run(head.new_cache(4, torch.float32, "cpu"), zero, zero, torch.arange(1))
    assert head.one_call.kernels is kernels and head.one_call.decoder is not None
    decoder, prepared = head.one_call.decoder
    calls: list[int] = []  # rows of each one-call forward

    class Counting:  # the decoder, counting its calls
        def run(self, *args):  # type: ignore[no-untyped-def]
            calls.append(args[1].shape[0])
            return decoder.run(*args)

    tokens = torch.tensor([200, 5, 17, 31, 8, 4, 7, 9])
    features = torch.randn(8, c)

    def outputs() -> list[torch.Tensor]:
        with torch.inference_mode():
            cache = head.new_cache(16, torch.float32, "cpu")
            embeds = target.embed(tokens)
            prompt = head.run(cache, embeds[:5], features[:5], torch.arange(5))
            mask = torch.zeros(3, 8, dtype=torch.bool)
            mask[:, :5] = True
            mask[0, 5] = mask[1, 6] = mask[2, 7] = True  # three siblings over the prompt
            tree = head.run(cache, embeds[5:], features[5:], torch.full((3,), 5), mask)
        return [prompt, tree]

    try:
        head.one_call.decoder = (Counting(), prepared)  # type: ignore[assignment]
        fused = outputs()
        head.one_call.decoder = None  # the layer op by op
        by_layer = outputs()
    finally:
        head.one_call.decoder = (decoder, prepared)
    assert calls == [5, 3]
    for a, b in zip(fused, by_layer, strict=True):
        assert torch.equal(a, b)


def test_heads_beside_a_stored_target_draft_from_blocks(quant_gguf: Path, tmp_path: Path) -> None:
    """A target run as stored gets its drafter heads' layers, and the draft vocabulary's columns of
    its LM head, in Q8_0 blocks (read once per depth); greedy output stays plain decoding's."""
    from specdecode.drafters.eagle import EagleHead, save_head
    from specdecode.layers.lm_head import QuantizedHead

    if select("cpu").quant is None:
        pytest.skip("no quantized kernels here (no C++ compiler, or SPECDECODE_CPU_ISA=off)")
    llm = LLM(str(quant_gguf), speculation_policy=False, progress=False)  # drafts every step
    target = llm.model
    assert target.runs_stored
    torch.manual_seed(0)
    vocab = torch.arange(0, target.config.vocab_size, 3)
    head = EagleHead(target.config, draft_vocab=vocab)
    path = save_head(head, tmp_path / "eagle", target="tiny", dtype=torch.float32)
    loaded = llm.drafters.head("eagle", str(path))
    assert loaded.fc.quantized is not None and loaded.layer.gate_up.quantized is not None
    draft_head = loaded.draft_head(target)
    assert isinstance(draft_head, QuantizedHead)
    hidden = torch.randn(2, target.config.hidden_size)
    exact = target.logits(hidden)[:, vocab]
    torch.testing.assert_close(draft_head(hidden), exact, rtol=0, atol=2e-2 * float(exact.abs().max()))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[200 + i, 5, 17, 200 + i, 5] for i in range(3)]
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for spec in ({"method": "eagle", "head": str(path)}, {"method": "eagle2", "head": str(path)}):
        got = llm.generate(prompts, params, use_tqdm=False, speculative=spec)
        assert [o.token_ids for o in got] == want
        assert all(o.stats.num_draft_tokens > 0 for o in got)
