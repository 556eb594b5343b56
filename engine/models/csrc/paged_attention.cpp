// Paged attention for CPUs over a block table, for decode and prefill alike: each sequence has
// `nq` query rows (1 when decoding, the prompt when prefilling), the last `nq` of its `seq_len` KV
// positions, and every row attends causally to the positions up to its own, read in place from the
// sequence's blocks (the step's own K/V are written there first).
//
// Cost grows with the sum of the context lengths, not batch x longest: no gather, no padding, no
// mask. The query heads of one KV head (grouped-query attention) share each K/V row they read.
// Softmax is the online (streaming) form of Milakov & Gimelshein 2018, "Online normalizer
// calculation for softmax", as in FlashAttention (Dao et al. 2022), accumulated in float32 whatever
// the cache dtype. On CPUs with AVX512-BF16 (Intel Cooper Lake+, AMD Zen 4+), bfloat16 scores use
// the bf16 dot-product instruction (vdpbf16ps: exact products, float32 sums) for head_dim a
// multiple of 32: 1.4x faster. There p . v takes two positions per instruction too, with p rounded to
// bfloat16 first, as SDPA's CPU kernel rounds its probabilities before the product with V. float32
// with head_dim 64 or 128 takes the same shape of work with FMAs (attend_chunk_f32): decode at batch
// 32 and 256 positions 14.2 -> 11.9 ms a step, a 256-token prompt's attention 21.9 -> 13.5 ms.
//
// Layouts (row-major):
//   q               [num_query_rows, num_heads, head_dim], row i at q + i * q_stride
//   k/v cache       [num_blocks, block_size, num_kv_heads, head_dim] (one layer)
//   block_tables    [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32 (this step's rows included)
//   query_start_loc [num_seqs + 1] int32: sequence b's rows are query_start_loc[b] .. [b + 1] - 1
//   out             [num_query_rows, num_heads, head_dim], contiguous
// window > 0 keeps the last `window` positions of each row only (Mistral/Qwen2 sliding window).
// softcap > 0 caps every score s (q . k * scale) to softcap * tanh(s / softcap) before the softmax (Gemma 2).
//
// Built at run time by pdserve/engine/models/kernels.py with the system compiler (-march=native)
// and called through ctypes; OpenMP resolves to the libgomp torch has already loaded.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {  // amx_attention.cpp
bool amx_attention_bf16(uint16_t* out, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                        const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int64_t max_blocks, int64_t q_stride, float scale, int64_t window,
                        float softcap, int num_threads);
}

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
constexpr int kChunk = 16;  // KV positions scored before one softmax update
constexpr int kMaxItemStates = 8;  // (query row, KV head) states one work item carries
constexpr int kQueryTile = 8;  // query rows of one sequence per work item

// kHeadDim > 0 fixes head_dim at compile time so the accumulators stay in vector registers.
// The running state of one KV head's query group for one sequence.
template <typename T, int kHeadDim>
struct HeadState {
  float qf[kMaxGroups][kMaxHeadDim], acc[kMaxGroups][kMaxHeadDim], m[kMaxGroups], l[kMaxGroups];
#if defined(__AVX512BF16__)
  __m512bh qb[kMaxGroups][kMaxHeadDim / 32];  // unscaled bf16 q, for the dot-product instruction
#endif
};

template <typename T, int kHeadDim>
constexpr bool kUseDpbf16 =
#if defined(__AVX512BF16__)
    std::is_same_v<T, uint16_t> && kHeadDim > 0 && kHeadDim % 32 == 0;
#else
    false;
#endif

template <typename T, int kHeadDim>
void init_state(HeadState<T, kHeadDim>& st, const T* q_head, int64_t groups, int64_t head_dim, float scale) {
  for (int64_t g = 0; g < groups; ++g) {
    const T* qp = q_head + g * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      st.qf[g][d] = load(qp, d) * scale;
      st.acc[g][d] = 0.f;
    }
    st.m[g] = -INFINITY;
    st.l[g] = 0.f;
#if defined(__AVX512BF16__)
    if constexpr (kUseDpbf16<T, kHeadDim>) {
      for (int c = 0; c < kHeadDim / 32; ++c) st.qb[g][c] = (__m512bh)_mm512_loadu_si512(qp + 32 * c);
    }
#endif
  }
}

