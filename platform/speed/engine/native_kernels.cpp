// Row-invariant decode kernels for x86 CPUs with AVX-512 or AVX2 (with FMA): the linear of 1..8 rows and the
// attention of one query per row over its positions of the paged KV cache (speed.engine.native).
//
// Linear: out[r, j] = dot(x[r, :], w[j, :]) for 1..8 rows.
//
// Decoding reads every weight once per group pass whatever the row count, so a pass is bound by memory
// bandwidth: the kernel streams each weight row once for all R rows (R <= 8) and keeps the rows' partial sums in
// registers. Each output's dot product is summed in one fixed order (16-lane partial sums over k in order, masked
// tail last, then one fixed tree over the lanes: vsum), whatever R, the output blocking or the thread count:
// threads split the outputs, never the reduction. So a row's result never depends on its company, its position or
// the row count. Weights are float32 or bfloat16 (widened to float32 in registers: fp32 accumulation either way).
//
// Every kernel works on 16 float lanes (V): one AVX-512 register, or on AVX2 two 256-bit halves taking the same
// operation lane by lane (a fused multiply-add per lane on both, the lanes' sum in the same tree), so the two
// instruction sets compute the same sums in the same order: the same bits by construction. Only the register
// blocking differs (AVX2 has 16 vector registers, not 32), and blocking never changes a sum.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPEED_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define SPEED_AVX512 0
#else
#error "speed's decode kernels need AVX-512 (F, BW, VL) or AVX2 with FMA"
#endif

namespace {

// The sum of 16 lanes given as halves (lanes 0-7, 8-15), in the tree of GCC's _mm512_reduce_add_ps: the halves
// added, then the two quarters of that, then lanes {0, 2} and {1, 3}, then those two.
inline float sum16(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

#if SPEED_AVX512
struct V {
    __m512 v;
};
inline __mmask16 lanes(int64_t n) { return (__mmask16)((1u << n) - 1u); }  // the first n of 16 lanes (0 <= n <= 16)
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset1(float a) { return {_mm512_set1_ps(a)}; }
inline V vload(const float *p) { return {_mm512_loadu_ps(p)}; }
inline V vload_n(int64_t n, const float *p) { return {_mm512_maskz_loadu_ps(lanes(n), p)}; }  // the rest zero
inline void vstore(float *p, V a) { _mm512_storeu_ps(p, a.v); }
inline void vstore_n(int64_t n, float *p, V a) { _mm512_mask_storeu_ps(p, lanes(n), a.v); }
inline V vfmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline float vsum(V a) {
    return sum16(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}
inline V widen(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
inline V load_w(const float *p) { return vload(p); }
inline V load_w(const uint16_t *p) { return widen(_mm256_loadu_si256((const __m256i *)p)); }
inline V load_w_n(int64_t n, const float *p) { return vload_n(n, p); }
inline V load_w_n(int64_t n, const uint16_t *p) { return widen(_mm256_maskz_loadu_epi16(lanes(n), p)); }
// A packed panel row (speed.engine.native.pack): outputs 0-15 in lo, 16-31 in hi.
inline void load_panel(const float *p, V &lo, V &hi) {
    lo = vload(p);
    hi = vload(p + 16);
}
inline void load_panel(const uint16_t *p, V &lo, V &hi) {
    const __m512i v = _mm512_loadu_si512((const void *)p);
    lo = {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
    hi = {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)))};
}
#else
struct V {
    __m256 lo, hi;  // lanes 0-7, 8-15
};
inline __m256i lanes8(int64_t n) {  // all ones in the first n of 8 lanes (n may be below 0 or above 8)
    const int m = (int)(n < 0 ? 0 : (n > 8 ? 8 : n));
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V vload(const float *p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vload_n(int64_t n, const float *p) {
    return {_mm256_maskload_ps(p, lanes8(n)), _mm256_maskload_ps(p + 8, lanes8(n - 8))};
}
inline void vstore(float *p, V a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
inline void vstore_n(int64_t n, float *p, V a) {
    _mm256_maskstore_ps(p, lanes8(n), a.lo);
    _mm256_maskstore_ps(p + 8, lanes8(n - 8), a.hi);
}
inline V vfmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline float vsum(V a) { return sum16(a.lo, a.hi); }
inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
inline V load_w(const float *p) { return vload(p); }
inline V load_w(const uint16_t *p) { return {widen8(p), widen8(p + 8)}; }
inline V load_w_n(int64_t n, const float *p) { return vload_n(n, p); }
inline V load_w_n(int64_t n, const uint16_t *p) {
    uint16_t part[16] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = p[i];
    return load_w(part);
}
inline void load_panel(const float *p, V &lo, V &hi) {
    lo = vload(p);
    hi = vload(p + 16);
}
inline void load_panel(const uint16_t *p, V &lo, V &hi) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)p), v1 = _mm256_loadu_si256((const __m256i *)(p + 16));
    const __m256i top = _mm256_set1_epi32((int)0xFFFF0000u);
    lo = {_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16))};
    hi = {_mm256_castsi256_ps(_mm256_and_si256(v0, top)), _mm256_castsi256_ps(_mm256_and_si256(v1, top))};
}
#endif

