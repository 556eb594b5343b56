// Fused bfloat16 elementwise kernels for the decoder: one pass each where eager torch makes 3-8.
//
// Each reproduces transformers' eager bfloat16 arithmetic (compute in float32, round to bfloat16
// after every op that torch rounds after), so results match eager torch except where a float32
// reduction order or exp() differs by an ulp. Shapes are row-major with explicit row strides.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace {

inline float bf(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf(float x) {  // round to nearest even, NaN kept
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf(float x) { return bf(to_bf(x)); }

constexpr int64_t kParallelElements = 1 << 15;  // below this one thread beats waking the others

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
  }
}

// gate_up: [rows, 2 * inter] (gate | up), out: [rows, inter] = bf16(bf16(silu(gate)) * up).
void pdserve_silu_mul_bf16(uint16_t* out, const uint16_t* gate_up, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= kParallelElements)
  for (int64_t t = 0; t < rows; ++t) {
    const uint16_t* g = gate_up + t * 2 * inter;
    const uint16_t* u = g + inter;
    uint16_t* o = out + t * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float x = bf(g[i]);
      o[i] = to_bf(round_bf(x / (1.f + pdserve::exp_approx(-x))) * bf(u[i]));
    }
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
  }
}

}  // extern "C"
