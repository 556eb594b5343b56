// Dense linears for AVX-512 CPUs: bfloat16 weights times bfloat16 activations with AVX512-BF16
// (vdpbf16ps: exact products, float32 sums), and float32 times float32 with FMA.
//
// y[m, n] = bias[n] + sum_k x[m, k] * w[n, k], accumulated in float32 (bfloat16: rounded once at the end).
//
// The 16 lanes of a vector are 16 output channels, as in quant_linear.cpp: each instruction multiplies
// each lane's weights of one step (bfloat16: the pair of inputs 2j, 2j + 1; float32: input j) by that
// step's x broadcast to every lane, so no horizontal sum is needed and a decode step (one row) streams
// each weight byte once, in order. The weights are packed by engine/models/kernels.py in blocks of 16
// channels nb, E inputs a step (E = 2 for bfloat16, 1 for float32):
//
//   packed [N / 16, K / E, 16, E]: element [nb, j, l, e] = w[16 nb + l, E j + e]
//
// Blocks of 16 channels are split over `threads` OpenMP threads; each runs every row of x through its
// block (8 rows a pass, two accumulator chains a row in registers) while the block's weights stay in
// the L1 or L2 cache. A row of y depends on its own row of x only, always summed in the same order, so
// the result does not depend on the batch around it. Needs N % 16 == 0 and K % E == 0.
//
// The bfloat16 layout is also the one an AMX B tile reads: on AMX CPUs amx_linear.cpp runs every call
// over the same packed weight.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kRowsPerPass = 8;  // rows of x whose accumulators one pass over a block keeps in registers
// Weights asked for this far ahead (4 KB), so that DRAM reads overlap the arithmetic once several rows
// make the loop compute-bound (bfloat16 lm_head at 8 rows, DRAM-cold: 5.3 -> 3.4 ms)
constexpr int64_t kPrefetchBytes = 4096;

// One element type's loads, multiply-adds and stores.
struct F32 {
  using T = float;
  static constexpr int64_t E = 1;
  static __m512 bias(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 fma(__m512 acc, const float* w, const float* x) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_set1_ps(*x), acc);
  }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
struct Bf16 {
  using T = uint16_t;
  static constexpr int64_t E = 2;
  static __m512 bias(const uint16_t* p) { return pdserve::load_bf16x16(p); }
  static __m512 fma(__m512 acc, const uint16_t* w, const uint16_t* x) {  // x[k], x[k + 1] in every lane
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_set1_epi32(v));
  }
  static void store(uint16_t* p, __m512 v) { pdserve::store_bf16x16(p, v); }
};
#endif

// Rows m0 .. m0 + M of y for the 16 channels of block nb. Two chains a row (even and odd steps) hide
// the instruction's latency at one row. Where `later` is set, the pass also asks for `share` bytes
// from there into L2, spread over its steps: another block's weights, read while this pass computes.
template <typename V, int M>
void channel_block(const typename V::T* x, const typename V::T* w, const typename V::T* bias, typename V::T* y,
                   int64_t N, int64_t K, int64_t nb, int64_t m0, const char* later, int64_t share) {
  using T = typename V::T;
  constexpr int64_t kStep = 16 * V::E;  // elements of w per step
  constexpr int64_t kAhead = kPrefetchBytes / sizeof(T);
  const int64_t P = K / V::E;
  const T* wb = w + nb * P * kStep;
  const T* xr = x + m0 * K;
  __m512 acc[M], acc2[M];
  for (int m = 0; m < M; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= P; j += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + j * kStep + kAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + (j + 1) * kStep + kAhead), _MM_HINT_T0);
    if (later != nullptr) {
      const char* at = later + j * share / P;
      _mm_prefetch(at, _MM_HINT_T1);
      _mm_prefetch(at + 64, _MM_HINT_T1);
    }
    for (int m = 0; m < M; ++m) {
      acc[m] = V::fma(acc[m], wb + j * kStep, xr + m * K + V::E * j);
      acc2[m] = V::fma(acc2[m], wb + (j + 1) * kStep, xr + m * K + V::E * (j + 1));
    }
  }
  if (j < P)
    for (int m = 0; m < M; ++m) acc[m] = V::fma(acc[m], wb + j * kStep, xr + m * K + V::E * j);
  const __m512 b0 = bias != nullptr ? V::bias(bias + nb * 16) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) V::store(y + (m0 + m) * N + nb * 16, _mm512_add_ps(_mm512_add_ps(acc[m], acc2[m]), b0));
}