template <int R, int J, typename W>
void block(const float *x, const W *w, float *out, int64_t K, int64_t N, int64_t j0, int64_t j1) {
    const int64_t kv = K & ~int64_t(15), tail = K - kv;
    int64_t j = j0;
    for (; j + J <= j1; j += J) {
        V acc[R][J];
        for (int r = 0; r < R; r++)
            for (int q = 0; q < J; q++) acc[r][q] = vzero();
        const W *w0 = w + j * K;
        for (int64_t k = 0; k < kv; k += 16) {
            V wv[J];
            for (int q = 0; q < J; q++) wv[q] = load_w(w0 + q * K + k);
            for (int r = 0; r < R; r++) {
                const V xv = vload(x + k * R + r * 16);
                for (int q = 0; q < J; q++) acc[r][q] = vfmadd(xv, wv[q], acc[r][q]);
            }
        }
        if (tail) {
            V wv[J];
            for (int q = 0; q < J; q++) wv[q] = load_w_n(tail, w0 + q * K + kv);
            for (int r = 0; r < R; r++) {
                const V xv = vload_n(tail, x + kv * R + r * 16);
                for (int q = 0; q < J; q++) acc[r][q] = vfmadd(xv, wv[q], acc[r][q]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int q = 0; q < J; q++) out[r * N + j + q] = vsum(acc[r][q]);
    }
    if (j < j1) block<R, 1>(x, w, out, K, N, j, j1);
}

// Outputs per block: as many as the 32 vector registers hold beside the rows' sums (R * J + J + 1 <= 32). Measured
// (Ouro-1.4B's widths, interleaved A/B, 7 rounds): 5 rows on 5 outputs instead of 3 stream 4 % faster in float32 and
// 23 % in bf16, 6 rows on 4 instead of 3 8-9 %; 4 rows on 6 and 7 rows on 4 no faster. J never changes a sum.
template <int R, typename W>
void rows(const float *x, const W *w, float *out, int64_t K, int64_t N, int64_t j0, int64_t j1) {
    constexpr int J = R <= 2 ? 8 : (R <= 5 ? 5 : (R == 6 ? 4 : 3));
    block<R, J>(x, w, out, K, N, j0, j1);
}

// Weights below this many elements run on one thread: waking a second costs more than it saves.
constexpr int64_t PARALLEL_MIN = int64_t(1) << 18;

template <typename W>
void linear(const float *x, const W *w, float *out, int64_t R, int64_t K, int64_t N, int threads) {
    if (N * K < PARALLEL_MIN) threads = 1;
    const int64_t per = ((N + threads - 1) / threads + 7) / 8 * 8;
    // The rows interleaved 16 values at a time (x[r, k] at (k / 16) * 16R + 16r + k % 16): a k step's R vectors
    // side by side, one stream for the prefetcher instead of R (3-7 % faster at 4 to 8 rows of Ouro-1.4B's
    // widths; the same sums, so the same bits).
    const int64_t K16 = (K + 15) & ~int64_t(15);
    std::vector<float> xi;
    if (R > 1) {  // one row is already in that layout
        xi.assign(R * K16, 0.0f);
        for (int64_t r = 0; r < R; r++)
            for (int64_t k = 0; k < K; k++) xi[(k & ~int64_t(15)) * R + r * 16 + (k & 15)] = x[r * K + k];
        x = xi.data();
    }
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t j0 = t * per, j1 = j0 + per < N ? j0 + per : N;
        if (j0 >= j1) continue;
        switch (R) {
            case 1: rows<1>(x, w, out, K, N, j0, j1); break;
            case 2: rows<2>(x, w, out, K, N, j0, j1); break;
            case 3: rows<3>(x, w, out, K, N, j0, j1); break;
            case 4: rows<4>(x, w, out, K, N, j0, j1); break;
            case 5: rows<5>(x, w, out, K, N, j0, j1); break;
            case 6: rows<6>(x, w, out, K, N, j0, j1); break;
            case 7: rows<7>(x, w, out, K, N, j0, j1); break;
            case 8: rows<8>(x, w, out, K, N, j0, j1); break;
        }
    }
}

// Packed linear: the same product on a weight packed in panels of PANEL outputs (speed.engine.native.pack): panel
// p holds w[p * PANEL + q, k] at (p * K + k) * PANEL + q (bfloat16: the panel's two halves interleaved, output q at
// 2q and q + 16 at 2q + 1, so that one 64-byte load widens into outputs 0-15 by a shift and 16-31 by a mask), the
// last panel padded with zeros. Each k step reads one panel row (PANEL contiguous weights) and multiplies it by
// every row's x[r, k], broadcast: a multiply-add per weight vector and row, with no reduction across lanes, so the
// rows' count costs little (the dot form above reloads each row's inputs for every few outputs and reduces every
// output: at 4-8 rows it streams at 40-70 % of the bandwidth, this form at 70-100 %; docs/benchmarks.md). Each
// output is summed in one fixed order, x[r, 0] w[j, 0] + ... then each next k by one fused multiply-add, whatever
// R, the panels per block or the thread count: a row's bits never depend on its company.
constexpr int PANEL = 32;
// Every block prefetches its panel rows this far ahead (in k), but float32 at one row. Measured at Ouro-1.4B's
// widths: on AMD Zen 4, 7-8 rows +6-11 % in float32 and +36-40 % in bfloat16, 1-6 rows unchanged (the hardware
// prefetcher kept up); on an Intel Xeon (AMX generation, 2.6 GHz), 2-6 rows +5-24 % in float32 and 1-6 rows
// +10-44 % in bfloat16, one float32 row 2.5 % slower (so it prefetches none).
constexpr int PREFETCH_K = 32;

// B panels at a time (B * 2 weight vectors and R * B * 2 sums in registers) from panel p0 to p1.
template <int R, int B, typename W>
void panels(const float *x, const W *w, float *out, int64_t K, int64_t N, int64_t p0, int64_t p1) {
    int64_t p = p0;
    for (; p + B <= p1; p += B) {
        V acc[R][B][2];
        for (int r = 0; r < R; r++)
            for (int b = 0; b < B; b++) acc[r][b][0] = acc[r][b][1] = vzero();
        const W *wp = w + p * K * PANEL;
        for (int64_t k = 0; k < K; k++) {
            V wv[B][2];
            if (R > 1 || sizeof(W) == 2) {  // the panel rows PREFETCH_K ahead: both cache lines of a float32 one
                for (int b = 0; b < B; b++) {
                    const W *ahead = wp + (b * K + k + PREFETCH_K) * PANEL;
                    _mm_prefetch((const char *)ahead, _MM_HINT_T0);
                    if (sizeof(W) == 4) _mm_prefetch((const char *)(ahead + 16), _MM_HINT_T0);
                }
            }
            for (int b = 0; b < B; b++) load_panel(wp + (b * K + k) * PANEL, wv[b][0], wv[b][1]);
            for (int r = 0; r < R; r++) {
                const V xv = vset1(x[r * K + k]);
                for (int b = 0; b < B; b++) {
                    acc[r][b][0] = vfmadd(xv, wv[b][0], acc[r][b][0]);
                    acc[r][b][1] = vfmadd(xv, wv[b][1], acc[r][b][1]);
                }
            }
        }
        for (int b = 0; b < B; b++) {
            const int64_t j = (p + b) * PANEL;
            const int64_t left = N - j;  // outputs of this panel that exist (the last panel's padding is not stored)
            const int64_t n0 = left >= 16 ? 16 : left, n1 = left >= 32 ? 16 : (left > 16 ? left - 16 : 0);
            for (int r = 0; r < R; r++) {
                vstore_n(n0, out + r * N + j, acc[r][b][0]);
                vstore_n(n1, out + r * N + j + 16, acc[r][b][1]);
            }
        }
    }
    if (p < p1) panels<R, 1>(x, w, out, K, N, p, p1);
}

#if !SPEED_AVX512
// AVX2 blocking of the same product for bfloat16 from 3 rows and float32 from 6 (16 vector registers, not 32: the
// blocks above spill). A panel is taken KC k steps at a time; within a chunk, blocks of G rows by Q quarters of the
// panel (8 outputs each) continue their sums from ``acc`` (the panel's, in memory between blocks), the chunk's weights
// read from memory by the first block and from the L1 cache by the others. The first block prefetches its rows
// PREFETCH_K ahead, the second the next chunk's (KC ahead): without it the memory stream stood idle while the later
// blocks computed from L1 (at Ouro-1.4B's widths on an AMD EPYC (Zen 3), 2 threads, the median of 8-12 interleaved
// sweeps: bfloat16 4-8 rows +2-18 %, float32 6-8 rows +9-22 %). Each output is still x[r, 0] w[j, 0] then each next
// k by one fused multiply-add, in order: the same sums as the AVX-512 blocks, so the same bits.
constexpr int64_t KC = 128;

template <int Q0>
inline __m256 quarter(const float *p) { return _mm256_loadu_ps(p + 8 * Q0); }
template <int Q0>
inline __m256 quarter(const uint16_t *p) {  // the interleaved bfloat16 panel row: outputs 0-15 shifted, 16-31 masked
    const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 * (Q0 & 1)));
    return Q0 < 2 ? _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
                  : _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

