// y (M, N) = x (M, K) @ W^T for weights kept in GGUF's block formats, on any CPU.
//
// W is N rows of K weights, each row a run of blocks exactly as the GGUF file stores them
// (Q4_0, Q4_1, Q5_0, Q8_0: 32 weights a block; Q4_K, Q6_K: 256, in eight groups of 32). Every
// format decodes a group of 32 weights into two vectors of 16 float lanes (V below).
//
// Two ways through, with the same arithmetic:
// - few rows of x (decoding a token, verifying a draft): each group of 32 weights is decoded in
//   registers and multiplied straight into every row of x, so a weight is read and decoded once
//   per forward and never stored;
// - many rows (prefill): a thread decodes a few weight rows into float32 scratch (they stay in
//   L1 or L2), then runs every row of x over them.
//
// Dequantized values are those of gguf-py's `dequantize` (each product of a scale and a quantized
// integer below is exact in float32). Each output is two sums kept in 16 float lanes (lanes.h),
// over the first and the second halves of the groups of 32 (two independent chains of fused
// multiply-adds, so one row is not bound by their latency), lane j taking k = j mod 16 in
// ascending k; the two are added and the lanes folded in a fixed order. Both ways,
// every build with FMA (AVX-512, AVX2) and any batch give the same sums: a row's result is
// bitwise the same alone or with other rows, and on AVX-512 or AVX2.
//
// The same source is built once per instruction set: AVX-512, AVX2 + FMA + F16C, and a portable
// build whose plain loops the compiler vectorizes for its target (SSE2 on x86, NEON on ARM).
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "lanes.h"

namespace {

using namespace lanes;

// Per build: G weight rows decoded into scratch together and SR rows of x per pass over them;
// up to DIRECT rows of x decode in registers instead, RMAX rows per decode.
#if defined(__AVX512F__)
constexpr int G = 4, SR = 4, DIRECT = 8, RMAX = 4;

inline V scaled(__m128i q, float s, float a) {  // 16 int8 lanes -> float(q) * s + a
    return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(s), _mm512_set1_ps(a))};
}
#elif defined(__AVX2__)
constexpr int G = 2, SR = 2, DIRECT = 8, RMAX = 4;

inline V scaled(__m128i q, float s, float a) {
    const __m256 S = _mm256_set1_ps(s), A = _mm256_set1_ps(a);
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), S, A),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), S, A)};
}
#else
constexpr int G = 2, SR = 1, DIRECT = 2, RMAX = 1;

inline V scaled(const int8_t* q, float s, float a) {
    V r;
    for (int j = 0; j < 16; ++j) r.f[j] = float(q[j]) * s + a;
    return r;
}
#endif

float half(const uint8_t* p) {  // IEEE binary16, little-endian, to float32 (exact)
    const uint16_t h = uint16_t(p[0] | p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | man << 13;
    } else if (exp != 0) {
        bits = sign | (exp + 112) << 23 | man << 13;
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        uint32_t m = man;
        do {
            ++e;
            m <<= 1;
        } while ((m & 0x400) == 0);
        bits = sign | uint32_t(112 - e) << 23 | (m & 0x3ff) << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

// ---- the formats: group `g` of a block -> its 32 weights as lo (first 16) and hi --------------
// ggml's type ids (ggml.h), the formats we read.
enum Format : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

#if defined(__AVX2__)
inline __m128i low_nibbles(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(0x0f)); }
inline __m128i high_nibbles(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 32 bits -> 32 bytes, byte j 0x10 where bit j is set (Q5_0's fifth bits).
inline __m256i fifth_bits(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                          3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask), _mm256_set1_epi8(0x10));
}

#if defined(__AVX512F__)
// 4-bit formats on AVX-512: a block's 16 possible weights are computed once (a table in one
// register, by the same fused multiply-add as weight by weight), then each weight is a lookup by
// its nibble (vpermps reads an index's low four bits): half the instructions of converting
// every nibble to float and scaling it.
inline __m512 iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// 16 bytes -> lo: the tables' entries at their low nibbles, hi: at their high nibbles.
inline void look_up(const uint8_t* q, __m512 table, V& lo, V& hi) {
    const __m512i idx = _mm512_cvtepu8_epi32(load16(q));
    lo = {_mm512_permutexvar_ps(idx, table)};
    hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table)};
}

