// The rest of a decoding forward's few rows, per instruction set (lanes.h): attention of listed
// rows over listed cache slots, and RMS norm.
//
// Attention: the rows of a forward (single requests, every sequence of an in-flight batch, the
// nodes of a draft tree) each attend to their own list of slots of one paged cache (their prefix,
// and for a tree node its ancestors), so a ragged batch of many sequences is one call per layer
// instead of a gather and an SDPA per sequence. A row's output depends only on its own query and
// slots, in a fixed order: bitwise the same alone or in any batch, whatever the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "lanes.h"

namespace {

using namespace lanes;

// Rotary embedding of one head's row: y = x * cos + rotate_half(x) * sin, each product and the sum
// rounded as torch's three elementwise ops round them (no fused multiply-add), so keys rotated here
// and keys rotated by torch (prefill chunks through SDPA) are bitwise the same.
__attribute__((optimize("fp-contract=off"))) void rotate(const float* __restrict x, const float* __restrict cos,
                                                          const float* __restrict sin, int64_t D,
                                                          float* __restrict y) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; ++d) {
        const float r = d < half ? -x[d + half] : x[d - half];
        const float a = x[d] * cos[d];
        const float b = r * sin[d];
        y[d] = a + b;
    }
}

// Heads that share a key/value head, at most this many per task (a task's scores and sums live
// in its scratch and registers).
constexpr int MAX_GROUP = 16;

// Queries a task attends at once: its heads, for every row that has the same slots over its span
// (the rows of a verified draft, tree or chain, over their shared prefix).
constexpr int MAX_QUERIES = 32;

// A row's slots go in spans of SPAN (the last shorter), each span a task of its own: one row alone
// (decoding a token) then has work for every thread however few its key/value heads, and reads
// each key and value once for all the heads that share it. The spans depend only on the row's own
// number of slots, so its result is the same alone or in any batch, whatever the thread count.
// Spans of 64 wrote and merged ~4x the partial results (a 512-token prompt's, ~5 MB past L2) and
// ran ~4x the tasks: SmolLM2's attention over a 512-token prompt took 1.5x as long, 8 rows over
// 1024 slots 1.25x (2 threads, this Xeon); one row over 40-200 slots within noise of it.
constexpr int64_t SPAN = 256;

// Ask for the n rows of D floats at `base + slots[i] * D` now (the hardware's prefetching, a
// stream or two per thread, read a row's keys and values at ~25 GB/s on two cores of a Zen 5).
// Whether to is the machine's: the instructions cost more than they gain on some (a Zen 4's
// attention over 1024 slots, one row, 8% faster without them on AVX-512, 22% on AVX2), so it is
// timed both ways when the library loads (`cpu_isa.py`) and set by specdecode_attention_prefetch.
// Either way the same arithmetic: the same bits.
constexpr int64_t AHEAD = 32;  // slots ahead
bool ask_ahead = true;
template <typename T>
inline void ask_for(const T* base, const int64_t* slots, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; d += int64_t(64 / sizeof(T))) prefetch(base + slots[i] * D + d);
}