// G rows (x + g * K) by quarters Q0..Q0+Q-1 of the panel at wp, k from k0 to k1, continuing the sums in acc (G, PANEL).
template <int G, int Q, int Q0, int PF, typename W>
inline void part(const float *x, int64_t K, const W *wp, int64_t k0, int64_t k1, float *acc) {
    __m256 a[G][Q];
    for (int g = 0; g < G; g++)
        for (int q = 0; q < Q; q++) a[g][q] = _mm256_loadu_ps(acc + g * PANEL + 8 * (Q0 + q));
    constexpr int64_t AHEAD = PF == 1 ? PREFETCH_K : KC;
    for (int64_t k = k0; k < k1; k++) {
        const W *row = wp + k * PANEL;
        if (PF) {  // 1: the chunk's first block reads from memory, PREFETCH_K ahead; 2: the next chunk's rows (past
                   // the weight's end at its last chunk: a prefetch never faults)
            _mm_prefetch((const char *)(row + AHEAD * PANEL), _MM_HINT_T0);
            if (sizeof(W) == 4) _mm_prefetch((const char *)(row + AHEAD * PANEL + 16), _MM_HINT_T0);
        }
        __m256 wv[Q];
        wv[0] = quarter<Q0>(row);
        if (Q > 1) wv[1] = quarter<Q0 + 1>(row);
        if (Q > 2) wv[2] = quarter<Q0 + 2>(row);
        if (Q > 3) wv[3] = quarter<Q0 + 3>(row);
        for (int g = 0; g < G; g++) {
            const __m256 xv = _mm256_broadcast_ss(x + g * K + k);
            for (int q = 0; q < Q; q++) a[g][q] = _mm256_fmadd_ps(xv, wv[q], a[g][q]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int q = 0; q < Q; q++) _mm256_storeu_ps(acc + g * PANEL + 8 * (Q0 + q), a[g][q]);
}

// G rows on both halves of the panel, one after the other (G up to 6: 12 sums, 2 weights and 1 input in registers);
// PF: this is the chunk's first block: its first part prefetches this chunk's rows, its second the next chunk's.
template <int G, bool PF, typename W>
inline void halves(const float *x, int64_t K, const W *wp, int64_t k0, int64_t k1, float *acc) {
    part<G, 2, 0, PF ? 1 : 0>(x, K, wp, k0, k1, acc);
    part<G, 2, 2, PF ? 2 : 0>(x, K, wp, k0, k1, acc);
}

template <int R, typename W>
void panels_avx2(const float *x, const W *w, float *out, int64_t K, int64_t N, int64_t p0, int64_t p1) {
    alignas(32) float acc[R * PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const W *wp = w + p * K * PANEL;
        for (int i = 0; i < R * PANEL; i++) acc[i] = 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t k1 = k0 + KC < K ? k0 + KC : K;
            if constexpr (R <= 6) {
                halves<R, true>(x, K, wp, k0, k1, acc);
            } else {  // two groups of rows: 4, then the rest
                halves<4, true>(x, K, wp, k0, k1, acc);
                halves<R - 4, false>(x + 4 * K, K, wp, k0, k1, acc + 4 * PANEL);
            }
        }
        const int64_t j = p * PANEL, left = N - j < PANEL ? N - j : PANEL;  // the last panel's padding not stored
        for (int r = 0; r < R; r++)
            for (int64_t q = 0; q < left; q++) out[r * N + j + q] = acc[r * PANEL + q];
    }
}
#endif

template <typename W>
void linear_packed(const float *x, const W *w, float *out, int64_t R, int64_t K, int64_t N, int threads) {
    if (N * K < PARALLEL_MIN) threads = 1;
    const int64_t P = (N + PANEL - 1) / PANEL;
    const int64_t per = ((P + threads - 1) / threads + 1) / 2 * 2;
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t p0 = t * per, p1 = p0 + per < P ? p0 + per : P;
        if (p0 >= p1) continue;
#if !SPEED_AVX512
        // Measured at Ouro-1.4B's widths on an AMD EPYC with AVX2 (2 threads): the blocks below (two panels, their
        // sums spilling to the L1 cache) stream float32 at 1-5 rows and bfloat16 at 1-2 rows faster than the
        // chunked blocks (1 row: 35 against 25 GB/s), which win beyond (bfloat16 4-6 rows: 19-21 against 10-15; 3
        // rows, 2026-12-07 on Zen 3: 27-30 against 21 GB/s, and a whole pass of 3 rows had cost more than one of 4).
        if (R >= (sizeof(W) == 4 ? 6 : 3)) {
            switch (R) {
                case 3: panels_avx2<3>(x, w, out, K, N, p0, p1); break;
                case 4: panels_avx2<4>(x, w, out, K, N, p0, p1); break;
                case 5: panels_avx2<5>(x, w, out, K, N, p0, p1); break;
                case 6: panels_avx2<6>(x, w, out, K, N, p0, p1); break;
                case 7: panels_avx2<7>(x, w, out, K, N, p0, p1); break;
                case 8: panels_avx2<8>(x, w, out, K, N, p0, p1); break;
            }
            continue;
        }
#endif
        switch (R) {  // two panels a block up to 4 rows (more chains in flight), one beyond (registers)
            case 1: panels<1, 2>(x, w, out, K, N, p0, p1); break;
            case 2: panels<2, 2>(x, w, out, K, N, p0, p1); break;
            case 3: panels<3, 2>(x, w, out, K, N, p0, p1); break;
            case 4: panels<4, 2>(x, w, out, K, N, p0, p1); break;
            case 5: panels<5, 2>(x, w, out, K, N, p0, p1); break;
            case 6: panels<6, 2>(x, w, out, K, N, p0, p1); break;
            case 7: panels<7, 1>(x, w, out, K, N, p0, p1); break;
            case 8: panels<8, 1>(x, w, out, K, N, p0, p1); break;
        }
    }
}

