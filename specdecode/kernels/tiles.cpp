// y (M, N) = x (M, K) @ W for float weights in 32-column tiles: the few-row product of decoding
// and verification for float32 weights (and a bfloat16 model's, widened), per instruction set
// (lanes.h); on AVX-512 also bfloat16 weights through AVX512_BF16 (the approximate product of
// drafts and of the greedy screen, and a bfloat16 model's few rows).
//
// W is stored (N / 32, K, 32), each tile one contiguous block that a thread streams front to
// back, read from memory once for every row of a block. Each output is one running sum over k in
// ascending order, a fused multiply-add a step, whatever M, the row's block or the thread count:
// a row's result is bitwise the same alone or in any batch, and the same on every build with
// fused multiply-add (AVX-512, AVX2), so verification and plain decoding round it alike. (MKL
// re-reads or repacks the weights for every few rows, so 8 rows cost ~2x one, and rounds a row
// by how many rows its step has.)
#include <omp.h>

#include <cstdint>

#include "lanes.h"

namespace {

using namespace lanes;

constexpr int64_t kTile = 32;  // two vectors of 16 lanes
#if defined(__AVX512F__)
constexpr int kBlockRows = 6;  // 2 x 2 tiles x 6 rows of accumulators, of the 32 zmm registers
constexpr int kGroup = 2;      // tiles at once for a block of rows
constexpr int kGroupOne = 4;   // ... and for a row alone
#else
constexpr int kBlockRows = 3;  // AVX2: 3 x 2 vectors of two ymm each, of the 16 registers
constexpr int kGroup = 1;
constexpr int kGroupOne = 1;
#endif
constexpr int64_t kAhead = 16;      // weight rows prefetched ahead in each stream (16 x 128 B)
constexpr int64_t kMaxBlocks = 64;  // row blocks a call takes

// MB rows over G adjacent tiles: G memory streams and 2 G MB sums of 16 lanes, each over k in
// order whatever MB and G (one tile at a time, one row on AVX-512 ran 25% slower than MKL's gemv).
template <int MB, int G>
void tile_rows(const float* __restrict x, int64_t K, const float* __restrict w, float* __restrict y, int64_t N) {
    V lo[G][MB], hi[G][MB];
    for (int g = 0; g < G; ++g)
        for (int m = 0; m < MB; ++m) lo[g][m] = hi[g][m] = zero();
    for (int64_t k = 0; k < K; ++k) {
        for (int g = 0; g < G; ++g) {
            const float* row = w + g * K * kTile + k * kTile;
            // (lanes::prefetch's asm statement made GCC store every sum to memory at each step
            // here; the builtin does not)
            __builtin_prefetch(row + kAhead * kTile);
            __builtin_prefetch(row + kAhead * kTile + 16);
            const V w0 = loadv(row), w1 = loadv(row + 16);
            for (int m = 0; m < MB; ++m) {
                const V xb = set1(x[m * K + k]);
                lo[g][m] = fma(xb, w0, lo[g][m]);
                hi[g][m] = fma(xb, w1, hi[g][m]);
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int m = 0; m < MB; ++m) {
            storev(y + g * kTile + m * N, lo[g][m]);
            storev(y + g * kTile + m * N + 16, hi[g][m]);
        }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
template <int G, int... R>
constexpr TileFn kTiles[] = {nullptr, tile_rows<R, G>...};
template <int G>
#if defined(__AVX512F__)
constexpr const TileFn* kByRows = kTiles<G, 1, 2, 3, 4, 5, 6>;
#else
constexpr const TileFn* kByRows = kTiles<G, 1, 2, 3>;
#endif

// M rows in blocks of at most `most`, as even as possible (16 rows in blocks of 6 are 6 + 5 + 5).
struct Blocks {
    int64_t n = 0, start[kMaxBlocks], size[kMaxBlocks];

    Blocks(int64_t M, int64_t most) {
        const int64_t blocks = (M + most - 1) / most;
        if (blocks > kMaxBlocks) return;  // n = 0: too many rows for one call
        for (int64_t done = 0; n < blocks; ++n) {
            size[n] = (M - done + (blocks - n) - 1) / (blocks - n);
            start[n] = done;
            done += size[n];
        }
    }
};

// Each thread's equal run of the N / 32 tiles, [begin, end): run(begin, end) in parallel.
template <class Run>
void over_tiles(int64_t N, int threads, const Run& run) {
    const int64_t n_tiles = N / kTile;
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        run(n_tiles * me / parts, n_tiles * (me + 1) / parts);
    }
}

// Every block of rows over tiles [t, t + G) while they are in L2.
template <int G>
void blocks_over(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t t, const Blocks& rows) {
    for (int64_t b = 0; b < rows.n; ++b)
        kByRows<G>[rows.size[b]](x + rows.start[b] * K, K, w + t * K * kTile, y + rows.start[b] * N + t * kTile, N);
}

}  // namespace

extern "C" {

// x (M, K), w tiled (N / 32, K, 32), y (M, N), all float32. Each thread takes an equal run of
// tiles, G at a time then singly, and runs every block of rows over them while they are in cache:
// the weights come from memory once. Returns 0, or -1 where N is not a multiple of 32 (or M is
// past kMaxBlocks blocks).
int specdecode_tiles_f32(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int threads) {
    const Blocks rows(M, kBlockRows);
    if (N % kTile != 0 || rows.n == 0) return -1;
    over_tiles(N, threads, [&](int64_t t, int64_t end) {
        if (M == 1) {
            for (; t + kGroupOne <= end; t += kGroupOne) blocks_over<kGroupOne>(x, w, y, K, N, t, rows);
        }
        for (; t + kGroup <= end; t += kGroup) blocks_over<kGroup>(x, w, y, K, N, t, rows);
        for (; t < end; ++t) blocks_over<1>(x, w, y, K, N, t, rows);
    });
    return 0;
}

}  // extern "C"

// (AVX512_BF16's intrinsics need GCC 10 or clang 10: with an older compiler the build has no bf16
// entry, and `cpu_isa.bf16_tiles` finds none.)
#if defined(__AVX512F__) && (defined(__clang__) ? __clang_major__ >= 10 : __GNUC__ >= 10)
// ---- bfloat16 weights (AVX512_BF16) -------------------------------------------------------------
// Tile t holds 32 columns as (K / 2, 32, 2): for each pair of k, the 32 columns' two weights side
// by side, the operand layout of VDPBF16PS (lane j += a[2j] b[2j] + a[2j+1] b[2j+1], float32
// sums). Half the bytes of float32, and unlike oneDNN's bf16 path it stays bound by memory at one
// row. The greedy screen's error bound covers bf16 inputs and these float32 sums.
namespace {

constexpr int kBf16Rows = 12;  // 2 x 12 accumulators + 2 weight vectors fit the 32 zmm registers

template <int MB>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16(const uint32_t* __restrict x, int64_t K2,
                                                            const uint16_t* __restrict w, float* __restrict y,
                                                            int64_t N) {
    __m512 lo[MB], hi[MB];
    for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; ++k2) {
        const uint16_t* row = w + k2 * 2 * kTile;  // 32 columns x 2 weights
        __builtin_prefetch(row + 2 * kTile * kAhead);
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

using TileBf16Fn = void (*)(const uint32_t*, int64_t, const uint16_t*, float*, int64_t);
template <int... R>
constexpr TileBf16Fn kTilesBf16[] = {nullptr, tile_bf16<R>...};
constexpr const TileBf16Fn* kBf16ByRows = kTilesBf16<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>;

}  // namespace

extern "C" {

// x (M, K) bf16 as raw 16-bit words, K even; w tiled as above; y (M, N) float32. Call only where
// the CPU has AVX512_BF16. Every block of rows runs over a tile while it is in L2 (the screening
// head is read from memory once for any M). Returns 0, or -1 for shapes the tiles do not cover.
int specdecode_tiles_bf16(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                          int threads) {
    const Blocks rows(M, kBf16Rows);
    if (N % kTile != 0 || K % 2 != 0 || rows.n == 0) return -1;
    over_tiles(N, threads, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
            for (int64_t b = 0; b < rows.n; ++b)
                kBf16ByRows[rows.size[b]](reinterpret_cast<const uint32_t*>(x + rows.start[b] * K), K / 2,
                                          w + t * K * kTile, y + rows.start[b] * N + t * kTile, N);
    });
    return 0;
}

}  // extern "C"
#endif