// Heads' running sums o over n slots' values, each weighed by its score p (head g's at
// p[g * stride + k]), for as many of `left` heads as one pass takes (returned): GN at once, each
// head's sum in slot order, so the same bits whichever pass takes it.
template <int NC, int GN, typename T>
inline void value_pass(const T* __restrict vc, const int64_t* __restrict idx, int64_t n, const float* p,
                       int64_t stride, V (*o)[NC]) {
    constexpr int64_t D = NC * 16;
    V acc[GN][NC];
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < NC; ++c) acc[g][c] = o[g][c];
    for (int64_t k = 0; k < n; ++k) {
        const T* v = vc + idx[k] * D;
        V vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = loadc(v + c * 16);
        for (int g = 0; g < GN; ++g) {
            const V w = set1(p[g * stride + k]);
            for (int c = 0; c < NC; ++c) acc[g][c] = fma(w, vv[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < NC; ++c) o[g][c] = acc[g][c];
}

template <int NC, typename T, int GN = (NC >= 8 ? 2 : 24 / NC)>
inline int value_sums(int left, const T* vc, const int64_t* idx, int64_t n, const float* p, int64_t stride,
                      V (*o)[NC]) {
    if constexpr (GN > 1) {
        if (left < GN) return value_sums<NC, T, GN - 1>(left, vc, idx, n, p, stride, o);
    }
    value_pass<NC, GN, T>(vc, idx, n, p, stride, o);
    return GN;
}

// Attention of G queries (heads sharing one key/value head, of rows sharing these slots) over
// `L` slots (`idx`), query g over the first lens[g] of them, unnormalised: for each query, its top
// score m (scaled), the sum l of exp(score - m), and o = the sum of exp(score - m) v_j. NC =
// head_dim / 16; `s` is scratch for G x L scores, each rounded up to 16. Slots come 16 at a time,
// each block's keys and values read from memory once for all G queries; a query's scores are 16
// keys at a time (`reduce16`: each the same sum as `reduce` of its key's products), and slots
// past its own add exact zeros, so a query's result is the same in any group.
template <int NC, typename T>
void attend_span(int G, const float* const* q, const int64_t* lens, const T* __restrict kc, const T* __restrict vc,
                 const int64_t* __restrict idx, int64_t L, int64_t L_all, float scale, float* __restrict s,
                 V (&o)[MAX_QUERIES][NC], float* m_out, float* l_out) {
    constexpr int64_t D = NC * 16;
    const int64_t padded = (L + 15) / 16 * 16;
    const V sc = set1(scale);
    V top[MAX_QUERIES];
    for (int g = 0; g < G; ++g) top[g] = set1(-INFINITY);
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const int64_t n = L - j0 < 16 ? L - j0 : 16;
        const T* key[16];
        for (int64_t k = 0; k < 16; ++k) key[k] = kc + idx[j0 + (k < n ? k : n - 1)] * D;  // past L: the last again
        if (ask_ahead && j0 + AHEAD < L_all) {  // keys and values ahead (a span's values are read after its scores)
            ask_for(kc, idx + j0 + AHEAD, std::min<int64_t>(16, L_all - j0 - AHEAD), D);
            ask_for(vc, idx + j0 + AHEAD, std::min<int64_t>(16, L_all - j0 - AHEAD), D);
        }
        for (int g = 0; g < G; ++g) {
            V qv[NC];
            for (int c = 0; c < NC; ++c) qv[c] = loadv(q[g] + c * 16);
            V acc[16];
            for (int k = 0; k < 16; ++k) {
                acc[k] = mul(qv[0], loadc(key[k]));
                for (int c = 1; c < NC; ++c) acc[k] = fma(qv[c], loadc(key[k] + c * 16), acc[k]);
            }
            V x = mul(reduce16(acc), sc);
            storev(s + g * padded + j0, x);
            if (j0 + 16 > lens[g]) {  // slots past the query's own: no maximum (and no weight below)
                std::fill(s + g * padded + std::max(j0, lens[g]), s + g * padded + j0 + 16, -INFINITY);
                x = loadv(s + g * padded + j0);
            }
            top[g] = maxv(top[g], x);
        }
    }
    for (int g = 0; g < G; ++g) {
        float* sg = s + g * padded;
        float lanes_top[16];
        storev(lanes_top, top[g]);
        float m = -INFINITY;
        for (float t : lanes_top) m = t > m ? t : m;
        std::fill(sg + lens[g], sg + padded, m);
        const V mv = set1(m);
        V total = zero();
        for (int64_t j = 0; j < L; j += 16) storev(sg + j, exp_nonpositive(sub(loadv(sg + j), mv)));
        std::fill(sg + lens[g], sg + padded, 0.0f);  // past the query's last slot: no weight (adding
        // its zeros to the sums below changes no bit)
        for (int64_t j = 0; j < L; j += 16) total = add(total, loadv(sg + j));
        m_out[g] = m;
        l_out[g] = reduce(total);
    }
    // The heads' sums over 16 slots' values at a time, read from memory once; each value row
    // serves several heads at once (`value_sums`: independent chains, where one head alone had
    // its NC chains of fused multiply-adds each wait on its last sum).
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) o[g][c] = zero();
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const int64_t n = L - j0 < 16 ? L - j0 : 16;
        for (int g0 = 0; g0 < G;) g0 += value_sums<NC, T>(G - g0, vc, idx + j0, n, s + g0 * padded + j0, padded, o + g0);
    }
}

