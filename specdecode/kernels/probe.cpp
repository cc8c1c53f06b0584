// What this build of the kernels can do at best on this CPU: the rate of fused multiply-adds in
// the 16 float lanes of lanes.h when nothing else limits them (no loads, enough independent
// chains to hide their latency), on `threads` threads. The compute bound benchmarks draw the
// forward-latency curve against (bench-runtime).
#include <omp.h>

#include <cstdint>

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

extern "C" {

// FLOP/s (two a lane per multiply-add) of `iters` steps of 16 independent chains per thread.
double specdecode_peak_flops(int threads, int64_t iters) {
    double seconds = 0.0;
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        V acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = set1(0.001f * float(i + omp_get_thread_num()));
        const V a = set1(0.999f), b = set1(1e-4f);
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (int64_t n = 0; n < iters; ++n) {
            for (int i = 0; i < 16; ++i) {
                acc[i] = fma(acc[i], a, b);
                keep(acc[i]);
            }
        }
        const double t = omp_get_wtime() - t0;
#pragma omp critical
        seconds = t > seconds ? t : seconds;
        for (int i = 0; i < 16; ++i) sink += reduce(acc[i]);
    }
    const double flops = 2.0 * 16 * 16 * double(iters) * threads;
    return sink == 12345.0f ? 0.0 : flops / seconds;  // `sink` keeps the chains alive
}

}  // extern "C"