// Attention: one query per row against the keys/values of its positions 0..len[r]-1, read in place from the
// paged cache (speed.engine.cache.KVCache): off[r, p] is the element offset of position p's key (and value) for
// kv head 0 in the pool (>= 0; kv head g at + g * pool_hs) or, encoded as -(1 + o), in the side entries (kv head g
// at + g * side_hs). Query head h reads kv head h / group. Each (row, head) is computed by one thread in one fixed
// order: scores q.k (16-lane partial sums over d in order, then vsum), their max, exp(s - max)
// (libm's expf), the total summed over positions in order, the values mixed over positions in order, divided by
// the total. So a row's result depends only on its own query and positions: not on its company, the other rows'
// lengths, the thread count or what the pool holds beyond its positions. q is pre-scaled by the caller.
void attend_one(const float *q, const float *kp, const float *vp, const float *ks, const float *vs, const int64_t *off,
                int64_t len, int64_t D, int64_t kv_head, int64_t pool_hs, int64_t side_hs, float *score, float *acc,
                float *out) {
    const int64_t dv = D & ~int64_t(15), tail = D - dv;
    float top = -INFINITY;
    for (int64_t p = 0; p < len; p++) {
        const int64_t o = off[p];
        const float *k = o >= 0 ? kp + o + kv_head * pool_hs : ks + (-o - 1) + kv_head * side_hs;
        V a = vzero();
        for (int64_t d = 0; d < dv; d += 16) a = vfmadd(vload(q + d), vload(k + d), a);
        if (tail) a = vfmadd(vload_n(tail, q + dv), vload_n(tail, k + dv), a);
        score[p] = vsum(a);
        top = score[p] > top ? score[p] : top;
    }
    float total = 0.0f;
    for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
    for (int64_t p = 0; p < len; p++) {
        const float w = expf(score[p] - top);
        total += w;
        const int64_t o = off[p];
        const float *v = o >= 0 ? vp + o + kv_head * pool_hs : vs + (-o - 1) + kv_head * side_hs;
        const V wv = vset1(w);
        for (int64_t d = 0; d < dv; d += 16) vstore(acc + d, vfmadd(wv, vload(v + d), vload(acc + d)));
        if (tail) vstore_n(tail, acc + dv, vfmadd(wv, vload_n(tail, v + dv), vload_n(tail, acc + dv)));
    }
    for (int64_t d = 0; d < D; d++) out[d] = acc[d] / total;
}

