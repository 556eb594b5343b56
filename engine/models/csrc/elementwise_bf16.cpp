// Fused bfloat16 elementwise kernels for the decoder: one pass each where eager torch makes 3-8.
//
// Each reproduces transformers' eager bfloat16 arithmetic (compute in float32, round to bfloat16
// after every op that torch rounds after), so results match eager torch except where a float32
// reduction order or exp() differs by an ulp. Shapes are row-major with explicit row strides.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pdserve::bf;

inline uint16_t to_bf(float x) {  // round to nearest even, NaN kept
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf(float x) { return bf(to_bf(x)); }

using pdserve::kParallelElements;

#if defined(__AVX512F__)
// 16 bfloat16 <-> float32 lanes; `mask` selects the lanes a row's tail has.
inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
using pdserve::tail_mask;
#if defined(__AVX512BF16__)
// One instruction (vcvtneps2bf16) rounds to nearest even as to_bf does, except that a float32 denormal
// becomes a signed zero and a NaN keeps its sign: values a decoder's activations never hold.
inline __m256i to_bf16_lanes(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
inline __m256i to_bf16_lanes(__m512 x) {  // to_bf's rounding in 32-bit lanes, narrowed
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
}
#endif
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 round_bf16(__m512 x) { return widen_bf16(to_bf16_lanes(x)); }
inline void store_bf16(uint16_t* p, __m512 x, __mmask16 mask) { _mm256_mask_storeu_epi16(p, mask, to_bf16_lanes(x)); }
// 1 / d within 2 float32 ulp: vrcp14ps and one Newton-Raphson step, in place of vdivps (a 16-lane
// divide issues once every 16 cycles or so, a cycle an element of silu).
inline __m512 reciprocal(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}
#endif

}  // namespace

extern "C" {

// residual/delta/out: [rows, hidden], weight: [hidden]. If delta is non-null: residual += delta
// (bf16 add) first. Then out = weight * bf16(r * rsqrt(mean(r^2) + eps)), as LlamaRMSNorm.
void pdserve_add_rms_norm_bf16(uint16_t* out, uint16_t* residual, const uint16_t* delta, const uint16_t* weight,
                               int64_t rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= kParallelElements)
  for (int64_t t = 0; t < rows; ++t) {
    uint16_t* r = residual + t * hidden;
    float sum = 0.f;
#if defined(__AVX512F__)
    __m512 sq = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = tail_mask(hidden - i);
      __m512 v = load_bf16(r + i, m);
      if (delta != nullptr) {
        v = round_bf16(_mm512_add_ps(v, load_bf16(delta + t * hidden + i, m)));
        store_bf16(r + i, v, m);
      }
      sq = _mm512_fmadd_ps(v, v, sq);  // masked-off lanes load as 0
    }
    sum = _mm512_reduce_add_ps(sq);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    uint16_t* o = out + t * hidden;
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = tail_mask(hidden - i);
      store_bf16(o + i, _mm512_mul_ps(load_bf16(weight + i, m), round_bf16(_mm512_mul_ps(load_bf16(r + i, m), vinv))), m);
    }
#else
    if (delta != nullptr) {
      const uint16_t* d = delta + t * hidden;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = round_bf(bf(r[i]) + bf(d[i]));
        r[i] = to_bf(v);
        sum += v * v;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += bf(r[i]) * bf(r[i]);
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    uint16_t* o = out + t * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) o[i] = to_bf(bf(weight[i]) * round_bf(bf(r[i]) * inv));
#endif
  }
}

