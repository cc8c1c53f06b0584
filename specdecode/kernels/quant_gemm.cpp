// y (M, N) = x (M, K) @ W^T for weights kept in GGUF's block formats, on any CPU.
//
// W is N rows of K weights in one of GGUF's block formats (Q4_0, Q4_1, Q5_0, Q8_0: 32 weights a
// block; Q4_K, Q6_K: 256, in eight groups of 32). When a model loads, `specdecode_qpack` lays
// each weight out again in *tiles* of 16 rows of W (16 outputs) side by side: the same bits per
// weight (the same quants and scales; Q4_K's packed scales take 2.8% more), interleaved so that
// one step of a group decodes weight k of all 16 outputs into the 16 float lanes of lanes.h.
// A product then broadcasts x[k] and multiplies it into the 16 outputs at once: no horizontal
// sums, x read once per tile rather than once per output, and a block's scales converted once
// for its 16 outputs. (Laid out as stored, decoding a block one output at a time took ~3.6
// cycles a group of 32, against ~2.7 here, and re-reading x for every output bound several rows
// by cache bandwidth.)
//
// A group of 32 weights of a tile is decoded in 16 steps; step j gives the quants of weights
// k = 32g + j (lo) and k = 32g + 16 + j (hi) of the 16 outputs, which stand for a q + b with the
// group's scales (exactly gguf-py's dequantized values: every product of a scale and a quant is
// exact in float32). A product sums x q per group and applies the scales once per group (see
// "products" below); the order is the same whatever the number of rows, the path and the build,
// so a row's result is bitwise the same alone or in any batch, and every build with FMA
// (AVX-512, AVX2) gives the same bits.
//
// Two paths with that arithmetic:
// - few rows of x (decoding a token, verifying a draft): each step's quants are decoded in
//   registers and used for every row, so a weight is read and decoded once per forward;
// - many rows (prefill): a thread decodes a unit of two tiles into float32 scratch (in L1 or
//   L2), then runs the rows over it in register blocks.
//
// The same source is built once per instruction set: AVX-512, AVX2 + FMA + F16C, and a portable
// build whose plain loops the compiler vectorizes for its target (SSE2 on x86, NEON on ARM).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "lanes.h"

// AVX512-VBMI's byte permutes and multishifts with VNNI's dot products: where Q4_K's and Q6_K's
// int8 decoding rows spread their quads in two instructions (the optional flags of the AVX-512
// build, used where the CPU lists them).
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define VBMI_QUADS 1
#else
#define VBMI_QUADS 0
#endif