// Soft-capping of n scores in place: s -> softcap * tanh(s / softcap) (Gemma 2's attn_logit_softcapping).
inline void cap_scores(float* s, int64_t n, float softcap) {
  for (int64_t j = 0; j < n; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
}

// Ask for one head's K or V row of a later position, so that DRAM reads of several blocks overlap
// the arithmetic (the hardware prefetchers alone sustain about a quarter of the bandwidth here,
// since every block is a new, short stream).
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(static_cast<const char*>(p) + c);
}

#if defined(__AVX512F__)
// out[j] = the sum of v[j]'s 16 lanes, for j < 16: a transposing reduction tree (15 shuffle pairs and
// adds for 16 rows, where one horizontal sum per row costs about as much each).
inline __m512 row_sums16(const __m512 (&v)[16]) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes of rows 2i and 2i+1, halved
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lane k: 4 partial sums of row 4i + k
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // z[4k + e] holds row k + 4e
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// One group's online softmax update over the 16 scores sv of a chunk of n positions (lanes past n
// weigh 0), soft-capped first where softcap > 0: the running max m and sum l move on, corr =
// e^(old m - new m) is what the accumulators are to be scaled by; returns p = e^(s - new m).
inline __m512 online_softmax16(__m512 sv, int64_t n, float softcap, float& m, float& l, float& corr) {
  if (softcap > 0.f) {
    alignas(64) float capped[kChunk];  // softcap's scalar pass
    _mm512_store_ps(capped, sv);
    cap_scores(capped, n, softcap);
    sv = _mm512_load_ps(capped);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);  // n <= 16 positions in this chunk
  const float mx = std::max(m, _mm512_mask_reduce_max_ps(valid, sv));
  corr = pdserve::exp_approx(m - mx);
  const __m512 p = _mm512_maskz_mov_ps(valid, pdserve::exp_approx16(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
  l = l * corr + _mm512_reduce_add_ps(p);
  m = mx;
  return p;
}

// acc[g] = the accumulators of group g0 + g scaled by its corr, for the gc groups of one pass.
template <int kPassGroups, int kF>
inline void load_rescaled(__m512 (&acc)[kPassGroups][kF], const float (&st_acc)[kMaxGroups][kMaxHeadDim],
                          const float* corr, int64_t g0, int64_t gc) {
  for (int g = 0; g < kPassGroups; ++g) {
    if (g < gc) {
      const __m512 c = _mm512_set1_ps(corr[g0 + g]);
      for (int f = 0; f < kF; ++f) acc[g][f] = _mm512_mul_ps(_mm512_loadu_ps(st_acc[g0 + g] + 16 * f), c);
    }
  }
}

// attend_chunk for float32 with head_dim 64 or 128: the scores of 16 positions by FMAs into one
// vector a position and one reduction tree (where the generic loop sums each dot product across its
// lanes), and p . v with each group's accumulators in registers, several groups per pass over the
// V rows (where the generic loop loads and stores them for every position).
template <int kHeadDim>
void attend_chunk_f32(HeadState<float, kHeadDim>& st, const float* k, const float* v, const int64_t* slots, int64_t n,
                      int64_t row, int64_t groups, float softcap) {
  constexpr int kF = kHeadDim / 16, kPassGroups = 16 / kF;
  static_assert(kChunk == 16, "one reduction tree scores a chunk");
  alignas(64) float pf[kMaxGroups][kChunk];
  float corr[kMaxGroups];
  for (int64_t g = 0; g < groups; ++g) {
    __m512 qv[kF];
    for (int f = 0; f < kF; ++f) qv[f] = _mm512_loadu_ps(st.qf[g] + 16 * f);  // q already scaled
    __m512 part[16];
    for (int j = 0; j < 16; ++j) {
      part[j] = _mm512_setzero_ps();
      if (j < n) {
        const float* kp = k + slots[j] * row;
        part[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp));
        for (int f = 1; f < kF; ++f) part[j] = _mm512_fmadd_ps(qv[f], _mm512_loadu_ps(kp + 16 * f), part[j]);
      }
    }
    _mm512_store_ps(pf[g], online_softmax16(row_sums16(part), n, softcap, st.m[g], st.l[g], corr[g]));
  }
  for (int64_t g0 = 0; g0 < groups; g0 += kPassGroups) {
    const int64_t gc = std::min<int64_t>(kPassGroups, groups - g0);
    __m512 acc[kPassGroups][kF];
    load_rescaled<kPassGroups, kF>(acc, st.acc, corr, g0, gc);
    for (int64_t j = 0; j < n; ++j) {
      const float* vp = v + slots[j] * row;
      __m512 x[kF];
      for (int f = 0; f < kF; ++f) x[f] = _mm512_loadu_ps(vp + 16 * f);
      for (int g = 0; g < kPassGroups; ++g) {
        if (g < gc) {
          const __m512 pj = _mm512_set1_ps(pf[g0 + g][j]);
          for (int f = 0; f < kF; ++f) acc[g][f] = _mm512_fmadd_ps(x[f], pj, acc[g][f]);
        }
      }
    }
    for (int g = 0; g < kPassGroups; ++g)
      if (g < gc)
        for (int f = 0; f < kF; ++f) _mm512_storeu_ps(st.acc[g0 + g] + 16 * f, acc[g][f]);
  }
}
#endif

#if defined(__AVX512BF16__)
// attend_chunk for bfloat16 with head_dim 64 or 128: scores by vdpbf16ps, 16 positions per reduction
// tree; p . v with each group's accumulators in registers, several groups per pass over the V rows.
template <int kHeadDim>
void attend_chunk_dpbf16(HeadState<uint16_t, kHeadDim>& st, const uint16_t* k, const uint16_t* v,
                         const int64_t* slots, int64_t n, int64_t row,
                         int64_t groups, float scale, float softcap) {
  constexpr int kBf = kHeadDim / 32, kF = kHeadDim / 16, kPassGroups = 16 / kF;
  static_assert(kChunk == 16, "one reduction tree scores a chunk");
  // p in bfloat16, rounded as SDPA's CPU kernel rounds its probabilities before the product with V;
  // lanes past n are 0, so an odd n pairs its last row with 0
  alignas(64) uint16_t pb[kMaxGroups][kChunk];
  float corr[kMaxGroups];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[16];
    for (int j = 0; j < 16; ++j) {
      part[j] = _mm512_setzero_ps();
      if (j < n) {
        const uint16_t* kp = k + slots[j] * row;
        for (int c = 0; c < kBf; ++c)
          part[j] = _mm512_dpbf16_ps(part[j], st.qb[g][c], (__m512bh)_mm512_loadu_si512(kp + 32 * c));
      }
    }
    const __m512 p =
        online_softmax16(_mm512_mul_ps(row_sums16(part), vscale), n, softcap, st.m[g], st.l[g], corr[g]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb[g]), (__m256i)_mm512_cvtneps_pbh(p));
  }
  // p . v by vdpbf16ps over pairs of positions: unpacklo/hi_epi16 of two V rows gives each lane a
  // (row j, row j + 1) pair of one dim, so the accumulators hold the dims in acc_slot order.
  for (int64_t g0 = 0; g0 < groups; g0 += kPassGroups) {
    const int64_t gc = std::min<int64_t>(kPassGroups, groups - g0);
    __m512 acc[kPassGroups][kF];
    load_rescaled<kPassGroups, kF>(acc, st.acc, corr, g0, gc);
    for (int64_t j = 0; j < n; j += 2) {
      const uint16_t* va = v + slots[j] * row;
      const uint16_t* vb = j + 1 < n ? v + slots[j + 1] * row : va;
      __m512i x[kF];
      for (int h = 0; h < kBf; ++h) {
        const __m512i ra = _mm512_loadu_si512(va + 32 * h), rb = _mm512_loadu_si512(vb + 32 * h);
        x[2 * h] = _mm512_unpacklo_epi16(ra, rb);
        x[2 * h + 1] = _mm512_unpackhi_epi16(ra, rb);
      }
      for (int g = 0; g < kPassGroups; ++g) {
        if (g < gc) {
          int32_t pair;
          std::memcpy(&pair, pb[g0 + g] + j, 4);
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
          for (int f = 0; f < kF; ++f) acc[g][f] = _mm512_dpbf16_ps(acc[g][f], (__m512bh)x[f], pp);
        }
      }
    }
    for (int g = 0; g < kPassGroups; ++g)
      if (g < gc)
        for (int f = 0; f < kF; ++f) _mm512_storeu_ps(st.acc[g0 + g] + 16 * f, acc[g][f]);
  }
}
#endif