struct Q4_0_ {
    static constexpr int weights = 32, bytes = 18;
    static void group(const uint8_t* b, int, V& lo, V& hi) {  // d, 16 bytes of nibble pairs
        const __m512 table = _mm512_fmadd_ps(_mm512_sub_ps(iota(), _mm512_set1_ps(8.0f)), _mm512_set1_ps(half(b)),
                                             _mm512_setzero_ps());
        look_up(b + 2, table, lo, hi);
    }
};

struct Q4_1_ {
    static constexpr int weights = 32, bytes = 20;
    static void group(const uint8_t* b, int, V& lo, V& hi) {  // d, m, nibbles
        uint32_t dm;
        std::memcpy(&dm, b, 4);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(int(dm)));  // d, m, 0, 0
        const __m512 table =
            _mm512_fmadd_ps(iota(), _mm512_broadcastss_ps(f), _mm512_broadcastss_ps(_mm_movehdup_ps(f)));
        look_up(b + 4, table, lo, hi);
    }
};
#else
struct Q4_0_ {
    static constexpr int weights = 32, bytes = 18;
    static void group(const uint8_t* b, int, V& lo, V& hi) {  // d, 16 bytes of nibble pairs
        const float d = half(b);
        const __m128i q = load16(b + 2), eight = _mm_set1_epi8(8);
        lo = scaled(_mm_sub_epi8(low_nibbles(q), eight), d, 0.0f);
        hi = scaled(_mm_sub_epi8(high_nibbles(q), eight), d, 0.0f);
    }
};

struct Q4_1_ {
    static constexpr int weights = 32, bytes = 20;
    static void group(const uint8_t* b, int, V& lo, V& hi) {  // d, m, nibbles
        const float d = half(b), m = half(b + 2);
        const __m128i q = load16(b + 4);
        lo = scaled(low_nibbles(q), d, m);
        hi = scaled(high_nibbles(q), d, m);
    }
};

#endif

struct Q5_0_ {
    static constexpr int weights = 32, bytes = 22;
    static void group(const uint8_t* b, int, V& lo, V& hi) {  // d, 32 fifth bits, nibbles
        const float d = half(b);
        uint32_t bits;
        std::memcpy(&bits, b + 2, 4);
        const __m256i h = fifth_bits(bits);
        const __m128i q = load16(b + 6), sixteen = _mm_set1_epi8(16);
        lo = scaled(_mm_sub_epi8(_mm_or_si128(low_nibbles(q), _mm256_castsi256_si128(h)), sixteen), d, 0.0f);
        hi = scaled(_mm_sub_epi8(_mm_or_si128(high_nibbles(q), _mm256_extracti128_si256(h, 1)), sixteen), d, 0.0f);
    }
};

struct Q8_0_ {
    static constexpr int weights = 32, bytes = 34;
    static void group(const uint8_t* b, int, V& lo, V& hi) {  // d, 32 int8
        const float d = half(b);
        lo = scaled(load16(b + 2), d, 0.0f);
        hi = scaled(load16(b + 18), d, 0.0f);
    }
};
#else  // portable: plain loops over 32 int8 lanes

struct Q4_0_ {
    static constexpr int weights = 32, bytes = 18;
    static void group(const uint8_t* b, int, V& lo, V& hi) {
        const float d = half(b);
        const uint8_t* q = b + 2;
        int8_t v[32];
        for (int j = 0; j < 16; ++j) v[j] = int8_t((q[j] & 0xf) - 8), v[j + 16] = int8_t((q[j] >> 4) - 8);
        lo = scaled(v, d, 0.0f);
        hi = scaled(v + 16, d, 0.0f);
    }
};