// Rows whose slots over a span are the same, or one's the start of the other's, share its task
// (`Span`): each block of keys and values is read once for all of their queries, taken as more
// heads of the group. A prompt's rows and a verified chain's are such rows (each row's slots are
// the row before's and its own): their last spans, of different lengths, are one task, not one
// each. A query weighs only its own row's slots: those past them get no maximum and no weight,
// so each query's arithmetic is its own, the same bits alone or sharing.
struct Span {
    int64_t first, n;  // the span's slots: row `longest`'s [first, first + n) of its list
    int count;         // rows sharing it
    int32_t longest;   // the row whose slots these are: every other's are their start
    int32_t rows[MAX_QUERIES];
    int64_t lens[MAX_QUERIES];  // each row's own slots of the span (a start of the n)
};

// Each row's slots in spans of SPAN, a span shared by consecutive rows whose slots there agree
// (at most `max_rows`); part_at: where a row of several spans keeps its partials (-1: one span).
inline std::vector<Span> shared_spans(const int64_t* row_ptr, const int64_t* idx, int64_t n_rows, int max_rows,
                                      int64_t Hq, std::vector<int64_t>& part_at, int64_t& parts) {
    std::vector<Span> spans;
    std::vector<int64_t> open;  // per span index: the latest span there, which a next row may share
    parts = 0;
    for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t L = row_ptr[r + 1] - row_ptr[r];
        for (int64_t j = 0, s = 0; j < L; j += SPAN, ++s) {
            const int64_t n = std::min(SPAN, L - j);
            if (size_t(s) == open.size()) open.push_back(-1);
            const int64_t at = open[size_t(s)];
            if (at >= 0) {
                Span& sp = spans[size_t(at)];
                const int64_t* mine = idx + row_ptr[r] + j;
                const int64_t* theirs = idx + row_ptr[sp.longest] + j;
                if (sp.count < max_rows && std::equal(mine, mine + std::min(n, sp.n), theirs)) {
                    sp.rows[sp.count] = int32_t(r), sp.lens[sp.count++] = n;
                    if (n > sp.n) sp.n = n, sp.longest = int32_t(r);
                    continue;
                }
            }
            open[size_t(s)] = int64_t(spans.size());
            Span sp{j, n, 1, int32_t(r), {}, {}};
            sp.rows[0] = int32_t(r), sp.lens[0] = n;
            spans.push_back(sp);
        }
        if (L > SPAN) part_at[size_t(r)] = parts, parts += (L + SPAN - 1) / SPAN * Hq;
    }
    return spans;
}

// Where each of `threads` runs of the tasks (key/value head, span, chunk of heads) ends, so that
// each holds about an equal share of their work: a span's queries times its slots, plus a
// constant for a task's own overhead.
inline std::vector<int64_t> balanced_runs(const std::vector<Span>& spans, int64_t chunks, int64_t n_tasks,
                                          int threads) {
    const auto n_spans = int64_t(spans.size());
    auto work = [&](int64_t task) {
        const Span& sp = spans[size_t(task / chunks % n_spans)];
        return sp.count * sp.n + 16;
    };
    int64_t total = 0;
    for (int64_t task = 0; task < n_tasks; ++task) total += work(task);
    std::vector<int64_t> ends(size_t(std::max(threads, 1)), n_tasks);
    int64_t done = 0, task = 0;
    for (int t = 0; t + 1 < threads; ++t) {
        const int64_t goal = total * (t + 1) / threads;
        while (task < n_tasks && done + work(task) / 2 < goal) done += work(task++);
        ends[size_t(t)] = task;
    }
    return ends;
}