namespace {

using namespace lanes;

// ---- 16 int32 lanes, for decoding quants ---------------------------------------------------------
#if defined(__AVX512F__)
struct VI {
    __m512i v;
};
inline VI u8_lanes(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline VI i8_lanes(const uint8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline VI u32_lanes(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
// 16 lanes of three bytes each (48 bytes, little-endian), zero-extended: read as the 64 bytes
// ending with them (a masked load of the 48 alone took longer than the whole decoding), so the 16
// before them must be readable (Q6_K_'s are its scales or the step pair before), each 128-bit
// lane given its four lanes' 12 bytes, then spread.
inline VI u24_lanes(const uint8_t* p) {
    const __m512i v = _mm512_loadu_si512(p - 16);
    const __m512i words = _mm512_permutexvar_epi32(_mm512_setr_epi32(4, 5, 6, 0, 7, 8, 9, 0, 10, 11, 12, 0, 13, 14, 15, 0), v);
    const __m512i spread = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1));
    return {_mm512_shuffle_epi8(words, spread)};
}
inline VI and_(VI a, int m) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(m))}; }
inline VI or_(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
inline VI shr(VI a, int n) { return {_mm512_srli_epi32(a.v, n)}; }
inline VI shl(VI a, int n) { return {_mm512_slli_epi32(a.v, n)}; }
inline V to_float(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline V halves(const uint8_t* p) {  // 16 IEEE binary16 -> float32 (exact)
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
#elif defined(__AVX2__)
struct VI {
    __m256i lo, hi;
};
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline VI u8_lanes(const uint8_t* p) { return {_mm256_cvtepu8_epi32(load8(p)), _mm256_cvtepu8_epi32(load8(p + 8))}; }
inline VI i8_lanes(const uint8_t* p) { return {_mm256_cvtepi8_epi32(load8(p)), _mm256_cvtepi8_epi32(load8(p + 8))}; }
inline VI u32_lanes(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
// 16 lanes of three bytes each (48 bytes, little-endian), zero-extended: four 16-byte loads, none
// past the 48 bytes (the last from byte 32, its lanes' bytes at 4..15), spread per 128-bit lane.
inline VI u24_lanes(const uint8_t* p) {
    const __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(p)), load16(p + 12), 1);
    const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(p + 24)), load16(p + 32), 1);
    const __m256i first = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,  //
                                           0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    const __m256i last = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,  //
                                          4, 5, 6, -1, 7, 8, 9, -1, 10, 11, 12, -1, 13, 14, 15, -1);
    return {_mm256_shuffle_epi8(a, first), _mm256_shuffle_epi8(b, last)};
}
inline VI and_(VI a, int m) {
    const __m256i k = _mm256_set1_epi32(m);
    return {_mm256_and_si256(a.lo, k), _mm256_and_si256(a.hi, k)};
}
inline VI or_(VI a, VI b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline VI shr(VI a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline VI shl(VI a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline V to_float(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline V halves(const uint8_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
#else
struct VI {
    int32_t i[16];
};
inline VI u8_lanes(const uint8_t* p) {
    VI r;
    for (int j = 0; j < 16; ++j) r.i[j] = p[j];
    return r;
}
inline VI i8_lanes(const uint8_t* p) {
    VI r;
    for (int j = 0; j < 16; ++j) r.i[j] = int8_t(p[j]);
    return r;
}
inline VI u32_lanes(const uint8_t* p) {
    VI r;
    std::memcpy(r.i, p, sizeof(r.i));
    return r;
}
inline VI u24_lanes(const uint8_t* p) {  // 16 lanes of three bytes each, little-endian
    VI r;
    for (int j = 0; j < 16; ++j) r.i[j] = p[3 * j] | p[3 * j + 1] << 8 | p[3 * j + 2] << 16;
    return r;
}
inline VI and_(VI a, int m) {
    for (int32_t& v : a.i) v &= m;
    return a;
}
inline VI or_(VI a, VI b) {
    for (int j = 0; j < 16; ++j) a.i[j] |= b.i[j];
    return a;
}
inline VI shr(VI a, int n) {
    for (int32_t& v : a.i) v = int32_t(uint32_t(v) >> n);
    return a;
}
inline VI shl(VI a, int n) {
    for (int32_t& v : a.i) v = int32_t(uint32_t(v) << n);
    return a;
}
inline V to_float(VI a) {
    V r;
    for (int j = 0; j < 16; ++j) r.f[j] = float(a.i[j]);
    return r;
}
#endif

// ---- int8 products (drafts' prefill rows: see "prefill rows with int8 activations") -----------------
// W8: 64 bytes of quants, output c's four at 4c (of a tile's 16 outputs); X4: four int8 of a row of
// x, broadcast; dot4 adds the four products of each output to its int32 lane (one instruction with
// AVX512-VNNI). Without VNNI, `pairs` sums them two by two into int16 (unsigned 6-bit quants by
// x in [-127, 127]: at most 16002, so that a few pairs' sums may be added in int16 before they are
// widened), and `widen_add` adds both of an output's pair sums to its int32 lane. `dot4s` is
// dot4 for signed quants (Q8_0's): |q| by x with q's sign, whose pairs (at most 2 x 128 x 127)
// fit int16 too, the same exact sums.
inline int32_t word4(const int8_t* x) {  // four int8, as one little-endian word
    int32_t v;
    std::memcpy(&v, x, 4);
    return v;
}
// `vpdpbusd` on 8 lanes: AVX512-VNNI's, or AVX-VNNI's (the same instruction VEX-encoded, on CPUs
// without AVX-512: Intel's client chips from Alder Lake on, AMD's from Zen 5; an optional flag of
// the AVX2 build), the same sums as `vpmaddubsw` pairs widened.
#if defined(__AVX512VNNI__)
#define VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define VNNI256 0
#endif
#if defined(__AVX2__)
// An integer sum held where it is. GCC reassociates a run of integer adds (a row's pair sums over
// a group's steps, without VNNI) into a tree over every step's products, all of them live at
// once, and spills them to the stack: `int8_word_rows` of 4 rows stored and loaded 64 of them a
// group (160 stack accesses in the function, 47 with this). An empty asm that reads and writes
// the sum keeps the adds in the order written, each product consumed as it is made; the sums
// are exact, so no bit changes. On a Zen 3 (AVX2, no VNNI, 2 threads, in-process A/B of every
// product of a forward with int8 activations): SmolLM2 0.74-0.85x the time at 3-64 rows (0.96x
// at 2, 0.99x at 1), Qwen 1.5B 0.74-0.84x (0.94x, 1.01x).
inline __m256i held(__m256i v) {
    asm("" : "+x"(v));
    return v;
}
inline __m256i dot4s(__m256i acc, __m256i w, __m256i x) {  // `dot4s` on 8 lanes
    const __m256i a = _mm256_abs_epi8(w), sx = _mm256_sign_epi8(x, w);
#if VNNI256
    return dpbusd256(acc, a, sx);
#else
    return held(_mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, sx), _mm256_set1_epi16(1))));
#endif
}
#endif
#if defined(__AVX512F__)
inline VI to_int(V a) { return {_mm512_cvttps_epi32(a.v)}; }
inline VI zero_i() { return {_mm512_setzero_si512()}; }
inline void store_i(uint8_t* p, VI a) { _mm512_storeu_si512(p, a.v); }
inline VI add_i(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
struct W8 {
    __m512i v;
};
inline W8 load_w8(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
struct X4 {
    __m512i v;
};
inline X4 bcast4(const int8_t* x) { return {_mm512_set1_epi32(word4(x))}; }
struct P {
    __m512i v;
};
inline P pairs(W8 w, X4 x) { return {_mm512_maddubs_epi16(w.v, x.v)}; }
inline P add16(P a, P b) { return {_mm512_add_epi16(a.v, b.v)}; }
inline P zero_p() { return {_mm512_setzero_si512()}; }
inline VI widen_add(VI acc, P p) { return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(p.v, _mm512_set1_epi16(1)))}; }
#if defined(__AVX512VNNI__)
constexpr bool VNNI = true;
inline VI dot4(VI acc, W8 w, X4 x) { return {_mm512_dpbusd_epi32(acc.v, w.v, x.v)}; }
#else
constexpr bool VNNI = false;
inline VI dot4(VI acc, W8 w, X4 x) { return widen_add(acc, pairs(w, x)); }
#endif
inline VI dot4s(VI acc, W8 w, X4 x) {
    const __m512i signed_x = _mm512_mask_sub_epi8(x.v, _mm512_movepi8_mask(w.v), _mm512_setzero_si512(), x.v);
    return dot4(acc, {_mm512_abs_epi8(w.v)}, {signed_x});
}
#elif defined(__AVX2__)
inline VI to_int(V a) { return {_mm256_cvttps_epi32(a.lo), _mm256_cvttps_epi32(a.hi)}; }
inline VI add_i(VI a, VI b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline VI zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline void store_i(uint8_t* p, VI a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), a.hi);
}
struct W8 {
    __m256i lo, hi;
};
inline W8 load_w8(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
struct X4 {
    __m256i v;
};
inline X4 bcast4(const int8_t* x) { return {_mm256_set1_epi32(word4(x))}; }
struct P {
    __m256i lo, hi;
};
inline P pairs(W8 w, X4 x) { return {_mm256_maddubs_epi16(w.lo, x.v), _mm256_maddubs_epi16(w.hi, x.v)}; }
inline P add16(P a, P b) { return {held(_mm256_add_epi16(a.lo, b.lo)), held(_mm256_add_epi16(a.hi, b.hi))}; }
inline P zero_p() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VI widen_add(VI acc, P p) {
    const __m256i one = _mm256_set1_epi16(1);
    return {held(_mm256_add_epi32(acc.lo, _mm256_madd_epi16(p.lo, one))),
            held(_mm256_add_epi32(acc.hi, _mm256_madd_epi16(p.hi, one)))};
}
#if VNNI256
constexpr bool VNNI = true;
inline VI dot4(VI acc, W8 w, X4 x) { return {dpbusd256(acc.lo, w.lo, x.v), dpbusd256(acc.hi, w.hi, x.v)}; }
#else
constexpr bool VNNI = false;
inline VI dot4(VI acc, W8 w, X4 x) { return widen_add(acc, pairs(w, x)); }
#endif
inline VI dot4s(VI acc, W8 w, X4 x) { return {dot4s(acc.lo, w.lo, x.v), dot4s(acc.hi, w.hi, x.v)}; }
#else
inline VI to_int(V a) {
    VI r;
    for (int j = 0; j < 16; ++j) r.i[j] = int32_t(a.f[j]);
    return r;
}
inline VI zero_i() { return VI{}; }
inline void store_i(uint8_t* p, VI a) { std::memcpy(p, a.i, sizeof(a.i)); }
struct W8 {
    uint8_t b[64];
};
inline W8 load_w8(const uint8_t* p) {
    W8 w;
    std::memcpy(w.b, p, 64);
    return w;
}
struct X4 {
    int32_t b[4];
};
inline X4 bcast4(const int8_t* x) { return {{x[0], x[1], x[2], x[3]}}; }
struct P {
    int32_t s[32];  // (no int16 limit to keep here: the sums are exact either way)
};
inline P pairs(W8 w, X4 x) {
    P p;
    for (int j = 0; j < 32; ++j) p.s[j] = w.b[2 * j] * x.b[2 * (j % 2)] + w.b[2 * j + 1] * x.b[2 * (j % 2) + 1];
    return p;
}
inline P add16(P a, P b) {
    for (int j = 0; j < 32; ++j) a.s[j] += b.s[j];
    return a;
}
inline VI widen_add(VI acc, P p) {
    for (int j = 0; j < 16; ++j) acc.i[j] += p.s[2 * j] + p.s[2 * j + 1];
    return acc;
}
constexpr bool VNNI = false;
inline VI dot4(VI acc, W8 w, X4 x) { return widen_add(acc, pairs(w, x)); }
inline VI dot4s(VI acc, W8 w, X4 x) {
    for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 4; ++i) acc.i[j] += int8_t(w.b[4 * j + i]) * x.b[i];
    return acc;
}
#endif

#if !defined(__AVX2__)
float half(const uint8_t* p) {  // IEEE binary16, little-endian, to float32 (exact)
    const uint16_t h = uint16_t(p[0] | p[1] << 8);
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
}

inline V halves(const uint8_t* p) {
    V r;
    for (int j = 0; j < 16; ++j) r.f[j] = half(p + 2 * j);
    return r;
}
#endif

// ---- the formats ------------------------------------------------------------------------------
// ggml's type ids (ggml.h), the formats we read.
enum Format : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
constexpr int TILE = 16;  // outputs a tile holds side by side

// A group of 32 of a tile's block, as every format decodes it: step j's quants q (weights
// k = 32g + j, "lo", and 32g + 16 + j, "hi", of the 16 outputs) stand for a q + b, with the
// scales of the group's lo and hi halves (each product of a scale and a quant exact in float32).
struct lanes_group {
    V a_lo, a_hi, b_lo, b_hi;
    const uint8_t* q;
};

// The 4-bit quants of a group and tile, 256 bytes, laid out one of two ways. Byte pairs (GGUF's):
// step j's 16 bytes at 16 j, output c's byte holding weight j in its low nibble and j + 16 in its
// high, spread to lanes a step. Words (`words`, Q4_0, Q4_1 and Q4_K on AVX-512): four runs of 64
// bytes (lo steps 0-7, lo 8-15, hi 0-7, hi 8-15), output c's quants in word c, step 8i + s's at
// bits 4s; a step is a shift of words already in lanes and a table lookup of their low 4 bits
// (vpermps reads no other bits), no bytes spread to lanes: on Zen 4, Q4_1 products of one and two
// rows 7-8% faster. Q4_K's float rows gain nothing from words (Zen 5: within ±10% either way at
// 1-8 rows, 8 rows ~7% slower), but its int8 decoding rows read them as Q4_0's do, with no
// permutes (below). AVX2's float rows take a mask and a conversion more a step from words than
// from byte pairs (Zen 5, AVX2 build, in-process: one and two rows of Q4_1 and Q4_K 4-12% slower),
// while its int8 decoding rows take fewer operations from words (two masks and a shift a run
// against a permute and four unpacks a step pair: 0.71-0.88x the time at 1-16 rows): so on AVX2
// the float layout (`WORDS4`, the build's `specdecode_qlayout`) keeps byte pairs and the int8
// one (`specdecode_qlayout_int8`, what `QuantCPU.approximate` packs) has words. Each format is
// a template of its layout (`W`). The same quants either way, so the same products. `put4` writes
// one step's quants of output c (a tile's 256 bytes zeroed first where in words); `get4` reads it.
#if defined(__AVX512F__)
constexpr bool WORDS4 = true;
#else
constexpr bool WORDS4 = false;
#endif
// The int8 layout's: words wherever there are int8 decoding rows to read them; on AVX2 Q6_K's too
// (`Q6_K_`), where AVX-512 reads its triples with VBMI's byte permutes instead.
#if defined(__AVX2__)
constexpr bool INT8_WORDS4 = true;
#else
constexpr bool INT8_WORDS4 = WORDS4;
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool INT8_WORDS6 = true;
#else
constexpr bool INT8_WORDS6 = false;
#endif

template <bool words>
inline void put4(uint8_t* q, int c, int j, int lo, int hi) {
    if constexpr (words) {
        q[64 * (j / 8) + 4 * c + (j % 8) / 2] |= uint8_t((lo & 15) << (4 * (j % 2)));
        q[128 + 64 * (j / 8) + 4 * c + (j % 8) / 2] |= uint8_t((hi & 15) << (4 * (j % 2)));
    } else {
        q[16 * j + c] = uint8_t((lo & 15) | (hi & 15) << 4);
    }
}

template <bool words>
inline void get4(const uint8_t* q, int c, int j, int& lo, int& hi) {
    if constexpr (words) {
        lo = q[64 * (j / 8) + 4 * c + (j % 8) / 2] >> (4 * (j % 2)) & 15;
        hi = q[128 + 64 * (j / 8) + 4 * c + (j % 8) / 2] >> (4 * (j % 2)) & 15;
    } else {
        lo = q[16 * j + c] & 15, hi = q[16 * j + c] >> 4;
    }
}

template <bool words>
inline void nibbles(const uint8_t* q, int j, V& lo, V& hi) {  // step j's quants
#if defined(__AVX512F__)
    if constexpr (words) {
        const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        VI l = u32_lanes(q + 64 * (j / 8)), h = u32_lanes(q + 128 + 64 * (j / 8));
        if (j % 8) l = shr(l, 4 * (j % 8)), h = shr(h, 4 * (j % 8));
        lo = {_mm512_permutexvar_ps(l.v, values)};
        hi = {_mm512_permutexvar_ps(h.v, values)};
        return;
    }
#else
    if constexpr (words) {  // a shift, a mask and a conversion
        VI l = u32_lanes(q + 64 * (j / 8)), h = u32_lanes(q + 128 + 64 * (j / 8));
        if (j % 8) l = shr(l, 4 * (j % 8)), h = shr(h, 4 * (j % 8));
        lo = to_float(and_(l, 15));
        hi = to_float(and_(h, 15));
        return;
    }
#endif
    const VI v = u8_lanes(q + 16 * j);
    lo = to_float(and_(v, 15));
    hi = to_float(shr(v, 4));
}

// Each format: `weights` and `bytes` of a GGUF block; `packed`, the bytes of a tile's block (16
// outputs' blocks, laid out again by `pack`, which takes the 16 outputs' GGUF blocks); `bits`, of
// a quant (unsigned, 0 .. 2^bits - 1, but Q8_0's, signed); `Group`,
// a group of a tile's block ready to decode (`group` makes it), `quants`, step j's quants, and
// `uniform`, whether both halves of a group share their scales.
struct Uniform {
    static constexpr bool uniform = true, words = false;
    using Group = lanes_group;
};

template <bool W = WORDS4>
struct Q4_0_ : Uniform {  // d (16 x fp16), then the 4-bit quants (`put4`)
    static constexpr int weights = 32, bytes = 18, packed = TILE * bytes, bits = 4;
    static constexpr bool words = W;
    static constexpr int quant_bytes = 256;  // a group's quants: `get`, `put` read and write a step's
    static void get(const uint8_t* q, int c, int j, int& lo, int& hi) { get4<W>(q, c, j, lo, hi); }
    static void put(uint8_t* q, int c, int j, int lo, int hi) { put4<W>(q, c, j, lo, hi); }
    static void pack(const uint8_t* const* src, uint8_t* dst) {
        if constexpr (W) std::memset(dst + 32, 0, 256);  // words are put a nibble at a time
        for (int c = 0; c < TILE; ++c) {
            std::memcpy(dst + 2 * c, src[c], 2);
            for (int j = 0; j < 16; ++j) put4<W>(dst + 32, c, j, src[c][2 + j], src[c][2 + j] >> 4);
        }
    }
    static Group group(const uint8_t* t, int) {
        const V d = halves(t), b = mul(d, set1(-8.0f));  // d (q - 8) = fma(q, d, -8 d): exact
        return {d, d, b, b, t + 32};
    }
    static void quants(const Group& g, int j, V& lo, V& hi) { nibbles<W>(g.q, j, lo, hi); }
};

template <bool W = WORDS4>
struct Q4_1_ : Uniform {  // d, m (16 x fp16 each), the 4-bit quants
    static constexpr int weights = 32, bytes = 20, packed = TILE * bytes, bits = 4;
    static constexpr bool words = W;
    static constexpr int quant_bytes = 256;  // a group's quants: `get`, `put` read and write a step's
    static void get(const uint8_t* q, int c, int j, int& lo, int& hi) { get4<W>(q, c, j, lo, hi); }
    static void put(uint8_t* q, int c, int j, int lo, int hi) { put4<W>(q, c, j, lo, hi); }
    static void pack(const uint8_t* const* src, uint8_t* dst) {
        if constexpr (W) std::memset(dst + 64, 0, 256);
        for (int c = 0; c < TILE; ++c) {
            std::memcpy(dst + 2 * c, src[c], 2);
            std::memcpy(dst + 32 + 2 * c, src[c] + 2, 2);
            for (int j = 0; j < 16; ++j) put4<W>(dst + 64, c, j, src[c][4 + j], src[c][4 + j] >> 4);
        }
    }
    static Group group(const uint8_t* t, int) {
        const V d = halves(t), m = halves(t + 32);
        return {d, d, m, m, t + 64};
    }
    static void quants(const Group& g, int j, V& lo, V& hi) { nibbles<W>(g.q, j, lo, hi); }
};

struct Q5_0_ {  // d, the fifth bits (16 x uint32: bit k of output c), nibble pairs
    static constexpr int weights = 32, bytes = 22, packed = TILE * bytes, bits = 5;
    static constexpr bool uniform = true, words = false;
    static void pack(const uint8_t* const* src, uint8_t* dst) {
        for (int c = 0; c < TILE; ++c) {
            std::memcpy(dst + 2 * c, src[c], 2);
            std::memcpy(dst + 32 + 4 * c, src[c] + 2, 4);
            for (int j = 0; j < 16; ++j) dst[96 + 16 * j + c] = src[c][6 + j];
        }
    }
    struct Group : lanes_group {  // and the fifth bits
        VI h;
    };
    static Group group(const uint8_t* t, int) {
        const V d = halves(t), b = mul(d, set1(-16.0f));
        return {{d, d, b, b, t + 96}, u32_lanes(t + 32)};
    }
    static void quants(const Group& g, int j, V& lo, V& hi) {
        const VI v = u8_lanes(g.q + 16 * j);
        lo = to_float(or_(and_(v, 15), shl(and_(shr(g.h, j), 1), 4)));
        hi = to_float(or_(shr(v, 4), shl(and_(shr(g.h, j + 16), 1), 4)));
    }
};

struct Q8_0_ : Uniform {  // d, then 16 steps x (16 int8 at j, 16 at j + 16)
    static constexpr int weights = 32, bytes = 34, packed = TILE * bytes, bits = 8;  // signed
    static void pack(const uint8_t* const* src, uint8_t* dst) {
        for (int c = 0; c < TILE; ++c) {
            std::memcpy(dst + 2 * c, src[c], 2);
            for (int j = 0; j < 16; ++j) {
                dst[32 + 32 * j + c] = src[c][2 + j];
                dst[32 + 32 * j + 16 + c] = src[c][2 + 16 + j];
            }
        }
    }
    static Group group(const uint8_t* t, int) {
        const V d = halves(t);
        return {d, d, zero(), zero(), t + 32};
    }
    static void quants(const Group& g, int j, V& lo, V& hi) {
        lo = to_float(i8_lanes(g.q + 32 * j));
        hi = to_float(i8_lanes(g.q + 32 * j + 16));
    }
};

// Q4_K's 6-bit scale and min of group g (0..7) from the block's 12 scale bytes.
inline void q4_k_scale(const uint8_t* s, int g, int& sc, int& mn) {
    if (g < 4) {
        sc = s[g] & 63;
        mn = s[g + 4] & 63;
    } else {
        sc = (s[g + 4] & 0xf) | ((s[g - 4] >> 6) << 4);
        mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
}

// d, dmin (16 x fp16 each); per group of 32: scales (16 bytes), mins (16 bytes), nibble pairs.
// GGUF keeps groups 2i and 2i + 1 as the low and high nibbles of the same 32 bytes; here each
// group has its own, in byte pairs (`put4`: weights j and j + 16 in a byte).
template <bool W = WORDS4>
struct Q4_K_ : Uniform {
    static constexpr int weights = 256, bytes = 144, group_bytes = 32 + 256, packed = 64 + 8 * group_bytes, bits = 4;
    static constexpr bool words = W;
    static constexpr int quant_bytes = 256;  // a group's quants: `get`, `put` read and write a step's
    static void get(const uint8_t* q, int c, int j, int& lo, int& hi) { get4<W>(q, c, j, lo, hi); }
    static void put(uint8_t* q, int c, int j, int lo, int hi) { put4<W>(q, c, j, lo, hi); }
    static void pack(const uint8_t* const* src, uint8_t* dst) {
        if constexpr (W)
            for (int g = 0; g < 8; ++g) std::memset(dst + 64 + g * group_bytes + 32, 0, 256);
        for (int c = 0; c < TILE; ++c) {
            const uint8_t* b = src[c];
            std::memcpy(dst + 2 * c, b, 2);
            std::memcpy(dst + 32 + 2 * c, b + 2, 2);
            for (int g = 0; g < 8; ++g) {
                uint8_t* o = dst + 64 + g * group_bytes;
                int sc, mn;
                q4_k_scale(b + 4, g, sc, mn);
                o[c] = uint8_t(sc);
                o[16 + c] = uint8_t(mn);
                const uint8_t* q = b + 16 + (g / 2) * 32;
                for (int j = 0; j < 16; ++j) {
                    const int lo = (g & 1) ? q[j] >> 4 : q[j] & 0xf;
                    const int hi = (g & 1) ? q[j + 16] >> 4 : q[j + 16] & 0xf;
                    put4<W>(o + 32, c, j, lo, hi);
                }
            }
        }
    }
    // d sc q - dmin mn = fma(q, d sc, -(dmin mn)): both products exact (fp16 by 6 bits)
    static Group group(const uint8_t* t, int g) {
        const uint8_t* o = t + 64 + g * group_bytes;
        const V a = mul(halves(t), to_float(u8_lanes(o)));
        const V b = mul(sub(zero(), halves(t + 32)), to_float(u8_lanes(o + 16)));
        return {a, a, b, b, o + 32};
    }
    static void quants(const Group& g, int j, V& lo, V& hi) { nibbles<W>(g.q, j, lo, hi); }
};

// d (16 x fp16); per group of 32: int8 scales of its two halves (16 + 16 bytes: what the AVX-512
// build reads before a group's first step pair), then its 6-bit quants (384 bytes) one of two
// ways. Triples (the float rows'): 8 step pairs of 48 bytes, output c's three bytes at 3c holding
// its quants of steps 2i and 2i + 1, each lo then hi, 6 bits apiece from bit 0. (Kept as GGUF
// splits them, 4 low bits and 2 high, a step took 13 integer operations to put together, more than
// its multiply-adds at 4 rows.) Words (`W`: AVX2's int8 layout): the low 4 bits as Q4's words
// (`put4<true>`, 256 bytes), then the top 2 bits in two runs of 64 bytes (lo half, hi half),
// output c's word at 4c: its byte k holds those of steps 2k, 2k + 1, 8 + 2k, 8 + 2k + 1 of the
// half at bits 0, 2, 4, 6. An int8 row then takes a run's quants as four bytes per output
// (a mask, or a shift and a mask, of the nibbles, or-ed with a shift and a mask of the top bits),
// four quants of one half a lane: one dot product each, no lanes of zeros (`int8_q6_word_rows`).
// `put6` and `get6` write and read output c's step j.
template <bool W>
inline void put6(uint8_t* q, int c, int j, int lo, int hi) {
    if constexpr (W) {
        put4<true>(q, c, j, lo, hi);
        const int bit = 4 * (j / 8) + 2 * (j % 2), at = 4 * c + (j % 8) / 2;
        q[256 + at] |= uint8_t((lo >> 4 & 3) << bit);
        q[256 + 64 + at] |= uint8_t((hi >> 4 & 3) << bit);
    } else {
        uint8_t* o = q + 48 * (j / 2) + 3 * c;
        uint32_t v = uint32_t(o[0] | o[1] << 8 | o[2] << 16);
        v |= uint32_t((lo & 63) | (hi & 63) << 6) << (12 * (j % 2));
        for (int k = 0; k < 3; ++k) o[k] = uint8_t(v >> (8 * k));
    }
}

template <bool W>
inline void get6(const uint8_t* q, int c, int j, int& lo, int& hi) {
    if constexpr (W) {
        get4<true>(q, c, j, lo, hi);
        const int bit = 4 * (j / 8) + 2 * (j % 2), at = 4 * c + (j % 8) / 2;
        lo |= (q[256 + at] >> bit & 3) << 4;
        hi |= (q[256 + 64 + at] >> bit & 3) << 4;
    } else {
        const uint8_t* o = q + 48 * (j / 2) + 3 * c;
        const uint32_t v = uint32_t(o[0] | o[1] << 8 | o[2] << 16) >> (12 * (j % 2));
        lo = int(v & 63), hi = int(v >> 6 & 63);
    }
}

template <bool W = false>
struct Q6_K_ {
    static constexpr int weights = 256, bytes = 210, group_bytes = 32 + 384, packed = 32 + 8 * group_bytes, bits = 6;
    static constexpr bool uniform = false, words = W;  // each half of a group has its own scale
    static constexpr int quant_bytes = 384;  // a group's quants: `get`, `put` read and write a step's
    static void get(const uint8_t* q, int c, int j, int& lo, int& hi) { get6<W>(q, c, j, lo, hi); }
    static void put(uint8_t* q, int c, int j, int lo, int hi) { put6<W>(q, c, j, lo, hi); }
    using Group = lanes_group;
    static void pack(const uint8_t* const* src, uint8_t* dst) {
        for (int g = 0; g < 8; ++g) std::memset(dst + 32 + g * group_bytes + 32, 0, 384);  // put a quant at a time
        for (int c = 0; c < TILE; ++c) {
            const uint8_t* b = src[c];
            std::memcpy(dst + 2 * c, b + 208, 2);
            int q[256];  // 0..63, in GGUF's order (ggml's dequantize_row_q6_K)
            for (int h = 0; h < 2; ++h) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                for (int l = 0; l < 32; ++l) {
                    q[128 * h + l] = (ql[l] & 0xf) | ((qh[l] & 3) << 4);
                    q[128 * h + l + 32] = (ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4);
                    q[128 * h + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    q[128 * h + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            for (int g = 0; g < 8; ++g) {
                uint8_t* o = dst + 32 + g * group_bytes;
                const int* w = q + 32 * g;
                o[c] = b[192 + 2 * g];
                o[16 + c] = b[192 + 2 * g + 1];
                for (int j = 0; j < 16; ++j) put(o + 32, c, j, w[j], w[j + 16]);
            }
        }
    }
    // d sc (q - 32) = fma(q, d sc, -32 d sc): d sc exact (fp16 by int8), and so is -32 d sc
    static Group group(const uint8_t* t, int g) {
        const uint8_t* o = t + 32 + g * group_bytes;
        const V d = halves(t);
        const V a_lo = mul(d, to_float(i8_lanes(o))), a_hi = mul(d, to_float(i8_lanes(o + 16)));
        return {a_lo, a_hi, mul(a_lo, set1(-32.0f)), mul(a_hi, set1(-32.0f)), o + 32};
    }
    // (the loops run j as a constant: a pair's bytes are loaded and spread once for both steps)
    static void quants(const Group& g, int j, V& lo, V& hi) {
        if constexpr (W) {
            VI l = u32_lanes(g.q + 64 * (j / 8)), h = u32_lanes(g.q + 128 + 64 * (j / 8));
            VI tl = u32_lanes(g.q + 256), th = u32_lanes(g.q + 320);
            const int bit = 4 * (j / 8) + 2 * (j % 2);
            if (j % 8) l = shr(l, 4 * (j % 8)), h = shr(h, 4 * (j % 8));
            if (bit + 8 * ((j % 8) / 2)) tl = shr(tl, bit + 8 * ((j % 8) / 2)), th = shr(th, bit + 8 * ((j % 8) / 2));
            lo = to_float(or_(and_(l, 15), shl(and_(tl, 3), 4)));
            hi = to_float(or_(and_(h, 15), shl(and_(th, 3), 4)));
            return;
        }
        const VI v = u24_lanes(g.q + 48 * (j / 2));
        if (j % 2 == 0) {
            lo = to_float(and_(v, 63));
            hi = to_float(and_(shr(v, 6), 63));
        } else {
            lo = to_float(and_(shr(v, 12), 63));
            hi = to_float(shr(v, 18));
        }
    }
};

// Step j's weights dequantized (the values gguf-py gives): for reading rows, not for products.
template <class F>
inline void weights(const typename F::Group& g, int j, V& lo, V& hi) {
    F::quants(g, j, lo, hi);
    lo = fma(lo, g.a_lo, g.b_lo);
    hi = fma(hi, g.a_hi, g.b_hi);
}

// ---- products ---------------------------------------------------------------------------------
// A unit is two tiles (32 outputs) with their blocks interleaved: block b of the first tile, block
// b of the second, then block b + 1: the pair is read as one stream. (Two tiles a few KB apart,
// read side by side, halved the memory bandwidth a row of x got.)
//
// The arithmetic, per output of a row, group by group (32 weights, lo and hi halves of 16):
//   s_lo = sum over j of x[32g + j] q_lo[j],  s_hi likewise (chains of fused multiply-adds, j
//   ascending), then acc = fma(a_lo, s_lo, acc), fma(a_hi, s_hi, ...), fma(b_lo, X_lo, ...),
//   fma(b_hi, X_hi, ...), where X_lo, X_hi are the sums of the row's x over the two halves.
// That is sum of x (a q + b) with the scales applied once per group, not per weight: two float
// operations a weight and row instead of three (converting, then dequantizing, then multiplying
// each quant took a row of x to the float units' limit; laid out like this it reads weights at
// about the memory's rate). It is the same in every path, build and batch, so a row's result is
// bitwise the same alone or in any batch, on AVX-512 or AVX2.
constexpr int UNIT = 2 * TILE;

// Per build: up to FEW rows of x decode a unit in registers, TILES of its two tiles and R <= FR
// rows at a time (2 R TILES sums within the registers: 32 zmm, 16 ymm; the running totals wait
// in L1); more rows decode a unit into scratch and run SR rows at a time over it; prefill rows run
// PR at a time over a unit dequantized into scratch. (AVX2 runs 3 or more rows in half tiles,
// `few_rows8`, and never decodes into scratch.)
// Where FR1 > FR (AVX-512), a unit's tiles go one at a time instead, R <= FR1 rows a pass (2 R
// sums), past `PAIRED_ROWS`: on Zen 4 that was 8-25% faster than two tiles of FR rows at 1-32
// rows of Q4_K, Q5_0 and Q6_K, at 2-32 of Q4_1, and 15% for Q8_0 at 16-32; each tile is decoded
// once per FR1 rows rather than once per FR. `pair_tiles` keeps the earlier choice instead (two
// tiles up to FR rows, Q6_K up to 4; a tile a pass at FR1 rows or fewer past that), chosen on a
// Zen 5: which is faster is timed when the library loads (`cpu_isa.tile_pairing`), and either
// way the same arithmetic, so the same bits.
bool pair_tiles = false;
#if defined(__AVX512F__)
constexpr int TILES = 2, FEW = 32, FR = 6, FR1 = 12, SR = 6, PR = 6;
#elif defined(__AVX2__)
// AVX2 decodes in registers at every row count (FR8 rows of half tiles; Q8_0 FR rows of whole
// ones): against the float scratch it was 1.2-1.4x faster at 12-128 rows of every format tried.
constexpr int TILES = 1, FEW = 1 << 30, FR = 2, FR1 = 0, SR = 3, PR = 2;
#else
constexpr int TILES = 1, FEW = 2, FR = 1, FR1 = 0, SR = 1, PR = 1;
#endif

// Ask for the bytes F's distance past [p, p + n) now: the hardware's own prefetching, one stream
// per thread, left a row of x at ~30 GB/s of weights on two cores where ~40 are had with this.
// The distance: 12 KB for the formats of 32-weight blocks, whose blocks a row passes quickly
// (interleaved A/B from memory: Q4_0 and Q4_1 5-10% faster at 1 and 2 rows than at 4 KB), 4 KB
// for Q4_K and Q6_K (8% slower at 12 KB).
template <class F>
constexpr int PREFETCH = F::weights == 32 ? 12288 : 4096;
template <class F>
inline void prefetch_ahead(const uint8_t* p, int n) {
    for (int i = 0; i < n; i += 64) prefetch(p + PREFETCH<F> + i);
}

// y[n] for the outputs n < `valid` of C tiles (their sums in s).
template <int C>
inline void lanes_store(const V (&s)[C], float* y, int valid) {
    for (int c = 0; c < C; ++c) {
        const int n = valid - c * TILE;
        if (n >= TILE) {
            storev(y + c * TILE, s[c]);
        } else if (n > 0) {
            float tmp[TILE];
            storev(tmp, s[c]);
            std::memcpy(y + c * TILE, tmp, sizeof(float) * n);
        }
    }
}

// The sums of each row's x over each half group (16 values, in lanes.h's fixed order): xs (M, K/16).
void half_sums(const float* x, int64_t M, int64_t K, float* xs) {
    for (int64_t i = 0; i < M * (K / 16); ++i) xs[i] = reduce(loadv(x + 16 * i));
}

// The running sums of R rows over C tiles, kept in memory (L1): touched once a group, they would
// otherwise take registers the group's own sums need.
template <int R, int C>
struct Sums {
    alignas(64) float v[R][C][TILE] = {};
    V get(int r, int c) const { return loadv(v[r][c]); }
    void set(int r, int c, V a) { storev(v[r][c], a); }
    void store(int r, float* y, int valid) const {
        V s[C];
        for (int c = 0; c < C; ++c) s[c] = get(r, c);
        lanes_store<C>(s, y, valid);
    }
};

// A group's scales applied to its sums, the multiply-adds of the arithmetic above: four, or where
// both halves share their scales (`uniform`: every format but Q6_K) an add and two.
template <bool uniform>
inline V apply(const lanes_group& g, V s_lo, V s_hi, float x_lo, float x_hi, V acc) {
    if constexpr (uniform) {
        acc = fma(g.a_lo, add(s_lo, s_hi), acc);
        return fma(g.b_lo, set1(x_lo + x_hi), acc);
    }
    acc = fma(g.a_lo, s_lo, acc);
    acc = fma(g.a_hi, s_hi, acc);
    acc = fma(g.b_lo, set1(x_lo), acc);
    return fma(g.b_hi, set1(x_hi), acc);
}

// The same for int8 rows: group g's int32 sums of x q (the whole group's in s_lo where `uniform`)
// scaled by row r's x scale (xd (R, K/32)), its half sums of float x from xs (R, K/16). The one
// arithmetic of every int8 path (prompt rows, decoding rows read from words, byte pairs or Q6_K's
// quads: the words' rows write it out), so that they give the same bits.
// Where both halves share their scales: the group's sums s, row scale d and the row's sum of x
// over the group (its two half sums added).
inline V apply_int8_uniform(const lanes_group& sc, VI s, float d, float x_sum, V acc) {
    acc = fma(sc.a_lo, mul(to_float(s), set1(d)), acc);
    return fma(sc.b_lo, set1(x_sum), acc);
}
template <bool uniform>
inline V apply_int8(const lanes_group& sc, VI s_lo, VI s_hi, const float* xd, const float* xs, int64_t K, int r,
                    int64_t g, V acc) {
    const float x_lo = xs[r * (K / 16) + 2 * g], x_hi = xs[r * (K / 16) + 2 * g + 1];
    if constexpr (uniform) return apply_int8_uniform(sc, s_lo, xd[r * (K / 32) + g], x_lo + x_hi, acc);
    const V d = set1(xd[r * (K / 32) + g]);
    acc = fma(sc.a_lo, mul(to_float(s_lo), d), acc);
    acc = fma(sc.a_hi, mul(to_float(s_hi), d), acc);
    acc = fma(sc.b_lo, set1(x_lo), acc);
    return fma(sc.b_hi, set1(x_hi), acc);
}

// R rows of x (R, K) over C tiles of a unit from tile `first` (0, or 1 when C is 1), their quants
// decoded in registers, each step used by every row.
template <class F, int R, int C>
__attribute__((noinline)) void few_rows(const float* x, const float* xs, int64_t K, const uint8_t* unit,
                                        int first, float* y, int64_t ldy, int valid) {
    constexpr int groups = F::weights / 32;
    const int64_t halves_per_row = K / 16;
    Sums<R, C> acc;
    for (int64_t b = 0; b < K / F::weights; ++b) {
        prefetch_ahead<F>(unit + 2 * b * F::packed, 2 * F::packed);
        for (int i = 0; i < groups; ++i) {
            typename F::Group g[C];
            for (int c = 0; c < C; ++c) g[c] = F::group(unit + (2 * b + first + c) * F::packed, i);
            const int64_t k0 = (b * groups + i) * 32;
            V lo[R][C], hi[R][C];
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = zero();
#pragma GCC unroll 16  // constant steps: Q6_K's shifts and row offsets fold (1.3x at 4 rows)
            for (int j = 0; j < 16; ++j) {
                V ql[C], qh[C];
                for (int c = 0; c < C; ++c) F::quants(g[c], j, ql[c], qh[c]);
                for (int r = 0; r < R; ++r) {
                    const V xl = set1(x[r * K + k0 + j]), xh = set1(x[r * K + k0 + 16 + j]);
                    for (int c = 0; c < C; ++c) {
                        lo[r][c] = fma(xl, ql[c], lo[r][c]);
                        hi[r][c] = fma(xh, qh[c], hi[r][c]);
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                const float x_lo = xs[r * halves_per_row + k0 / 16], x_hi = xs[r * halves_per_row + k0 / 16 + 1];
                for (int c = 0; c < C; ++c)
                    acc.set(r, c, apply<F::uniform>(g[c], lo[r][c], hi[r][c], x_lo, x_hi, acc.get(r, c)));
            }
        }
    }
    for (int r = 0; r < R; ++r) acc.store(r, y + r * ldy + first * TILE, valid - first * TILE);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2's decoding rows: a tile's 16 outputs as two halves of 8 (one ymm each), R <= FR8 rows of a
// half at a time. A whole tile at 2 rows took 16 ymm for 4 sums and its quants, so 4 rows decoded
// every step twice; a half holds 4 rows' 8 sums in registers and decodes each step once for them
// (the other half's decoding is dead code the compiler drops). Each lane's operations and their
// order are few_rows's: the same bits as AVX-512's, in any batch. Q8_0, whose quants take two
// operations a step to decode, keeps whole tiles (its half steps were 10-15% slower: twice the
// broadcasts of x for the same multiply-adds).
constexpr int FR8 = 4;

template <int H>
inline __m256 half8(V a) {
    if constexpr (H == 0) {
        return a.lo;
    } else {
        return a.hi;
    }
}

// Half H of group g (its scales and quants) for R rows, applied to their running sums acc.
template <class F, int R, int H>
inline void group_half(const typename F::Group& g, const float* x, const float* xs, int64_t K, int64_t k0,
                       float (&acc)[R][TILE]) {
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
        V ql, qh;
        F::quants(g, j, ql, qh);
        const __m256 l = half8<H>(ql), h = half8<H>(qh);
        for (int r = 0; r < R; ++r) {
            lo[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * K + k0 + j]), l, lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * K + k0 + 16 + j]), h, hi[r]);
        }
    }
    for (int r = 0; r < R; ++r) {  // apply<F::uniform>, on this half
        const float x_lo = xs[r * (K / 16) + k0 / 16], x_hi = xs[r * (K / 16) + k0 / 16 + 1];
        __m256 a = _mm256_load_ps(acc[r] + 8 * H);
        if constexpr (F::uniform) {
            a = _mm256_fmadd_ps(half8<H>(g.a_lo), _mm256_add_ps(lo[r], hi[r]), a);
            a = _mm256_fmadd_ps(half8<H>(g.b_lo), _mm256_set1_ps(x_lo + x_hi), a);
        } else {
            a = _mm256_fmadd_ps(half8<H>(g.a_lo), lo[r], a);
            a = _mm256_fmadd_ps(half8<H>(g.a_hi), hi[r], a);
            a = _mm256_fmadd_ps(half8<H>(g.b_lo), _mm256_set1_ps(x_lo), a);
            a = _mm256_fmadd_ps(half8<H>(g.b_hi), _mm256_set1_ps(x_hi), a);
        }
        _mm256_store_ps(acc[r] + 8 * H, a);
    }
}

// R rows of x over tile `first` of a unit, each group decoded half by half (see FR8).
template <class F, int R>
__attribute__((noinline)) void few_rows8(const float* x, const float* xs, int64_t K, const uint8_t* unit,
                                         int first, float* y, int64_t ldy, int valid) {
    constexpr int groups = F::weights / 32;
    alignas(32) float acc[R][TILE] = {};
    for (int64_t b = 0; b < K / F::weights; ++b) {
        prefetch_ahead<F>(unit + 2 * b * F::packed, 2 * F::packed);
        for (int i = 0; i < groups; ++i) {
            const typename F::Group g = F::group(unit + (2 * b + first) * F::packed, i);
            const int64_t k0 = (b * groups + i) * 32;
            group_half<F, R, 0>(g, x, xs, K, k0, acc);
            group_half<F, R, 1>(g, x, xs, K, k0, acc);
        }
    }
    for (int r = 0; r < R; ++r) {
        const V s[1] = {loadv(acc[r])};
        lanes_store<1>(s, y + r * ldy + first * TILE, valid - first * TILE);
    }
}
#endif

// A unit decoded into scratch, per group of 32 and tile: the tile's scales (lanes_group's four
// V), then 16 steps x (lo, hi) quants.
constexpr int64_t SCRATCH_TILE = (4 + 16 * 2) * TILE;  // floats a group and tile
constexpr int64_t SCRATCH_GROUP = 2 * SCRATCH_TILE;

// Each group of a unit's blocks in order, the next blocks prefetched: fn(its group of tile 0, of
// tile 1).
template <class F, class Fn>
void each_group(const uint8_t* unit, int64_t K, const Fn& fn) {
    constexpr int groups = F::weights / 32;
    for (int64_t b = 0; b < K / F::weights; ++b) {
        prefetch_ahead<F>(unit + 2 * b * F::packed, 2 * F::packed);
        for (int i = 0; i < groups; ++i)
            fn(F::group(unit + 2 * b * F::packed, i), F::group(unit + (2 * b + 1) * F::packed, i));
    }
}

template <class F>
void decode_unit(const uint8_t* unit, int64_t K, float* w) {
    each_group<F>(unit, K, [&](const typename F::Group& g0, const typename F::Group& g1) {
        for (const typename F::Group* g : {&g0, &g1}) {
            storev(w, g->a_lo), storev(w + TILE, g->a_hi), storev(w + 2 * TILE, g->b_lo);
            storev(w + 3 * TILE, g->b_hi);
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
                V lo, hi;
                F::quants(*g, j, lo, hi);
                storev(w + (4 + 2 * j) * TILE, lo);
                storev(w + (5 + 2 * j) * TILE, hi);
            }
            w += SCRATCH_TILE;
        }
    });
}

// R rows of x over C tiles of a decoded unit (as `decode_unit` lays it out) from tile `first`.
template <int R, int C, bool uniform>
__attribute__((noinline)) void scratch_rows(const float* x, const float* xs, int64_t K, const float* w,
                                            int first, float* y, int64_t ldy, int valid) {
    const int64_t halves_per_row = K / 16;
    Sums<R, C> acc;
    w += first * SCRATCH_TILE;
    for (int64_t k0 = 0; k0 < K; k0 += 32, w += SCRATCH_GROUP) {
        lanes_group g[C];
        for (int c = 0; c < C; ++c) {
            const float* t = w + c * SCRATCH_TILE;
            g[c] = {loadv(t), loadv(t + TILE), loadv(t + 2 * TILE), loadv(t + 3 * TILE), nullptr};
        }
        V lo[R][C], hi[R][C];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = zero();
        for (int j = 0; j < 16; ++j) {
            for (int r = 0; r < R; ++r) {
                const V xl = set1(x[r * K + k0 + j]), xh = set1(x[r * K + k0 + 16 + j]);
                for (int c = 0; c < C; ++c) {
                    const float* q = w + c * SCRATCH_TILE + (4 + 2 * j) * TILE;
                    lo[r][c] = fma(xl, loadv(q), lo[r][c]);
                    hi[r][c] = fma(xh, loadv(q + TILE), hi[r][c]);
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const float x_lo = xs[r * halves_per_row + k0 / 16], x_hi = xs[r * halves_per_row + k0 / 16 + 1];
            for (int c = 0; c < C; ++c)
                acc.set(r, c, apply<uniform>(g[c], lo[r][c], hi[r][c], x_lo, x_hi, acc.get(r, c)));
        }
    }
    for (int r = 0; r < R; ++r) acc.store(r, y + r * ldy + first * TILE, valid - first * TILE);
}

// ---- prefill rows: their own arithmetic ----------------------------------------------------------
// A prompt's rows are many and need no invariance with the decoding rows of a step (a request's
// prompt is always prefilled), so they take the arithmetic that is fastest for many rows: a unit's
// weights dequantized once into scratch (per group: 16 steps x (tile 0 lo, hi, tile 1 lo, hi)),
// each output two chains (k mod 32 < 16, and the rest) summed at the end: no work per group, and
// ~20% faster than the decoding rows' arithmetic at 64 rows.
template <class F>
void dequantize_unit(const uint8_t* unit, int64_t K, float* w) {
    each_group<F>(unit, K, [&](const typename F::Group& g0, const typename F::Group& g1) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j, w += 4 * TILE) {
            V lo, hi;
            weights<F>(g0, j, lo, hi);
            storev(w, lo);
            storev(w + TILE, hi);
            weights<F>(g1, j, lo, hi);
            storev(w + 2 * TILE, lo);
            storev(w + 3 * TILE, hi);
        }
    });
}

// R prefill rows of x over a dequantized unit (as `dequantize_unit` lays it out).
template <int R>
__attribute__((noinline)) void prefill_rows(const float* x, int64_t K, const float* w, float* y, int64_t ldy,
                                            int valid) {
    V lo[R][2], hi[R][2];
    for (int r = 0; r < R; ++r) lo[r][0] = lo[r][1] = hi[r][0] = hi[r][1] = zero();
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        for (int j = 0; j < 16; ++j, w += 4 * TILE) {
            for (int r = 0; r < R; ++r) {
                const V xl = set1(x[r * K + k0 + j]), xh = set1(x[r * K + k0 + 16 + j]);
                lo[r][0] = fma(xl, loadv(w), lo[r][0]);
                hi[r][0] = fma(xh, loadv(w + TILE), hi[r][0]);
                lo[r][1] = fma(xl, loadv(w + 2 * TILE), lo[r][1]);
                hi[r][1] = fma(xh, loadv(w + 3 * TILE), hi[r][1]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const V s[2] = {add(lo[r][0], hi[r][0]), add(lo[r][1], hi[r][1])};
        lanes_store<2>(s, y + r * ldy, valid);
    }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2's 16 ymm registers: R rows of prefill_rows's two chains for 8 outputs of the unit at a time
// (w: their lo at w[0..8), hi at w[16..24) of each step), the same sums in the same order (the same
// bits as AVX-512's); two tiles at 2 rows took 32 accumulators and ran at ~45% of the float peak.
constexpr int PR8 = 6;

template <int R>
__attribute__((noinline)) void prefill_rows8(const float* x, int64_t K, const float* w, float* y, int64_t ldy,
                                             int valid) {
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        for (int j = 0; j < 16; ++j, w += 4 * TILE) {
            const __m256 wl = _mm256_loadu_ps(w), wh = _mm256_loadu_ps(w + TILE);
            for (int r = 0; r < R; ++r) {
                lo[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * K + k0 + j]), wl, lo[r]);
                hi[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * K + k0 + 16 + j]), wh, hi[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float out[8];
        _mm256_storeu_ps(out, _mm256_add_ps(lo[r], hi[r]));
        std::memcpy(y + r * ldy, out, sizeof(float) * (valid < 8 ? valid : 8));
    }
}
#endif

// `run<R>` with R = rows (1 .. RMAX), chosen at compile time.
template <int RMAX, int R = RMAX, class Run>
void run_rows(int rows, const Run& run) {
    if (rows == R) {
        run.template operator()<R>();
    } else if constexpr (R > 1) {
        run_rows<RMAX, R - 1>(rows, run);
    }
}

// All M rows of x through `run<R>`, RMAX at a time, then the rest together.
template <int RMAX, class Run>
void by_rows(int64_t M, const Run& run) {
    for (; M >= RMAX; M -= RMAX) run.template operator()<RMAX>();
    if (M > 0) run_rows<RMAX>(int(M), run);
}

// All M rows of x through `run<R>` in the fewest passes of at most RMAX rows, the rows shared
// evenly among them: with 8 at most, 9 rows as 5 and 4, not as 8 and a pass that decodes every
// weight again for one row (AVX-512, Qwen 1.5B's Q4_K MLP matrices from memory: 9 and 10 rows
// 0.89-0.93x the time).
template <int RMAX, class Run>
void by_passes(int64_t M, const Run& run) {
    while (M > 0) {
        const int64_t passes = (M + RMAX - 1) / RMAX, rows = (M + passes - 1) / passes;
        run_rows<RMAX>(int(rows), run);
        M -= rows;
    }
}

template <class F>
void prefill_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
                     int threads) {
    const int64_t unit_bytes = 2 * (K / F::weights) * F::packed;
    const int64_t units = (N + UNIT - 1) / UNIT;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scratch(size_t(K) * UNIT);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t u = units * t / nt; u < units * (t + 1) / nt; ++u) {
            const int64_t n0 = u * UNIT;
            const int valid = int(N - n0 < UNIT ? N - n0 : UNIT);
            dequantize_unit<F>(w + u * unit_bytes, K, scratch.data());
#if defined(__AVX512F__) || !defined(__AVX2__)
            const float* xr = x;
            float* yr = y + n0;
            by_rows<PR>(M, [&]<int R>() {
                prefill_rows<R>(xr, K, scratch.data(), yr, ldy, valid);
                xr += R * K, yr += R * ldy;
            });
#else
            for (int q = 0; q < 4 && 8 * q < valid; ++q) {  // the unit's four 8-output quarters
                const float* xr = x;
                float* yr = y + n0 + 8 * q;
                by_rows<PR8>(M, [&]<int R>() {
                    prefill_rows8<R>(xr, K, scratch.data() + 32 * (q / 2) + 8 * (q % 2), yr, ldy, valid - 8 * q);
                    xr += R * K, yr += R * ldy;
                });
            }
#endif
        }
    }
}

// ---- prefill rows with int8 activations (drafts) --------------------------------------------------
// A draft model only proposes, so its prompt may be read with less precision: each row of x is
// rounded to int8 per group of 32 (scale max|x| / 127, as llama.cpp's Q8_0), and each group's
// x·q summed exactly in int32 over unsigned quants (one VNNI instruction for 4 weights of 16
// outputs, against 4 float multiply-adds), then scaled once: y = sum over groups of
// a (dx sum x8 q) + b sum x, the second with the row's own float sums. Every format: Q8_0's signed
// quants through `dot4s`. A unit is decoded into scratch as
// bytes: per group and tile, its scales (a_lo, a_hi, b_lo, b_hi: 64 floats), then 8 steps of
// 4 weights (k = 32 g + 4 s + i) of the 16 outputs, output c's at 4c.
constexpr int64_t I8_TILE = 64 * 4 + 8 * 64;  // bytes of a group and tile

// x (M, K) -> int8 (M, K) and a scale per group of 32 (M, K/32): round(x / d), d = max|x| / 127,
// rounded to nearest even (the default rounding mode's `nearbyint`). With `words`, each run of 8
// bytes goes in the words' order 0 2 4 6 1 3 5 7 (for Q4_0's and Q4_1's words). The vector builds give the
// scalar loop's bits (max and the products are exact operations either way); they run before
// every int8 product, on one thread, so a scalar loop here was ~3% of a forward of 8 rows.
inline void in_word_order(int8_t* q) {  // each run of 8 of a group's 32 as 0 2 4 6 1 3 5 7
    for (int i = 0; i < 32; i += 8) {
        int8_t t[8];
        std::memcpy(t, q + i, 8);
        for (int s = 0; s < 4; ++s) q[i + s] = t[2 * s], q[i + 4 + s] = t[2 * s + 1];
    }
}
#if defined(__AVX512F__)
template <bool words = false>
inline float quantize_group(const float* v, int8_t* q) {
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m128i lo = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)));
    __m128i hi = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)));
    if constexpr (words) {
        const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
        lo = _mm_shuffle_epi8(lo, order), hi = _mm_shuffle_epi8(hi, order);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), hi);
    return amax / 127.0f;
}
#elif defined(__AVX2__)
template <bool words = false>
inline float quantize_group(const float* v, int8_t* q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(v + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[i]));
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
    const float amax = _mm256_cvtss_f32(m);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
    // packs work per 128-bit lane: dwords come out as 0 4 1 5 2 6 3 7 of the wanted order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if constexpr (words) {  // each run of 8 as 0 2 4 6 1 3 5 7
        const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
        ordered = _mm256_shuffle_epi8(ordered, _mm256_broadcastsi128_si256(order));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
    return amax / 127.0f;
}
#else
template <bool words = false>
inline float quantize_group(const float* v, int8_t* q) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; ++j) q[j] = int8_t(std::nearbyint(v[j] * inv));
    if constexpr (words) in_word_order(q);
    return amax / 127.0f;
}
#endif

