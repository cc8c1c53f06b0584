// y (M, N) = x (M, K) @ W^T for weights kept in GGUF's block formats, on any CPU.
//
// W is N rows of K weights, each row a run of blocks exactly as the GGUF file stores them
// (Q4_0, Q4_1, Q5_0, Q8_0: 32 weights a block; Q4_K, Q6_K: 256). A thread takes a contiguous run
// of rows, NB at a time: it dequantizes those NB rows once into float32 scratch (they stay in L1
// or L2), then multiplies every row of x over them. However many rows x has, each weight is read
// from memory and dequantized once per forward, so verifying a draft of a few tokens costs little
// more than decoding one.
//
// Dequantized values are those of gguf-py's `dequantize` (every product of a scale and a
// quantized integer below is exact in float32, so the order of operations cannot change them),
// and each output is a sum in float32 over VW lanes in ascending k, reduced in a fixed order, the
// same whichever rows share the forward: a row's result is bitwise the same alone or in any
// batch (for one build of this file).
//
// The same source is built once per instruction set with the vector width VW of its registers
// (SPECDECODE_VW: 16 for AVX-512, 8 for AVX2 + FMA, 4 for the portable build: SSE2 on x86, NEON
// on ARM); the compiler vectorizes GCC vector types and the dequantization loops.
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <vector>

#ifndef SPECDECODE_VW
#define SPECDECODE_VW 4
#endif
#ifndef SPECDECODE_NB
#define SPECDECODE_NB 2
#endif

namespace {

constexpr int VW = SPECDECODE_VW;
constexpr int NB = SPECDECODE_NB;  // weight rows dequantized and multiplied together
constexpr int MR = 4;              // rows of x per pass over the NB weight rows
typedef float vec __attribute__((vector_size(VW * 4)));

// ggml's type ids (ggml.h), the formats we read.
enum Format : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

float half(const uint8_t* p) {  // IEEE binary16, little-endian, to float32 (exact)
    const uint32_t h = uint32_t(p[0]) | uint32_t(p[1]) << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
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

// int8 lanes -> y = float(v) * scale + add, 16 at a time: the one conversion every format ends
// in (each weight a scale times a small integer, exact in float32, plus at most one offset).
#if defined(__AVX2__)
inline void put16(__m128i v, float scale, float add, float* y) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), _mm512_set1_ps(scale),
                                        _mm512_set1_ps(add)));
#else
    const __m256 s = _mm256_set1_ps(scale), a = _mm256_set1_ps(add);
    _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s, a));
    _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), s, a));
#endif
}

inline __m128i low_nibbles(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(0x0f)); }
inline __m128i high_nibbles(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// 32 bits -> 32 bytes, byte j 0x10 where bit j is set (Q5_0's fifth bits).
inline __m256i fifth_bits(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                          3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask), _mm256_set1_epi8(0x10));
}

struct Q4_0_ {
    static constexpr int weights = 32, bytes = 18;
    static void dequant(const uint8_t* b, float* y) {  // d, 16 bytes of nibble pairs
        const float d = half(b);
        const __m128i q = load16(b + 2), eight = _mm_set1_epi8(8);
        put16(_mm_sub_epi8(low_nibbles(q), eight), d, 0.0f, y);
        put16(_mm_sub_epi8(high_nibbles(q), eight), d, 0.0f, y + 16);
    }
};

struct Q4_1_ {
    static constexpr int weights = 32, bytes = 20;
    static void dequant(const uint8_t* b, float* y) {  // d, m, nibbles
        const float d = half(b), m = half(b + 2);
        const __m128i q = load16(b + 4);
        put16(low_nibbles(q), d, m, y);
        put16(high_nibbles(q), d, m, y + 16);
    }
};

struct Q5_0_ {
    static constexpr int weights = 32, bytes = 22;
    static void dequant(const uint8_t* b, float* y) {  // d, 32 fifth bits, nibbles
        const float d = half(b);
        uint32_t hi;
        std::memcpy(&hi, b + 2, 4);
        const __m256i h = fifth_bits(hi);
        const __m128i q = load16(b + 6), sixteen = _mm_set1_epi8(16);
        put16(_mm_sub_epi8(_mm_or_si128(low_nibbles(q), _mm256_castsi256_si128(h)), sixteen), d, 0.0f, y);
        put16(_mm_sub_epi8(_mm_or_si128(high_nibbles(q), _mm256_extracti128_si256(h, 1)), sixteen), d, 0.0f, y + 16);
    }
};