template <int NC, typename T>
void attend_rows(const float* q, int64_t q_sh, int64_t q_st, const float* kn, int64_t k_sh, int64_t k_st,
                 const float* vn, int64_t v_sh, int64_t v_st, T* kc, T* vc, int64_t c_sh, const int64_t* rows,
                 const int64_t* new_slot, int64_t n_rows, const int64_t* row_ptr, const int64_t* idx, float* out,
                 int64_t o_st, int64_t Hq, int64_t Hkv, float scale, const float* cos, const float* sin,
                 int threads) {
    constexpr int64_t D = NC * 16, PART = D + 2;  // a span's partial result: o, m, l
    const int64_t group = Hq / Hkv;
    int64_t per = group;  // heads a task: the whole group where it fits the task's registers
    while (per > MAX_GROUP || group % per) --per;
    const int64_t chunks = group / per;
    std::vector<int64_t> part_at(size_t(n_rows), -1);
    int64_t parts = 0;
    const std::vector<Span> spans = shared_spans(row_ptr, idx, n_rows, int(MAX_QUERIES / per), Hq, part_at, parts);
    const auto n_spans = int64_t(spans.size());
    // Each span's partial result, every one written by its task before the merge reads it (left
    // unzeroed: a 512-token prompt's are ~5 MB).
    const std::unique_ptr<float[]> partial(new float[size_t(parts * PART)]);
    std::vector<float> rotated(cos != nullptr ? size_t(n_rows * Hq * D) : 0);
    const int64_t n_tasks = Hkv * n_spans * chunks;
    const std::vector<int64_t> task_ends = balanced_runs(spans, chunks, n_tasks, threads);
#pragma omp parallel num_threads(threads)
    {
        // The new keys and values into their slots first: rows of a tree see their ancestors'.
        // Queries are rotated here too, once each (not once for every span of their row).
#pragma omp for schedule(static)
        for (int64_t task = 0; task < n_rows * Hkv; ++task) {
            const int64_t r = task / Hkv, h = task % Hkv, t = rows[r];
            T* kd = kc + h * c_sh + new_slot[r] * D;
            T* vd = vc + h * c_sh + new_slot[r] * D;
            if (cos != nullptr) {
                if constexpr (std::is_same_v<T, float>) {
                    rotate(kn + h * k_sh + t * k_st, cos + t * D, sin + t * D, D, kd);
                } else {  // rotated in float32, then narrowed
                    float rotated_key[D];
                    rotate(kn + h * k_sh + t * k_st, cos + t * D, sin + t * D, D, rotated_key);
                    for (int c = 0; c < NC; ++c) storec(kd + c * 16, loadv(rotated_key + c * 16));
                }
            } else {
                for (int c = 0; c < NC; ++c) storec(kd + c * 16, loadv(kn + h * k_sh + t * k_st + c * 16));
            }
            for (int c = 0; c < NC; ++c) storec(vd + c * 16, loadv(vn + h * v_sh + t * v_st + c * 16));
            if (cos != nullptr)  // and the queries of the heads that share this key/value head
                for (int64_t g = h * group; g < (h + 1) * group; ++g)
                    rotate(q + g * q_sh + t * q_st, cos + t * D, sin + t * D, D, rotated.data() + (r * Hq + g) * D);
        }
        std::vector<float> scratch(size_t(MAX_QUERIES * SPAN));
        V o[MAX_QUERIES][NC];
        float m[MAX_QUERIES], l[MAX_QUERIES];
        // Tasks by key/value head, then span (rows in order), then its heads `per` at a time: a
        // thread reads a key/value head's slots once from memory, then from its own cache for
        // every span of a later row that shares them. Each thread takes a run of tasks holding
        // an equal share of the work (`task_ends`): a span several rows share is several times
        // the work of one row's own slots (a tree's), so equal numbers of tasks left one thread
        // waiting on the other. (A team smaller than asked for takes the runs in turn.)
        for (int run = omp_get_thread_num(); run < int(task_ends.size()); run += omp_get_num_threads()) {
            const int64_t begin = run ? task_ends[size_t(run - 1)] : 0;
            for (int64_t task = begin; task < task_ends[size_t(run)]; ++task) {
                const int64_t kvh = task / (n_spans * chunks);
                const Span& sp = spans[size_t(task / chunks % n_spans)];
                const int64_t h0 = kvh * group + task % chunks * per, r0 = sp.longest;
                const float* qs[MAX_QUERIES];  // query i: row sp.rows[i / per], head h0 + i % per
                int64_t lens[MAX_QUERIES];      // and its row's own slots of the span
                for (int64_t i = 0; i < sp.count * per; ++i) {
                    const int64_t r = sp.rows[i / per], h = h0 + i % per;
                    qs[i] = cos != nullptr ? rotated.data() + (r * Hq + h) * D : q + h * q_sh + rows[r] * q_st;
                    lens[i] = sp.lens[i / per];
                }
                attend_span<NC, T>(int(sp.count * per), qs, lens, kc + kvh * c_sh, vc + kvh * c_sh,
                                   idx + row_ptr[r0] + sp.first, sp.n, row_ptr[r0 + 1] - row_ptr[r0] - sp.first,
                                   scale, scratch.data(), o, m, l);
                for (int64_t i = 0; i < sp.count * per; ++i) {
                    const int64_t r = sp.rows[i / per], h = h0 + i % per;
                    if (part_at[size_t(r)] < 0) {  // the row's one span: its result
                        const V iv = set1(1.0f / l[i]);
                        for (int c = 0; c < NC; ++c)
                            storev(out + rows[r] * o_st + h * D + c * 16, mul(o[i][c], iv));
                    } else {
                        float* p = partial.get() + (part_at[size_t(r)] + sp.first / SPAN * Hq + h) * PART;
                        for (int c = 0; c < NC; ++c) storev(p + c * 16, o[i][c]);
                        p[D] = m[i], p[D + 1] = l[i];
                    }
                }
            }
        }
#pragma omp barrier
        // Rows of several spans: their spans' partials merged in order, each weighed by
        // exp(its top - the row's top).
#pragma omp for schedule(static)
        for (int64_t task = 0; task < n_rows * Hq; ++task) {
            const int64_t r = task / Hq, h = task % Hq;
            if (part_at[size_t(r)] < 0) continue;
            const int64_t spans = (row_ptr[r + 1] - row_ptr[r] + SPAN - 1) / SPAN;
            const float* first = partial.get() + (part_at[size_t(r)] + h) * PART;
            float top = -INFINITY;
            for (int64_t i = 0; i < spans; ++i) top = std::max(top, first[i * Hq * PART + D]);
            V acc[NC];
            for (int c = 0; c < NC; ++c) acc[c] = zero();
            float total = 0.0f;
            for (int64_t i = 0; i < spans; ++i) {
                const float* p = first + i * Hq * PART;
                float w[16];
                storev(w, exp_nonpositive(set1(p[D] - top)));
                for (int c = 0; c < NC; ++c) acc[c] = fma(set1(w[0]), loadv(p + c * 16), acc[c]);
                total = std::fma(w[0], p[D + 1], total);
            }
            const V iv = set1(1.0f / total);
            for (int c = 0; c < NC; ++c) storev(out + rows[r] * o_st + h * D + c * 16, mul(acc[c], iv));
        }
    }
}