// With more than one pass over a block, the passes after the first (its weights then in L2) ask for
// the next block's weights, a share each, so that DRAM reads spread over all the arithmetic instead of
// holding up each block's first pass.
template <typename V>
void linear(const typename V::T* x, const typename V::T* packed, const typename V::T* bias, typename V::T* y,
            int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t passes = (M + kRowsPerPass - 1) / kRowsPerPass;
  const int64_t block_bytes = K * 16 * static_cast<int64_t>(sizeof(typename V::T));
  const int64_t share = passes > 1 ? block_bytes / (passes - 1) : 0;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t nb = 0; nb < N / 16; ++nb) {
    for (int64_t m0 = 0, pass = 0; m0 < M; m0 += kRowsPerPass, ++pass) {
      const char* later = pass > 0 && nb + 1 < N / 16
                              ? reinterpret_cast<const char*>(packed) + (nb + 1) * block_bytes + (pass - 1) * share
                              : nullptr;
      switch (std::min<int64_t>(kRowsPerPass, M - m0)) {
        case 1: channel_block<V, 1>(x, packed, bias, y, N, K, nb, m0, later, share); break;
        case 2: channel_block<V, 2>(x, packed, bias, y, N, K, nb, m0, later, share); break;
        case 3: channel_block<V, 3>(x, packed, bias, y, N, K, nb, m0, later, share); break;
        case 4: channel_block<V, 4>(x, packed, bias, y, N, K, nb, m0, later, share); break;
        case 5: channel_block<V, 5>(x, packed, bias, y, N, K, nb, m0, later, share); break;
        case 6: channel_block<V, 6>(x, packed, bias, y, N, K, nb, m0, later, share); break;
        case 7: channel_block<V, 7>(x, packed, bias, y, N, K, nb, m0, later, share); break;
        default: channel_block<V, kRowsPerPass>(x, packed, bias, y, N, K, nb, m0, later, share); break;
      }
    }
  }
}

}  // namespace

// 1 where this CPU has AVX-512F (float32), 0 where not (the caller keeps oneDNN's GEMM).
extern "C" int pdserve_f32_linear_supported() { return 1; }

// x [M, K] float32 (row stride K), packed as above (E = 1), bias [N] float32 or null -> y [M, N] float32.
extern "C" void pdserve_f32_linear(const float* x, const float* packed, const float* bias, float* y, int64_t M,
                                   int64_t N, int64_t K, int threads) {
  linear<F32>(x, packed, bias, y, M, N, K, threads);
}

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
// 1 where this CPU has AVX512-BF16, 0 where not.
extern "C" int pdserve_bf16_linear_supported() { return 1; }

// x [M, K] bfloat16 (row stride K), packed as above (E = 2), bias [N] bfloat16 or null -> y [M, N] bfloat16.
extern "C" void pdserve_bf16_linear(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                                    int64_t M, int64_t N, int64_t K, int threads) {
  linear<Bf16>(x, packed, bias, y, M, N, K, threads);
}
#endif

#else

extern "C" int pdserve_f32_linear_supported() { return 0; }
extern "C" void pdserve_f32_linear(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int) {}

#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__))
extern "C" int pdserve_bf16_linear_supported() { return 0; }
extern "C" void pdserve_bf16_linear(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                                    int64_t, int) {}
#endif