// gate_up: [rows, 2 * inter] (gate | up), out: [rows, inter] = bf16(bf16(silu(gate)) * up).
void pdserve_silu_mul_bf16(uint16_t* out, const uint16_t* gate_up, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= kParallelElements)
  for (int64_t t = 0; t < rows; ++t) {
    const uint16_t* g = gate_up + t * 2 * inter;
    const uint16_t* u = g + inter;
    uint16_t* o = out + t * inter;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < inter; i += 16) {
      const __mmask16 m = inter - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (inter - i)) - 1);
      const __m512 x = load_bf16(g + i, m);
      const __m512 silu = _mm512_mul_ps(x, reciprocal(_mm512_add_ps(_mm512_set1_ps(1.f), pdserve::exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
      store_bf16(o + i, _mm512_mul_ps(round_bf16(silu), load_bf16(u + i, m)), m);
    }
#else
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float x = bf(g[i]);
      o[i] = to_bf(round_bf(x / (1.f + pdserve::exp_approx(-x))) * bf(u[i]));
    }
#endif
  }
}

// In place on x: [rows, heads, head_dim] with row stride `row_stride` elements; cos/sin: [rows,
// head_dim] bf16. x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) =
// cat(-x2, x1) (RoFormer, Su et al. 2021, as transformers applies it).
void pdserve_rope_bf16(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t rows, int64_t heads,
                       int64_t head_dim, int64_t row_stride, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= kParallelElements)
  for (int64_t t = 0; t < rows; ++t) {
    const uint16_t* c = cos + t * head_dim;
    const uint16_t* s = sin + t * head_dim;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < half; i += 16) {  // cos and sin loaded once for every head
      const __mmask16 m = tail_mask(half - i);
      const __m512 c_lo = load_bf16(c + i, m), c_hi = load_bf16(c + i + half, m);
      const __m512 s_lo = load_bf16(s + i, m), s_hi = load_bf16(s + i + half, m);
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* p = x + t * row_stride + h * head_dim;
        const __m512 a = load_bf16(p + i, m), b = load_bf16(p + i + half, m);
        const __m512 lo = _mm512_sub_ps(round_bf16(_mm512_mul_ps(a, c_lo)), round_bf16(_mm512_mul_ps(b, s_lo)));
        const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, c_hi)), round_bf16(_mm512_mul_ps(a, s_hi)));
        store_bf16(p + i, lo, m);
        store_bf16(p + i + half, hi, m);
      }
    }
#else
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* p = x + t * row_stride + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = bf(p[i]), b = bf(p[i + half]);
        const float lo = round_bf(round_bf(a * bf(c[i])) + round_bf(-b * bf(s[i])));
        const float hi = round_bf(round_bf(b * bf(c[i + half])) + round_bf(a * bf(s[i + half])));
        p[i] = to_bf(lo);
        p[i + half] = to_bf(hi);
      }
    }
#endif
  }
}

// Gemma's RMSNorm (transformers' Gemma2RMSNorm / Gemma3RMSNorm): out = bf16(x * rsqrt(mean(x^2) + eps)
// * weight1), all in float32 and rounded once, weight1 = 1 + w in float32. Row t holds `heads` vectors
// of `dim` (1 for a layer's norm; the heads of q and k for Gemma 3's q/k norm, head s normalized with
// weight1[s * dim ..]), at x + t * x_stride and out + t * out_stride.
void pdserve_gemma_rms_norm_bf16(uint16_t* out, int64_t out_stride, const uint16_t* x, int64_t x_stride,
                                 const float* weight1, int64_t rows, int64_t heads, int64_t dim, float eps,
                                 int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * heads * dim >= kParallelElements)
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* xr = x + t * x_stride + h * dim;
      uint16_t* o = out + t * out_stride + h * dim;
      const float* w = weight1 + h * dim;
#if defined(__AVX512F__)
      __m512 sq = _mm512_setzero_ps();
      for (int64_t i = 0; i < dim; i += 16) {
        const __m512 v = load_bf16(xr + i, tail_mask(dim - i));
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const __m512 vinv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(dim) + eps));
      for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = tail_mask(dim - i);
        const __m512 v = _mm512_mul_ps(load_bf16(xr + i, m), vinv);
        store_bf16(o + i, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)), m);
      }
#else
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += bf(xr[i]) * bf(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) o[i] = to_bf(bf(xr[i]) * inv * w[i]);
#endif
    }
  }
}

}  // extern "C"