// Fold KV positions slots[0..n) of one KV head (k/v point at that head in position 0's row) into st.
// Decode steps and prefill tiles run this one function from one call site, so a position's
// attention is the same bits whichever computed it (batch invariance: a sequence that migrates or
// is preempted, recomputed by a prefill, goes on exactly as it would have). Keep it one function
// with one call site: two compiled copies may vectorize their reductions in different orders.
template <typename T, int kHeadDim>
void attend_chunk(HeadState<T, kHeadDim>& st, const T* k, const T* v, const int64_t* slots, int64_t n,
                  int64_t row, int64_t groups, int64_t head_dim, float scale, float softcap) {
#if defined(__AVX512BF16__)
  if constexpr (kUseDpbf16<T, kHeadDim>) {
    attend_chunk_dpbf16<kHeadDim>(st, k, v, slots, n, row, groups, scale, softcap);
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && (kHeadDim == 64 || kHeadDim == 128)) {
    attend_chunk_f32<kHeadDim>(st, k, v, slots, n, row, groups, softcap);
    return;
  }
#endif
  float s[kMaxGroups][kChunk], x[kMaxHeadDim];
  for (int64_t j = 0; j < n; ++j) {  // scores s = q . k
    const T* kp = k + slots[j] * row;
    for (int64_t d = 0; d < head_dim; ++d) x[d] = load(kp, d);
    for (int64_t g = 0; g < groups; ++g) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += st.qf[g][d] * x[d];
      s[g][j] = dot;
    }
  }
  if (softcap > 0.f)
    for (int64_t g = 0; g < groups; ++g) cap_scores(s[g], n, softcap);
  for (int64_t g = 0; g < groups; ++g) {  // online softmax update
    float mx = st.m[g];
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[g][j]);
    const float corr = pdserve::exp_approx(st.m[g] - mx);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      s[g][j] = pdserve::exp_approx(s[g][j] - mx);
      sum += s[g][j];
    }
    st.l[g] = st.l[g] * corr + sum;
    st.m[g] = mx;
    for (int64_t d = 0; d < head_dim; ++d) st.acc[g][d] *= corr;
  }
  for (int64_t j = 0; j < n; ++j) {  // acc += p . v
    const T* vp = v + slots[j] * row;
    for (int64_t d = 0; d < head_dim; ++d) x[d] = load(vp, d);
    for (int64_t g = 0; g < groups; ++g) {
      const float p = s[g][j];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) st.acc[g][d] += p * x[d];
    }
  }
}

