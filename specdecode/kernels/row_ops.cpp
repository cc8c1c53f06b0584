// The rest of a decoding forward's few rows, per instruction set (lanes.h): attention of listed
// rows over listed cache slots, and RMS norm.
//
// Attention: the rows of a forward (single requests, every sequence of an in-flight batch, the
// nodes of a draft tree) each attend to their own list of slots of one paged cache (their prefix,
// and for a tree node its ancestors), so a ragged batch of many sequences is one call per layer
// instead of a gather and an SDPA per sequence. A row's output depends only on its own query and
// slots, in a fixed order: bitwise the same alone or in any batch, whatever the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lanes.h"

namespace {

using namespace lanes;

// Rotary embedding of one head's row: y = x * cos + rotate_half(x) * sin, each product and the sum
// rounded as torch's three elementwise ops round them (no fused multiply-add), so keys rotated here
// and keys rotated by torch (prefill chunks through SDPA) are bitwise the same.
__attribute__((optimize("fp-contract=off"))) void rotate(const float* __restrict x, const float* __restrict cos,
                                                          const float* __restrict sin, int64_t D,
                                                          float* __restrict y) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; ++d) {
        const float r = d < half ? -x[d + half] : x[d - half];
        const float a = x[d] * cos[d];
        const float b = r * sin[d];
        y[d] = a + b;
    }
}

// Heads that share a key/value head, at most this many per task (a task's scores and sums live
// in its scratch and registers).
constexpr int MAX_GROUP = 16;

// G query rows (heads sharing one key/value head) of one row: for each, softmax(q . k_j * scale)
// over the row's L slots, times v_j. NC = head_dim / 16. `s` is scratch for G x L scores, each
// rounded up to 16. Slots come 16 at a time, each block's keys and values read from memory once
// for all G heads; a head's scores are 16 keys at a time (`reduce16`: each the same sum as
// `reduce` of its key's products), so a head's result is the same in any group.
template <int NC>
void attend_heads(int G, const float* const* q, const float* __restrict kc, const float* __restrict vc,
                  const int64_t* __restrict idx, int64_t L, float scale, float* const* out, float* __restrict s) {
    constexpr int64_t D = NC * 16;
    const int64_t padded = (L + 15) / 16 * 16;
    const V sc = set1(scale);
    V top[MAX_GROUP];
    for (int g = 0; g < G; ++g) top[g] = set1(-INFINITY);
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const int64_t n = L - j0 < 16 ? L - j0 : 16;
        const float* key[16];
        for (int64_t k = 0; k < 16; ++k) key[k] = kc + idx[j0 + (k < n ? k : n - 1)] * D;  // past L: the last again
        for (int g = 0; g < G; ++g) {
            V qv[NC];
            for (int c = 0; c < NC; ++c) qv[c] = loadv(q[g] + c * 16);
            V acc[16];
            for (int k = 0; k < 16; ++k) {
                acc[k] = mul(qv[0], loadv(key[k]));
                for (int c = 1; c < NC; ++c) acc[k] = fma(qv[c], loadv(key[k] + c * 16), acc[k]);
            }
            const V x = mul(reduce16(acc), sc);
            storev(s + g * padded + j0, x);
            top[g] = maxv(top[g], x);  // the repeated last key adds no new maximum
        }
    }
    float inv[MAX_GROUP];
    for (int g = 0; g < G; ++g) {
        float* sg = s + g * padded;
        float lanes_top[16];
        storev(lanes_top, top[g]);
        float m = -INFINITY;
        for (float t : lanes_top) m = t > m ? t : m;
        std::fill(sg + L, sg + padded, m);
        const V mv = set1(m);
        V total = zero();
        for (int64_t j = 0; j < L; j += 16) storev(sg + j, exp_nonpositive(sub(loadv(sg + j), mv)));
        std::fill(sg + L, sg + padded, 0.0f);  // past the last slot: no weight
        for (int64_t j = 0; j < L; j += 16) total = add(total, loadv(sg + j));
        inv[g] = 1.0f / reduce(total);
    }
    // The heads' sums over 16 slots' values at a time, read from memory once; each value row
    // serves up to GB heads at once (independent chains: no head waits on its own last sum).
    constexpr int GB = NC >= 8 ? 2 : 24 / NC;
    V o[MAX_GROUP][NC];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) o[g][c] = zero();
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const int64_t n = L - j0 < 16 ? L - j0 : 16;
        int g0 = 0;
        for (; g0 + GB <= G; g0 += GB) {
            V acc[GB][NC];
            for (int g = 0; g < GB; ++g)
                for (int c = 0; c < NC; ++c) acc[g][c] = o[g0 + g][c];
            for (int64_t k = 0; k < n; ++k) {
                const float* v = vc + idx[j0 + k] * D;
                V vv[NC];
                for (int c = 0; c < NC; ++c) vv[c] = loadv(v + c * 16);
                for (int g = 0; g < GB; ++g) {
                    const V p = set1(s[(g0 + g) * padded + j0 + k]);
                    for (int c = 0; c < NC; ++c) acc[g][c] = fma(p, vv[c], acc[g][c]);
                }
            }
            for (int g = 0; g < GB; ++g)
                for (int c = 0; c < NC; ++c) o[g0 + g][c] = acc[g][c];
        }
        for (; g0 < G; ++g0) {
            V acc[NC];
            for (int c = 0; c < NC; ++c) acc[c] = o[g0][c];
            for (int64_t k = 0; k < n; ++k) {
                const float* v = vc + idx[j0 + k] * D;
                const V p = set1(s[g0 * padded + j0 + k]);
                for (int c = 0; c < NC; ++c) acc[c] = fma(p, loadv(v + c * 16), acc[c]);
            }
            for (int c = 0; c < NC; ++c) o[g0][c] = acc[c];
        }
    }
    for (int g = 0; g < G; ++g) {
        const V iv = set1(inv[g]);
        for (int c = 0; c < NC; ++c) storev(out[g] + c * 16, mul(o[g][c], iv));
    }
}