// SiLU(x) * up: e = exp(-|x|) <= 1, sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below.
inline V silu_times(V x, V up) {
    const V e = exp_nonpositive(minv(x, sub(zero(), x)));
    const V one = set1(1.0f);
    const V sig = select_nonnegative(x, div(one, add(one, e)), div(e, add(one, e)));
    return mul(mul(x, sig), up);
}

}  // namespace

extern "C" {

// Whether row attention asks for keys and values ahead in software (see `ask_for`).
void specdecode_attention_prefetch(int on) { ask_ahead = on != 0; }

// q (H, T, D) at strides (q_sh, q_st); new keys/values (Hkv, T, D) likewise; cos/sin (T, D) the
// rotary tables at each row's position, applied here to q and the new keys (null: already done);
// the layer's cache kc/vc (Hkv, S, D) with head stride c_sh, float32 or (half_cache) float16; for each of `n_rows` rows (indices
// into T): the slot its new key/value goes to and, as CSR (row_ptr, idx), the slots it attends
// to; out (T, H, D) with row stride o_st. Returns 0, or -1 for a head size the kernel does not take.
int specdecode_attend_rows(const float* q, int64_t q_sh, int64_t q_st, const float* kn, int64_t k_sh, int64_t k_st,
                           const float* vn, int64_t v_sh, int64_t v_st, void* kc, void* vc, int64_t c_sh,
                           const int64_t* rows, const int64_t* new_slot, int64_t n_rows, const int64_t* row_ptr,
                           const int64_t* idx, float* out, int64_t o_st, int64_t Hq, int64_t Hkv, int64_t D,
                           float scale, const float* cos, const float* sin, int threads, int half_cache) {
    if (Hkv <= 0 || Hq % Hkv != 0) return -1;
    const auto run = [&](auto* k_cache, auto* v_cache, auto one, auto two, auto four, auto eight) {
        const auto fn = D == 16 ? one : D == 32 ? two : D == 64 ? four : D == 128 ? eight : nullptr;
        if (fn == nullptr) return -1;
        fn(q, q_sh, q_st, kn, k_sh, k_st, vn, v_sh, v_st, k_cache, v_cache, c_sh, rows, new_slot, n_rows, row_ptr,
           idx, out, o_st, Hq, Hkv, scale, cos, sin, threads);
        return 0;
    };
    if (half_cache) {
        auto* k = static_cast<uint16_t*>(kc);
        auto* v = static_cast<uint16_t*>(vc);
        return run(k, v, attend_rows<1, uint16_t>, attend_rows<2, uint16_t>, attend_rows<4, uint16_t>,
                   attend_rows<8, uint16_t>);
    }
    return run(static_cast<float*>(kc), static_cast<float*>(vc), attend_rows<1, float>, attend_rows<2, float>,
               attend_rows<4, float>, attend_rows<8, float>);
}

// y (M, C) = x / sqrt(mean(x^2) + eps) * w, float32, one thread: a row's sum of squares runs in a
// fixed order (16 lanes, then `reduce`), so a row's result does not depend on M.
// (torch's rms_norm costs ~40 us a call inside a decoding forward, 60 calls a token.)
void specdecode_rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t C, float eps) {
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * C;
        float* yr = y + m * C;
        V acc = zero();
        int64_t c = 0;
        for (; c + 16 <= C; c += 16) {
            const V v = loadv(xr + c);
            acc = fma(v, v, acc);
        }
        if (c < C) {  // the last lanes, zero-padded
            float tail[16] = {};
            std::copy(xr + c, xr + C, tail);
            const V v = loadv(tail);
            acc = fma(v, v, acc);
        }
        const float scale = 1.0f / std::sqrt(reduce(acc) / static_cast<float>(C) + eps);
        const V s = set1(scale);
        for (c = 0; c + 16 <= C; c += 16) storev(yr + c, mul(mul(loadv(xr + c), s), loadv(w + c)));
        for (; c < C; ++c) yr[c] = xr[c] * scale * w[c];
    }
}

// out (M, I) = SiLU(gu[:, :I]) * gu[:, I:] for gu (M, 2 I): x * sigmoid(x) * up, sigmoid through
// exp of -|x| (lanes.h), each lane on its own, so a row's result does not depend on M.
void specdecode_silu_mul(const float* gu, int64_t M, int64_t I, float* out) {
    for (int64_t m = 0; m < M; ++m) {
        const float* g = gu + m * 2 * I;
        const float* u = g + I;
        float* o = out + m * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) storev(o + i, silu_times(loadv(g + i), loadv(u + i)));
        if (i < I) {  // the last lanes, padded
            float gt[16] = {}, ut[16] = {}, ot[16];
            std::copy(g + i, g + I, gt);
            std::copy(u + i, u + I, ut);
            storev(ot, silu_times(loadv(gt), loadv(ut)));
            std::copy(ot, ot + (I - i), o + i);
        }
    }
}

}  // extern "C"
