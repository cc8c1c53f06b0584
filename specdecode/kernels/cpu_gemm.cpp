// y (M, N) = x (M, K) @ W for the few rows of a decoding or verification forward, on AVX-512.
//
// W is stored in 32-column tiles, (N / 32, K, 32): tile t is one contiguous K x 32 block, so a
// thread streams its tiles front to back and every weight is read from memory once, however many
// rows (MKL re-reads or repacks the weights for every few rows, so 8 rows cost ~2x one row).
// Each output is one running sum over k in ascending order, whatever M, the row's block or the
// thread count: a row's result is bitwise the same alone or in any batch.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kTile = 32;
constexpr int kMaxRows = 12;  // bf16: 2 x 12 accumulators + 2 weight vectors fit the 32 zmm registers
constexpr int kPairRows = 6;  // float32 rows per block, run over two tiles at once (2 x 2 x 6 + 4)
constexpr int kPrefetch = 16;  // weight rows ahead in each stream (16 x 128 B = 2 KB)

// G adjacent tiles at once: G independent memory streams and 2 * G * MB accumulation chains, so
// one or two rows still keep the memory system busy (one tile at a time, one row ran 25% slower
// than MKL's gemv). Each output is still one running sum over k in order, whatever MB and G.
template <int MB, int G>
void tiles(const float* __restrict x, int64_t K, const float* __restrict w, float* __restrict y,
           int64_t N) {
    __m512 lo[G][MB], hi[G][MB];
    for (int g = 0; g < G; ++g)
        for (int m = 0; m < MB; ++m) {
            lo[g][m] = _mm512_setzero_ps();
            hi[g][m] = _mm512_setzero_ps();
        }
    const int64_t stride = K * kTile;
    for (int64_t k = 0; k < K; ++k) {
        for (int g = 0; g < G; ++g) {
            const float* row = w + g * stride + k * kTile;
            _mm_prefetch(reinterpret_cast<const char*>(row + kTile * kPrefetch), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(row + kTile * kPrefetch + 16), _MM_HINT_T0);
            const __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16);
            for (int m = 0; m < MB; ++m) {
                const __m512 xb = _mm512_set1_ps(x[m * K + k]);
                lo[g][m] = _mm512_fmadd_ps(xb, w0, lo[g][m]);
                hi[g][m] = _mm512_fmadd_ps(xb, w1, hi[g][m]);
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int m = 0; m < MB; ++m) {
            _mm512_storeu_ps(y + g * kTile + m * N, lo[g][m]);
            _mm512_storeu_ps(y + g * kTile + m * N + 16, hi[g][m]);
        }
}

template <int MB>
void rows(const float* x, const float* w, float* y, int64_t K, int64_t N, int threads) {
    // Each thread takes an equal contiguous run of tiles (within one tile), in groups of G and
    // then singly: an uneven split leaves a thread idle while memory is the bottleneck.
    constexpr int G = MB == 1 ? 4 : 2;
    const int64_t n_tiles = N / kTile;
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = n_tiles * me / parts, end = n_tiles * (me + 1) / parts;
        int64_t t = begin;
        for (; t + G <= end; t += G) tiles<MB, G>(x, K, w + t * K * kTile, y + t * kTile, N);
        for (; t < end; ++t) tiles<MB, 1>(x, K, w + t * K * kTile, y + t * kTile, N);
    }
}

using RowsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int);
constexpr RowsFn kRows[kPairRows + 1] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>};

// bfloat16 weights for an approximate product (the screening LM head of `greedy_tokens`, whose
// error bound covers bf16 inputs and float32 accumulation). Tile t holds 32 columns as
// (K / 2, 32, 2): for each pair of k, the 32 columns' two weights side by side, the operand layout
// of VDPBF16PS (lane j += a[2j] * b[2j] + a[2j+1] * b[2j+1]). Half the bytes of float32, and
// unlike oneDNN's bf16 path it stays bound by memory at one row (measured: same time as fp32 MKL).
template <int MB>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16(const uint32_t* __restrict x, int64_t K2,
                                                            const uint16_t* __restrict w,
                                                            float* __restrict y, int64_t N) {
    __m512 lo[MB], hi[MB];
    for (int m = 0; m < MB; ++m) {
        lo[m] = _mm512_setzero_ps();
        hi[m] = _mm512_setzero_ps();
    }
    for (int64_t k2 = 0; k2 < K2; ++k2) {
        const uint16_t* row = w + k2 * 2 * kTile;  // 32 columns x 2 weights
        _mm_prefetch(reinterpret_cast<const char*>(row + 2 * kTile * kPrefetch), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + 32);
        for (int m = 0; m < MB; ++m) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * K2 + k2]));
            lo[m] = _mm512_dpbf16_ps(lo[m], xb, w0);
            hi[m] = _mm512_dpbf16_ps(hi[m], xb, w1);
        }
    }
    for (int m = 0; m < MB; ++m) {
        _mm512_storeu_ps(y + m * N, lo[m]);
        _mm512_storeu_ps(y + m * N + 16, hi[m]);
    }
}