struct Q8_0_ {
    static constexpr int weights = 32, bytes = 34;
    static void dequant(const uint8_t* b, float* y) {  // d, 32 int8
        const float d = half(b);
        put16(load16(b + 2), d, 0.0f, y);
        put16(load16(b + 18), d, 0.0f, y + 16);
    }
};

#else  // portable: plain loops the compiler vectorizes for its target

inline void put16(const int8_t* v, float scale, float add, float* __restrict y) {
    for (int j = 0; j < 16; ++j) y[j] = float(v[j]) * scale + add;
}

struct Q4_0_ {
    static constexpr int weights = 32, bytes = 18;
    static void dequant(const uint8_t* b, float* __restrict y) {
        const float d = half(b);
        const uint8_t* q = b + 2;
        for (int j = 0; j < 16; ++j) y[j] = float(int(q[j] & 0xf) - 8) * d;
        for (int j = 0; j < 16; ++j) y[j + 16] = float(int(q[j] >> 4) - 8) * d;
    }
};

struct Q4_1_ {
    static constexpr int weights = 32, bytes = 20;
    static void dequant(const uint8_t* b, float* __restrict y) {
        const float d = half(b), m = half(b + 2);
        const uint8_t* q = b + 4;
        for (int j = 0; j < 16; ++j) y[j] = float(q[j] & 0xf) * d + m;
        for (int j = 0; j < 16; ++j) y[j + 16] = float(q[j] >> 4) * d + m;
    }
};

struct Q5_0_ {
    static constexpr int weights = 32, bytes = 22;
    static void dequant(const uint8_t* b, float* __restrict y) {
        const float d = half(b);
        uint32_t hi;
        std::memcpy(&hi, b + 2, 4);
        const uint8_t* q = b + 6;
        for (int j = 0; j < 16; ++j) y[j] = float(int((q[j] & 0xf) | (((hi >> j) & 1) << 4)) - 16) * d;
        for (int j = 0; j < 16; ++j) y[j + 16] = float(int((q[j] >> 4) | (((hi >> (j + 16)) & 1) << 4)) - 16) * d;
    }
};

struct Q8_0_ {
    static constexpr int weights = 32, bytes = 34;
    static void dequant(const uint8_t* b, float* __restrict y) {
        const float d = half(b);
        const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
        for (int j = 0; j < 32; ++j) y[j] = float(q[j]) * d;
    }
};
#endif

struct Q4_K_ {
    static constexpr int weights = 256, bytes = 144;
    static void dequant(const uint8_t* b, float* __restrict y) {  // d, dmin, 12 bytes of 6-bit scales/mins, 128
        const float d = half(b), dmin = half(b + 2);
        const uint8_t* s = b + 4;
        const uint8_t* q = b + 16;
        for (int g = 0; g < 8; ++g) {  // eight groups of 32 weights, each with a scale and a min
            int sc, mn;
            if (g < 4) {
                sc = s[g] & 63;
                mn = s[g + 4] & 63;
            } else {
                sc = (s[g + 4] & 0xf) | ((s[g - 4] >> 6) << 4);
                mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
            }
            const float scale = d * float(sc), offset = dmin * float(mn);
            const uint8_t* qq = q + (g / 2) * 32;
            float* yy = y + g * 32;
#if defined(__AVX2__)
            for (int h = 0; h < 2; ++h) {
                const __m128i v = load16(qq + 16 * h);
                put16((g & 1) ? high_nibbles(v) : low_nibbles(v), scale, -offset, yy + 16 * h);
            }
#else
            int8_t v[32];
            for (int l = 0; l < 32; ++l) v[l] = int8_t((g & 1) ? (qq[l] >> 4) : (qq[l] & 0xf));
            put16(v, scale, -offset, yy);
            put16(v + 16, scale, -offset, yy + 16);
#endif
        }
    }
};