template <bool words = false>
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d) {
    for (int64_t i = 0; i < M * (K / 32); ++i) d[i] = quantize_group<words>(x + 32 * i, q + 32 * i);
}

template <class F>
void bytes_unit(const uint8_t* unit, int64_t K, uint8_t* w) {
    each_group<F>(unit, K, [&](const typename F::Group& g0, const typename F::Group& g1) {
        for (const typename F::Group* g : {&g0, &g1}) {
            float* scales = reinterpret_cast<float*>(w);
            storev(scales, g->a_lo), storev(scales + TILE, g->a_hi), storev(scales + 2 * TILE, g->b_lo);
            storev(scales + 3 * TILE, g->b_hi);
            uint8_t* q = w + 64 * 4;
            VI lo[4], hi[4];
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {  // steps 4s .. 4s + 3 are bytes 0..3 of step s (lo) and 4 + s (hi)
                V l, h;
                F::quants(*g, j, l, h);
                const VI li = shl(and_(to_int(l), 0xFF), 8 * (j % 4)), hi_ = shl(and_(to_int(h), 0xFF), 8 * (j % 4));
                lo[j % 4] = j % 4 ? or_(lo[j % 4 - 1], li) : li;
                hi[j % 4] = j % 4 ? or_(hi[j % 4 - 1], hi_) : hi_;
                if (j % 4 == 3) {
                    store_i(q + 64 * (j / 4), lo[3]);
                    store_i(q + 64 * (4 + j / 4), hi[3]);
                }
            }
            w += I8_TILE;
        }
    });
}

