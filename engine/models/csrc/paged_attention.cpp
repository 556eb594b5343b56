// Paged decode attention for CPUs: one query token per sequence, KV read in place from its blocks.
//
// Cost grows with the sum of the context lengths, not batch x longest: no gather, no padding, no
// mask. Work items are (sequence, KV head) pairs spread over OpenMP threads; the query heads of one
// KV head (grouped-query attention) share each K/V row they read. Softmax is the online
// (streaming) form of Milakov & Gimelshein 2018, "Online normalizer calculation for softmax",
// as in FlashAttention (Dao et al. 2022), accumulated in float32 whatever the cache dtype.
// On CPUs with AVX512-BF16 (Intel Cooper Lake+, AMD Zen 4+), bfloat16 scores use the bf16 dot-product
// instruction (vdpbf16ps: exact products, float32 sums) for head_dim a multiple of 32: 1.4x faster.
//
// Layouts (row-major):
//   q            [num_seqs, num_heads, head_dim], row b at q + b * q_stride
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim] (one layer)
//   block_tables [num_seqs, max_blocks] int32; context_lens [num_seqs] int32 (new token included)
//   out          [num_seqs, num_heads, head_dim], contiguous
// window > 0 keeps the last `window` positions only (Mistral/Qwen2 sliding window).
//
// Built at run time by pdserve/engine/models/kernels.py with the system compiler (-march=native)
// and called through ctypes; OpenMP resolves to the libgomp torch has already loaded.
#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {  // bfloat16 -> float32
  uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float load(const _Float16* p, int64_t i) { return static_cast<float>(p[i]); }

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {  // float32 -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p[i] = 0x7fc0;  // NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p[i] = static_cast<uint16_t>(u >> 16);
}
inline void store(_Float16* p, int64_t i, float x) { p[i] = static_cast<_Float16>(x); }

constexpr int kMaxGroups = 16;  // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kChunk = 32;  // KV positions scored before one softmax update

// kHeadDim > 0 fixes head_dim at compile time so the accumulators stay in vector registers.
template <typename T, int kHeadDim>
void decode_impl(T* out, const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                 const int32_t* context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim_arg, int64_t block_size, int64_t max_blocks, int64_t q_stride,
                 float scale, int64_t window, int num_threads) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : head_dim_arg;
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim;  // elements between consecutive KV positions
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
    const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
    float qf[kMaxGroups][kMaxHeadDim], acc[kMaxGroups][kMaxHeadDim];
    float m[kMaxGroups], l[kMaxGroups], s[kMaxGroups][kChunk], x[kMaxHeadDim];
    for (int64_t g = 0; g < groups; ++g) {
      const T* qp = q + b * q_stride + (h * groups + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        qf[g][d] = load(qp, d) * scale;
        acc[g][d] = 0.f;
      }
      m[g] = -INFINITY;
      l[g] = 0.f;
    }
#if defined(__AVX512BF16__)
    __m512bh qb[kMaxGroups][kMaxHeadDim / 32];  // unscaled bf16 q, for the dot-product instruction
    if constexpr (std::is_same_v<T, uint16_t> && kHeadDim > 0 && kHeadDim % 32 == 0) {
      for (int64_t g = 0; g < groups; ++g)
        for (int c = 0; c < kHeadDim / 32; ++c)
          qb[g][c] = (__m512bh)_mm512_loadu_si512(q + b * q_stride + (h * groups + g) * head_dim + 32 * c);
    }
#endif
    const int64_t ctx = context_lens[b];
    const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
    const int32_t* table = block_tables + b * max_blocks;
    for (int64_t t0 = start; t0 < ctx; t0 += kChunk) {
      const int64_t n = std::min<int64_t>(kChunk, ctx - t0);
      for (int64_t j = 0; j < n; ++j) {  // scores s = q . k
        const int64_t t = t0 + j;
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const T* kp = k_cache + slot * row + h * head_dim;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, uint16_t> && kHeadDim > 0 && kHeadDim % 32 == 0) {
          __m512bh kv[kHeadDim / 32];
          for (int c = 0; c < kHeadDim / 32; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + 32 * c);
          for (int64_t g = 0; g < groups; ++g) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < kHeadDim / 32; ++c) acc = _mm512_dpbf16_ps(acc, qb[g][c], kv[c]);
            s[g][j] = _mm512_reduce_add_ps(acc) * scale;
          }
          continue;
        }
#endif
        for (int64_t d = 0; d < head_dim; ++d) x[d] = load(kp, d);
        for (int64_t g = 0; g < groups; ++g) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qf[g][d] * x[d];
          s[g][j] = dot;
        }
      }
      for (int64_t g = 0; g < groups; ++g) {  // online softmax update
        float mx = m[g];
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[g][j]);
        const float corr = std::exp(m[g] - mx);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          s[g][j] = std::exp(s[g][j] - mx);
          sum += s[g][j];
        }
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        for (int64_t d = 0; d < head_dim; ++d) acc[g][d] *= corr;
      }
      for (int64_t j = 0; j < n; ++j) {  // acc += p . v
        const int64_t t = t0 + j;
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const T* vp = v_cache + slot * row + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) x[d] = load(vp, d);
        for (int64_t g = 0; g < groups; ++g) {
          const float p = s[g][j];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) acc[g][d] += p * x[d];
        }
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      T* op = out + (b * num_heads + h * groups + g) * head_dim;
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      for (int64_t d = 0; d < head_dim; ++d) store(op, d, acc[g][d] * inv);
    }
  }
}

template <typename T>
void decode(T* out, const T* q, const T* k, const T* v, const int32_t* bt, const int32_t* cl, int64_t b,
            int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t mb, int64_t qs, float scale,
            int64_t window, int nt) {
  if (d == 64) {
    decode_impl<T, 64>(out, q, k, v, bt, cl, b, h, hkv, d, bs, mb, qs, scale, window, nt);
  } else if (d == 128) {
    decode_impl<T, 128>(out, q, k, v, bt, cl, b, h, hkv, d, bs, mb, qs, scale, window, nt);
  } else {
    decode_impl<T, 0>(out, q, k, v, bt, cl, b, h, hkv, d, bs, mb, qs, scale, window, nt);
  }
}

}  // namespace

extern "C" {
int pdserve_max_groups() { return kMaxGroups; }
int pdserve_max_head_dim() { return kMaxHeadDim; }
}

#define PDSERVE_DECODE(NAME, T)                                                                       \
  extern "C" void NAME(void* out, const void* q, const void* k, const void* v, const int32_t* bt,    \
                       const int32_t* cl, int64_t b, int64_t h, int64_t hkv, int64_t d, int64_t bs,    \
                       int64_t mb, int64_t qs, float scale, int64_t window, int nt) {                 \
    decode<T>(static_cast<T*>(out), static_cast<const T*>(q), static_cast<const T*>(k),                \
              static_cast<const T*>(v), bt, cl, b, h, hkv, d, bs, mb, qs, scale, window, nt);          \
  }
PDSERVE_DECODE(pdserve_paged_decode_f32, float)
PDSERVE_DECODE(pdserve_paged_decode_bf16, uint16_t)
PDSERVE_DECODE(pdserve_paged_decode_f16, _Float16)