// Work items are (tile of up to kQueryTile query rows of one sequence, run of KV heads). The rows of
// a tile share every K/V row they read while it is in L1; all KV heads of a sequence in one item
// read each position's K/V row whole and in order, which the prefetchers stream from DRAM. A batch
// too small to keep every thread busy that way splits the heads instead.
template <typename T, int kHeadDim>
void attention_impl(T* out, const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                    const int32_t* seq_lens, const int32_t* query_start_loc, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim_arg, int64_t block_size, int64_t max_blocks,
                    int64_t q_stride, float scale, int64_t window, float softcap, int num_threads) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : head_dim_arg;
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim;  // elements between consecutive KV positions
  std::vector<std::pair<int32_t, int32_t>> tiles;  // (sequence, first query row of the tile)
  bool multi_row = false;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int32_t nq = query_start_loc[b + 1] - query_start_loc[b];
    multi_row |= nq > 1;
    for (int32_t r = 0; r < nq; r += kQueryTile) tiles.emplace_back(static_cast<int32_t>(b), r);
  }
  const int64_t tile_rows = multi_row ? kQueryTile : 1;
  int64_t heads_per_item = std::min<int64_t>(num_kv_heads, kMaxItemStates / tile_rows);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  while (heads_per_item > 1 && num_tiles * (num_kv_heads / heads_per_item) < 4 * num_threads) heads_per_item /= 2;
  while (num_kv_heads % heads_per_item) --heads_per_item;
  const int64_t items_per_tile = num_kv_heads / heads_per_item;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t item = 0; item < num_tiles * items_per_tile; ++item) {
    const auto [b, r0] = tiles[item / items_per_tile];
    const int64_t h0 = (item % items_per_tile) * heads_per_item;
    const int64_t nq = query_start_loc[b + 1] - query_start_loc[b];
    const int64_t rows = std::min<int64_t>(tile_rows, nq - r0);
    // query row r (of nq) sees positions [lo_r, hi_r): itself and what came before, in its window
    int64_t lo[kQueryTile], hi[kQueryTile];
    for (int64_t r = 0; r < rows; ++r) {
      hi[r] = seq_lens[b] - nq + r0 + r + 1;
      lo[r] = window > 0 ? std::max<int64_t>(0, hi[r] - window) : 0;
    }
    HeadState<T, kHeadDim> states[kMaxItemStates];
    for (int64_t i = 0; i < heads_per_item; ++i)
      for (int64_t r = 0; r < rows; ++r)
        init_state(states[i * rows + r], q + (query_start_loc[b] + r0 + r) * q_stride + (h0 + i) * groups * head_dim,
                   groups, head_dim, scale);
    const int32_t* table = block_tables + b * max_blocks;
    // Slots of this chunk and the next. A decode step prefetches the next chunk's rows before it reads
    // this one's, which keeps the loads of several blocks in flight (batch 32, 288 positions, 12
    // layers: bf16 7.7 -> 4.2 ms, fp32 14.6 -> 8.6 ms).
    int64_t slots[2][kChunk];
    const auto fill = [&](int64_t* dst, int64_t t0, int64_t n) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j;
        dst[j] = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
      }
    };
    const int64_t end = hi[rows - 1];
    fill(slots[0], lo[0], std::min<int64_t>(kChunk, end - lo[0]));
    for (int64_t t0 = lo[0], cur = 0; t0 < end; t0 += kChunk, cur ^= 1) {
      const int64_t n = std::min<int64_t>(kChunk, end - t0);
      const int64_t next_n = std::max<int64_t>(0, std::min<int64_t>(kChunk, end - t0 - kChunk));
      fill(slots[cur ^ 1], t0 + kChunk, next_n);
      if (!multi_row) {  // a decode step asks for the next chunk's K and V rows of its heads now
        const int64_t head_bytes = heads_per_item * head_dim * static_cast<int64_t>(sizeof(T));
        for (int64_t j = 0; j < next_n; ++j) {
          prefetch_row(k_cache + slots[cur ^ 1][j] * row + h0 * head_dim, head_bytes);
          prefetch_row(v_cache + slots[cur ^ 1][j] * row + h0 * head_dim, head_bytes);
        }
      }
      for (int64_t i = 0; i < heads_per_item; ++i) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t a = std::max<int64_t>(0, lo[r] - t0), z = std::min<int64_t>(n, hi[r] - t0);
          if (a >= z) continue;
          const T* kh = k_cache + (h0 + i) * head_dim;
          const T* vh = v_cache + (h0 + i) * head_dim;
          attend_chunk<T, kHeadDim>(states[i * rows + r], kh, vh, slots[cur] + a, z - a, row, groups, head_dim, scale,
                                    softcap);
        }
      }
    }
    for (int64_t i = 0; i < heads_per_item; ++i) {
      for (int64_t r = 0; r < rows; ++r) {
        const HeadState<T, kHeadDim>& st = states[i * rows + r];
        for (int64_t g = 0; g < groups; ++g) {
          T* op = out + ((query_start_loc[b] + r0 + r) * num_heads + (h0 + i) * groups + g) * head_dim;
          const float inv = st.l[g] > 0.f ? 1.f / st.l[g] : 0.f;
          for (int64_t d = 0; d < head_dim; ++d)
            store(op, d, st.acc[g][kUseDpbf16<T, kHeadDim> ? pdserve::acc_slot(d) : d] * inv);
        }
      }
    }
  }
}