// Steps [S0, S1) of a group of both tiles (t: their quant bytes) for R rows (x4: each row's group
// of int8 x), added to acc. Without VNNI, L steps' pair sums are added in int16 before widening
// (signed quants: L is 1).
template <int R, int S0, int S1, int L, bool sgn = false>
inline void group_dots(const uint8_t* const (&t)[2], const int8_t* const (&x4)[R], VI (&acc)[R][2]) {
    if constexpr (VNNI || sgn) {
        for (int s = S0; s < S1; ++s) {
            const W8 w[2] = {load_w8(t[0] + 64 * s), load_w8(t[1] + 64 * s)};
            for (int r = 0; r < R; ++r) {
                const X4 x = bcast4(x4[r] + 4 * s);
                for (int c = 0; c < 2; ++c) acc[r][c] = sgn ? dot4s(acc[r][c], w[c], x) : dot4(acc[r][c], w[c], x);
            }
        }
    } else {
        for (int s0 = S0; s0 < S1; s0 += L) {
            P p[R][2];
            for (int s = s0; s < s0 + L && s < S1; ++s) {
                const W8 w[2] = {load_w8(t[0] + 64 * s), load_w8(t[1] + 64 * s)};
                for (int r = 0; r < R; ++r) {
                    const X4 x = bcast4(x4[r] + 4 * s);
                    for (int c = 0; c < 2; ++c) p[r][c] = s == s0 ? pairs(w[c], x) : add16(p[r][c], pairs(w[c], x));
                }
            }
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < 2; ++c) acc[r][c] = widen_add(acc[r][c], p[r][c]);
        }
    }
}