struct Q4_1_ {
    static constexpr int weights = 32, bytes = 20;
    static void group(const uint8_t* b, int, V& lo, V& hi) {
        const float d = half(b), m = half(b + 2);
        const uint8_t* q = b + 4;
        int8_t v[32];
        for (int j = 0; j < 16; ++j) v[j] = int8_t(q[j] & 0xf), v[j + 16] = int8_t(q[j] >> 4);
        lo = scaled(v, d, m);
        hi = scaled(v + 16, d, m);
    }
};

struct Q5_0_ {
    static constexpr int weights = 32, bytes = 22;
    static void group(const uint8_t* b, int, V& lo, V& hi) {
        const float d = half(b);
        uint32_t bits;
        std::memcpy(&bits, b + 2, 4);
        const uint8_t* q = b + 6;
        int8_t v[32];
        for (int j = 0; j < 16; ++j) {
            v[j] = int8_t(int((q[j] & 0xf) | (((bits >> j) & 1) << 4)) - 16);
            v[j + 16] = int8_t(int((q[j] >> 4) | (((bits >> (j + 16)) & 1) << 4)) - 16);
        }
        lo = scaled(v, d, 0.0f);
        hi = scaled(v + 16, d, 0.0f);
    }
};

struct Q8_0_ {
    static constexpr int weights = 32, bytes = 34;
    static void group(const uint8_t* b, int, V& lo, V& hi) {
        const float d = half(b);
        const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
        lo = scaled(q, d, 0.0f);
        hi = scaled(q + 16, d, 0.0f);
    }
};
#endif

struct Q4_K_ {
    static constexpr int weights = 256, bytes = 144;
    // d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (groups 2i and 2i + 1 are
    // the low and high nibbles of the same 32 bytes)
    static void group(const uint8_t* b, int g, V& lo, V& hi) {
        const uint8_t* s = b + 4;
        int sc, mn;
        if (g < 4) {
            sc = s[g] & 63;
            mn = s[g + 4] & 63;
        } else {
            sc = (s[g + 4] & 0xf) | ((s[g - 4] >> 6) << 4);
            mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
        }
        const float scale = half(b) * float(sc), offset = half(b + 2) * float(mn);
        const uint8_t* q = b + 16 + (g / 2) * 32;
#if defined(__AVX512F__)
        const __m512 table = _mm512_fmadd_ps(iota(), _mm512_set1_ps(scale), _mm512_set1_ps(-offset));
        __m512i a = _mm512_cvtepu8_epi32(load16(q)), c = _mm512_cvtepu8_epi32(load16(q + 16));
        if (g & 1) {
            a = _mm512_srli_epi32(a, 4);
            c = _mm512_srli_epi32(c, 4);
        }
        lo = {_mm512_permutexvar_ps(a, table)};
        hi = {_mm512_permutexvar_ps(c, table)};
#elif defined(__AVX2__)
        const __m128i a = load16(q), c = load16(q + 16);
        lo = scaled((g & 1) ? high_nibbles(a) : low_nibbles(a), scale, -offset);
        hi = scaled((g & 1) ? high_nibbles(c) : low_nibbles(c), scale, -offset);
#else
        int8_t v[32];
        for (int l = 0; l < 32; ++l) v[l] = int8_t((g & 1) ? (q[l] >> 4) : (q[l] & 0xf));
        lo = scaled(v, scale, -offset);
        hi = scaled(v + 16, scale, -offset);
#endif
    }
};