template <typename T>
void attention(T* out, const T* q, const T* k, const T* v, const int32_t* bt, const int32_t* sl, const int32_t* qsl,
               int64_t b, int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t mb, int64_t qs, float scale,
               int64_t window, float softcap, int nt) {
  if constexpr (std::is_same_v<T, uint16_t>) {  // bfloat16 on AMX tiles where amx_attention.cpp takes it
    if (pdserve::amx_attention_bf16(out, q, k, v, bt, sl, qsl, b, h, hkv, d, bs, mb, qs, scale, window, softcap, nt))
      return;
  }
  if (d == 64) {
    attention_impl<T, 64>(out, q, k, v, bt, sl, qsl, b, h, hkv, d, bs, mb, qs, scale, window, softcap, nt);
  } else if (d == 128) {
    attention_impl<T, 128>(out, q, k, v, bt, sl, qsl, b, h, hkv, d, bs, mb, qs, scale, window, softcap, nt);
  } else {
    attention_impl<T, 0>(out, q, k, v, bt, sl, qsl, b, h, hkv, d, bs, mb, qs, scale, window, softcap, nt);
  }
}

}  // namespace

extern "C" {
int pdserve_max_groups() { return kMaxGroups; }
int pdserve_max_head_dim() { return kMaxHeadDim; }
}

