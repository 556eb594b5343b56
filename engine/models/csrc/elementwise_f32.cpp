// Fused float32 elementwise kernels for the decoder: one pass each where eager torch makes 3-8
// (RMSNorm alone: pow, mean, add, rsqrt, mul, mul, each a pass over the rows and a new tensor).
//
// The arithmetic is transformers' eager float32 arithmetic op for op: the residual add and RoPE give
// the same bits (each product rounded before the sum, as torch's separate mul and add kernels round;
// the multiplies use embedded rounding so that the compiler cannot fuse them into an FMA), RMSNorm
// differs only where the rounding of its sum of squares does (an ulp of the scale), SiLU where exp()
// does (exp_approx16, 2 ulp, against torch's SLEEF expf). Shapes are row-major with explicit row
// strides where the caller passes views.
#include <cmath>
#include <cstdint>

#include "vec_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pdserve::kParallelElements;

#if defined(__AVX512F__)
using pdserve::tail_mask;
// a * b and a + b rounded once each, never fused into an FMA by the compiler
inline __m512 mul_rn(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m512 add_rn(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m512 sub_rn(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#endif

}  // namespace

extern "C" {

// residual/delta/out: [rows, hidden] float32, weight: [hidden]. If delta is non-null: residual +=
// delta first. Then out = weight * (r * (1 / sqrt(sum(r^2) / hidden + eps))), as LlamaRMSNorm; the
// squares (rounded to float32, as torch's pow) are summed in float64, so the sum is within half an
// ulp of the exact one, as close as torch's cascade sum or closer.
__attribute__((optimize("fp-contract=off"))) void pdserve_add_rms_norm_f32(float* out, float* residual,
                                                                          const float* delta, const float* weight,
                                                                          int64_t rows, int64_t hidden, float eps,
                                                                          int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= kParallelElements)
  for (int64_t t = 0; t < rows; ++t) {
    float* r = residual + t * hidden;
    float* o = out + t * hidden;
#if defined(__AVX512F__)
    __m512d sq_lo = _mm512_setzero_pd(), sq_hi = _mm512_setzero_pd();
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = tail_mask(hidden - i);
      __m512 v = _mm512_maskz_loadu_ps(m, r + i);
      if (delta != nullptr) {
        v = add_rn(v, _mm512_maskz_loadu_ps(m, delta + t * hidden + i));
        _mm512_mask_storeu_ps(r + i, m, v);
      }
      const __m512 sq = mul_rn(v, v);  // masked-off lanes load as 0
      sq_lo = _mm512_add_pd(sq_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
      sq_hi = _mm512_add_pd(sq_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1))));
    }
    const float sum = static_cast<float>(_mm512_reduce_add_pd(_mm512_add_pd(sq_lo, sq_hi)));
    const __m512 vinv = _mm512_set1_ps(1.f / std::sqrt(sum / static_cast<float>(hidden) + eps));
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = tail_mask(hidden - i);
      const __m512 x = mul_rn(_mm512_maskz_loadu_ps(m, r + i), vinv);
      _mm512_mask_storeu_ps(o + i, m, mul_rn(_mm512_maskz_loadu_ps(m, weight + i), x));
    }
#else
    double sum = 0.0;
    for (int64_t i = 0; i < hidden; ++i) {
      if (delta != nullptr) r[i] = r[i] + delta[t * hidden + i];
      const float sq = r[i] * r[i];
      sum += sq;
    }
    const float inv = 1.f / std::sqrt(static_cast<float>(sum) / static_cast<float>(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i) o[i] = weight[i] * (r[i] * inv);
#endif
  }
}

// gate_up: [rows, 2 * inter] float32 (gate | up), out: [rows, inter] = silu(gate) * up, silu(x) =
// x / (1 + e^-x) (Elfwing et al. 2018), divided exactly.
void pdserve_silu_mul_f32(float* out, const float* gate_up, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= kParallelElements)
  for (int64_t t = 0; t < rows; ++t) {
    const float* g = gate_up + t * 2 * inter;
    const float* u = g + inter;
    float* o = out + t * inter;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < inter; i += 16) {
      const __mmask16 m = tail_mask(inter - i);
      const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
      const __m512 e = pdserve::exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), x));
      const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
      _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
    }
#else
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + pdserve::exp_approx(-g[i])) * u[i];
#endif
  }
}

// In place on x: [rows, heads, head_dim] float32 with row stride `row_stride` elements; cos/sin:
// [rows, head_dim]. x = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) (RoFormer, Su
// et al. 2021, as transformers applies it), each product rounded before the sum.
__attribute__((optimize("fp-contract=off"))) void pdserve_rope_f32(float* x, const float* cos, const float* sin,
                                                                  int64_t rows, int64_t heads, int64_t head_dim,
                                                                  int64_t row_stride, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= kParallelElements)
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cos + t * head_dim;
    const float* s = sin + t * head_dim;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < half; i += 16) {  // cos and sin loaded once for every head
      const __mmask16 m = tail_mask(half - i);
      const __m512 c_lo = _mm512_maskz_loadu_ps(m, c + i), c_hi = _mm512_maskz_loadu_ps(m, c + i + half);
      const __m512 s_lo = _mm512_maskz_loadu_ps(m, s + i), s_hi = _mm512_maskz_loadu_ps(m, s + i + half);
      for (int64_t h = 0; h < heads; ++h) {
        float* p = x + t * row_stride + h * head_dim;
        const __m512 a = _mm512_maskz_loadu_ps(m, p + i), b = _mm512_maskz_loadu_ps(m, p + i + half);
        _mm512_mask_storeu_ps(p + i, m, sub_rn(mul_rn(a, c_lo), mul_rn(b, s_lo)));
        _mm512_mask_storeu_ps(p + i + half, m, add_rn(mul_rn(b, c_hi), mul_rn(a, s_hi)));
      }
    }
#else
    for (int64_t h = 0; h < heads; ++h) {
      float* p = x + t * row_stride + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = p[i], b = p[i + half];
        p[i] = a * c[i] - b * s[i];
        p[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
#endif
  }
}

}  // extern "C"