struct Q6_K_ {
    static constexpr int weights = 256, bytes = 210;
    // 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d. Group g: half h = g / 4
    // of 128 weights, part p = g % 4 of it; lane l takes the low (p < 2) or high nibble of
    // ql[l + 32 (p & 1)] and bits 2p, 2p + 1 of qh[l]; lanes 0-15 and 16-31 have a scale each.
    static void group(const uint8_t* b, int g, V& lo, V& hi) {
        const int h = g / 4, p = g % 4;
        const uint8_t* ql = b + 64 * h + 32 * (p & 1);
        const uint8_t* qh = b + 128 + 32 * h;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * p;
        const float d = half(b + 208);
#if defined(__AVX2__)
        const __m256i mask = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
        __m256i low = load32(ql);
        if (p >= 2) low = _mm256_srli_epi16(low, 4);
        low = _mm256_and_si256(low, mask);
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(load32(qh), _mm_cvtsi32_si128(2 * p)), three);
        const __m256i v = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
        lo = scaled(_mm256_castsi256_si128(v), d * float(sc[0]), 0.0f);
        hi = scaled(_mm256_extracti128_si256(v, 1), d * float(sc[1]), 0.0f);
#else
        int8_t v[32];
        for (int l = 0; l < 32; ++l) {
            const int nib = p < 2 ? (ql[l] & 0xf) : (ql[l] >> 4);
            v[l] = int8_t((nib | (((qh[l] >> (2 * p)) & 3) << 4)) - 32);
        }
        lo = scaled(v, d * float(sc[0]), 0.0f);
        hi = scaled(v + 16, d * float(sc[1]), 0.0f);
#endif
    }
};

// ---- products ---------------------------------------------------------------------------------

// Few rows: y[r * ldy] for the R rows of x (R, K) over one weight row w: each group of 32
// weights is decoded once, in registers, for all R rows. (One weight row at a time: decoding
// several rows together, to share the loads of x, read memory as several interleaved streams
// and ran up to 1.4x slower a token in the model.)
template <class F, int R>
void direct(const float* x, int64_t K, const uint8_t* w, float* y, int64_t ldy) {
    constexpr int groups = F::weights / 32;
    V lo_acc[R], hi_acc[R];
    for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = zero();
    for (int64_t b = 0; b < K / F::weights; ++b, w += F::bytes) {
        for (int i = 0; i < groups; ++i) {
            const int64_t k = (b * groups + i) * 32;
            V lo, hi;
            F::group(w, i, lo, hi);
            for (int r = 0; r < R; ++r) {
                lo_acc[r] = fma(loadv(x + r * K + k), lo, lo_acc[r]);
                hi_acc[r] = fma(loadv(x + r * K + k + 16), hi, hi_acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) y[r * ldy] = reduce(add(lo_acc[r], hi_acc[r]));
}

// All M rows of x over one weight row: RMAX rows at a time, then the rest.
template <class F, int R = RMAX>
void direct_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t ldy) {
    for (; M >= R; M -= R, x += R * K, y += R * ldy) direct<F, R>(x, K, w, y, ldy);
    if constexpr (R > 1) direct_rows<F, R - 1>(x, M, K, w, y, ldy);
}

// Many rows: n weight rows (row_bytes apart) are decoded once into w (n, K), float32.
template <class F>
void decode_rows(const uint8_t* src, int64_t row_bytes, int n, int64_t K, float* w) {
    constexpr int groups = F::weights / 32;
    for (int g = 0; g < n; ++g, src += row_bytes, w += K) {
        for (int64_t b = 0; b < K / F::weights; ++b) {
            for (int i = 0; i < groups; ++i) {
                V lo, hi;
                F::group(src + b * F::bytes, i, lo, hi);
                storev(w + (b * groups + i) * 32, lo);
                storev(w + (b * groups + i) * 32 + 16, hi);
            }
        }
    }
}

template <int R, int Gn>
void dots(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
    V first[R][Gn];  // the sums over the first halves of the groups of 32, then the second halves
    for (int h = 0; h < 2; ++h) {
        V acc[R][Gn];
        for (int r = 0; r < R; ++r)
            for (int g = 0; g < Gn; ++g) acc[r][g] = zero();
        for (int64_t k = 16 * h; k < K; k += 32) {
            V wv[Gn];
            for (int g = 0; g < Gn; ++g) wv[g] = loadv(w + g * K + k);
            for (int r = 0; r < R; ++r) {
                const V xv = loadv(x + r * K + k);
                for (int g = 0; g < Gn; ++g) acc[r][g] = fma(xv, wv[g], acc[r][g]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int g = 0; g < Gn; ++g) {
                if (h == 0) {
                    first[r][g] = acc[r][g];
                } else {
                    y[r * ldy + g] = reduce(add(first[r][g], acc[r][g]));
                }
            }
    }
}

template <int Gn, int R = SR>
void dot_rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy) {
    for (; M >= R; M -= R, x += R * K, y += R * ldy) dots<R, Gn>(x, K, w, y, ldy);
    if constexpr (R > 1) dot_rows<Gn, R - 1>(x, M, K, w, y, ldy);
}

template <class F>
void product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
             int threads) {
    const int64_t row_bytes = K / F::weights * F::bytes;
    const bool few = M <= DIRECT;
    const int64_t tiles = (N + G - 1) / G;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scratch(few ? 0 : size_t(G) * size_t(K));
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i = tiles * t / nt; i < tiles * (t + 1) / nt; ++i) {
            const int64_t n0 = i * G;
            const int nb = int(N - n0 < G ? N - n0 : G);
            const uint8_t* wi = w + n0 * row_bytes;
            if (few) {
                for (int g = 0; g < nb; ++g) direct_rows<F>(x, M, K, wi + g * row_bytes, y + n0 + g, ldy);
            } else {
                decode_rows<F>(wi, row_bytes, nb, K, scratch.data());
                if (nb == G) {
                    dot_rows<G>(x, M, K, scratch.data(), y + n0, ldy);
                } else {
                    for (int g = 0; g < nb; ++g) dot_rows<1>(x, M, K, scratch.data() + g * K, y + n0 + g, ldy);
                }
            }
        }
    }
}

