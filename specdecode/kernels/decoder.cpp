// A whole decoding forward's layers in one call: for each pre-norm decoder layer (Llama, Qwen2),
// RMS norm -> q|k|v -> row attention (rotary inside) -> o -> residual -> RMS norm -> gate|up ->
// SiLU(gate) * up -> down -> residual, over the T rows of x, with the same kernels the layers call
// one by one from Python (specdecode_rms_norm, specdecode_qmm, specdecode_attend_rows,
// specdecode_silu_mul), in the same order, so both ways give the same bits. What it saves is the
// Python between them: ~20 calls a layer, about half of a small model's one-token forward.
#include <omp.h>

#include <cstddef>
#include <cstdint>
#include <memory>

extern "C" {
int specdecode_qmm(int format, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                   int64_t ldy, int threads, int prefill);
int specdecode_attend_rows(const float* q, int64_t q_sh, int64_t q_st, const float* kn, int64_t k_sh, int64_t k_st,
                           const float* vn, int64_t v_sh, int64_t v_st, void* kc, void* vc, int64_t c_sh,
                           const int64_t* rows, const int64_t* new_slot, int64_t n_rows, const int64_t* row_ptr,
                           const int64_t* idx, float* out, int64_t o_st, int64_t Hq, int64_t Hkv, int64_t D,
                           float scale, const float* cos, const float* sin, int threads, int half_cache);
void specdecode_rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t C, float eps);
void specdecode_silu_mul(const float* gu, int64_t M, int64_t I, float* out);
}

namespace {

// Rows from which the elementwise work between the products (norms, SiLU, residuals, biases) is
// split between the threads too: a prompt's. Below, one thread (a team costs more than the work).
constexpr int64_t SPLIT_ROWS = 32;

// fn(first, last) over rows [0, T), in one run a thread where T >= SPLIT_ROWS. Each row's
// arithmetic is its own: the same bits however the rows are split.
template <typename F>
void by_rows(int64_t T, int threads, F fn) {
    if (T < SPLIT_ROWS || threads <= 1) return fn(int64_t(0), T);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        fn(T * t / nt, T * (t + 1) / nt);
    }
}

// Scratch of n floats, left uninitialised (every element is written before it is read; a
// prompt's zeroed buffers cost ~2% of its forward).
inline std::unique_ptr<float[]> scratch(int64_t n) { return std::unique_ptr<float[]>(new float[size_t(n)]); }

// A layer's record (int64 each, see cpu_isa.py): the two norms' weights (the first 0: no norm
// before attention), then each matrix
// (q|k|v, o, gate|up, down) as its bias (0: none), its number of parts and each part's ggml
// type, data and rows (up to MAX_PARTS).
constexpr int MAX_PARTS = 3, MATRIX = 2 + 3 * MAX_PARTS, RECORD = 2 + 4 * MATRIX;

// y (T, N) = x (T, K) @ W^T + bias, rows before `prefill_from` with the decoding arithmetic
// `decoding` (specdecode_qmm's 0, or 3 for a draft's), the rest with the prefill arithmetic
// `prefill` (1, or 2 for a draft's).
int product(const int64_t* m, const float* x, int64_t T, int64_t K, int64_t N, float* y, int64_t prefill_from,
            int decoding, int prefill, int threads) {
    const float* bias = reinterpret_cast<const float*>(m[0]);
    int64_t first = 0;
    for (int p = 0; p < m[1]; ++p) {
        const int64_t* part = m + 2 + 3 * p;
        const int fmt = int(part[0]);
        const auto* w = reinterpret_cast<const uint8_t*>(part[1]);
        const int64_t rows = part[2];
        const int64_t d = prefill_from < T ? prefill_from : T;
        if (d > 0 && specdecode_qmm(fmt, x, d, K, w, rows, y + first, N, threads, decoding)) return 1;
        if (d < T && specdecode_qmm(fmt, x + d * K, T - d, K, w, rows, y + d * N + first, N, threads, prefill))
            return 1;
        first += rows;
    }
    if (first != N) return 1;
    if (bias != nullptr)
        by_rows(T, threads, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t)
                for (int64_t n = 0; n < N; ++n) y[t * N + n] += bias[n];
        });
    return 0;
}

}  // namespace

