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
// Positions are scored 64 at a time, one softmax update a chunk, each 16 by one unrolled run of dot
// products and one reduction tree (lanes past the sequence score a valid row, then are masked). A
// thread takes a contiguous run of work items and, decoding, asks for the next chunk's K/V rows (or
// its next item's first) a few lines at a time while it computes. Rows are addressed by element
// offsets (slot x row) computed once a chunk. Batch 32, 256 positions, 12 layers, bf16, one thread of
// an AVX-512 EPYC: 18.0 -> 6.4 ms a step (4.6 ms with the cache in L3); a 256-token prompt on two
// threads 14 -> 8 ms.
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

#include <omp.h>

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
constexpr int kChunk = 64;  // KV positions scored before one softmax update
constexpr int kSub = kChunk / 16;  // 16-position blocks of a chunk, one reduction tree each
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

// The next chunk's K and V rows of a decode item, asked for a few lines at a time from inside the
// arithmetic (step() once per 16 positions a group scores and once per 16 positions of each pass over
// V), so that the reads stream at an even pace; asking for them all at once fills the core's queue of
// misses and stalls the work beside it. Rows go in as K, V, K, V, ... in position order (all K rows
// before the V rows, or a block's K before its V, read 40 % slower), each a counted loop of
// prefetcht0 (prefetcht2, into L2 only, read 10-25 % slower once the requests were paced so).
struct Prefetcher {
  const char* rows[2 * kChunk];
  int64_t count = 0, lines_per_row = 0, next = 0, line = 0, per_step = 0;
  void add(const void* p) {
    rows[count++] = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
  }
  int64_t lines() const { return count * lines_per_row; }
  void step() { take(per_step); }
  void finish() { take(lines()); }  // what the arithmetic left unasked
  void take(int64_t left) {
    while (left > 0 && next < count) {
      const int64_t n = std::min(left, lines_per_row - line);
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(rows[next] + 64 * (line + i), 0, 3);
      left -= n;
      line += n;
      if (line == lines_per_row) line = 0, ++next;
    }
  }
};

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

// One group's online softmax update over the scores sv[0..nsub) of a chunk of n positions (16 a
// vector; lanes past n weigh 0), soft-capped first where softcap > 0: the running max m and sum l
// move on, corr = e^(old m - new m) is what the accumulators are to be scaled by, and p = e^(s - new
// m) goes to p_out[0..16 nsub) as float32 or, for bfloat16 p . v, rounded to bfloat16.
template <typename P>
inline void online_softmax_chunk(__m512 (&sv)[kSub], int nsub, int64_t n, float softcap, float& m, float& l,
                                 float& corr, P* p_out) {
  if (softcap > 0.f) {
    alignas(64) float capped[kChunk];  // softcap's scalar pass
    for (int b = 0; b < nsub; ++b) _mm512_store_ps(capped + 16 * b, sv[b]);
    cap_scores(capped, n, softcap);
    for (int b = 0; b < nsub; ++b) sv[b] = _mm512_load_ps(capped + 16 * b);
  }
  __m512 mxv = _mm512_set1_ps(-INFINITY);
  for (int b = 0; b < nsub; ++b) mxv = _mm512_mask_max_ps(mxv, pdserve::tail_mask(n - 16 * b), mxv, sv[b]);
  const float mx = std::max(m, _mm512_reduce_max_ps(mxv));
  corr = pdserve::exp_approx(m - mx);
  const __m512 mxb = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int b = 0; b < nsub; ++b) {
    const __m512 p = _mm512_maskz_mov_ps(pdserve::tail_mask(n - 16 * b), pdserve::exp_approx16(_mm512_sub_ps(sv[b], mxb)));
    sum = _mm512_add_ps(sum, p);
    if constexpr (std::is_same_v<P, float>) {
      _mm512_store_ps(p_out + 16 * b, p);
    } else {
      _mm256_store_si256(reinterpret_cast<__m256i*>(p_out + 16 * b), (__m256i)_mm512_cvtneps_pbh(p));
    }
  }
  l = l * corr + _mm512_reduce_add_ps(sum);
  m = mx;
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

// The element offsets of a chunk's n positions' rows, padded to 16 nsub with position 0's: the
// lanes past n score (and, paired with a 0 weight, read) a valid row, which the softmax masks.
inline int pad_offsets(int64_t (&off)[kChunk], const int64_t* offs, int64_t n) {
  const int nsub = static_cast<int>((n + 15) / 16);
  for (int64_t j = 0; j < 16 * nsub; ++j) off[j] = offs[j < n ? j : 0];
  return nsub;
}