struct Q6_K_ {
    static constexpr int weights = 256, bytes = 210;
    static void dequant(const uint8_t* b, float* __restrict y) {  // 128 low nibbles, 64 of high pairs, 16 scales, d
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        const float d = half(b + 208);
        for (int h = 0; h < 2; ++h) {           // two halves of 128
            for (int l0 = 0; l0 < 32; l0 += 16) {  // lanes l0..l0+15 share their scales
                const int is = l0 / 16;
                int8_t v[4][16];
                for (int l = 0; l < 16; ++l) {
                    const int i = l0 + l;
                    v[0][l] = int8_t(int((ql[i] & 0xf) | ((qh[i] & 3) << 4)) - 32);
                    v[1][l] = int8_t(int((ql[i + 32] & 0xf) | (((qh[i] >> 2) & 3) << 4)) - 32);
                    v[2][l] = int8_t(int((ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4)) - 32);
                    v[3][l] = int8_t(int((ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4)) - 32);
                }
                for (int part = 0; part < 4; ++part) {
#if defined(__AVX2__)
                    const __m128i lanes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v[part]));
#else
                    const int8_t* lanes = v[part];
#endif
                    put16(lanes, d * float(sc[is + 2 * part]), 0.0f, y + l0 + 32 * part);
                }
            }
            y += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
    }
};

template <class F>
void dequant_row(const uint8_t* src, int64_t K, float* dst) {
    for (int64_t k = 0; k < K; k += F::weights, src += F::bytes) F::dequant(src, dst + k);
}

struct Layout {
    int weights;  // per block
    int bytes;
    void (*row)(const uint8_t*, int64_t, float*);  // a row of K weights
};

template <class F>
constexpr Layout layout() {
    return {F::weights, F::bytes, dequant_row<F>};
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

float reduce(vec v) {  // a fixed order: halves folded, then the last lanes left to right
    float lanes[VW];
    std::memcpy(lanes, &v, sizeof(v));
    for (int w = VW / 2; w >= 4; w /= 2)
        for (int i = 0; i < w; ++i) lanes[i] += lanes[i + w];
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

vec load(const float* p) {
    vec v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

// y[r * ldy + g] for r < R, g < G: rows of x (R, K) over the dequantized weight rows w (G, K).
template <int R, int G>
void dots(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
    vec acc[R][G];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) acc[r][g] = vec{};
    for (int64_t k = 0; k < K; k += VW) {
        vec wv[G];
        for (int g = 0; g < G; ++g) wv[g] = load(w + g * K + k);
        for (int r = 0; r < R; ++r) {
            const vec xv = load(x + r * K + k);
            for (int g = 0; g < G; ++g) acc[r][g] += xv * wv[g];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) y[r * ldy + g] = reduce(acc[r][g]);
}

template <int G>
void all_rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) dots<MR, G>(x + m * K, K, w, y + m * ldy, ldy);
    for (; m < M; ++m) dots<1, G>(x + m * K, K, w, y + m * ldy, ldy);
}

}  // namespace

extern "C" {

int specdecode_qvw() { return VW; }

// y[m * ldy + n] for the N weight rows of w. 0 when done; 1: a format this file does not read;
// 2: K not a whole number of blocks.
int specdecode_qmm(int format, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                   float* y, int64_t ldy, int threads) {
    Layout lay;
    if (!layout_of(format, &lay)) return 1;
    if (K % lay.weights != 0) return 2;
    const int64_t row_bytes = K / lay.weights * lay.bytes;
    const int64_t groups = (N + NB - 1) / NB;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scratch(size_t(NB) * size_t(K));
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        for (int64_t g = g0; g < g1; ++g) {
            const int64_t n0 = g * NB;
            const int nb = int(N - n0 < NB ? N - n0 : NB);
            for (int i = 0; i < nb; ++i) lay.row(w + (n0 + i) * row_bytes, K, scratch.data() + i * K);
            if (nb == NB) {
                all_rows<NB>(x, M, K, scratch.data(), y + n0, ldy);
            } else {
                for (int i = 0; i < nb; ++i) all_rows<1>(x, M, K, scratch.data() + i * K, y + n0 + i, ldy);
            }
        }
    }
    return 0;
}

// Dequantize rows `ids` (n of them) of W (rows of K weights) into out (n, K): embedding lookups.
int specdecode_qrows(int format, const uint8_t* w, int64_t K, const int64_t* ids, int64_t n, float* out) {
    Layout lay;
    if (!layout_of(format, &lay)) return 1;
    if (K % lay.weights != 0) return 2;
    const int64_t row_bytes = K / lay.weights * lay.bytes;
    for (int64_t i = 0; i < n; ++i) lay.row(w + ids[i] * row_bytes, K, out + i * K);
    return 0;
}

}  // extern "C"
