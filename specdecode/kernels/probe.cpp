// What this build of the kernels can do at best on this CPU, the bounds benchmarks draw the
// forward-latency curve against (bench-runtime): the rate of fused multiply-adds in the 16 float
// lanes of lanes.h when nothing else limits them (no loads, enough independent chains to hide
// their latency), and the rate memory is read at, on `threads` threads.
#include <omp.h>

#include <cstdint>
#include <vector>

#include "lanes.h"

using namespace lanes;

namespace {

inline void keep(V& a) {  // the compiler may not fold or drop the chain
#if defined(__AVX512F__)
    __asm__ volatile("" : "+v"(a.v));
#elif defined(__AVX2__)
    __asm__ volatile("" : "+x"(a.lo), "+x"(a.hi));
#else
    __asm__ volatile("" : : "r"(a.f) : "memory");
#endif
}

}  // namespace

// Independent chains per thread: enough to hide the latency of two pipes, few enough to stay in
// registers (12 zmm of 32; 6 x 2 ymm of 16).
#if defined(__AVX512F__)
constexpr int CHAINS = 12;
#else
constexpr int CHAINS = 6;
#endif

extern "C" {

// FLOP/s (two a lane per multiply-add) of `iters` steps of CHAINS independent chains per thread
// (named one by one: in an array GCC kept them in memory).
double specdecode_peak_flops(int threads, int64_t iters) {
    double seconds = 0.0;
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        const float s = 0.001f * float(omp_get_thread_num() + 1);
        V c0 = set1(s), c1 = set1(2 * s), c2 = set1(3 * s), c3 = set1(4 * s), c4 = set1(5 * s), c5 = set1(6 * s);
        V c6 = set1(7 * s), c7 = set1(8 * s), c8 = set1(9 * s), c9 = set1(10 * s), c10 = set1(11 * s);
        V c11 = set1(12 * s);
        const V a = set1(0.999f), b = set1(1e-4f);
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (int64_t n = 0; n < iters; ++n) {
            c0 = fma(c0, a, b), c1 = fma(c1, a, b), c2 = fma(c2, a, b), c3 = fma(c3, a, b);
            c4 = fma(c4, a, b), c5 = fma(c5, a, b);
            keep(c0), keep(c1), keep(c2), keep(c3), keep(c4), keep(c5);
            if constexpr (CHAINS > 6) {
                c6 = fma(c6, a, b), c7 = fma(c7, a, b), c8 = fma(c8, a, b), c9 = fma(c9, a, b);
                c10 = fma(c10, a, b), c11 = fma(c11, a, b);
                keep(c6), keep(c7), keep(c8), keep(c9), keep(c10), keep(c11);
            }
        }
        const double t = omp_get_wtime() - t0;
#pragma omp critical
        seconds = t > seconds ? t : seconds;
        sink += reduce(add(add(add(c0, c1), add(c2, c3)), add(add(c4, c5), add(c6, c7))));
        sink += reduce(add(add(c8, c9), add(c10, c11)));
    }
    const double flops = 2.0 * 16 * CHAINS * double(iters) * threads;
    return sink == 12345.0f ? 0.0 : flops / seconds;  // `sink` keeps the chains alive
}

// Bytes/s of `threads` threads reading `bytes` of memory (far more than the caches hold) once,
// each its own contiguous share, as the products read weights (best of three passes).
double specdecode_read_bandwidth(int threads, int64_t bytes) {
    const int64_t n = bytes / sizeof(float) / 64 * 64;
    std::vector<float> buf(size_t(n), 1.0f);  // written here: its pages are real
    double best = 1e30;
    float sink = 0.0f;
    for (int pass = 0; pass < 3; ++pass) {
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const float* p = buf.data();
            V s0 = zero(), s1 = zero(), s2 = zero(), s3 = zero();
            for (int64_t i = n / 64 * t / nt * 64; i < n / 64 * (t + 1) / nt * 64; i += 64) {
                s0 = add(s0, loadv(p + i)), s1 = add(s1, loadv(p + i + 16));
                s2 = add(s2, loadv(p + i + 32)), s3 = add(s3, loadv(p + i + 48));
            }
            sink += reduce(add(add(s0, s1), add(s2, s3)));
        }
        const double t = omp_get_wtime() - t0;
        best = t < best ? t : best;
    }
    return sink == 12345.0f ? 0.0 : double(n) * sizeof(float) / best;
}

}  // extern "C"