// R rows of int8 x (xq (R, K), scales xd (R, K/32), float half sums xs (R, K/16), or where
// `uniform` each group's two added (R, K/32)) over a unit decoded by `bytes_unit`. L: steps whose
// int16 pair sums fit together (8 for 4-bit quants); sgn: signed quants (Q8_0).
template <int R, bool uniform, int L, bool sgn>
__attribute__((noinline)) void int8_rows(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                                         const uint8_t* w, float* y, int64_t ldy, int valid) {
    V out[R][2];
    for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = zero();
    for (int64_t g = 0; g < K / 32; ++g, w += 2 * I8_TILE) {
        const uint8_t* const t[2] = {w + 64 * 4, w + I8_TILE + 64 * 4};
        const int8_t* x4[R];
        for (int r = 0; r < R; ++r) x4[r] = xq + r * K + 32 * g;
        VI lo[R][2], hi[R][2];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < 2; ++c) lo[r][c] = hi[r][c] = zero_i();
        if constexpr (uniform) {
            group_dots<R, 0, 8, L, sgn>(t, x4, lo);
        } else {
            group_dots<R, 0, 4, L>(t, x4, lo);
            group_dots<R, 4, 8, L>(t, x4, hi);
        }
        for (int c = 0; c < 2; ++c) {
            const float* f = reinterpret_cast<const float*>(w + c * I8_TILE);
            const lanes_group sc = {loadv(f), loadv(f + TILE), loadv(f + 2 * TILE), loadv(f + 3 * TILE), nullptr};
            for (int r = 0; r < R; ++r) {
                if constexpr (uniform) {  // xs: the groups' sums of x (R, K/32)
                    out[r][c] = apply_int8_uniform(sc, lo[r][c], xd[r * (K / 32) + g], xs[r * (K / 32) + g], out[r][c]);
                } else {
                    out[r][c] = apply_int8<false>(sc, lo[r][c], hi[r][c], xd, xs, K, r, g, out[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) lanes_store<2>(out[r], y + r * ldy, valid);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Steps [S0, S1) of a group of one tile (q: its quant bytes) for R rows (x4: each row's group of
// int8 x), their sums added to `sum`: `group_dots` on one tile. (`group_dots` made generic over
// its tiles and called with one lost ~25% of the one-tile kernel's throughput to worse register
// use on Zen 3, hence the copy.)
template <int R, int S0, int S1, int L, bool sgn>
inline void tile_dots(const uint8_t* q, const int8_t* const (&x4)[R], VI (&sum)[R]) {
    if constexpr (VNNI || sgn) {
        for (int s = S0; s < S1; ++s) {
            const W8 wq = load_w8(q + 64 * s);
            for (int r = 0; r < R; ++r) {
                const X4 x = bcast4(x4[r] + 4 * s);
                sum[r] = sgn ? dot4s(sum[r], wq, x) : dot4(sum[r], wq, x);
            }
        }
    } else {
        for (int s0 = S0; s0 < S1; s0 += L) {
            P p[R];
            for (int s = s0; s < s0 + L && s < S1; ++s) {
                const W8 wq = load_w8(q + 64 * s);
                for (int r = 0; r < R; ++r) {
                    const X4 x = bcast4(x4[r] + 4 * s);
                    p[r] = s == s0 ? pairs(wq, x) : add16(p[r], pairs(wq, x));
                }
            }
            for (int r = 0; r < R; ++r) sum[r] = widen_add(sum[r], p[r]);
        }
    }
}

// `int8_rows` for one tile (`c`) of a unit at a time: AVX2's 16 registers hold R rows' float
// sums and their integer sums of the tile, the step's quants and a broadcast of x (15 at 3 rows
// of a format whose groups have one scale, `uniform`), where `int8_rows` over both tiles needed 29
// and kept a third of them on the stack, each step storing and loading them again. Q6_K's halves
// (their own scales) are summed one after the other, the lo half's applied before the hi half's
// are taken (`apply_int8`'s float operations in its order), in 6R + 3 registers. The integer sums
// are the same and the floats after them the same operations in the same order: the same bits.
// Groups [g0, g1) of the tile: the float sums start from `part` (R, TILE) past the first group and
// end there before the last.
template <int R, bool uniform, int L, bool sgn>
__attribute__((noinline)) void int8_tile_rows(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                                              const uint8_t* w, int c, int64_t g0, int64_t g1, float* part,
                                              float* y, int64_t ldy, int valid) {
    V out[R];
    for (int r = 0; r < R; ++r) out[r] = g0 == 0 ? zero() : loadv(part + r * TILE);
    const uint8_t* tile = w + c * I8_TILE + g0 * 2 * I8_TILE;
    for (int64_t g = g0; g < g1; ++g, tile += 2 * I8_TILE) {
        const uint8_t* q = tile + 64 * 4;
        const int8_t* x4[R];
        for (int r = 0; r < R; ++r) x4[r] = xq + r * K + 32 * g;
        const float* f = reinterpret_cast<const float*>(tile);
        if constexpr (uniform) {  // xs: the groups' sums of x (R, K/32)
            VI sum[R];
            for (int r = 0; r < R; ++r) sum[r] = zero_i();
            tile_dots<R, 0, 8, L, sgn>(q, x4, sum);
            const lanes_group sc = {loadv(f), loadv(f + TILE), loadv(f + 2 * TILE), loadv(f + 3 * TILE), nullptr};
            for (int r = 0; r < R; ++r)
                out[r] = apply_int8_uniform(sc, sum[r], xd[r * (K / 32) + g], xs[r * (K / 32) + g], out[r]);
        } else {  // xs: the half groups' sums of x (R, K/16)
            for (int h = 0; h < 2; ++h) {
                VI sum[R];
                for (int r = 0; r < R; ++r) sum[r] = zero_i();
                if (h == 0) {
                    tile_dots<R, 0, 4, L, sgn>(q, x4, sum);
                } else {
                    tile_dots<R, 4, 8, L, sgn>(q, x4, sum);
                }
                const V a = loadv(f + h * TILE);
                for (int r = 0; r < R; ++r) {
                    out[r] = fma(a, mul(to_float(sum[r]), set1(xd[r * (K / 32) + g])), out[r]);
                    if (h == 1) {
                        out[r] = fma(loadv(f + 2 * TILE), set1(xs[r * (K / 16) + 2 * g]), out[r]);
                        out[r] = fma(loadv(f + 3 * TILE), set1(xs[r * (K / 16) + 2 * g + 1]), out[r]);
                    }
                }
            }
        }
    }
    if (g1 < K / 32) {
        for (int r = 0; r < R; ++r) storev(part + r * TILE, out[r]);
    } else {
        for (int r = 0; r < R; ++r) lanes_store<1>({out[r]}, y + r * ldy + c * TILE, valid - c * TILE);
    }
}
#endif

#if defined(__AVX512F__)
constexpr int IR = 6;  // int8 rows at a time
#elif defined(__AVX2__)
// AVX2 builds take the prompt rows through `int8_tile_rows`, not `int8_rows`. (Zen 5, `int8_rows`
// of the AVX2 build, 64-256 prompt rows against one at a time: Qwen's Q4_K 8960x1536 0.72-0.75x
// the time, its Q6_K 1536x8960 0.81x, Q8_0 0.89x with AVX-VNNI; without, 0.55-0.66x, 0.91x, ~1x;
// 2 or 4 rows slower than 3.) `int8_tile_rows` on Zen 3: 3 rows at a time (4 keep their sums on
// the stack: 2.1x the time a group in L1; Q6_K at 2, in 15 registers, ~0.9x the throughput of 3,
// which spill a few), over 16 groups of a tile before the next rows, so that the tile's bytes of
// them (12 KB) stay in L1 for all the rows, not read again from L2 for each 3 (K = 8960, the rows
// of one unit from L2 before: Qwen 1.5B's Q4_K down projection ~1.18x the throughput; 4 groups
// ~0.85x of 16, 8 or 32 within the noise).
constexpr int TILE_IR = 3;
constexpr int64_t TILE_GROUPS = 16;
#else
constexpr int IR = 1;
#endif

template <class F>
void int8_prefill_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                          int64_t ldy, int threads) {
    constexpr bool sgn = F::bits == 8;  // Q8_0
    constexpr int L = sgn ? 1 : 8 >> (F::bits - 4);  // 4 bits: 8 x 3810 < 2^15; 5: 4 x 7874; 6: 2 x 16002
    const int64_t unit_bytes = 2 * (K / F::weights) * F::packed;
    const int64_t units = (N + UNIT - 1) / UNIT;
    // x in int8, its scales and half sums: every element written below before it is read (left
    // uninitialised: zeroing a prompt's took longer than rounding it).
    const std::unique_ptr<int8_t[]> xq(new int8_t[size_t(M * K)]);
    const std::unique_ptr<float[]> xd(new float[size_t(M * (K / 32))]), xs(new float[size_t(M * (K / 16))]);
    const std::unique_ptr<float[]> xg(new float[F::uniform ? size_t(M * (K / 32)) : 0]);  // xs's pairs summed
#pragma omp parallel num_threads(threads)
    {
        std::vector<uint8_t> scratch(size_t(K / 32 * 2 * I8_TILE));
#if defined(__AVX2__) && !defined(__AVX512F__)
        std::vector<float> part(size_t(M * TILE));  // `int8_tile_rows`' float sums between runs
#endif
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        {  // each thread rounds its share of the rows (the same groups, each on its own)
            const int64_t r0 = M * t / nt, r1 = M * (t + 1) / nt;
            quantize_rows(x + r0 * K, r1 - r0, K, xq.get() + r0 * K, xd.get() + r0 * (K / 32));
            half_sums(x + r0 * K, r1 - r0, K, xs.get() + r0 * (K / 16));
            if constexpr (F::uniform)  // each group's two half sums added once, not once a tile
                for (int64_t i = r0 * (K / 32); i < r1 * (K / 32); ++i) xg[i] = xs[2 * i] + xs[2 * i + 1];
        }
#pragma omp barrier
        for (int64_t u = units * t / nt; u < units * (t + 1) / nt; ++u) {
            const int64_t n0 = u * UNIT;
            const int valid = int(N - n0 < UNIT ? N - n0 : UNIT);
            bytes_unit<F>(w + u * unit_bytes, K, scratch.data());
#if defined(__AVX2__) && !defined(__AVX512F__)
            for (int c = 0; c * TILE < valid; ++c) {
                for (int64_t g0 = 0; g0 < K / 32; g0 += TILE_GROUPS) {
                    const int64_t g1 = std::min(K / 32, g0 + TILE_GROUPS);
                    int64_t r0 = 0;
                    by_rows<TILE_IR>(M, [&]<int R>() {
                        const float* sums = F::uniform ? xg.get() + r0 * (K / 32) : xs.get() + r0 * (K / 16);
                        int8_tile_rows<R, F::uniform, L, sgn>(xq.get() + r0 * K, xd.get() + r0 * (K / 32), sums, K,
                                                              scratch.data(), c, g0, g1, part.data() + r0 * TILE,
                                                              y + r0 * ldy + n0, ldy, valid);
                        r0 += R;
                    });
                }
            }
#else
            int64_t r0 = 0;
            by_rows<IR>(M, [&]<int R>() {
                const float* sums = F::uniform ? xg.get() + r0 * (K / 32) : xs.get() + r0 * (K / 16);
                int8_rows<R, F::uniform, L, sgn>(xq.get() + r0 * K, xd.get() + r0 * (K / 32), sums, K,
                                            scratch.data(), y + r0 * ldy + n0, ldy, valid);
                r0 += R;
            });
#endif
        }
    }
}

// ---- decoding rows with int8 activations ----------------------------------------------------------
// A model run with int8 activations (a draft's, or a target's where asked: `QuantCPU.approximate`)
// may read its decoding rows (a token, or the few of a verified draft) in int8 too, for the 4-bit
// formats, Q6_K and Q8_0. Where a format's quants sit in words (Q4_0, Q4_1, Q4_K on AVX-512:
// `put4<true>`), a word's eight quants of a run (steps 8i .. 8i + 7 of a half group) are two sets
// of four bytes with no spreading: its low nibbles (steps 8i + 0, 2, 4, 6) and its high ones
// (8i + 1, 3, 5, 7), each one VNNI dot product with the row's int8 x in that order
// (`quantize_rows<true>`). A group of a tile is then four loads, six integer operations and eight
// dot products a row, against 32 shifts and lookups and 32 float multiply-adds a row (Q4_K's
// groups of Qwen 1.5B's MLP shape, 2 threads, Zen 5, in-process A/B from memory: 0.69-0.83x the
// time of the byte pairs' quads at 1-4 rows). On AVX2 the int8 layout holds them in words too
// (`INT8_WORDS4`); weights in byte pairs take the float decoding rows. Q6_K's go through
// `int8_q6_rows`, Q8_0's through `int8_q8_rows`.
// The integer sums are those of the prompt rows (`int8_rows`; on AVX2 `int8_tile_rows`) and the
// floats after them the same operations in the same order: the same bits as the int8 prefill
// rows, in any batch, on AVX-512 and AVX2. Q5_0 and
// the portable build take the float decoding rows.
template <class F>
constexpr bool INT8_WORDS = F::words;  // Q4_0, Q4_1, Q4_K in words; AVX2's int8 layout, Q6_K too

#if defined(__AVX2__)
// 16 int32 lanes from two registers of 8 (outputs 0-7, 8-15).
#if defined(__AVX512F__)
inline VI int32_lanes(__m256i lo, __m256i hi) { return {_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)}; }
#else
inline VI int32_lanes(__m256i lo, __m256i hi) { return {lo, hi}; }
#endif

// f(group, g) for each group of tile `first` of a unit in order (g: its index along K), the
// unit's blocks asked for ahead.
template <class F, class Fn>
inline void tile_groups(const uint8_t* unit, int64_t K, int first, Fn&& f) {
    constexpr int groups = F::weights / 32;
    for (int64_t b = 0; b < K / F::weights; ++b) {
        prefetch_ahead<F>(unit + 2 * b * F::packed, 2 * F::packed);
        const uint8_t* block = unit + (2 * b + first) * F::packed;
        for (int i = 0; i < groups; ++i) f(F::group(block, i), b * groups + i);
    }
}

// Q6_K (`Q6_K_`: a step pair's four 6-bit quants of an output in its three bytes) puts each
// output's quants in the bytes (q[2p], q[2p + 1], q[2p + 16], q[2p + 17]) of a 32-bit lane (five
// integer operations for 16 outputs), and takes the lo and hi halves' sums (each with its own
// scale) as two dot products with x's (x[2p], x[2p + 1], 0, 0) and (0, 0, x[2p + 16], x[2p + 17])
// (`q6_x`): one `vpdpbusd` each with VNNI, else `vpmaddubsw` then `vpmaddwd` (`dot4`).
// With AVX512-VBMI and VNNI, two step pairs at once (`Q6_PAIRS`): a 64-bit lane holds an output's
// lo quad (q[4m] .. q[4m + 3]) and its hi quad (q[4m + 16] .. q[4m + 19]) of step pairs 2m and
// 2m + 1, taken by one `vpdpbusd` with x's (x[4m] .. x[4m + 3], x[4m + 16] .. x[4m + 19]): one dot
// product a step pair and row instead of two, the same integer sums (Qwen 1.5B, 2 threads, Zen 4,
// in-process A/B: down projection at 5 rows 0.65 -> 0.55 ms, LM head 15.1 -> 12.8 ms; its int8
// forward of 1 / 5 tokens 46.0 -> 42.7 / 85.6 -> 74.7 ms).
constexpr bool Q6_PAIRS = VBMI_QUADS;
// int8 x (M, K) in `quantize_rows`'s order -> per group and step pair p those two quads: (M, 2 K);
// with `Q6_PAIRS`, per group and pair of step pairs m its eight bytes: (M, K).
void q6_x(const int8_t* q, int64_t M, int64_t K, int8_t* out) {
    for (int64_t i = 0; i < M * (K / 32); ++i, q += 32) {
        if constexpr (Q6_PAIRS) {
            for (int m = 0; m < 4; ++m, out += 8)
                for (int k = 0; k < 4; ++k) out[k] = q[4 * m + k], out[4 + k] = q[4 * m + 16 + k];
        } else {
            for (int p = 0; p < 8; ++p, out += 8) {
                std::memset(out, 0, 8);
                out[0] = q[2 * p], out[1] = q[2 * p + 1], out[6] = q[2 * p + 16], out[7] = q[2 * p + 17];
            }
        }
    }
}

inline W8 w8_of(VI a) {  // 16 lanes of four bytes, as `dot4` takes weights
#if defined(__AVX512F__)
    return {a.v};
#else
    return {a.lo, a.hi};
#endif
}

#if VBMI_QUADS
// Q6_PAIRS: output c's three bytes of step pair 2m to bytes 0-2 of a 64-bit lane and those of 2m + 1
// to bytes 4-6 (outputs 0-7 in one register, 8-15 in another: one two-table byte permute each of
// the pair's 96 bytes, read as bytes 0-63 and 32-95), then one multishift takes the lo quad's bits
// (0, 12 of the first three bytes, 0, 12 of the second) to the lane's low four bytes and the hi
// quad's (6, 18, 6, 18) to its high four.
struct Q6Pairs {
    alignas(64) uint8_t index[2][64];
    static constexpr Q6Pairs make() {
        Q6Pairs t{};
        for (int h = 0; h < 2; ++h)
            for (int lane = 0; lane < 8; ++lane) {
                const int c = 8 * h + lane;
                for (int k = 0; k < 3; ++k) {
                    t.index[h][8 * lane + k] = uint8_t(3 * c + k);             // table one: bytes 0-63
                    t.index[h][8 * lane + 4 + k] = uint8_t(48 + 3 * c + k + 32);  // table two: 32-95 at 64
                }
            }
        return t;
    }
};
constexpr Q6Pairs Q6_PAIR_INDEX = Q6Pairs::make();

template <class F, int R>
__attribute__((noinline)) void int8_q6_rows(const int8_t* x8, const float* xd, const float* xs, int64_t K,
                                            const uint8_t* unit, int first, float* y, int64_t ldy, int valid) {
    const __m512i index[2] = {_mm512_load_si512(Q6_PAIR_INDEX.index[0]), _mm512_load_si512(Q6_PAIR_INDEX.index[1])};
    const __m512i shifts = _mm512_set1_epi64(int64_t(0x322612062C200C00ull)), six = _mm512_set1_epi8(0x3F);
    // the sums' lanes (lo, hi of outputs 0-7, then of 8-15) -> all lo, all hi
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    Sums<R, 1> out;
    tile_groups<F>(unit, K, first, [&](const typename F::Group& grp, int64_t g) {
        __m512i acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int m = 0; m < 4; ++m) {
            const __m512i a = _mm512_loadu_si512(grp.q + 96 * m), b = _mm512_loadu_si512(grp.q + 96 * m + 32);
            __m512i w[2];
            for (int h = 0; h < 2; ++h)
                w[h] = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, _mm512_permutex2var_epi8(a, index[h], b)), six);
            for (int r = 0; r < R; ++r) {
                int64_t quads;
                std::memcpy(&quads, x8 + r * K + 32 * g + 8 * m, 8);
                const __m512i x = _mm512_set1_epi64(quads);
                for (int h = 0; h < 2; ++h) acc[r][h] = _mm512_dpbusd_epi32(acc[r][h], w[h], x);
            }
        }
        for (int r = 0; r < R; ++r) {
            const VI lo = {_mm512_permutex2var_epi32(acc[r][0], even, acc[r][1])};
            const VI hi = {_mm512_permutex2var_epi32(acc[r][0], odd, acc[r][1])};
            out.set(r, 0, apply_int8<false>(grp, lo, hi, xd, xs, K, r, g, out.get(r, 0)));
        }
    });
    for (int r = 0; r < R; ++r) out.store(r, y + r * ldy + first * TILE, valid - first * TILE);
}
#else
// A step pair's quads (q[2p], q[2p + 1], q[2p + 16], q[2p + 17]) of the 16 outputs from its 48 bytes.
inline W8 q6_quads(const uint8_t* p) {
    const VI v = u24_lanes(p);  // q[2p] | q[2p + 16] << 6 | q[2p + 1] << 12 | q[2p + 17] << 18
    return w8_of(or_(or_(and_(v, 0x3F), and_(shr(v, 4), 0x3F00)),
                     or_(and_(shl(v, 10), 0x3F0000), and_(shl(v, 6), 0x3F000000))));
}

// R rows of int8 x (x8: `q6_x`; scales xd (R, K/32); float half sums xs (R, K/16)) over tile
// `first` of a unit of Q6_K (without `Q6_PAIRS`: AVX2, AVX-512 CPUs without VBMI or VNNI).
template <class F, int R>
__attribute__((noinline)) void int8_q6_rows(const int8_t* x8, const float* xd, const float* xs, int64_t K,
                                            const uint8_t* unit, int first, float* y, int64_t ldy, int valid) {
    Sums<R, 1> out;
    tile_groups<F>(unit, K, first, [&](const typename F::Group& grp, int64_t g) {
        VI lo[R], hi[R];
        for (int r = 0; r < R; ++r) lo[r] = hi[r] = zero_i();
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
            const W8 w = q6_quads(grp.q + 48 * p);
            for (int r = 0; r < R; ++r) {
                const int8_t* xr = x8 + r * 2 * K + 64 * g + 8 * p;
                lo[r] = dot4(lo[r], w, bcast4(xr));
                hi[r] = dot4(hi[r], w, bcast4(xr + 4));
            }
        }
        for (int r = 0; r < R; ++r) out.set(r, 0, apply_int8<false>(grp, lo[r], hi[r], xd, xs, K, r, g, out.get(r, 0)));
    });
    for (int r = 0; r < R; ++r) out.store(r, y + r * ldy + first * TILE, valid - first * TILE);
}
#endif