void attend(const float *q, const float *kp, const float *vp, const float *ks, const float *vs, const int64_t *off,
            const int64_t *len, int64_t R, int64_t H, int64_t D, int64_t L, int64_t pool_hs, int64_t side_hs,
            int64_t group, float *out, int threads) {
    int64_t work = 0;
    for (int64_t r = 0; r < R; r++) work += len[r];
    if (work * H * D < (int64_t(1) << 15)) threads = 1;  // small: a second thread costs more than it saves
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<float> score(L > 0 ? L : 1), acc(D);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < R * H; i++) {
            const int64_t r = i / H, h = i % H;
            attend_one(q + i * D, kp, vp, ks, vs, off + r * L, len[r], D, h / group, pool_hs, side_hs, score.data(),
                       acc.data(), out + i * D);
        }
    }
}

// RMS norm of each row: out = x / sqrt(mean(x^2) + eps) * w, the squares summed in 16-lane partial sums over
// the row in order (masked tail last), then vsum: each row alone, in one fixed order.
void rms_norm(const float *x, const float *w, float *out, int64_t R, int64_t D, float eps) {
    const int64_t dv = D & ~int64_t(15), tail = D - dv;
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * D;
        V a = vzero();
        for (int64_t d = 0; d < dv; d += 16) {
            const V v = vload(xr + d);
            a = vfmadd(v, v, a);
        }
        if (tail) {
            const V v = vload_n(tail, xr + dv);
            a = vfmadd(v, v, a);
        }
        const float scale = 1.0f / sqrtf(vsum(a) / (float)D + eps);
        const V sv = vset1(scale);
        float *o = out + r * D;
        for (int64_t d = 0; d < dv; d += 16)
            vstore(o + d, vmul(vmul(vload(xr + d), sv), vload(w + d)));
        for (int64_t d = dv; d < D; d++) o[d] = xr[d] * scale * w[d];
    }
}

