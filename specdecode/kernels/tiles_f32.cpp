// y (M, N) = x (M, K) @ W for float32 weights in 32-column tiles, per instruction set (lanes.h):
// the few-row product of `cpu_gemm.cpp` for every build, AVX2 and plain C++ included.
//
// W is stored (N / 32, K, 32), each tile one contiguous block that a thread streams front to
// back, read from memory once for every row of a block. Each output is one running sum over k in
// ascending order, a fused multiply-add a step, whatever M, the row's block or the thread count:
// a row's result is bitwise the same alone or in any batch (and the same as `cpu_gemm.cpp`'s on
// AVX-512, which sums in the same order), so verification and plain decoding round it alike.
#include <omp.h>

#include <cstdint>

#include "lanes.h"

namespace {

using namespace lanes;

constexpr int64_t kTile = 32;  // two vectors of 16 lanes
#if defined(__AVX512F__)
constexpr int kBlockRows = 6;  // 2 x 6 x 2 accumulators of the 32 zmm registers
#else
constexpr int kBlockRows = 3;  // AVX2: 3 x 2 vectors of two ymm each, of the 16 registers
#endif
constexpr int64_t kAhead = 16;  // weight rows prefetched ahead

// MB rows over one tile: 2 * MB sums of 16 lanes, k in order.
template <int MB>
void tile_rows(const float* __restrict x, int64_t K, const float* __restrict w, float* __restrict y, int64_t N) {
    V lo[MB], hi[MB];
    for (int m = 0; m < MB; ++m) lo[m] = hi[m] = zero();
    for (int64_t k = 0; k < K; ++k) {
        const float* row = w + k * kTile;
        prefetch(row + kAhead * kTile);
        prefetch(row + kAhead * kTile + 16);
        const V w0 = loadv(row), w1 = loadv(row + 16);
        for (int m = 0; m < MB; ++m) {
            const V xb = set1(x[m * K + k]);
            lo[m] = fma(xb, w0, lo[m]);
            hi[m] = fma(xb, w1, hi[m]);
        }
    }
    for (int m = 0; m < MB; ++m) {
        storev(y + m * N, lo[m]);
        storev(y + m * N + 16, hi[m]);
    }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
template <int... R>
constexpr TileFn kTiles[] = {nullptr, tile_rows<R>...};
#if defined(__AVX512F__)
constexpr const TileFn* kByRows = kTiles<1, 2, 3, 4, 5, 6>;
#else
constexpr const TileFn* kByRows = kTiles<1, 2, 3>;
#endif

}  // namespace

extern "C" {

// x (M, K), w tiled (N / 32, K, 32), y (M, N), all float32. Each thread takes an equal run of
// tiles and runs every block of rows over a tile while it is in cache. Returns 0, or -1 where N
// is not a multiple of 32.
int specdecode_tiles_f32(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int threads) {
    if (N % kTile != 0 || M <= 0) return -1;
    const int64_t n_tiles = N / kTile;
#pragma omp parallel num_threads(threads)
    {
        const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = n_tiles * me / parts, end = n_tiles * (me + 1) / parts;
        for (int64_t t = begin; t < end; ++t)
            for (int64_t m = 0; m < M; m += kBlockRows) {
                const int64_t rows = M - m < kBlockRows ? M - m : kBlockRows;
                kByRows[rows](x + m * K, K, w + t * K * kTile, y + m * N + t * kTile, N);
            }
    }
    return 0;
}

}  // extern "C"