template <class F>
void rows(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
    const int64_t row_bytes = K / F::weights * F::bytes;
    for (int64_t i = 0; i < n; ++i) decode_rows<F>(w + ids[i] * row_bytes, row_bytes, 1, K, out + i * K);
}

struct Layout {
    int weights;  // per block
    void (*product)(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int);
    void (*rows)(const uint8_t*, int64_t, const int64_t*, int64_t, float*);
};

template <class F>
constexpr Layout layout() {
    return {F::weights, product<F>, rows<F>};
}

bool layout_of(int format, Layout* out) {
    switch (format) {
        case Q4_0: *out = layout<Q4_0_>(); return true;
        case Q4_1: *out = layout<Q4_1_>(); return true;
        case Q5_0: *out = layout<Q5_0_>(); return true;
        case Q8_0: *out = layout<Q8_0_>(); return true;
        case Q4_K: *out = layout<Q4_K_>(); return true;
        case Q6_K: *out = layout<Q6_K_>(); return true;
        default: return false;
    }
}

}  // namespace

extern "C" {

// y[m * ldy + n] for the N weight rows of w. 0 when done; 1: a format this file does not read;
// 2: K not a whole number of blocks.
int specdecode_qmm(int format, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                   float* y, int64_t ldy, int threads) {
    Layout lay;
    if (!layout_of(format, &lay)) return 1;
    if (K % lay.weights != 0) return 2;
    lay.product(x, M, K, w, N, y, ldy, threads);
    return 0;
}

// Dequantize rows `ids` (n of them) of W (rows of K weights) into out (n, K): embedding lookups.
int specdecode_qrows(int format, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
    Layout lay;
    if (!layout_of(format, &lay)) return 1;
    if (K % lay.weights != 0) return 2;
    lay.rows(w, K, ids, n, out);
    return 0;
}

}  // extern "C"