// The scores of a chunk's positions, 16 a vector in sv[0..nsub): dot(kp) gives one position's 16
// partial sums from its K row kp, and one reduction tree sums 16 positions' partials; off holds
// the rows' offsets, padded (pad_offsets). A few of the next chunk's lines are asked for before each 16.
template <typename T, typename Dot>
inline void score_chunk(__m512 (&sv)[kSub], int nsub, const T* k, const int64_t (&off)[kChunk], Prefetcher& ahead,
                        Dot dot) {
  for (int b = 0; b < nsub; ++b) {
    ahead.step();
    __m512 part[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) part[j] = dot(k + off[16 * b + j]);
    sv[b] = row_sums16(part);
  }
}

// attend_chunk for float32 with head_dim 64 or 128: the scores of 16 positions by FMAs into one
// vector a position and one reduction tree (where the generic loop sums each dot product across its
// lanes), and p . v with each group's accumulators in registers, several groups per pass over the
// V rows (where the generic loop loads and stores them for every position).
template <int kHeadDim>
void attend_chunk_f32(HeadState<float, kHeadDim>& st, const float* k, const float* v, const int64_t* offs, int64_t n,
                      int64_t groups, float softcap, Prefetcher& ahead) {
  constexpr int kF = kHeadDim / 16, kPassGroups = 16 / kF;
  alignas(64) float pf[kMaxGroups][kChunk];
  float corr[kMaxGroups];
  int64_t off[kChunk];
  const int nsub = pad_offsets(off, offs, n);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 qv[kF];
    for (int f = 0; f < kF; ++f) qv[f] = _mm512_loadu_ps(st.qf[g] + 16 * f);  // q already scaled
    __m512 sv[kSub];
    score_chunk(sv, nsub, k, off, ahead, [&](const float* kp) {
      __m512 part = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp));
#pragma GCC unroll 8
      for (int f = 1; f < kF; ++f) part = _mm512_fmadd_ps(qv[f], _mm512_loadu_ps(kp + 16 * f), part);
      return part;
    });
    online_softmax_chunk(sv, nsub, n, softcap, st.m[g], st.l[g], corr[g], pf[g]);
  }
  for (int64_t g0 = 0; g0 < groups; g0 += kPassGroups) {
    const int64_t gc = std::min<int64_t>(kPassGroups, groups - g0);
    __m512 acc[kPassGroups][kF];
    load_rescaled<kPassGroups, kF>(acc, st.acc, corr, g0, gc);
    for (int64_t j = 0; j < n; ++j) {
      if (j % 16 == 0) ahead.step();
      const float* vp = v + off[j];
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
                         const int64_t* offs, int64_t n, int64_t groups, float scale, float softcap,
                         Prefetcher& ahead) {
  constexpr int kBf = kHeadDim / 32, kF = kHeadDim / 16, kPassGroups = 16 / kF;
  // p in bfloat16, rounded as SDPA's CPU kernel rounds its probabilities before the product with V;
  // lanes past n are 0, so an odd n pairs its last row with 0
  alignas(64) uint16_t pb[kMaxGroups][kChunk];
  float corr[kMaxGroups];
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t off[kChunk];
  const int nsub = pad_offsets(off, offs, n);
  for (int64_t g = 0; g < groups; ++g) {
    __m512bh qb[kBf];
    for (int c = 0; c < kBf; ++c) qb[c] = st.qb[g][c];
    __m512 sv[kSub];
    score_chunk(sv, nsub, k, off, ahead, [&](const uint16_t* kp) {
      __m512 part = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int c = 0; c < kBf; ++c) part = _mm512_dpbf16_ps(part, qb[c], (__m512bh)_mm512_loadu_si512(kp + 32 * c));
      return part;
    });
    for (int b = 0; b < nsub; ++b) sv[b] = _mm512_mul_ps(sv[b], vscale);
    online_softmax_chunk(sv, nsub, n, softcap, st.m[g], st.l[g], corr[g], pb[g]);
  }
  // p . v by vdpbf16ps over pairs of positions: unpacklo/hi_epi16 of two V rows gives each lane a
  // (row j, row j + 1) pair of one dim, so the accumulators hold the dims in acc_slot order.
  for (int64_t g0 = 0; g0 < groups; g0 += kPassGroups) {
    const int64_t gc = std::min<int64_t>(kPassGroups, groups - g0);
    __m512 acc[kPassGroups][kF];
    load_rescaled<kPassGroups, kF>(acc, st.acc, corr, g0, gc);
    for (int64_t j = 0; j < n; j += 2) {
      if (j % 16 == 0) ahead.step();
      const uint16_t* va = v + off[j];
      const uint16_t* vb = v + off[j + 1];  // position 0's row past n, with weight 0
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

#if defined(__AVX512BF16__)
// One query row's output for group g: acc (in acc_slot order) times inv, rounded to bfloat16 as
// store() rounds it, 16 dims a vector.
struct AccSlots {
  int32_t at[32];
  constexpr AccSlots() : at() {
    for (int d = 0; d < 32; ++d) at[d] = static_cast<int32_t>(pdserve::acc_slot(d));
  }
};
constexpr AccSlots kAccSlots{};

template <int kHeadDim>
inline void store_acc_bf16(uint16_t* out, const float* acc, float inv) {
  const __m512i lo = _mm512_loadu_si512(kAccSlots.at), hi = _mm512_loadu_si512(kAccSlots.at + 16);
  const __m512 s = _mm512_set1_ps(inv);
  for (int c = 0; c < kHeadDim / 32; ++c) {
    const __m512 a = _mm512_loadu_ps(acc + 32 * c), b = _mm512_loadu_ps(acc + 32 * c + 16);
    pdserve::store_bf16x16(out + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(a, lo, b), s));
    pdserve::store_bf16x16(out + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a, hi, b), s));
  }
}
#endif