// Q8_0 (`Q8_0_`: a step's 16 signed quants lo, then its 16 hi) takes a step pair's 64 bytes as two
// registers, interleaves their bytes (steps 2p and 2p + 1 of an output side by side), then their
// byte pairs, so that output c's lane holds (q[2p], q[2p + 1], q[2p + 16], q[2p + 17]), outputs 0-7
// in one register and 8-15 in the other (two unpacks, two permutes and two shuffles for 16
// outputs), multiplied by x's matching quad (`q8_x`) as `dot4s` does: |q| by x with q's sign.
// With AVX512-VBMI and VNNI (`Q8_UNSIGNED`), every row count takes both tiles of a unit at once:
// one byte permute puts a tile's quads of a step pair in one register, and flipping their top bits
// makes them the unsigned q + 128 that `vpdpbusd` takes as they are: one dot product a step pair,
// tile and row, its sums started at -128 (x[0] + ... + x[31]) (`q8_x`), so that they end as the
// same integer sums of x q. Zen 4, 2 threads, in-process A/B: 8192x576 (in cache) at 3 / 4 / 8 rows
// 0.115 / 0.139 / 0.250 -> 0.068 / 0.079 / 0.158 ms; SmolLM2's 49152x576 LM head (30 MB, from
// memory) at 6 / 8 rows 1.74 / 1.92 -> 1.56 / 1.58 ms. One and two rows were no faster this way on
// the Zen 4, but on a Xeon (model 167) the same head's product of one / two rows took 0.73 / 0.68x
// the time of `dot4s` (2 threads, in-process A/B, from memory), so they take it too.
constexpr bool Q8_UNSIGNED = VBMI_QUADS;
constexpr int64_t X8Q8 = Q8_UNSIGNED ? 2 : 1;  // bytes of `q8_x` a weight
// int8 x (M, K) in `quantize_rows`'s order -> per group and step pair p: x[2p], x[2p + 1],
// x[2p + 16], x[2p + 17] (M, K).
// With `Q8_UNSIGNED`, each group's 32 bytes are followed by its int32 -128 (x[0] + ... + x[31]) and 28
// bytes of padding: (M, 2 K).
void q8_x(const int8_t* q, int64_t M, int64_t K, int8_t* out) {
    for (int64_t i = 0; i < M * (K / 32); ++i, q += 32) {
        for (int p = 0; p < 8; ++p, out += 4)
            out[0] = q[2 * p], out[1] = q[2 * p + 1], out[2] = q[2 * p + 16], out[3] = q[2 * p + 17];
        if constexpr (Q8_UNSIGNED) {
            int32_t sum = 0;
            for (int k = 0; k < 32; ++k) sum += q[k];
            sum *= -128;
            std::memset(out, 0, 32);
            std::memcpy(out, &sum, 4);
            out += 32;
        }
    }
}

// R rows of int8 x (x8: `q8_x`; scales xd (R, K/32); float half sums xs (R, K/16)) over a unit of
// Q8_0.
#if VBMI_QUADS
struct Q8Quads {  // byte 4c + i of the permuted pair: output c's quants of steps 2p, 2p + 1 (lo), then hi
    alignas(64) uint8_t index[64];
    static constexpr Q8Quads make() {
        Q8Quads t{};
        for (int c = 0; c < 16; ++c) {
            t.index[4 * c] = uint8_t(c), t.index[4 * c + 1] = uint8_t(32 + c);
            t.index[4 * c + 2] = uint8_t(16 + c), t.index[4 * c + 3] = uint8_t(48 + c);
        }
        return t;
    }
};
constexpr Q8Quads Q8_QUAD_INDEX = Q8Quads::make();

// R rows over both tiles of a unit at once (the unit's blocks read in order).
template <class F, int R>
__attribute__((noinline)) void int8_q8_unsigned_rows(const int8_t* x8, const float* xd, const float* xs, int64_t K,
                                                     const uint8_t* unit, float* y, int64_t ldy, int valid) {
    const __m512i index = _mm512_load_si512(Q8_QUAD_INDEX.index), flip = _mm512_set1_epi8(char(0x80));
    Sums<R, 2> out;
    for (int64_t g = 0; g < K / 32; ++g) {
        const uint8_t* block = unit + 2 * g * F::packed;
        prefetch_ahead<F>(block, 2 * F::packed);
        __m512i acc[R][2];
        for (int r = 0; r < R; ++r) {
            int32_t start;
            std::memcpy(&start, x8 + r * 2 * K + 64 * g + 32, 4);
            acc[r][0] = acc[r][1] = _mm512_set1_epi32(start);
        }
        typename F::Group grp[2] = {F::group(block, 0), F::group(block + F::packed, 0)};
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
            __m512i w[2];
            for (int c = 0; c < 2; ++c)
                w[c] = _mm512_xor_si512(_mm512_permutexvar_epi8(index, _mm512_loadu_si512(grp[c].q + 64 * p)), flip);
            for (int r = 0; r < R; ++r) {
                const __m512i x = _mm512_set1_epi32(word4(x8 + r * 2 * K + 64 * g + 4 * p));
                for (int c = 0; c < 2; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], x);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < 2; ++c) {
                const VI sum = {acc[r][c]};
                out.set(r, c, apply_int8<true>(grp[c], sum, sum, xd, xs, K, r, g, out.get(r, c)));
            }
    }
    for (int r = 0; r < R; ++r) out.store(r, y + r * ldy, valid);
}
#endif  // VBMI_QUADS

// R rows over tile `first` with the signed quants (`dot4s`): without VBMI and VNNI.
template <class F, int R>
__attribute__((noinline)) void int8_q8_rows(const int8_t* x8, const float* xd, const float* xs, int64_t K,
                                            const uint8_t* unit, int first, float* y, int64_t ldy, int valid) {
    // within each 128-bit half: the byte pairs of outputs 0-3 (steps 2p, 2p + 1, lo) then their hi
    const __m256i quads = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3,
                                           10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    Sums<R, 1> out;
    tile_groups<F>(unit, K, first, [&](const typename F::Group& grp, int64_t g) {
        __m256i acc[R][2];  // outputs 0-7, 8-15
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp.q + 64 * p));
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp.q + 64 * p + 32));
            __m256i u[2] = {_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b)};
            for (int c = 0; c < 2; ++c) u[c] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(u[c], 0xD8), quads);
            for (int r = 0; r < R; ++r) {
                const __m256i x = _mm256_set1_epi32(word4(x8 + (r * K + 32 * g) * X8Q8 + 4 * p));
                for (int c = 0; c < 2; ++c) acc[r][c] = dot4s(acc[r][c], u[c], x);
            }
        }
        for (int r = 0; r < R; ++r) {
            const VI sum = int32_lanes(acc[r][0], acc[r][1]);
            out.set(r, 0, apply_int8<true>(grp, sum, sum, xd, xs, K, r, g, out.get(r, 0)));
        }
    });
    for (int r = 0; r < R; ++r) out.store(r, y + r * ldy + first * TILE, valid - first * TILE);
}
#endif

#if defined(__AVX2__)
// A run's 64 bytes of words (output c's at 4c) as its low nibbles (steps 8i + 0, 2, 4, 6 of each
// output, a byte apiece) and its high ones (8i + 1, 3, 5, 7): two masks and a shift.
inline W8 word_nibbles(const uint8_t* p, int odd) {
#if defined(__AVX512F__)
    const __m512i low = _mm512_set1_epi32(0x0F0F0F0F), v = _mm512_loadu_si512(p);
    return {_mm512_and_si512(odd ? _mm512_srli_epi32(v, 4) : v, low)};
#else
    const __m256i low = _mm256_set1_epi32(0x0F0F0F0F);
    const W8 v = load_w8(p);
    if (odd) return {_mm256_and_si256(_mm256_srli_epi32(v.lo, 4), low), _mm256_and_si256(_mm256_srli_epi32(v.hi, 4), low)};
    return {_mm256_and_si256(v.lo, low), _mm256_and_si256(v.hi, low)};
#endif
}

// Tiles a pass of `int8_word_rows` over a unit takes. Both, so that the weights
// stream in the order they lie and the memory keeps delivering while the rows multiply: always on
// AVX-512 (a zmm of sums a row and tile); on AVX2 for the 32-weight formats up to 4 rows, a tile's
// group at a time (a row's pair sums take two ymm: 4 rows' of both tiles would take all 16
// registers), each folded into the row's outputs before the other tile's. A pass a tile reads
// half of each block's bytes from memory and then the other half from the cache, the memory idle
// meanwhile. In-process A/B on a Zen 3 (AVX2, no VNNI, 2 threads, every layer product of a forward
// from memory, the same bits): Qwen 0.5B's Q4_0 at 1 / 2 / 3 / 4 rows 0.83 / 0.82 / 0.88 / 0.93-1.0x
// the time of a pass a tile, SmolLM2's Q4_1 0.79-0.88 / 0.83-0.85 / 0.92 / 0.89-1.0x; at 5 and 6
// rows 0.99-1.07x (kept a pass a tile); Qwen 1.5B's Q4_K 1.13-1.21x (kept: its 2.3 KB of a tile
// a block are runs the prefetching follows).
template <class F, int R>
constexpr int PASS_TILES =
#if defined(__AVX512F__)
    2;
