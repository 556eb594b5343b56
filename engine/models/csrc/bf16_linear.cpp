// bfloat16 weights times bfloat16 activations with AVX512-BF16 (vdpbf16ps: exact products, float32 sums).
//
// y[m, n] = bias[n] + sum_k x[m, k] * w[n, k], accumulated in float32, rounded once to bfloat16.
//
// The 16 lanes of a vector are 16 output channels, as in quant_linear.cpp: vdpbf16ps multiplies each
// lane's pair of weights (inputs 2j, 2j + 1) by the pair of x broadcast to every lane, so no horizontal
// sum is needed and a decode step (one row) streams each weight byte once, in order. The weights are
// packed by engine/models/linear.py in blocks of 16 channels nb:
//
//   packed [N / 16, K / 2, 16, 2] bfloat16: element [nb, j, l, e] = w[16 nb + l, 2 j + e]
//
// Blocks of 16 channels are split over `threads` OpenMP threads; each runs every row of x through its
// block (8 rows a pass, two accumulator chains a row in registers) while the block's weights stay in
// the L1 or L2 cache. A row of y depends on its own row of x only, always summed in the same order, so
// the result does not depend on the batch around it. Needs N % 16 == 0 and K % 2 == 0.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kRowsPerPass = 8;  // rows of x whose accumulators one pass over a block keeps in registers
// Weights asked for this far ahead (elements: 4 KB), so that DRAM reads overlap the arithmetic once
// several rows make the loop compute-bound (lm_head at 8 rows, cold: 5.3 -> 3.4 ms)
constexpr int64_t kPrefetchAhead = 2048;

inline void store_bf16x16(uint16_t* p, __m512 v) {  // round to nearest even (finite values)
  __m512i u = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

inline __m512bh pair(const uint16_t* p) {  // x[k], x[k + 1] in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// Rows m0 .. m0 + M of y for the 16 channels of block nb. Two chains a row (even and odd pairs) hide
// the instruction's latency at one row.
template <int M>
void channel_block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t N, int64_t K,
                   int64_t nb, int64_t m0) {
  const int64_t P = K / 2;
  const uint16_t* wb = w + nb * P * 32;
  const uint16_t* xr = x + m0 * K;
  __m512 acc[M], acc2[M];
  __m512 b0 = _mm512_setzero_ps();
  if (bias != nullptr)
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + nb * 16))), 16));
  for (int m = 0; m < M; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= P; j += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + j * 32 + kPrefetchAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + j * 32 + kPrefetchAhead + 32), _MM_HINT_T0);
    const __m512bh a = (__m512bh)_mm512_loadu_si512(wb + j * 32), b = (__m512bh)_mm512_loadu_si512(wb + j * 32 + 32);
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_dpbf16_ps(acc[m], a, pair(xr + m * K + 2 * j));
      acc2[m] = _mm512_dpbf16_ps(acc2[m], b, pair(xr + m * K + 2 * j + 2));
    }
  }
  if (j < P) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(wb + j * 32);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], a, pair(xr + m * K + 2 * j));
  }
  for (int m = 0; m < M; ++m)
    store_bf16x16(y + (m0 + m) * N + nb * 16, _mm512_add_ps(_mm512_add_ps(acc[m], acc2[m]), b0));
}

}  // namespace

// 1 where this CPU has AVX512-BF16, 0 where not (the caller keeps oneDNN's GEMM).
extern "C" int pdserve_bf16_linear_supported() { return 1; }

// x [M, K] bfloat16 (row stride K), packed as above, bias [N] bfloat16 or null -> y [M, N] bfloat16.
extern "C" void pdserve_bf16_linear(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                                    int64_t M, int64_t N, int64_t K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t nb = 0; nb < N / 16; ++nb) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      switch (std::min<int64_t>(kRowsPerPass, M - m0)) {
        case 1: channel_block<1>(x, packed, bias, y, N, K, nb, m0); break;
        case 2: channel_block<2>(x, packed, bias, y, N, K, nb, m0); break;
        case 3: channel_block<3>(x, packed, bias, y, N, K, nb, m0); break;
        case 4: channel_block<4>(x, packed, bias, y, N, K, nb, m0); break;
        case 5: channel_block<5>(x, packed, bias, y, N, K, nb, m0); break;
        case 6: channel_block<6>(x, packed, bias, y, N, K, nb, m0); break;
        case 7: channel_block<7>(x, packed, bias, y, N, K, nb, m0); break;
        default: channel_block<kRowsPerPass>(x, packed, bias, y, N, K, nb, m0); break;
      }
    }
  }
}

#else

extern "C" int pdserve_bf16_linear_supported() { return 0; }
extern "C" void pdserve_bf16_linear(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                                    int64_t, int) {}

#endif
