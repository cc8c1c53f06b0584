// 16 float32 lanes, the unit our per-instruction-set kernels compute in (quant_gemm.cpp,
// row_ops.cpp): one zmm register on AVX-512, two ymm on AVX2, plain arrays the compiler
// vectorizes elsewhere. Lane j of a sum over k takes k = j mod 16, and `reduce` folds the lanes
// in one fixed order, so every build with fused multiply-add gives the same bits.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace lanes {

#if defined(__AVX512F__)
struct V {
    __m512 v;
};
inline V zero() { return {_mm512_setzero_ps()}; }
inline V set1(float a) { return {_mm512_set1_ps(a)}; }
inline V loadv(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void storev(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V add(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V sub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V mul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V maxv(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V minv(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V div(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V select_nonnegative(V x, V a, V b) {  // lane-wise x >= 0 ? a : b
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_GE_OQ), b.v, a.v)};
}
inline V round_even(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V pow2(V n) {  // 2^n for whole n in [-126, 127]
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
#elif defined(__AVX2__)
struct V {
    __m256 lo, hi;
};
inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V loadv(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storev(float* p, V a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
inline V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V maxv(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V minv(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V div(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V select_nonnegative(V x, V a, V b) {  // lane-wise x >= 0 ? a : b
    const __m256 z = _mm256_setzero_ps();
    return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, z, _CMP_GE_OQ)),
            _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, z, _CMP_GE_OQ))};
}
inline V round_even(V a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline __m256 pow2_8(__m256 n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline V pow2(V n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
#else
struct V {
    float f[16];
};
inline V zero() { return V{}; }
inline V set1(float a) {
    V r;
    for (float& x : r.f) x = a;
    return r;
}
inline V loadv(const float* p) {
    V a;
    std::memcpy(a.f, p, sizeof(a.f));
    return a;
}
inline void storev(float* p, V a) { std::memcpy(p, a.f, sizeof(a.f)); }
inline V fma(V a, V b, V c) {
    for (int j = 0; j < 16; ++j) c.f[j] += a.f[j] * b.f[j];
    return c;
}
inline V add(V a, V b) {
    for (int j = 0; j < 16; ++j) a.f[j] += b.f[j];
    return a;
}
inline V sub(V a, V b) {
    for (int j = 0; j < 16; ++j) a.f[j] -= b.f[j];
    return a;
}
inline V mul(V a, V b) {
    for (int j = 0; j < 16; ++j) a.f[j] *= b.f[j];
    return a;
}
inline V maxv(V a, V b) {
    for (int j = 0; j < 16; ++j) a.f[j] = a.f[j] > b.f[j] ? a.f[j] : b.f[j];
    return a;
}
inline V minv(V a, V b) {
    for (int j = 0; j < 16; ++j) a.f[j] = a.f[j] < b.f[j] ? a.f[j] : b.f[j];
    return a;
}
inline V div(V a, V b) {
    for (int j = 0; j < 16; ++j) a.f[j] /= b.f[j];
    return a;
}
inline V select_nonnegative(V x, V a, V b) {  // lane-wise x >= 0 ? a : b
    for (int j = 0; j < 16; ++j) a.f[j] = x.f[j] >= 0.0f ? a.f[j] : b.f[j];
    return a;
}
inline V round_even(V a) {
    for (float& x : a.f) x = std::nearbyint(x);  // the default rounding mode: to nearest, even
    return a;
}
inline V pow2(V n) {
    for (float& x : n.f) {
        const uint32_t bits = uint32_t(int32_t(x) + 127) << 23;
        std::memcpy(&x, &bits, 4);
    }
    return n;
}
#endif

// The lanes summed in a fixed order: l[i] += l[i + 8], then l[i] += l[i + 4], then
// (l[0] + l[1]) + (l[2] + l[3]). In registers where there are vectors (going through memory,
// a vector store read back as scalars stalls on store forwarding: it cost more than the sums).
#if defined(__AVX2__)
inline float reduce4(__m128 a) {  // (a0 + a1) + (a2 + a3)
    const __m128 pairs = _mm_add_ps(a, _mm_movehdup_ps(a));  // a0 + a1, ., a2 + a3, .
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehl_ps(pairs, pairs)));
}
#endif
#if defined(__AVX512F__)
inline float reduce(V a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
    return reduce4(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#elif defined(__AVX2__)
inline float reduce(V a) {
    const __m256 h = _mm256_add_ps(a.lo, a.hi);
    return reduce4(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#else
inline float reduce(V a) {
    float* l = a.f;
    for (int w = 8; w >= 4; w /= 2)
        for (int i = 0; i < w; ++i) l[i] += l[i + w];
    return (l[0] + l[1]) + (l[2] + l[3]);
}
#endif

// reduce() of 16 vectors at once: lane k of the result is reduce(a[k]), the same sums in the same
// order, folded across the vectors by shuffles (a dot product a key would otherwise end in its own
// chain of extracts and scalar adds).
#if defined(__AVX512F__)
inline V reduce16(const V* a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i) {  // l[i] + l[i + 8]: keys 2i, 2i + 1 in the low, high 8 lanes
        const __m512 x = a[2 * i].v, y = a[2 * i + 1].v;
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int i = 0; i < 4; ++i)  // + l[i + 4]: key 4i + j in 128-bit chunk j
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 d[2];
    for (int i = 0; i < 2; ++i)  // l0 + l1, l2 + l3
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    // (l0 + l1) + (l2 + l3): lane 4j + m holds key 4m + j
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return {_mm512_permutexvar_ps(order, f)};
}
#elif defined(__AVX2__)
inline __m256 reduce8(const V* a) {  // keys 0..7
    __m256 c[4], d[2];
    for (int i = 0; i < 4; ++i) {  // (l[i] + l[i + 8]) + its l[i + 4]: key 2i + h in 128-bit half h
        const __m256 u = _mm256_add_ps(a[2 * i].lo, a[2 * i].hi), w = _mm256_add_ps(a[2 * i + 1].lo, a[2 * i + 1].hi);
        c[i] = _mm256_add_ps(_mm256_permute2f128_ps(u, w, 0x20), _mm256_permute2f128_ps(u, w, 0x31));
    }
    for (int i = 0; i < 2; ++i)  // l0 + l1, l2 + l3
        d[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    // (l0 + l1) + (l2 + l3): lane 4h + m holds key 2m + h
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline V reduce16(const V* a) { return {reduce8(a), reduce8(a + 8)}; }
#else
inline V reduce16(const V* a) {
    V r;
    for (int k = 0; k < 16; ++k) r.f[k] = reduce(a[k]);
    return r;
}
#endif

// e^x for x <= 0 (scores minus their maximum): 2^n e^r with |r| <= ln2/2 and a degree-6 Taylor
// polynomial (truncation below 1e-7 relative); under -87 the result is ~0 anyway.
inline V exp_nonpositive(V x) {
    x = maxv(x, set1(-87.0f));
    const V n = round_even(mul(x, set1(1.44269504088896341f)));
    V r = fma(n, set1(-0.693145751953125f), x);     // ln2, high part
    r = fma(n, set1(-1.428606765330187e-06f), r);   // ln2, low part
    V p = set1(1.0f / 720);
    for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fma(p, r, set1(c));
    return mul(p, pow2(n));
}

// 16 float16 (IEEE binary16) values widened to float32 (exact), and 16 float32 narrowed to
// float16, rounded to nearest even as torch's `.half()` rounds: what a key/value cache kept in
// half precision is read and written with (row_ops.cpp). F16C on x86, bit arithmetic elsewhere.
#if defined(__AVX512F__)
inline V loadh(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void storeh(uint16_t* p, V a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a.v, mode));
}
#elif defined(__AVX2__)
inline V loadh(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void storeh(uint16_t* p, V a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.lo, mode));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(a.hi, mode));
}
#else
inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float32
        float f = float(man) * 5.9604644775390625e-8f;
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {  // infinity or NaN
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const auto sign = uint16_t((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((x >> 13) & 0x3ffu));  // NaN stays NaN (quiet)
    if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // 65520 and up round to infinity
    if (x < 0x38800000u) {  // below 2^-14: a subnormal half, |f| * 2^24 rounded to an even integer
        float a;
        std::memcpy(&a, &x, 4);
        return uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.0f)));
    }
    const uint32_t r = (x + 0xfffu + ((x >> 13) & 1u)) >> 13;  // to nearest even at bit 13
    return uint16_t(sign | (r - (112u << 10)));
}
inline V loadh(const uint16_t* p) {
    V a;
    for (int j = 0; j < 16; ++j) a.f[j] = half_to_float(p[j]);
    return a;
}
inline void storeh(uint16_t* p, V a) {
    for (int j = 0; j < 16; ++j) p[j] = float_to_half(a.f[j]);
}
#endif

// A cache's rows in either precision: float32 as they are, float16 widened (and narrowed when stored).
inline V loadc(const float* p) { return loadv(p); }
inline V loadc(const uint16_t* p) { return loadh(p); }
inline void storec(float* p, V a) { storev(p, a); }
inline void storec(uint16_t* p, V a) { storeh(p, a); }

// Ask for the cache line holding p now (the kernels run ahead of the hardware's prefetcher, which
// follows a stream or two per thread). An asm statement on x86: GCC took __builtin_prefetch as a
// reason to store the accumulators to memory at every step.
inline void prefetch(const void* p) {
#if defined(__x86_64__)
    __asm__("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
    __builtin_prefetch(p);
#endif
}

}  // namespace lanes