// SwiGLU's gate: out[r, j] = silu(g) * u with g = x[r, j], u = x[r, F + j] (x: (R, 2F)), silu(g) = g / (1 + exp(-g)).
void swiglu(const float *x, float *out, int64_t R, int64_t F) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < F; j++) {
            const float g = x[r * 2 * F + j];
            out[r * F + j] = g / (1.0f + expf(-g)) * x[r * 2 * F + F + j];
        }
}

// Rotary positions of R rows' heads: x (R, heads, D) with rows row_stride apart (q or k inside a fused q;k;v row),
// cos and sin (R, D), out (R, heads, D). Halves (Llama, Ouro): dimension i pairs with i + D/2; pairs (Huginn): 2i
// with 2i + 1. Each output is x * cos + turned(x) * sin with the two products rounded apart, then their sum: the
// operations of speed.models.lm_blocks.rotate and rotate_pairs in float32, bit for bit (no fused multiply-add).
__attribute__((optimize("fp-contract=off"))) void rope(const float *x, int64_t row_stride, const float *cos,
                                                        const float *sin, float *out, int64_t R, int64_t heads,
                                                        int64_t D, int pairs) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < R; r++) {
        const float *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < heads; h++) {
            const float *v = x + r * row_stride + h * D;
            float *o = out + (r * heads + h) * D;
            for (int64_t i = 0; i < D; i++) {
                float turned;
                if (pairs)
                    turned = (i & 1) ? v[i - 1] : -v[i + 1];
                else
                    turned = i < half ? -v[i + half] : v[i - half];
                const float a = v[i] * c[i];
                const float b = turned * s[i];
                o[i] = a + b;
            }
        }
    }
}


