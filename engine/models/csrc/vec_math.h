// Branch-free float32 math that GCC vectorizes (std::exp stays scalar without -ffast-math).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {

// Elements of an elementwise call below which one thread beats waking the others.
constexpr int64_t kParallelElements = 1 << 15;

// One bfloat16 (its bits) as float32: exact.
inline float bf(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// e^x within 2 ulp over the float range (Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6
// polynomial for e^r, then scaled by 2^n). x is clamped to [-87.3, 88.3], so e^-inf gives 1e-38,
// not 0: callers only multiply by it.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Where the bfloat16 p . v of paged_attention.cpp and amx_attention.cpp keeps dim d of a head: V rows
// are interleaved two positions at a time with unpacklo/hi_epi16, so each 32 dims are two vectors
// (unpacklo, unpackhi) whose lane 4L + t holds dim 8L + t and 8L + 4 + t.
constexpr int64_t acc_slot(int64_t d) {
  const int64_t r = d % 32, half = (r % 8) / 4;
  return (d / 32) * 32 + half * 16 + (r / 8) * 4 + r % 4;
}

#if defined(__AVX512F__)
// The lanes of 16 that a row's last `left` elements fill (all 16 when left >= 16).
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

// 16 bfloat16 -> float32 lanes (the high half of each 32-bit lane).
inline __m512 load_bf16x16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 float32 -> bfloat16 lanes, rounded to nearest even (finite values).
inline void store_bf16x16(uint16_t* p, __m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

// exp_approx on 16 lanes, the same steps. Written with intrinsics because GCC, vectorizing the
// scalar form inside silu, splits the clamp into cases and divides by the clamped denominator in
// every lane: a denormal quotient per lane, and a microcode assist each (5.7 ns per element).
inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

}  // namespace pdserve