extern "C" {

// x (T, C) through `n_layers` layers (records RECORD int64 each), in place. Attention as
// specdecode_attend_rows takes it: each layer's cache (caches: key, value pointer per layer, head
// stride c_sh; float16 where `half_cache`), the rows' slots and CSR, the rotary tables (T, D). H, Hkv heads of D; I the MLP's
// width; rows before `prefill_from` take the decoding arithmetic `decoding`, the rest the prefill
// arithmetic `prefill` (product's). 0 when
// done; 1: a matrix the products do not take; 2: attention refused the shapes.
int specdecode_decoder_rows(const int64_t* layers, int n_layers, float* x, int64_t T, int64_t C, int64_t H,
                            int64_t Hkv, int64_t D, int64_t I, float eps, const int64_t* caches, int64_t c_sh,
                            const int64_t* rows, const int64_t* new_slot, int64_t n_rows, const int64_t* row_ptr,
                            const int64_t* idx, const float* cos, const float* sin, float scale,
                            int64_t prefill_from, int decoding, int prefill, int threads, int half_cache) {
    const int64_t qkv_n = (H + 2 * Hkv) * D, att_n = H * D;
    const auto h = scratch(T * C), qkv = scratch(T * qkv_n), att = scratch(T * att_n), out = scratch(T * C);
    const auto gu = scratch(T * 2 * I), act = scratch(T * I);
    if (n_rows < T)  // rows attention leaves out (none where the plan covers every row): zeros, as before
        for (int64_t i = 0; i < T * att_n; ++i) att[i] = 0.0f;
    const auto norm = [&](const float* w) {  // h = RMS norm of x
        by_rows(T, threads, [&](int64_t t0, int64_t t1) {
            specdecode_rms_norm(x + t0 * C, w, h.get() + t0 * C, t1 - t0, C, eps);
        });
    };
    const auto add_out = [&] {  // x += out
        by_rows(T, threads, [&](int64_t t0, int64_t t1) {
            for (int64_t i = t0 * C; i < t1 * C; ++i) x[i] = x[i] + out[i];
        });
    };
    for (int l = 0; l < n_layers; ++l) {
        const int64_t* rec = layers + int64_t(l) * RECORD;
        const auto* attn_norm = reinterpret_cast<const float*>(rec[0]);
        const auto* mlp_norm = reinterpret_cast<const float*>(rec[1]);
        const int64_t *m_qkv = rec + 2, *m_o = m_qkv + MATRIX, *m_gu = m_o + MATRIX, *m_down = m_gu + MATRIX;
        if (attn_norm != nullptr)
            norm(attn_norm);
        else  // a layer without a norm before attention (EAGLE's): its input as it is
            for (int64_t i = 0; i < T * C; ++i) h[i] = x[i];
        if (product(m_qkv, h.get(), T, C, qkv_n, qkv.get(), prefill_from, decoding, prefill, threads)) return 1;
        const float* q = qkv.get();
        if (specdecode_attend_rows(q, D, qkv_n, q + att_n, D, qkv_n, q + att_n + Hkv * D, D, qkv_n,
                                   reinterpret_cast<void*>(caches[2 * l]), reinterpret_cast<void*>(caches[2 * l + 1]),
                                   c_sh, rows, new_slot, n_rows, row_ptr, idx, att.get(), att_n, H, Hkv, D, scale, cos,
                                   sin, threads, half_cache))
            return 2;
        if (product(m_o, att.get(), T, att_n, C, out.get(), prefill_from, decoding, prefill, threads)) return 1;
        add_out();
        norm(mlp_norm);
        if (product(m_gu, h.get(), T, C, 2 * I, gu.get(), prefill_from, decoding, prefill, threads)) return 1;
        by_rows(T, threads, [&](int64_t t0, int64_t t1) {
            specdecode_silu_mul(gu.get() + t0 * 2 * I, t1 - t0, I, act.get() + t0 * I);
        });
        if (product(m_down, act.get(), T, I, C, out.get(), prefill_from, decoding, prefill, threads)) return 1;
        add_out();
    }
    return 0;
}

}  // extern "C"