// One Llama block of a looped LM on decode rows, every step on the kernels above in the order the Python path
// (speed.models.lm_blocks.Block.decode) runs them, so each output is bit for bit that path's; no Python between the
// steps (and none of its memory traffic between the weight streams). Ints a[] and floats f[] as named in
// speed.engine.native.lm_block. The rows' keys/values go to their own positions' places (off[r, len[r] - 1]) before
// the attention reads them; the cache's bookkeeping (lengths, blocks) is the caller's.
template <typename W>
void lm_block(const int64_t *a, const float *f) {
    const float *x = (const float *)a[0];
    float *out = (float *)a[1];
    const int64_t R = a[2], d = a[3], H = a[4], K = a[5], D = a[6], F = a[7];
    const float *attn_norm = (const float *)a[8], *attn_out_norm = (const float *)a[9];
    const float *mlp_norm = (const float *)a[10], *mlp_out_norm = (const float *)a[11];
    const bool norm_sum = a[12] != 0;
    const W *wqkv = (const W *)a[13], *wo = (const W *)a[14], *wi = (const W *)a[15], *wdown = (const W *)a[16];
    const float *q_bias = (const float *)a[17], *k_bias = (const float *)a[18];
    const float *cos = (const float *)a[19], *sin = (const float *)a[20];
    const int pairs = (int)a[21];
    float *kp = (float *)a[22], *vp = (float *)a[23];
    const int64_t *off = (const int64_t *)a[24], *len = (const int64_t *)a[25];
    const int64_t L = a[26], pool_hs = a[27];
    const int threads = (int)a[28];
    const float eps_attn = f[0], eps_attn_out = f[1], eps_mlp = f[2], eps_mlp_out = f[3], q_scale = f[4];
    const int64_t W3 = (H + 2 * K) * D;
    // scratch kept per thread and grown, never shrunk: no allocation (nor page faults) a call once warm
    static thread_local std::vector<float> h, qkv, qb, kb, q, k, y, o, x1, gu, s;
    for (auto [v, n] : {std::pair{&h, R * d}, {&qkv, R * W3}, {&q, R * H * D}, {&k, R * K * D}, {&y, R * H * D},
                        {&o, R * d}, {&x1, R * d}, {&gu, R * 2 * F}, {&s, R * F}})
        if ((int64_t)v->size() < n) v->resize(n);
    // attention: norm, q;k;v, bias, rotation, the rows' keys/values written, attention, output projection
    rms_norm(x, attn_norm, h.data(), R, d, eps_attn);
    linear_packed(h.data(), wqkv, qkv.data(), R, d, W3, threads);
    const float *qsrc = qkv.data(), *ksrc = qkv.data() + H * D;
    int64_t qstride = W3, kstride = W3;
    if (q_bias) {
        if ((int64_t)qb.size() < R * H * D) qb.resize(R * H * D);
        if ((int64_t)kb.size() < R * K * D) kb.resize(R * K * D);
        for (int64_t r = 0; r < R; r++) {
            for (int64_t i = 0; i < H * D; i++) qb[r * H * D + i] = qkv[r * W3 + i] + q_bias[i];
            for (int64_t i = 0; i < K * D; i++) kb[r * K * D + i] = qkv[r * W3 + H * D + i] + k_bias[i];
        }
        qsrc = qb.data(), ksrc = kb.data(), qstride = H * D, kstride = K * D;
    }
    rope(qsrc, qstride, cos, sin, q.data(), R, H, D, pairs);
    rope(ksrc, kstride, cos, sin, k.data(), R, K, D, pairs);
    for (int64_t r = 0; r < R; r++) {
        const int64_t at = off[r * L + len[r] - 1];
        for (int64_t g = 0; g < K; g++) {
            const float *kr = k.data() + (r * K + g) * D, *vr = qkv.data() + r * W3 + (H + K) * D + g * D;
            for (int64_t i = 0; i < D; i++) {
                kp[at + g * pool_hs + i] = kr[i];
                vp[at + g * pool_hs + i] = vr[i];
            }
        }
    }
    for (int64_t i = 0; i < R * H * D; i++) q[i] = q[i] * q_scale;
    attend(q.data(), kp, vp, kp, vp, off, len, R, H, D, L, pool_hs, D, H / K, y.data(), threads);
    linear_packed(y.data(), wo, o.data(), R, H * D, d, threads);
    // x + out_norm(o), or out_norm(x + o) (norm_sum); no out norm: x + o
    auto residual = [&](const float *base, float *sub, const float *w, float eps, float *dst) {
        if (norm_sum) {
            for (int64_t i = 0; i < R * d; i++) sub[i] = base[i] + sub[i];
            rms_norm(sub, w, dst, R, d, eps);
        } else if (w) {
            rms_norm(sub, w, dst, R, d, eps);
            for (int64_t i = 0; i < R * d; i++) dst[i] = base[i] + dst[i];
        } else {
            for (int64_t i = 0; i < R * d; i++) dst[i] = base[i] + sub[i];
        }
    };
    residual(x, o.data(), attn_out_norm, eps_attn_out, x1.data());
    // feed-forward: norm, [gate; up], silu(gate) * up, down projection, the residual again
    rms_norm(x1.data(), mlp_norm, h.data(), R, d, eps_mlp);
    linear_packed(h.data(), wi, gu.data(), R, d, 2 * F, threads);
    swiglu(gu.data(), s.data(), R, F);
    linear_packed(s.data(), wdown, o.data(), R, F, d, threads);
    residual(x1.data(), o.data(), mlp_out_norm, eps_mlp_out, out);
}
}  // namespace