template <int NC>
void attend_rows(const float* q, int64_t q_sh, int64_t q_st, const float* kn, int64_t k_sh, int64_t k_st,
                 const float* vn, int64_t v_sh, int64_t v_st, float* kc, float* vc, int64_t c_sh, const int64_t* rows,
                 const int64_t* new_slot, int64_t n_rows, const int64_t* row_ptr, const int64_t* idx, float* out,
                 int64_t o_st, int64_t Hq, int64_t Hkv, float scale, const float* cos, const float* sin,
                 int threads) {
    constexpr int64_t D = NC * 16;
    int64_t longest = 0;
    for (int64_t r = 0; r < n_rows; ++r) longest = std::max(longest, row_ptr[r + 1] - row_ptr[r]);
    const int64_t group = Hq / Hkv;
    // Heads per task: a whole group where that leaves every thread several tasks, else one (a
    // single row's few groups would leave a thread idle). A head's result does not depend on it.
    int64_t per = group;
    while (per > 1 && (n_rows * Hkv * (group / per) < 4 * threads || group % per || per > MAX_GROUP)) --per;
#pragma omp parallel num_threads(threads)
    {
        // The new keys and values into their slots first: rows of a tree see their ancestors'.
#pragma omp for schedule(static)
        for (int64_t task = 0; task < n_rows * Hkv; ++task) {
            const int64_t r = task / Hkv, h = task % Hkv, t = rows[r];
            float* kd = kc + h * c_sh + new_slot[r] * D;
            float* vd = vc + h * c_sh + new_slot[r] * D;
            if (cos != nullptr) {
                rotate(kn + h * k_sh + t * k_st, cos + t * D, sin + t * D, D, kd);
            } else {
                for (int c = 0; c < NC; ++c) storev(kd + c * 16, loadv(kn + h * k_sh + t * k_st + c * 16));
            }
            for (int c = 0; c < NC; ++c) storev(vd + c * 16, loadv(vn + h * v_sh + t * v_st + c * 16));
        }
        std::vector<float> scratch(per * ((longest + 15) / 16 * 16));
        std::vector<float> rotated(per * D);
        // Tasks by key/value head, then row, then its heads `per` at a time: a thread reads a
        // key/value head's slots once from memory, then from its own cache for every row.
        const int64_t chunks = group / per;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < Hkv * n_rows * chunks; ++task) {
            const int64_t kvh = task / (n_rows * chunks), r = task / chunks % n_rows;
            const int64_t h0 = kvh * group + task % chunks * per, t = rows[r];
            const float* qs[MAX_GROUP];
            float* outs[MAX_GROUP];
            for (int64_t g = 0; g < per; ++g) {
                qs[g] = q + (h0 + g) * q_sh + t * q_st;
                if (cos != nullptr) {
                    rotate(qs[g], cos + t * D, sin + t * D, D, rotated.data() + g * D);
                    qs[g] = rotated.data() + g * D;
                }
                outs[g] = out + t * o_st + (h0 + g) * D;
            }
            attend_heads<NC>(int(per), qs, kc + kvh * c_sh, vc + kvh * c_sh, idx + row_ptr[r],
                             row_ptr[r + 1] - row_ptr[r], scale, outs, scratch.data());
        }
    }
}