#define PDSERVE_ATTENTION(NAME, T)                                                                    \
  extern "C" void NAME(void* out, const void* q, const void* k, const void* v, const int32_t* bt,    \
                       const int32_t* sl, const int32_t* qsl, int64_t b, int64_t h, int64_t hkv, int64_t d, \
                       int64_t bs, int64_t mb, int64_t qs, float scale, int64_t window, float softcap,  \
                       int nt) {                                                                        \
    attention<T>(static_cast<T*>(out), static_cast<const T*>(q), static_cast<const T*>(k),             \
                 static_cast<const T*>(v), bt, sl, qsl, b, h, hkv, d, bs, mb, qs, scale, window, softcap, nt);   \
  }
PDSERVE_ATTENTION(pdserve_paged_attention_f32, float)
PDSERVE_ATTENTION(pdserve_paged_attention_bf16, uint16_t)
PDSERVE_ATTENTION(pdserve_paged_attention_f16, _Float16)

// This step's K and V rows into one layer's cache, at their slots: k and v [T, row_bytes] with row
// strides k_stride / v_stride bytes (views into the q|k|v GEMM's output), the cache's K plane at
// `cache`, its V plane `plane_bytes` further, slot s at s * row_bytes in each. A negative slot is
// skipped. One call per layer where torch's index_copy_ takes two (about 6 us each at one row).
extern "C" void pdserve_write_kv(char* cache, int64_t plane_bytes, const char* k, int64_t k_stride, const char* v,
                                 int64_t v_stride, const int64_t* slots, int64_t T, int64_t row_bytes) {
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    char* dst = cache + slots[t] * row_bytes;
    std::memcpy(dst, k + t * k_stride, row_bytes);
    std::memcpy(dst + plane_bytes, v + t * v_stride, row_bytes);
  }
}
