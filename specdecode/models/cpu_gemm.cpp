// y (M, N) = x (M, K) @ W for the few rows of a decoding or verification forward, on AVX-512.
//
// W is stored in 32-column tiles, (N / 32, K, 32): tile t is one contiguous K x 32 block, so a
// thread streams its tiles front to back and every weight is read from memory once for up to 12
// rows (MKL re-reads or repacks the weights for every few rows, so 8 rows cost ~2x one row).
// Each output is one running sum over k in ascending order, whatever M, the row's block or the
// thread count: a row's result is bitwise the same alone or in any batch.
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int kTile = 32;
constexpr int kMaxRows = 12;  // 2 x 12 accumulators + 2 weight vectors fit the 32 zmm registers
constexpr int kPrefetch = 32;  // weight rows ahead (32 x 128 B = 4 KB)

template <int MB>
void tile(const float* __restrict x, int64_t K, const float* __restrict w, float* __restrict y,
          int64_t N) {
    __m512 lo[MB], hi[MB];
    for (int m = 0; m < MB; ++m) {
        lo[m] = _mm512_setzero_ps();
        hi[m] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; ++k) {
        const float* row = w + k * kTile;
        _mm_prefetch(reinterpret_cast<const char*>(row + kTile * kPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row + kTile * kPrefetch + 16), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16);
        for (int m = 0; m < MB; ++m) {
            const __m512 xb = _mm512_set1_ps(x[m * K + k]);
            lo[m] = _mm512_fmadd_ps(xb, w0, lo[m]);
            hi[m] = _mm512_fmadd_ps(xb, w1, hi[m]);
        }
    }
    for (int m = 0; m < MB; ++m) {
        _mm512_storeu_ps(y + m * N, lo[m]);
        _mm512_storeu_ps(y + m * N + 16, hi[m]);
    }
}

template <int MB>
void rows(const float* x, const float* w, float* y, int64_t K, int64_t N, int threads) {
    const int64_t tiles = N / kTile;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) tile<MB>(x, K, w + t * K * kTile, y + t * kTile, N);
}

using RowsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int);
constexpr RowsFn kRows[kMaxRows + 1] = {nullptr,  rows<1>, rows<2>, rows<3>,  rows<4>,  rows<5>, rows<6>,
                                        rows<7>,  rows<8>, rows<9>, rows<10>, rows<11>, rows<12>};

}  // namespace

// Returns 0, or -1 when N is not a multiple of the tile width.
extern "C" int specdecode_tiled_mm(const float* x, const float* w, float* y, int64_t M, int64_t K,
                                   int64_t N, int threads) {
    if (N % kTile != 0) return -1;
    // Rows in blocks of at most 12, as even as possible: 16 rows are 8 + 8, not 12 + 4.
    const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
    int64_t done = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t mb = (M - done + (blocks - b) - 1) / (blocks - b);
        kRows[mb](x + done * K, w, y + done * N, K, N, threads);
        done += mb;
    }
    return 0;
}