#else
    F::weights == 32 && R <= 4 ? 2 : 1;
#endif

// R rows of int8 x (xq: `quantize_rows<true>`; scales xd (R, K/32); float half sums xs (R, K/16)) over
// PASS_TILES tiles from `pass` of a unit of F's words.
// S: integer sums a row and tile keeps (added at the end of a group), so that one row's dot
// products are not one chain waiting on each other's latency (a row alone took longer than two).
// Without VNNI a group's eight pair sums an output (4 runs, even and odd: 8 x 2 x 15 x 127 < 2^15)
// are added in int16 and widened once, as `group_dots` does.
template <class F, int R, int S = (!VNNI ? 1 : R == 1 ? 4 : R == 2 ? 2 : 1)>
__attribute__((noinline)) void int8_word_rows(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                                              const uint8_t* unit, int pass, float* y, int64_t ldy, int valid) {
#if defined(__AVX512F__)
    constexpr int NT = 2;  // tiles whose sums are live at once
#else
    constexpr int NT = 1;
#endif
    constexpr int groups = F::weights / 32, PASS = PASS_TILES<F, R>;
    V out[R][PASS];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < PASS; ++c) out[r][c] = zero();
    for (int64_t b = 0; b < K / F::weights; ++b) {
        const uint8_t* block = unit + 2 * b * F::packed;
        prefetch_ahead<F>(block, 2 * F::packed);
        for (int i = 0; i < groups; ++i) {
            const int64_t g = b * groups + i;
#pragma GCC unroll 2
            for (int t0 = 0; t0 < PASS; t0 += NT) {  // tiles pass + t0 .. pass + t0 + NT - 1
                const int first = pass + t0;
                const uint8_t* q[NT];  // their words
                for (int c = 0; c < NT; ++c) q[c] = F::group(block + (first + c) * F::packed, i).q;
                VI acc[R][NT][S];
                P p16[R][NT];  // without VNNI
                for (int r = 0; r < R; ++r)
                    for (int c = 0; c < NT; ++c) {
                        p16[r][c] = zero_p();
                        for (int s = 0; s < S; ++s) acc[r][c][s] = zero_i();
                    }
                // step 2 run + odd: a run's even steps (odd 0), then its odd ones; each sum a register
                const auto steps = [&](int run, int odd, const W8 (&w)[NT]) {
                    for (int r = 0; r < R; ++r) {
                        const X4 x = bcast4(xq + r * K + 32 * g + 8 * run + 4 * odd);
                        for (int c = 0; c < NT; ++c) {
                            if constexpr (VNNI) {
                                acc[r][c][(2 * run + odd) % S] = dot4(acc[r][c][(2 * run + odd) % S], w[c], x);
                            } else {
                                p16[r][c] = add16(p16[r][c], pairs(w[c], x));
                            }
                        }
                    }
                };
                if constexpr (NT == 2) {  // AVX-512: a run's words read once for both
#pragma GCC unroll 4
                    for (int run = 0; run < 4; ++run) {
                        W8 even[NT], odd[NT];
                        for (int c = 0; c < NT; ++c)
                            even[c] = word_nibbles(q[c] + 64 * run, 0), odd[c] = word_nibbles(q[c] + 64 * run, 1);
                        steps(run, 0, even);
                        steps(run, 1, odd);
                    }
                } else {  // AVX2: a parity at a time, fewer registers live (16 ymm)
#pragma GCC unroll 8
                    for (int step = 0; step < 8; ++step) {
                        W8 w[NT];
                        for (int c = 0; c < NT; ++c) w[c] = word_nibbles(q[c] + 64 * (step / 2), step % 2);
                        steps(step / 2, step % 2, w);
                    }
                }
                for (int c = 0; c < NT; ++c) {
                    const typename F::Group grp = F::group(block + (first + c) * F::packed, i);
                    for (int r = 0; r < R; ++r) {  // `apply_int8<true>`, written out: through it one row was ~4% slower
                        const V d = set1(xd[r * (K / 32) + g]);
                        const float x_lo = xs[r * (K / 16) + 2 * g], x_hi = xs[r * (K / 16) + 2 * g + 1];
                        VI sum = acc[r][c][0];
                        if constexpr (VNNI) {
                            for (int s = 1; s < S; ++s) sum = add_i(sum, acc[r][c][s]);
                        } else {
                            sum = widen_add(sum, p16[r][c]);
                        }
                        V& o = out[r][t0 + c];
                        o = fma(grp.a_lo, mul(to_float(sum), d), o);
                        o = fma(grp.b_lo, set1(x_lo + x_hi), o);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) lanes_store<PASS>(out[r], y + r * ldy + pass * TILE, valid - pass * TILE);
}

#if !defined(__AVX512F__)
// R rows of int8 x (xq: `quantize_rows<true>`; scales xd (R, K/32); float half sums xs (R, K/16))
// over tile `first` of a unit of Q6_K in words (AVX2's int8 layout): a run's even steps are the
// nibbles' low bits or-ed with their top bits moved to bits 4-5 of the same bytes, its odd steps
// likewise from the nibbles' high bits: four quants of an output and half a lane, one dot product
// with the row's matching x each. Runs 0-1 are the lo half, 2-3 the hi half, each its own sums.
// Without VNNI, a run's two pair sums an output (2 x 2 x 63 x 127 < 2^15) are added in int16, then
// widened.
template <class F, int R>
__attribute__((noinline)) void int8_q6_word_rows(const int8_t* xq, const float* xd, const float* xs, int64_t K,
                                                 const uint8_t* unit, int first, float* y, int64_t ldy, int valid) {
    const __m256i low = _mm256_set1_epi32(0x0F0F0F0F), top = _mm256_set1_epi32(0x30303030);
    Sums<R, 1> out;
    tile_groups<F>(unit, K, first, [&](const typename F::Group& grp, int64_t g) {
        VI half[2][R];
        for (int h = 0; h < 2; ++h)
            for (int r = 0; r < R; ++r) half[h][r] = zero_i();
#pragma GCC unroll 4
        for (int run = 0; run < 4; ++run) {
            const int h = run / 2;
            const W8 n = load_w8(grp.q + 64 * run), t = load_w8(grp.q + 256 + 64 * h);
            // top bits of the even steps at 0-1 (run 2h) or 4-5 (2h + 1) of each byte, of the odd at 2-3 or 6-7
            const auto even = [&](__m256i nib, __m256i hi2) {
                const __m256i up = run % 2 ? hi2 : _mm256_slli_epi32(hi2, 4);
                return _mm256_or_si256(_mm256_and_si256(nib, low), _mm256_and_si256(up, top));
            };
            const auto odd = [&](__m256i nib, __m256i hi2) {
                const __m256i up = run % 2 ? _mm256_srli_epi32(hi2, 2) : _mm256_slli_epi32(hi2, 2);
                return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(nib, 4), low), _mm256_and_si256(up, top));
            };
            const W8 e = {even(n.lo, t.lo), even(n.hi, t.hi)}, o = {odd(n.lo, t.lo), odd(n.hi, t.hi)};
            for (int r = 0; r < R; ++r) {
                const int8_t* x8 = xq + r * K + 32 * g + 8 * run;
                if constexpr (VNNI) {
                    half[h][r] = dot4(dot4(half[h][r], e, bcast4(x8)), o, bcast4(x8 + 4));
                } else {
                    half[h][r] = widen_add(half[h][r], add16(pairs(e, bcast4(x8)), pairs(o, bcast4(x8 + 4))));
                }
            }
        }
        for (int r = 0; r < R; ++r) out.set(r, 0, apply_int8<false>(grp, half[0][r], half[1][r], xd, xs, K, r, g, out.get(r, 0)));
    });
    for (int r = 0; r < R; ++r) out.store(r, y + r * ldy + first * TILE, valid - first * TILE);
}
#endif

#endif

// The build's int8 decoding rows (`int8_decoding_product`): which formats take them, x's int8
// bytes a weight as F's rows read it (`int8_x`: X8<F> of them), and R rows over a unit.
#if defined(__AVX2__)
template <class F>
constexpr bool Q6 = F::bits == 6 && !F::uniform;
template <class F>
constexpr bool Q8 = F::bits == 8;
template <class F>
constexpr bool INT8_DECODES = (INT8_WORDS<F> && (F::bits == 4 || INT8_WORDS6)) || (Q6<F> && !F::words) || Q8<F>;
template <class F>
constexpr int64_t X8 = INT8_WORDS<F> ? 1 : Q6<F> ? (Q6_PAIRS ? 1 : 2) : Q8<F> ? X8Q8 : 1;
// Int8 decoding rows a pass of a unit takes (their sums in registers: 32 zmm, 16 ymm). On AVX2 a
// row's sums take two ymm (with VNNI; without, its int16 pair sums two more, the int32 ones live
// only at a group's end), so words take more than four: five to eight rows of Qwen 1.5B's Q4_K
// and Q6_K MLP matrices from memory took 0.77-0.89x the time of a pass of four and a pass of the
// rest, which decodes every quant again (2 threads, Zen 5, in-process A/B; the build without VNNI,
// held to six, five and six 0.82-0.95x), Q4_0/Q4_1's five and six 0.93x (seven and eight spill:
// 1.45x). Q8_0's take four (five or more spill: 1.05-1.15x).
template <class F>
constexpr int IDR =
#if defined(__AVX512F__)
    8;
#else
    Q8<F> ? 4 : !VNNI || F::weights == 32 ? 6 : 8;
#endif

template <class F>
void int8_x(const float* x, int64_t M, int64_t K, int8_t* xq, float* d) {
    if constexpr (INT8_WORDS<F>) {
        quantize_rows<true>(x, M, K, xq, d);
    } else {
        std::vector<int8_t> q(size_t(M * K));
        quantize_rows(x, M, K, q.data(), d);
        (Q6<F> ? q6_x : q8_x)(q.data(), M, K, xq);
    }
}
template <class F, int R>
void int8_unit_rows(const int8_t* xq, const float* xd, const float* xs, int64_t K, const uint8_t* unit, float* y,
                    int64_t ldy, int valid) {
    if constexpr (INT8_WORDS<F> && F::bits == 4) {
        for (int pass = 0; pass < 2; pass += PASS_TILES<F, R>) int8_word_rows<F, R>(xq, xd, xs, K, unit, pass, y, ldy, valid);
        return;
    }
#if !defined(__AVX512F__)  // (INT8_WORDS6)
    if constexpr (INT8_WORDS<F> && Q6<F>) {
        for (int first = 0; first < 2; ++first) int8_q6_word_rows<F, R>(xq, xd, xs, K, unit, first, y, ldy, valid);
        return;
    }
#endif
#if VBMI_QUADS
    if constexpr (Q8<F>) {
        int8_q8_unsigned_rows<F, R>(xq, xd, xs, K, unit, y, ldy, valid);
        return;
    }
#endif
    for (int first = 0; first < 2; ++first) {
        if constexpr (Q6<F>) {
            int8_q6_rows<F, R>(xq, xd, xs, K, unit, first, y, ldy, valid);
        } else if constexpr (Q8<F>) {
            int8_q8_rows<F, R>(xq, xd, xs, K, unit, first, y, ldy, valid);
        }
    }
}
#else  // the float decoding rows (the declarations only name what is never called here)
template <class F>
constexpr bool INT8_DECODES = false;
template <class F>
constexpr int64_t X8 = 1;
template <class F>
constexpr int IDR = 1;
template <class F>
inline void int8_x(const float*, int64_t, int64_t, int8_t*, float*) {}
template <class F, int R>
void int8_unit_rows(const int8_t*, const float*, const float*, int64_t, const uint8_t*, float*, int64_t, int) {}
#endif

template <class F>
void product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy, int threads);

template <class F>
void int8_decoding_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                           int64_t ldy, int threads) {
    if constexpr (INT8_DECODES<F>) {
        const int64_t unit_bytes = 2 * (K / F::weights) * F::packed;
        const int64_t units = (N + UNIT - 1) / UNIT;
        std::vector<int8_t> xq(size_t(X8<F> * M * K));
        std::vector<float> xd(size_t(M * (K / 32))), xs(size_t(M * (K / 16)));
        int8_x<F>(x, M, K, xq.data(), xd.data());
        half_sums(x, M, K, xs.data());
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t n0 = u * UNIT;
            const int valid = int(N - n0 < UNIT ? N - n0 : UNIT);
            int64_t r0 = 0;
            by_passes<IDR<F>>(M, [&]<int R>() {
                int8_unit_rows<F, R>(xq.data() + r0 * X8<F> * K, xd.data() + r0 * (K / 32), xs.data() + r0 * (K / 16), K,
                                     w + u * unit_bytes, y + r0 * ldy + n0, ldy, valid);
                r0 += R;
            });
        }
    } else {
        product<F>(x, M, K, w, N, y, ldy, threads);
    }
}

// Up to how many prompt rows in int8 take the decoding rows above instead of `int8_prefill_product`:
// the same bits (the same integer sums, and the floats after them in the same order), in less
// time where a unit's quants decoded once per pass of rows cost less than laying the unit out in
// bytes for the prompt rows (`int8_rows`; on AVX2 `int8_tile_rows`). From in-process A/B on Zen 5 (2 threads, Qwen 1.5B's Q4_K and Q6_K MLP
// matrices and SmolLM2's Q4_1 MLP and Q8_0 head from memory, the decoding rows' time over the
// prefill rows'): AVX2 with VNNI 0.28-0.92x at every M from 4 to 512; without, Q4_K/Q4_1 0.44-0.89x
// up to 16 rows (~1.0x at 32, 1.2-1.35x at 64-256), Q6_K 0.35-0.86x to 256, Q8_0 0.62-0.97x to
// 128; AVX-512 with VNNI, Q4_K/Q4_1 0.42-0.89x up to 32 rows (1.06-1.27x from 48), Q6_K 0.61-0.84x
// up to 12 (1.0-1.5x from 16), Q8_0 0.56-0.93x to 256; without, 0.66-1.02x up to 8 (Q4_K/Q4_1),
// 0.94-0.99x at 4 (Q6_K/Q8_0), slower past them. On Zen 3 (AVX2, no VNNI), against the tile
// rows (`int8_tile_rows`): Q4_K (Qwen 1.5B's MLP) 0.76-0.89x at 24-64 rows, ~1.0x at 96-128;
// Q4_1 (SmolLM2, every layer product) 0.77x at 24, 0.86x at 48, ~1.0x at 64; Q4_0 (Qwen 0.5B)
// 0.86x at 32, 1.04x at 64; Q6_K (Qwen 1.5B's down projection, from L3) 0.90x at 24, ~1.0x at
// 32-40, 1.04-1.09x at 48, 1.24-1.40x at 128-256.
#if defined(__AVX512F__)
template <class F>
constexpr int64_t PROMPT_AS_DECODING =
    VNNI ? (F::bits == 8 ? 1 << 30 : F::bits == 6 ? 12 : 32) : F::bits == 4 ? 8 : 4;
#elif defined(__AVX2__)
template <class F>
constexpr int64_t PROMPT_AS_DECODING =
    VNNI ? 1 << 30 : F::bits == 8 ? 128 : F::bits == 6 ? 32 : F::weights == 256 ? 64 : 48;
