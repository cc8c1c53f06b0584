"""The GPU's Triton kernels (imported by `kernels.cuda` when first needed: Triton need not be
installed). Each program computes one row (and head) in an order fixed by the row's own size, so
a row's bits never depend on the other rows of its forward. Under TRITON_INTERPRET=1 they run on
CPU tensors, as the tests check them without a GPU."""

import triton
import triton.language as tl


@triton.jit
def rotated(x, cos, sin, D: tl.constexpr):
    # x * cos + rotate_half(x) * sin for the rows of D values at `x` (a pointer or a column
    # of them), rounded to x's dtype after each product and after the sum, as PyTorch's ops
    # in that dtype do.
    d = tl.arange(0, D)
    first = d < D // 2
    xv = tl.load(x + d)
    xp = tl.load(x + tl.where(first, d + D // 2, d - D // 2))
    turned = tl.where(first, -xp, xp)
    a = (xv.to(tl.float32) * cos.to(tl.float32)).to(xv.dtype)
    b = (turned.to(tl.float32) * sin.to(tl.float32)).to(xv.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(xv.dtype)


@triton.jit
def store_rows(
    k, v, kc, vc, rows, new_slots, cos, sin,
    k_sh, k_st, v_sh, v_st, kc_sh, kc_ss, vc_sh, vc_ss, c_st,
    D: tl.constexpr,
):  # fmt: skip
    # One program: row i's key (rotated) and value of key/value head h, into its slot.
    i = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.load(rows + i)
    slot = tl.load(new_slots + i)
    d = tl.arange(0, D)
    cs, sn = tl.load(cos + t * c_st + d), tl.load(sin + t * c_st + d)
    key = rotated(k + h * k_sh + t * k_st, cs, sn, D)
    tl.store(kc + h * kc_sh + slot * kc_ss + d, key)
    tl.store(vc + h * vc_sh + slot * vc_ss + d, tl.load(v + h * v_sh + t * v_st + d))


@triton.jit
def row_attention(
    q, kc, vc, out, rows, row_ptr, idx, cos, sin, scale,
    q_sh, q_st, k_sh, k_ss, v_sh, v_ss, o_st, o_sh, c_st,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program: row i's query heads of key/value head kvh (rotated as they load), over the
    # row's slots idx[row_ptr[i] : row_ptr[i+1]] in blocks of BLOCK (online softmax, float32).
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    t = tl.load(rows + i)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    live = g < GROUP
    heads = kvh * GROUP + tl.where(live, g, 0)  # dead lanes read head kvh * GROUP, unstored
    cs, sn = tl.load(cos + t * c_st + d), tl.load(sin + t * c_st + d)
    qv = rotated(q + heads[:, None] * q_sh + t * q_st, cs, sn, D)  # (GP, D)
    qv = qv.to(tl.float32)
    lo = tl.load(row_ptr + i).to(tl.int32)
    hi = tl.load(row_ptr + i + 1).to(tl.int32)
    top = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    s = lo
    while s < hi:  # not range(lo, hi, BLOCK): Triton 3.6's interpreter cannot index by a loaded bound
        at = s + tl.arange(0, BLOCK)
        seen = at < hi
        slot = tl.load(idx + at, mask=seen, other=0)
        kk = tl.load(kc + kvh * k_sh + slot[:, None] * k_ss + d[None, :], mask=seen[:, None], other=0.0)
        score = tl.sum(qv[:, None, :] * kk.to(tl.float32)[None, :, :], axis=2) * scale  # (GP, BLOCK)
        score = tl.where(seen[None, :], score, float("-inf"))
        new_top = tl.maximum(top, tl.max(score, axis=1))
        fade = tl.exp(top - new_top)
        p = tl.exp(score - new_top[:, None])
        vv = tl.load(vc + kvh * v_sh + slot[:, None] * v_ss + d[None, :], mask=seen[:, None], other=0.0)
        total = total * fade + tl.sum(p, axis=1)
        acc = acc * fade[:, None] + tl.sum(p[:, :, None] * vv.to(tl.float32)[None, :, :], axis=1)
        top = new_top
        s += BLOCK
    res = (acc / total[:, None]).to(out.dtype.element_ty)
    tl.store(out + t * o_st + heads[:, None] * o_sh + d[None, :], res, mask=live[:, None])


@triton.jit
def rms_norm_rows(x, w, y, x_sr, y_sr, n, eps, LOW: tl.constexpr, BLOCK: tl.constexpr):
    # One program: row r of x normalised in float32 and scaled by w; LOW: rounded to x's
    # dtype before the scaling (what a bfloat16 or float16 layer does, as the reference).
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < n
    xv = tl.load(x + r * x_sr + c, mask=m, other=0.0)
    xf = xv.to(tl.float32)
    normed = xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    if LOW:
        normed = normed.to(xv.dtype).to(tl.float32)
    res = tl.load(w + c, mask=m, other=0.0).to(tl.float32) * normed
    tl.store(y + r * y_sr + c, res.to(y.dtype.element_ty), mask=m)


@triton.jit
def silu_mul_rows(x, y, x_sr, y_sr, n, BLOCK: tl.constexpr):
    # One program: BLOCK columns of row r: SiLU(gate) * up, each rounded to the dtype as
    # PyTorch's two ops do.
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < n
    gate = tl.load(x + r * x_sr + c, mask=m, other=0.0)
    up = tl.load(x + r * x_sr + n + c, mask=m, other=0.0)
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
    tl.store(y + r * y_sr + c, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=m)
