// int8 weights times int8 activations for decode-sized calls (a few rows), with AVX512-VNNI.
//
//   y[m, n] = sw[n] * sum_b sx[m, b] * sum_{k in block b} q[n, k] * xq[m, k]
//
// q [N, K] int8 is the weight with one scale sw[n] per output channel (engine/models/quant.py); each
// row of x [M, K] bfloat16 is quantized here, per block of 16 inputs, to xq = round(x / sx) with
// sx[m, b] = max |x| over the block / 127 (as llama.cpp quantizes activations, in smaller blocks),
// so the products are int8 x int8 summed exactly in int32 by vpdpbusd, 64 per instruction; each of
// its 16 lanes sums 4 inputs of one block, so the blocks' scales apply lane by lane at no extra cost. vpdpbusd takes
// one operand unsigned: the weight bytes are flipped to q + 128 in register (xor 0x80), which adds
// 128 * sum_k xq[m, k] over each block; that term is taken off once per row of x.
//
// Why: torch's weight-only int8 kernel converts every weight to floating point before its FMA and
// streams weights at 6.2 GB/s on one core here, where a bfloat16 GEMV streams at 9 GB/s
// (docs/measurements.md); this loop costs 4 instructions per 64 weights.
//
// Rows of the output are split over `threads` OpenMP threads. A row of y depends on its own row of
// x only, so the result does not depend on the batch around it. Needs K % 64 == 0.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace {

constexpr int kBlock = 16;  // inputs per activation scale
constexpr int kChunk = 64;  // inputs per vpdpbusd
constexpr int kMaxRows = 8;

inline __m512 load_bf16x16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// One row of x: xq (K bytes); lane scales sx (K / 4 floats: lane i of 64-input chunk b, which sums
// inputs 4i .. 4i + 3 of the chunk, has its 16-input block's scale); returns the correction
// sum over blocks of scale * 128 * sum(xq of the block).
float quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* sx) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  float corr = 0.f;
  for (int64_t i = 0; i < K / kBlock; ++i) {  // 16 inputs: a quarter of a 64-byte chunk
    __m512 v = load_bf16x16(x + i * kBlock);
    float m = _mm512_reduce_max_ps(_mm512_and_ps(v, sign));
    float scale = m / 127.f;
    __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f)));  // nearest even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * kBlock), _mm512_cvtsepi32_epi8(qi));
    for (int lane = 0; lane < 4; ++lane) sx[i * 4 + lane] = scale;
    corr += scale * 128.f * static_cast<float>(_mm512_reduce_add_epi32(qi));
  }
  return corr;
}

}  // namespace

// The most rows of x one call takes (0 where this CPU has no AVX512-VNNI: the caller keeps torch's kernel).
extern "C" int pdserve_int8_linear_max_rows() { return kMaxRows; }

// x [M, K] bfloat16, q [N, K] int8, sw [N] float32 -> y [M, N] bfloat16; M <= kMaxRows, K % 64 == 0.
extern "C" void pdserve_int8_linear_bf16(const uint16_t* x, const int8_t* q, const float* sw, uint16_t* y,
                                         int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t nc = K / kChunk;
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * K / 4), corr(M);
  for (int64_t m = 0; m < M; ++m) corr[m] = quantize_row(x + m * K, K, xq.data() + m * K, sx.data() + m * K / 4);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* qn = q + n * K;
    __m512 acc[kMaxRows];
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      __m512i w = _mm512_xor_si512(_mm512_loadu_si512(qn + c * kChunk), flip);  // q + 128, unsigned
      for (int64_t m = 0; m < M; ++m) {
        __m512i xv = _mm512_loadu_si512(xq.data() + m * K + c * kChunk);
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(sx.data() + m * K / 4 + c * 16), acc[m]);
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = to_bf16((_mm512_reduce_add_ps(acc[m]) - corr[m]) * sw[n]);
  }
}

#else

extern "C" int pdserve_int8_linear_max_rows() { return 0; }
extern "C" void pdserve_int8_linear_bf16(const uint16_t*, const int8_t*, const float*, uint16_t*, int64_t, int64_t,
                                         int64_t, int) {}

#endif