extern "C" {
void speed_rope_f32(const float *x, int64_t row_stride, const float *cos, const float *sin, float *out, int64_t R,
                    int64_t heads, int64_t D, int pairs) {
    rope(x, row_stride, cos, sin, out, R, heads, D, pairs);
}
int speed_linear_abi() { return 7; }
int speed_vector_bits() { return SPEED_AVX512 ? 512 : 256; }
void speed_lm_block_f32(const int64_t *a, const float *f) { lm_block<float>(a, f); }
void speed_lm_block_bf16(const int64_t *a, const float *f) { lm_block<uint16_t>(a, f); }
int speed_linear_panel() { return PANEL; }
void speed_rms_norm_f32(const float *x, const float *w, float *out, int64_t R, int64_t D, float eps) {
    rms_norm(x, w, out, R, D, eps);
}
void speed_swiglu_f32(const float *x, float *out, int64_t R, int64_t F) { swiglu(x, out, R, F); }
void speed_attend_f32(const float *q, const float *kp, const float *vp, const float *ks, const float *vs,
                      const int64_t *off, const int64_t *len, int64_t R, int64_t H, int64_t D, int64_t L,
                      int64_t pool_hs, int64_t side_hs, int64_t group, float *out, int threads) {
    attend(q, kp, vp, ks, vs, off, len, R, H, D, L, pool_hs, side_hs, group, out, threads);
}
void speed_linear_f32(const float *x, const float *w, float *out, int64_t R, int64_t K, int64_t N, int threads) {
    linear(x, w, out, R, K, N, threads);
}
void speed_linear_bf16(const float *x, const uint16_t *w, float *out, int64_t R, int64_t K, int64_t N, int threads) {
    linear(x, w, out, R, K, N, threads);
}
void speed_linear_packed_f32(const float *x, const float *w, float *out, int64_t R, int64_t K, int64_t N,
                              int threads) {
    linear_packed(x, w, out, R, K, N, threads);
}
void speed_linear_packed_bf16(const float *x, const uint16_t *w, float *out, int64_t R, int64_t K, int64_t N,
                               int threads) {
    linear_packed(x, w, out, R, K, N, threads);
}
}