// SiLU(x) * up: e = exp(-|x|) <= 1, sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below.
inline V silu_times(V x, V up) {
    const V e = exp_nonpositive(minv(x, sub(zero(), x)));
    const V one = set1(1.0f);
    const V sig = select_nonnegative(x, div(one, add(one, e)), div(e, add(one, e)));
    return mul(mul(x, sig), up);
}

}  // namespace

extern "C" {

// q (H, T, D) at strides (q_sh, q_st); new keys/values (Hkv, T, D) likewise; cos/sin (T, D) the
// rotary tables at each row's position, applied here to q and the new keys (null: already done);
// the layer's cache kc/vc (Hkv, S, D) with head stride c_sh; for each of `n_rows` rows (indices
// into T): the slot its new key/value goes to and, as CSR (row_ptr, idx), the slots it attends
// to; out (T, H, D) with row stride o_st. Returns 0, or -1 for a head size the kernel does not take.
int specdecode_attend_rows(const float* q, int64_t q_sh, int64_t q_st, const float* kn, int64_t k_sh, int64_t k_st,
                           const float* vn, int64_t v_sh, int64_t v_st, float* kc, float* vc, int64_t c_sh,
                           const int64_t* rows, const int64_t* new_slot, int64_t n_rows, const int64_t* row_ptr,
                           const int64_t* idx, float* out, int64_t o_st, int64_t Hq, int64_t Hkv, int64_t D,
                           float scale, const float* cos, const float* sin, int threads) {
    if (Hkv <= 0 || Hq % Hkv != 0) return -1;
    using Fn = decltype(&attend_rows<1>);
    Fn fn = D == 16    ? attend_rows<1>
            : D == 32  ? attend_rows<2>
            : D == 64  ? attend_rows<4>
            : D == 128 ? attend_rows<8>
                       : nullptr;
    if (fn == nullptr) return -1;
    fn(q, q_sh, q_st, kn, k_sh, k_st, vn, v_sh, v_st, kc, vc, c_sh, rows, new_slot, n_rows, row_ptr, idx, out, o_st,
       Hq, Hkv, scale, cos, sin, threads);
    return 0;
}

// y (M, C) = x / sqrt(mean(x^2) + eps) * w, float32, one thread: a row's sum of squares runs in a
// fixed order (16 lanes, then `reduce`), so a row's result does not depend on M.
// (torch's rms_norm costs ~40 us a call inside a decoding forward, 60 calls a token.)
void specdecode_rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t C, float eps) {
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * C;
        float* yr = y + m * C;
        V acc = zero();
        int64_t c = 0;
        for (; c + 16 <= C; c += 16) {
            const V v = loadv(xr + c);
            acc = fma(v, v, acc);
        }
        if (c < C) {  // the last lanes, zero-padded
            float tail[16] = {};
            std::copy(xr + c, xr + C, tail);
            const V v = loadv(tail);
            acc = fma(v, v, acc);
        }
        const float scale = 1.0f / std::sqrt(reduce(acc) / static_cast<float>(C) + eps);
        const V s = set1(scale);
        for (c = 0; c + 16 <= C; c += 16) storev(yr + c, mul(mul(loadv(xr + c), s), loadv(w + c)));
        for (; c < C; ++c) yr[c] = xr[c] * scale * w[c];
    }
}

// out (M, I) = SiLU(gu[:, :I]) * gu[:, I:] for gu (M, 2 I): x * sigmoid(x) * up, sigmoid through
// exp of -|x| (lanes.h), each lane on its own, so a row's result does not depend on M.
void specdecode_silu_mul(const float* gu, int64_t M, int64_t I, float* out) {
    for (int64_t m = 0; m < M; ++m) {
        const float* g = gu + m * 2 * I;
        const float* u = g + I;
        float* o = out + m * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) storev(o + i, silu_times(loadv(g + i), loadv(u + i)));
        if (i < I) {  // the last lanes, padded
            float gt[16] = {}, ut[16] = {}, ot[16];
            std::copy(g + i, g + I, gt);
            std::copy(u + i, u + I, ut);
            storev(ot, silu_times(loadv(gt), loadv(ut)));
            std::copy(ot, ot + (I - i), o + i);
        }
    }
}

}  // extern "C"