#else
template <class F>
constexpr int64_t PROMPT_AS_DECODING = 0;
#endif

template <class F>
void int8_prompt_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
                         int threads) {
    if constexpr (INT8_DECODES<F>) {
        if (M <= PROMPT_AS_DECODING<F>) {
            int8_decoding_product<F>(x, M, K, w, N, y, ldy, threads);
            return;
        }
    }
    int8_prefill_product<F>(x, M, K, w, N, y, ldy, threads);
}

// Up to how many rows a pass decodes both tiles of a unit where FR1 > FR (see FR1): Q8_0's quants
// take the fewest operations to decode, so that x's broadcasts count (4-12% faster at 1-3 rows
// on Zen 4), and Q4_0 and Q4_1 in words at one row (SmolLM2's forward of one token ~9% faster).
template <class F>
constexpr int PAIRED_ROWS = F::bits == 8 ? 3 : INT8_WORDS<F> && F::weights == 32 ? 1 : 0;

template <class F>
void product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy,
             int threads) {
    const int64_t unit_bytes = 2 * (K / F::weights) * F::packed;
    const int64_t units = (N + UNIT - 1) / UNIT;
    // Rows a tile a pass takes: past `paired`, up to `single` (paired as before: Q6_K's decoding
    // takes registers of its own, two of its tiles at 5 or 6 rows spill).
    const int paired = pair_tiles ? (F::uniform ? FR : 4) : PAIRED_ROWS<F>, single = pair_tiles ? FR1 : FEW;
    const bool few = M <= FEW, one_pass = FR1 > FR && M > paired && M <= single;
    std::vector<float> xs(size_t(M * (K / 16)));
    half_sums(x, M, K, xs.data());
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scratch(few ? 0 : size_t(K / 32 * SCRATCH_GROUP));
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t u = units * t / nt; u < units * (t + 1) / nt; ++u) {
            const int64_t n0 = u * UNIT;
            const int valid = int(N - n0 < UNIT ? N - n0 : UNIT);
            const uint8_t* unit = w + u * unit_bytes;
            if constexpr (FR1 > FR) {
                if (one_pass) {  // each tile decoded once per FR1 rows
                    for (int first = 0; first < 2; ++first) {
                        const float* xr = x;
                        const float* sr = xs.data();
                        float* yr = y + n0;
                        by_rows<FR1>(M, [&]<int R>() {
                            few_rows<F, R, 1>(xr, sr, K, unit, first, yr, ldy, valid);
                            xr += R * K, sr += R * (K / 16), yr += R * ldy;
                        });
                    }
                    continue;
                }
            }
#if defined(__AVX2__) && !defined(__AVX512F__)
            if (few && F::bits < 8) {  // rows past FR8 decode the tile again, from cache; 1 or 2 take whole tiles
                for (int first = 0; first < 2; ++first) {
                    const float* xr = x;
                    const float* sr = xs.data();
                    float* yr = y + n0;
                    const auto next = [&](int r) { xr += r * K, sr += r * (K / 16), yr += r * ldy; };
                    int64_t m = M;
                    for (; m >= FR8; m -= FR8, next(FR8)) few_rows8<F, FR8>(xr, sr, K, unit, first, yr, ldy, valid);
                    if (m == 3) few_rows8<F, 3>(xr, sr, K, unit, first, yr, ldy, valid);
                    if (m == 2) few_rows<F, 2, 1>(xr, sr, K, unit, first, yr, ldy, valid);
                    if (m == 1) few_rows<F, 1, 1>(xr, sr, K, unit, first, yr, ldy, valid);
                }
                continue;
            }
#endif
            if (few) {  // rows past FR decode the unit again, from cache
                for (int first = 0; first < 2; first += TILES) {
                    const float* xr = x;
                    const float* sr = xs.data();
                    float* yr = y + n0;
                    by_rows<FR>(M, [&]<int R>() {
                        few_rows<F, R, TILES>(xr, sr, K, unit, first, yr, ldy, valid);
                        xr += R * K, sr += R * (K / 16), yr += R * ldy;
                    });
                }
            } else {
                decode_unit<F>(unit, K, scratch.data());
                for (int first = 0; first < 2; first += TILES) {
                    const float* xr = x;
                    const float* sr = xs.data();
                    float* yr = y + n0;
                    by_rows<SR>(M, [&]<int R>() {
                        scratch_rows<R, TILES, F::uniform>(xr, sr, K, scratch.data(), first, yr, ldy, valid);
                        xr += R * K, sr += R * (K / 16), yr += R * ldy;
                    });
                }
            }
        }
    }
}

// Rows `ids` of W (output n: lane n % 16 of tile n % 32 / 16 of unit n / 32), dequantized into
// out (n, K).
template <class F>
void rows(const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
    constexpr int groups = F::weights / 32;
    const int64_t unit_bytes = 2 * (K / F::weights) * F::packed;
    for (int64_t i = 0; i < n; ++i, out += K) {
        const uint8_t* tile = w + ids[i] / UNIT * unit_bytes + ids[i] % UNIT / TILE * F::packed;
        const int lane = int(ids[i] % TILE);
        for (int64_t b = 0; b < K / F::weights; ++b)
            for (int g = 0; g < groups; ++g) {
                const typename F::Group grp = F::group(tile + 2 * b * F::packed, g);
                float* o = out + (b * groups + g) * 32;
                for (int j = 0; j < 16; ++j) {
                    V lo, hi;
                    weights<F>(grp, j, lo, hi);
                    float l[TILE], h[TILE];
                    storev(l, lo);
                    storev(h, hi);
                    o[j] = l[lane];
                    o[16 + j] = h[lane];
                }
            }
    }
}

// W's N rows of GGUF blocks -> units (the last one padded with zero blocks: zero scales).
template <class F>
void pack(const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t blocks = K / F::weights, row_bytes = blocks * F::bytes;
    static const uint8_t zeros[F::bytes] = {};
    for (int64_t u = 0; u < (N + UNIT - 1) / UNIT; ++u)
        for (int64_t b = 0; b < blocks; ++b)
            for (int t = 0; t < 2; ++t, dst += F::packed) {
                const uint8_t* cols[TILE];
                for (int c = 0; c < TILE; ++c) {
                    const int64_t n = u * UNIT + t * TILE + c;
                    cols[c] = n < N ? src + n * row_bytes + b * F::bytes : zeros;
                }
                F::pack(cols, dst);
            }
}

using Product = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int);

struct Layout {
    int weights, packed;  // per block
    void (*pack)(const uint8_t*, int64_t, int64_t, uint8_t*);
    Product product, prefill, int8_prefill, int8_decoding;
    void (*rows)(const uint8_t*, int64_t, const int64_t*, int64_t, float*);
};

template <class F>
constexpr Layout layout() {
    return {F::weights, F::packed, pack<F>, product<F>, prefill_product<F>, int8_prompt_product<F>,
            int8_decoding_product<F>, rows<F>};
}

// A format's ggml type id, with WORDS where its 4-bit quants are in words (the others ignore it).
constexpr int WORDS = 256;

bool layout_of(int format, Layout* out) {
    const bool words = format & WORDS;
    switch (format & ~WORDS) {
        case Q4_0: *out = words ? layout<Q4_0_<true>>() : layout<Q4_0_<false>>(); return true;
        case Q4_1: *out = words ? layout<Q4_1_<true>>() : layout<Q4_1_<false>>(); return true;
        case Q5_0: *out = layout<Q5_0_>(); return true;
        case Q8_0: *out = layout<Q8_0_>(); return true;
        case Q4_K: *out = words ? layout<Q4_K_<true>>() : layout<Q4_K_<false>>(); return true;
        case Q6_K: *out = words ? layout<Q6_K_<true>>() : layout<Q6_K_<false>>(); return true;
        default: return false;
    }
}

// A format's units from one layout of its quants to the other (scales unchanged).
template <class From, class To>
void relayout(const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    constexpr int groups = From::weights / 32;
    const int64_t tiles = (N + UNIT - 1) / UNIT * 2 * (K / From::weights);
    std::memcpy(dst, src, size_t(tiles * From::packed));
    for (int64_t t = 0; t < tiles; ++t)
        for (int i = 0; i < groups; ++i) {
            const uint8_t* from = From::group(src + t * From::packed, i).q;
            uint8_t* to = dst + (from - src);
            std::memset(to, 0, To::quant_bytes);
            for (int c = 0; c < TILE; ++c)
                for (int j = 0; j < 16; ++j) {
                    int lo, hi;
                    From::get(from, c, j, lo, hi);
                    To::put(to, c, j, lo, hi);
                }
        }
}

#if defined(__AVX2__)
// Keeps the compiler from treating `x` as loop-invariant (it would hoist the products out of a
// loop that repeats them, and time adds alone).
inline void opaque(X4& x) {
#if defined(__AVX512F__)
    __asm__ volatile("" : "+v"(x.v));
#else
    __asm__ volatile("" : "+x"(x.v));
#endif
}
#endif

}  // namespace

extern "C" {

// Integer operations/s (two a byte multiply-add) of the int8 dot product the decoding rows run
// (`dot4`: 64 byte products summed into 16 int32 lanes; with VNNI one instruction, else three a
// ymm; on a Zen 3 without VNNI ~260 G on 2 threads, where this once timed adds alone: ~1290 G),
// on `threads` threads of `iters` steps of independent sums with nothing else to wait for: the
// compute bound of int8 activations. 0 for a build without int8 products (the portable one).
double specdecode_peak_int8_ops(int threads, int64_t iters) {
#if defined(__AVX2__)
#if defined(__AVX512F__)
    constexpr int CHAINS = 12;  // latency 5, two a cycle: 10 in flight
#else
    constexpr int CHAINS = 4;  // sums 8 ymm, x 4, w 2 of 16
#endif
    double seconds = 0.0;
    int64_t sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        uint8_t bytes[64];
        int8_t four[4];
        for (int i = 0; i < 64; ++i) bytes[i] = uint8_t(i + omp_get_thread_num());
        for (int i = 0; i < 4; ++i) four[i] = int8_t(i - 2);
        const W8 w = load_w8(bytes);
        // A row of x a chain, each chain's products its own (with one x for all, GCC made one
        // product and added it to every chain: adds alone were timed); named one by one (in
        // arrays GCC kept the sums in memory).
        const auto row = [&](int c) {
            four[0] = int8_t(c + 1);
            return bcast4(four);
        };
        X4 x0 = row(0), x1 = row(1), x2 = row(2), x3 = row(3), x4 = row(4), x5 = row(5), x6 = row(6), x7 = row(7);
        X4 x8 = row(8), x9 = row(9), x10 = row(10), x11 = row(11);
        VI a0 = zero_i(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0;
        VI a11 = a0;
        const auto step = [&](VI& a, X4& x) {
            opaque(x);
            a = dot4(a, w, x);
        };
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (int64_t n = 0; n < iters; ++n) {
            step(a0, x0), step(a1, x1), step(a2, x2), step(a3, x3);
            if constexpr (CHAINS > 4) {
                step(a4, x4), step(a5, x5), step(a6, x6), step(a7, x7);
                step(a8, x8), step(a9, x9), step(a10, x10), step(a11, x11);
            }
        }
        const double t = omp_get_wtime() - t0;
#pragma omp critical
        seconds = t > seconds ? t : seconds;
        const VI sums[] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
        uint8_t out[sizeof(VI)];
        for (int c = 0; c < CHAINS; ++c) {
            store_i(out, sums[c]);
            for (const uint8_t byte : out) sink += byte;  // every lane's (with one, the others were dropped)
        }
    }
    const double ops = 2.0 * 64 * CHAINS * double(iters) * threads;
    return sink == -1 ? 0.0 : ops / seconds;  // `sink` keeps the sums alive
#else
    (void)threads, (void)iters;
    return 0.0;
#endif
}

// This build's layouts, of float rows and of int8 rows: weights packed by one build run on the
// builds of the same name only; the 4-bit quants in words where the name says so.
const char* specdecode_qlayout() { return WORDS4 ? "tiles32-words4" : "tiles32"; }
const char* specdecode_qlayout_int8() {
    return INT8_WORDS6 ? "tiles32-words4-words6" : INT8_WORDS4 ? "tiles32-words4" : "tiles32";
}

// A packed weight (N rows of K) of a format with two layouts of its quants in the other one:
// `format` with WORDS or not is what dst is to be. 0 when done; 1: a format of one layout; 2: K not
// whole blocks.
int specdecode_qrelayout(int format, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const bool words = format & WORDS;
    Layout lay;
    if (!layout_of(format, &lay)) return 1;
    if (K % lay.weights != 0) return 2;
    switch (format & ~WORDS) {
        case Q4_0: words ? relayout<Q4_0_<false>, Q4_0_<true>>(src, N, K, dst) : relayout<Q4_0_<true>, Q4_0_<false>>(src, N, K, dst); return 0;
        case Q4_1: words ? relayout<Q4_1_<false>, Q4_1_<true>>(src, N, K, dst) : relayout<Q4_1_<true>, Q4_1_<false>>(src, N, K, dst); return 0;
        case Q4_K: words ? relayout<Q4_K_<false>, Q4_K_<true>>(src, N, K, dst) : relayout<Q4_K_<true>, Q4_K_<false>>(src, N, K, dst); return 0;
        case Q6_K: words ? relayout<Q6_K_<false>, Q6_K_<true>>(src, N, K, dst) : relayout<Q6_K_<true>, Q6_K_<false>>(src, N, K, dst); return 0;
        default: return 1;
    }
}

// Bytes the tiles of N rows of K weights take; -1: a format this file does not read; -2: K not a
// whole number of blocks.
int64_t specdecode_qpacked_bytes(int format, int64_t N, int64_t K) {
    Layout lay;
    if (!layout_of(format, &lay)) return -1;
    if (K % lay.weights != 0) return -2;
    return (N + UNIT - 1) / UNIT * 2 * (K / lay.weights) * lay.packed;
}

// src (N rows of K weights as GGUF stores them) -> dst (specdecode_qpacked_bytes). 0 when done.
int specdecode_qpack(int format, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    Layout lay;
    if (!layout_of(format, &lay)) return 1;
    if (K % lay.weights != 0) return 2;
    lay.pack(src, N, K, dst);
    return 0;
}

// Few rows pair a unit's tiles as chosen before (1) or go a tile a pass (0): see FR1.
void specdecode_pair_tiles(int on) { pair_tiles = on != 0; }

// y[m * ldy + n] for the N rows of packed W, with the arithmetic of decoding rows (`prefill` 0:
// each row's result the same in any batch), of prefill rows (1), of a draft's prefill rows (2:
// int8 activations, approximate) or of a draft's decoding rows (3: int8 for Q4_0, Q4_1, Q4_K, Q6_K
// and Q8_0 on AVX-512 and AVX2, else 0's). 0 when done; 1: a format this file does not read; 2: K not a whole
// number of blocks; 3: an unknown `prefill`.
int specdecode_qmm(int format, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                   float* y, int64_t ldy, int threads, int prefill) {
    Layout lay;
    if (!layout_of(format, &lay)) return 1;
    if (K % lay.weights != 0) return 2;
    if (prefill < 0 || prefill > 3) return 3;
    const Product run[] = {lay.product, lay.prefill, lay.int8_prefill, lay.int8_decoding};
    run[prefill](x, M, K, w, N, y, ldy, threads);
    return 0;
}

// Rows `ids` (n of them) of packed W (rows of K weights), dequantized into out (n, K).
int specdecode_qrows(int format, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
    Layout lay;
    if (!layout_of(format, &lay)) return 1;
    if (K % lay.weights != 0) return 2;
    lay.rows(w, K, ids, n, out);
    return 0;
}

}  // extern "C"