template <int MB>
void rows_bf16(const uint32_t* x, const uint16_t* w, float* y, int64_t K2, int64_t N, int threads) {
    const int64_t n_tiles = N / kTile;
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = n_tiles * me / parts, end = n_tiles * (me + 1) / parts;
        for (int64_t t = begin; t < end; ++t) tile_bf16<MB>(x, K2, w + t * K2 * 2 * kTile, y + t * kTile, N);
    }
}

using RowsBf16Fn = void (*)(const uint32_t*, const uint16_t*, float*, int64_t, int64_t, int);
constexpr RowsBf16Fn kRowsBf16[kMaxRows + 1] = {
    nullptr,       rows_bf16<1>, rows_bf16<2>, rows_bf16<3>,  rows_bf16<4>,  rows_bf16<5>, rows_bf16<6>,
    rows_bf16<7>, rows_bf16<8>, rows_bf16<9>, rows_bf16<10>, rows_bf16<11>, rows_bf16<12>};

using TileBf16Fn = void (*)(const uint32_t*, int64_t, const uint16_t*, float*, int64_t);
constexpr TileBf16Fn kTilesBf16[kMaxRows + 1] = {
    nullptr,        tile_bf16<1>,  tile_bf16<2>,  tile_bf16<3>, tile_bf16<4>, tile_bf16<5>, tile_bf16<6>,
    tile_bf16<7>,   tile_bf16<8>,  tile_bf16<9>,  tile_bf16<10>, tile_bf16<11>, tile_bf16<12>};

constexpr int64_t kMaxBlocks = 64;

// Splits M rows into blocks of at most `most`, as even as possible (16 rows in blocks of 12 are
// 8 + 8, not 12 + 4): fills start/size and returns the number of blocks, or -1 above kMaxBlocks.
int64_t row_blocks(int64_t M, int64_t most, int64_t* start, int64_t* size) {
    const int64_t blocks = (M + most - 1) / most;
    if (blocks > kMaxBlocks) return -1;
    int64_t done = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        size[b] = (M - done + (blocks - b) - 1) / (blocks - b);
        start[b] = done;
        done += size[b];
    }
    return blocks;
}

}  // namespace

// x (M, K) bf16 as raw 16-bit words, K even; w tiled as above; y (M, N) float32. Call only where
// the CPU has AVX512_BF16. Returns 0, or -1 for shapes the tiles do not cover. Several row blocks
// each run over a tile while it is in L2 (the screening head reads its 56 MB once for any M).
extern "C" int specdecode_tiled_mm_bf16(const uint16_t* x, const uint16_t* w, float* y, int64_t M,
                                        int64_t K, int64_t N, int threads) {
    if (N % kTile != 0 || K % 2 != 0) return -1;
    int64_t start[kMaxBlocks], size[kMaxBlocks];
    const int64_t blocks = row_blocks(M, kMaxRows, start, size);
    if (blocks < 0) return -1;
    if (blocks == 1) {
        kRowsBf16[M](reinterpret_cast<const uint32_t*>(x), w, y, K / 2, N, threads);
        return 0;
    }
    const int64_t n_tiles = N / kTile;
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = n_tiles * me / parts, end = n_tiles * (me + 1) / parts;
        for (int64_t t = begin; t < end; ++t)
            for (int64_t b = 0; b < blocks; ++b)
                kTilesBf16[size[b]](reinterpret_cast<const uint32_t*>(x + start[b] * K), K / 2,
                                    w + t * K * kTile, y + start[b] * N + t * kTile, N);
    }
    return 0;
}

namespace {

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr TileFn kTile1[kPairRows + 1] = {nullptr,     tiles<1, 1>, tiles<2, 1>, tiles<3, 1>,
                                          tiles<4, 1>, tiles<5, 1>, tiles<6, 1>};
constexpr TileFn kTile2[kPairRows + 1] = {nullptr,     tiles<1, 2>, tiles<2, 2>, tiles<3, 2>,
                                          tiles<4, 2>, tiles<5, 2>, tiles<6, 2>};

}  // namespace

// Returns 0, or -1 when N is not a multiple of the tile width (or M is beyond 64 blocks).
extern "C" int specdecode_tiled_mm(const float* x, const float* w, float* y, int64_t M, int64_t K,
                                   int64_t N, int threads) {
    if (N % kTile != 0) return -1;
    if (M <= kPairRows) {
        kRows[M](x, w, y, K, N, threads);
        return 0;
    }
    // More rows: blocks of at most 6, every block running over the same two tiles while they are
    // in L2. Two tiles at once keep two memory streams going (one stream of a 7-12 row block
    // left a third of the bandwidth unused), and the weights still come from memory once.
    int64_t start[kMaxBlocks], size[kMaxBlocks];
    const int64_t blocks = row_blocks(M, kPairRows, start, size);
    if (blocks < 0) return -1;
    const int64_t n_tiles = N / kTile;
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = n_tiles * me / parts, end = n_tiles * (me + 1) / parts;
        int64_t t = begin;
        for (; t + 2 <= end; t += 2)
            for (int64_t b = 0; b < blocks; ++b)
                kTile2[size[b]](x + start[b] * K, K, w + t * K * kTile, y + start[b] * N + t * kTile, N);
        for (; t < end; ++t)
            for (int64_t b = 0; b < blocks; ++b)
                kTile1[size[b]](x + start[b] * K, K, w + t * K * kTile, y + start[b] * N + t * kTile, N);
    }
    return 0;
}
