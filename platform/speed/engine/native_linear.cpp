// Row-invariant decode linear for CPUs with AVX-512: out[r, j] = dot(x[r, :], w[j, :]) for 1..8 rows.
//
// Decoding reads every weight once per group pass whatever the row count, so a pass is bound by memory
// bandwidth: the kernel streams each weight row once for all R rows (R <= 8) and keeps the rows' partial sums in
// registers. Each output's dot product is summed in one fixed order (16-lane partial sums over k in order, masked
// tail last, then _mm512_reduce_add_ps), whatever R, the output blocking or the thread count: threads split the
// outputs, never the reduction. So a row's result never depends on its company, its position or the row count.
// Weights are float32 or bfloat16 (widened to float32 in registers: fp32 accumulation either way).
#include <immintrin.h>
#include <stdint.h>

namespace {

inline __m512 load_w(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load_w(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
inline __m512 load_w_tail(__mmask16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_w_tail(__mmask16 m, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

template <int R, int J, typename W>
void block(const float *x, const W *w, float *out, int64_t K, int64_t N, int64_t j0, int64_t j1) {
    const int64_t kv = K & ~int64_t(15);
    const __mmask16 tail = (__mmask16)((1u << (K - kv)) - 1u);
    int64_t j = j0;
    for (; j + J <= j1; j += J) {
        __m512 acc[R][J];
        for (int r = 0; r < R; r++)
            for (int q = 0; q < J; q++) acc[r][q] = _mm512_setzero_ps();
        const W *w0 = w + j * K;
        for (int64_t k = 0; k < kv; k += 16) {
            __m512 wv[J];
            for (int q = 0; q < J; q++) wv[q] = load_w(w0 + q * K + k);
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_loadu_ps(x + r * K + k);
                for (int q = 0; q < J; q++) acc[r][q] = _mm512_fmadd_ps(xv, wv[q], acc[r][q]);
            }
        }
        if (tail) {
            __m512 wv[J];
            for (int q = 0; q < J; q++) wv[q] = load_w_tail(tail, w0 + q * K + kv);
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_maskz_loadu_ps(tail, x + r * K + kv);
                for (int q = 0; q < J; q++) acc[r][q] = _mm512_fmadd_ps(xv, wv[q], acc[r][q]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int q = 0; q < J; q++) out[r * N + j + q] = _mm512_reduce_add_ps(acc[r][q]);
    }
    if (j < j1) block<R, 1>(x, w, out, K, N, j, j1);
}

// Outputs per block: as many as the 32 vector registers hold beside the rows' sums (R * J + J + 1 <= 32).
template <int R, typename W>
void rows(const float *x, const W *w, float *out, int64_t K, int64_t N, int64_t j0, int64_t j1) {
    constexpr int J = R == 1 ? 8 : (R == 2 ? 8 : (R <= 4 ? 5 : 3));
    block<R, J>(x, w, out, K, N, j0, j1);
}

// Weights below this many elements run on one thread: waking a second costs more than it saves.
constexpr int64_t PARALLEL_MIN = int64_t(1) << 18;

template <typename W>
void linear(const float *x, const W *w, float *out, int64_t R, int64_t K, int64_t N, int threads) {
    if (N * K < PARALLEL_MIN) threads = 1;
    const int64_t per = ((N + threads - 1) / threads + 7) / 8 * 8;
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

}  // namespace

extern "C" {
int speed_linear_abi() { return 1; }
void speed_linear_f32(const float *x, const float *w, float *out, int64_t R, int64_t K, int64_t N, int threads) {
    linear(x, w, out, R, K, N, threads);
}
void speed_linear_bf16(const float *x, const uint16_t *w, float *out, int64_t R, int64_t K, int64_t N, int threads) {
    linear(x, w, out, R, K, N, threads);
}
}