// Fold n KV positions of one KV head into st: position j's K row at k + offs[j], its V row at v +
// offs[j] (k/v point at that head in slot 0's row).
// Decode steps and prefill tiles run this one function from one call site, so a position's
// attention is the same bits whichever computed it (batch invariance: a sequence that migrates or
// is preempted, recomputed by a prefill, goes on exactly as it would have). Keep it one function
// with one call site: two compiled copies may vectorize their reductions in different orders.
template <typename T, int kHeadDim>
void attend_chunk(HeadState<T, kHeadDim>& st, const T* k, const T* v, const int64_t* offs, int64_t n,
                  int64_t groups, int64_t head_dim, float scale, float softcap, Prefetcher& ahead) {
#if defined(__AVX512BF16__)
  if constexpr (kUseDpbf16<T, kHeadDim>) {
    attend_chunk_dpbf16<kHeadDim>(st, k, v, offs, n, groups, scale, softcap, ahead);
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && (kHeadDim == 64 || kHeadDim == 128)) {
    attend_chunk_f32<kHeadDim>(st, k, v, offs, n, groups, softcap, ahead);
    return;
  }
#endif
  float s[kMaxGroups][kChunk], x[kMaxHeadDim];
  for (int64_t j = 0; j < n; ++j) {  // scores s = q . k
    const T* kp = k + offs[j];
    if (j % 16 == 0)
      for (int64_t g = 0; g < groups; ++g) ahead.step();
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
    if (j % 16 == 0) ahead.step();
    const T* vp = v + offs[j];
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
  // passes over a chunk's V rows a KV head makes (the AVX-512 paths take 256 / head_dim groups a pass
  // at head_dim 64 and 128), to pace the prefetches
  const int64_t v_passes = kHeadDim == 64 || kHeadDim == 128 ? (groups * kHeadDim + 255) / 256 : 1;
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
  const int64_t num_items = num_tiles * items_per_tile;
  // An item's sequence b, first query row r0, first KV head h0, rows, and the positions [lo_r, hi_r)
  // its query row r sees: itself and what came before, in its window.
  struct Item {
    int64_t b, r0, h0, rows, lo[kQueryTile], hi[kQueryTile];
  };
  const auto item_at = [&](int64_t item) {
    Item it;
    it.b = tiles[item / items_per_tile].first;
    it.r0 = tiles[item / items_per_tile].second;
    it.h0 = (item % items_per_tile) * heads_per_item;
    const int64_t nq = query_start_loc[it.b + 1] - query_start_loc[it.b];
    it.rows = std::min<int64_t>(tile_rows, nq - it.r0);
    for (int64_t r = 0; r < it.rows; ++r) {
      it.hi[r] = seq_lens[it.b] - nq + it.r0 + r + 1;
      it.lo[r] = window > 0 ? std::max<int64_t>(0, it.hi[r] - window) : 0;
    }
    return it;
  };
  // the element offsets (slot x row) of sequence b's positions t .. t + n - 1, into dst
  const auto fill = [&](int64_t* dst, int64_t b, int64_t t, int64_t n) {
    const int32_t* table = block_tables + b * max_blocks;
    int64_t blk = t / block_size, off = t % block_size;
    for (int64_t j = 0; j < n; ++j) {
      dst[j] = (static_cast<int64_t>(table[blk]) * block_size + off) * row;
      if (++off == block_size) off = 0, ++blk;
    }
  };
  // Each thread takes a contiguous run of items of about equal cost (query rows x positions read), so
  // it knows its next item and asks for that item's first rows while it finishes the one before.
  std::vector<int64_t> cost_before(num_items + 1, 0);
  for (int64_t item = 0; item < num_items; ++item) {
    const Item it = item_at(item);
    cost_before[item + 1] = cost_before[item] + it.rows * (it.hi[it.rows - 1] - it.lo[0]);
  }
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num(), total = cost_before[num_items];
    const auto first_item = [&](int64_t k) {
      return k >= nt ? num_items
                     : std::lower_bound(cost_before.begin(), cost_before.end() - 1, total * k / nt) - cost_before.begin();
    };
    const int64_t item_end = first_item(t + 1);
    for (int64_t item = first_item(t); item < item_end; ++item) {
      const Item it = item_at(item);
      const int64_t b = it.b, h0 = it.h0, rows = it.rows;
      HeadState<T, kHeadDim> states[kMaxItemStates];
      for (int64_t i = 0; i < heads_per_item; ++i)
        for (int64_t r = 0; r < rows; ++r)
          init_state(states[i * rows + r],
                     q + (query_start_loc[b] + it.r0 + r) * q_stride + (h0 + i) * groups * head_dim, groups, head_dim,
                     scale);
      // Row offsets of this chunk and the next. A decode step asks for the next chunk's K and V rows (or the
      // next item's first) while it computes this one, which keeps the loads of several blocks in
      // flight (batch 32, 256 positions, 12 layers, bf16 on an AVX-512 EPYC: 15.7 ms a step without,
      // 9.5 ms asked for a few lines every 16 positions scored, 13.3 ms asked for all at once).
      int64_t offs[2][kChunk];
      const int64_t end = it.hi[rows - 1];
      fill(offs[0], b, it.lo[0], std::min<int64_t>(kChunk, end - it.lo[0]));
      for (int64_t t0 = it.lo[0], cur = 0; t0 < end; t0 += kChunk, cur ^= 1) {
        const int64_t n = std::min<int64_t>(kChunk, end - t0);
        const int64_t next_n = std::max<int64_t>(0, std::min<int64_t>(kChunk, end - t0 - kChunk));
        fill(offs[cur ^ 1], b, t0 + kChunk, next_n);
        Prefetcher ahead;
        if (!multi_row) {
          const int64_t row_bytes = heads_per_item * head_dim * static_cast<int64_t>(sizeof(T));
          ahead.lines_per_row = (row_bytes + 63) / 64 + (row_bytes % 64 != 0);  // an unaligned row spans one more
          const auto add = [&](const int64_t* s, int64_t count, int64_t h) {
            for (int64_t j = 0; j < count; ++j) {
              ahead.add(k_cache + s[j] + h * head_dim);
              ahead.add(v_cache + s[j] + h * head_dim);
            }
          };
          if (next_n > 0) {
            add(offs[cur ^ 1], next_n, h0);
          } else if (item + 1 < item_end) {
            const Item nx = item_at(item + 1);
            int64_t first[kChunk];
            const int64_t nn = std::min<int64_t>(kChunk, nx.hi[0] - nx.lo[0]);
            fill(first, nx.b, nx.lo[0], nn);
            add(first, nn, nx.h0);
          }
          const int64_t calls = heads_per_item * (groups + v_passes) * ((n + 15) / 16);
          ahead.per_step = (ahead.lines() + calls - 1) / calls;
        }
        for (int64_t i = 0; i < heads_per_item; ++i) {
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t a = std::max<int64_t>(0, it.lo[r] - t0), z = std::min<int64_t>(n, it.hi[r] - t0);
            if (a >= z) continue;
            const T* kh = k_cache + (h0 + i) * head_dim;
            const T* vh = v_cache + (h0 + i) * head_dim;
            attend_chunk<T, kHeadDim>(states[i * rows + r], kh, vh, offs[cur] + a, z - a, groups, head_dim, scale,
                                      softcap, ahead);
          }
        }
        ahead.finish();
      }
      for (int64_t i = 0; i < heads_per_item; ++i) {
        for (int64_t r = 0; r < rows; ++r) {
          const HeadState<T, kHeadDim>& st = states[i * rows + r];
          for (int64_t g = 0; g < groups; ++g) {
            T* op = out + ((query_start_loc[b] + it.r0 + r) * num_heads + (h0 + i) * groups + g) * head_dim;
            const float inv = st.l[g] > 0.f ? 1.f / st.l[g] : 0.f;
#if defined(__AVX512BF16__)
            if constexpr (kUseDpbf16<T, kHeadDim>) {
              store_acc_bf16<kHeadDim>(op, st.acc[g], inv);
              continue;
            }
#endif
            for (int64_t d = 0; d < head_dim; ++d)
              store(op, d, st.acc[g][kUseDpbf16<T, kHeadDim> ? pdserve::acc_slot(d) : d] * inv);
          }
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
