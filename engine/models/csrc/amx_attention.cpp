// Paged attention for bfloat16 on AMX tiles: paged_attention.cpp's computation, for its decode and
// prefill calls alike, where the CPU has AMX, head_dim is 64, 128 or 256, the block size a multiple of 16
// and no softcap is asked for (else paged_attention.cpp runs it).
//
// One work item is one KV head of a few query rows of one sequence: its columns are the (row, query
// head) pairs of that KV head's group, up to 16 (a decode row of grouped-query attention with 3 query
// heads a KV head is 3 columns). Two passes over the positions the rows see:
//   1. scores S^T [16 positions, 16 columns] = K [16 positions, head_dim] . Q^T, one C tile per 16
//      positions: the K rows are one block's consecutive slots, loaded straight from the cache as an A
//      tile; Q^T is packed once per item as B tiles. Scaled, masked to each row's positions (causal,
//      window) and kept in float32; then each column's maximum, p = exp(s - max) rounded to bfloat16
//      (as SDPA's CPU kernel rounds p) and its sum.
//   2. out [16 columns, head_dim] = P [16 columns, positions] . V, 32 positions a step: P is the A
//      tile; V's rows are interleaved two positions at a time into B tiles (unpacklo/hi, so the
//      accumulators hold the dims in vec_math.h's acc_slot order).
// Taking the maximum over all positions first (two passes), rather than the online softmax, leaves
// the output tiles in place across the whole sum.
//
// A prompt's rows make many items of each KV head (a 1,024-token prompt with 3 query heads a KV head:
// 205), each of which would read K and interleave V afresh. So a sequence of at least kPackItems
// items a KV head has its K and V packed once (pack_head: K^T as B tiles, V interleaved as pass 2
// takes it), and its items (attend_packed) compute the scores as S [16 columns, 16 positions] = Q . K^T
// over them: each score sums the same products in the same order as S^T's, so the bits are the same.
//
// Each element of a tile product depends on its own row and column only, and the steps are aligned
// to absolute positions (16 for scores, 32 for P . V), with exact zeros where a row does not see a
// position. So a query row gets the same bits whichever rows share its item: a decode step and a
// prefill of the same position agree (batch invariance, as in paged_attention.cpp), on this path.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <omp.h>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"

namespace {
bool amx_attention_on = true;  // pdserve_set_amx_attention: off runs paged_attention.cpp's path
}

// 1 (the default): bfloat16 calls this file can take run here; 0: paged_attention.cpp runs every call.
extern "C" void pdserve_set_amx_attention(int on) { amx_attention_on = on != 0; }

#if defined(PDSERVE_AMX)

namespace {

constexpr int kMaxDim = 256;
constexpr int64_t kAhead = 16;  // positions ahead whose K and V rows pass 1 asks for
constexpr int64_t kPackItems = 4;  // items a KV head from which a sequence's K and V are packed once
constexpr int64_t kPackBytes = 1 << 20;  // packed K and V a round holds, per thread (within its L2 cache)
constexpr int64_t kKeptPackBytes = 16 << 20;  // packed tiles' buffer a calling thread keeps between calls

struct Buffers {  // one thread's
  std::vector<float> s;        // [16, npos] scores
  std::vector<uint16_t> p;     // [16, npos] bfloat16 probabilities (rows past the item's columns 0)
  alignas(64) uint16_t qt[kMaxDim / 32][16][32];  // Q^T B tiles: [step][pair of dims][column, 2]
  alignas(64) uint16_t qa[16][kMaxDim];           // Q A tiles (packed heads): [column][dim]
  alignas(64) float c[16 * 16];
  alignas(64) uint16_t vb[4][16][32];  // V B tiles of one step, one per 16 dims: [pair of positions][dims x 2]
  alignas(64) float o[16][kMaxDim];    // out in acc_slot order
  alignas(64) uint16_t zero[kMaxDim] = {};
};

// p = exp(s - max) rounded to bfloat16 over one column's npos scores s (-inf where it sees no
// position, p 0 there), max the lanes' maxima mx; returns the column's sum of p.
inline float softmax_row(const float* s, uint16_t* p, int64_t npos, __m512 mx) {
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < npos; t += 16) {
    const __m512 sv = _mm512_loadu_ps(s + t);
    const __mmask16 seen = _mm512_cmp_ps_mask(sv, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(seen, pdserve::exp_approx16(_mm512_sub_ps(sv, m)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
}

// Pass 2 for 64 dims (`half`): buf.o's [16 columns, those dims] = P . V over positions p0 .. p1, 32 a
// step: P (buf.p, row stride npos) the A tile, V's four B tiles of positions t .. t + 31 (1 KB apart,
// interleaved as buf.vb) at v_tiles(t).
template <typename VTiles>
inline void pv_half(Buffers& buf, int64_t p0, int64_t p1, int64_t npos, int half, VTiles v_tiles) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t = p0; t < p1; t += 32) {
    const uint16_t* b = v_tiles(t);
    _tile_loadd(4, buf.p.data() + (t - p0), npos * 2);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 1024, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 1536, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, &buf.o[0][64 * half], kMaxDim * 4);
  _tile_stored(1, &buf.o[0][64 * half + 16], kMaxDim * 4);
  _tile_stored(2, &buf.o[0][64 * half + 32], kMaxDim * 4);
  _tile_stored(3, &buf.o[0][64 * half + 48], kMaxDim * 4);
}

// The item's cols outputs (buf.o in acc_slot order, over each column's sum l) into out as bfloat16.
template <int kDim>
inline void store_out(const Buffers& buf, uint16_t* out, const float* l, int64_t cols, int64_t first_row,
                      int64_t num_heads, int64_t h, int64_t groups) {
  for (int64_t j = 0; j < cols; ++j) {
    uint16_t* op = out + ((first_row + j / groups) * num_heads + h * groups + j % groups) * kDim;
    const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
    alignas(64) float o[kDim];
    for (int64_t d = 0; d < kDim; ++d) o[d] = buf.o[j][pdserve::acc_slot(d)] * inv;
    for (int64_t d = 0; d < kDim; d += 16) pdserve::store_bf16x16(op + d, _mm512_load_ps(o + d));
  }
}

template <int kDim>
void attend_item(Buffers& buf, uint16_t* out, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                 const int32_t* table, int64_t b, int64_t r0, int64_t rows, int64_t h, int64_t nq, int64_t seq_len,
                 int64_t q_start, int64_t num_heads, int64_t groups, int64_t row, int64_t block_size, int64_t q_stride,
                 float scale, int64_t window) {
  constexpr int kSteps = kDim / 32;
  const int64_t cols = rows * groups;
  int64_t lo[16], hi[16];  // column j sees positions [lo[j], hi[j])
  for (int64_t j = 0; j < cols; ++j) {
    hi[j] = seq_len - nq + r0 + j / groups + 1;
    lo[j] = window > 0 ? std::max<int64_t>(0, hi[j] - window) : 0;
  }
  const int64_t lo_min = lo[0], hi_max = hi[cols - 1];
  const int64_t p0 = lo_min / 32 * 32, p1 = (hi_max + 31) / 32 * 32, npos = p1 - p0;
  const auto slot = [&](int64_t t) { return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size; };
  // Q^T: column j's dims 2i, 2i + 1 of step s at qt[s][i][2j .. 2j + 1]; columns past cols are 0
  std::memset(buf.qt, 0, sizeof(buf.qt));
  for (int64_t j = 0; j < cols; ++j) {
    const uint16_t* qr = q + (q_start + r0 + j / groups) * q_stride + (h * groups + j % groups) * kDim;
    for (int s = 0; s < kSteps; ++s)
      for (int i = 0; i < 16; ++i) std::memcpy(&buf.qt[s][i][2 * j], qr + 32 * s + 2 * i, 4);
  }
  buf.s.resize(16 * npos);
  buf.p.resize(16 * npos);  // rows past cols are P's zero rows in the A tile; the rest is written below
  std::memset(buf.p.data() + cols * npos, 0, (16 - cols) * npos * sizeof(uint16_t));
  float* S = buf.s.data();
  // pass 1: scores, 16 positions a tile product, from the block holding lo_min on
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i gather_idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(16));
  const int64_t s0 = lo_min / 16 * 16;
  __m512 mx[16];
  for (int64_t j = 0; j < cols; ++j) {
    mx[j] = _mm512_set1_ps(-INFINITY);
    for (int64_t t = p0; t < s0; t += 16) _mm512_storeu_ps(S + j * npos + t - p0, mx[j]);
  }
  for (int64_t t = s0; t < p1; t += 16) {
    if (t >= hi_max) {
      for (int64_t j = 0; j < cols; ++j) _mm512_storeu_ps(S + j * npos + t - p0, _mm512_set1_ps(-INFINITY));
      continue;
    }
    const uint16_t* kp = k_cache + slot(t) * row + h * kDim;
    if (t + kAhead < hi_max) {  // K and V rows of this head kAhead positions on
      const int64_t next = slot(t + kAhead) * row + h * kDim;
      for (int j = 0; j < 16; ++j)
        for (int c = 0; c < kDim * 2; c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + next + j * row) + c, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + next + j * row) + c, _MM_HINT_T1);
        }
    }
    _tile_zero(0);
    for (int s = 0; s < kSteps; ++s) {
      _tile_loadd(4, kp + 32 * s, row * 2);
      _tile_loadd(6, buf.qt[s], 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, buf.c, 64);
    const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(t)));
    for (int64_t j = 0; j < cols; ++j) {
      const __mmask16 valid = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(lo[j]))) &
                              _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(hi[j])));
      const __m512 sc = _mm512_mul_ps(_mm512_i32gather_ps(gather_idx, buf.c + j, 4), _mm512_set1_ps(scale));
      const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sc);
      _mm512_storeu_ps(S + j * npos + t - p0, sv);
      mx[j] = _mm512_max_ps(mx[j], sv);
    }
  }
  float l[16];
  for (int64_t j = 0; j < cols; ++j) l[j] = softmax_row(S + j * npos, buf.p.data() + j * npos, npos, mx[j]);
  // pass 2: P . V, 32 positions (16 pairs) a step, 64 dims (4 C tiles) at a time; V's rows interleaved
  // into buf.vb as the step takes them
  for (int half = 0; half < kDim / 64; ++half)
    pv_half(buf, p0, p1, npos, half, [&](int64_t t) {
      // positions t .. t + 15 and t + 16 .. t + 31 each lie in one block (block_size % 16 == 0)
      const uint16_t* base[2];
      for (int x = 0; x < 2; ++x)
        base[x] = t + 16 * x < hi_max ? v_cache + slot(t + 16 * x) * row + h * kDim + 64 * half : buf.zero;
      for (int i = 0; i < 16; ++i) {
        const int64_t ta = t + 2 * i, tb = ta + 1;
        const uint16_t* va = ta >= lo_min && ta < hi_max ? base[i / 8] + (2 * i % 16) * row : buf.zero;
        const uint16_t* vb = tb >= lo_min && tb < hi_max ? base[i / 8] + (2 * i % 16 + 1) * row : buf.zero;
        for (int x = 0; x < 2; ++x) {
          const __m512i ra = _mm512_loadu_si512(va + 32 * x), rb = _mm512_loadu_si512(vb + 32 * x);
          _mm512_store_si512(buf.vb[2 * x][i], _mm512_unpacklo_epi16(ra, rb));
          _mm512_store_si512(buf.vb[2 * x + 1][i], _mm512_unpackhi_epi16(ra, rb));
        }
      }
      return &buf.vb[0][0][0];
    });
  store_out<kDim>(buf, out, l, cols, q_start + r0, num_heads, h, groups);
}

#include "amx_attention_packed.h"

}  // namespace

namespace pdserve {

// paged_attention.cpp's bf16 call on AMX tiles (arguments and layouts as there); false, having done
// nothing, where this path does not take it.
bool amx_attention_bf16(uint16_t* out, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                        const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int64_t max_blocks, int64_t q_stride, float scale, int64_t window,
                        float softcap, int num_threads) {
  const int64_t groups = num_heads / num_kv_heads;
  if (!amx_attention_on || (head_dim != 64 && head_dim != 128 && head_dim != 256) || softcap > 0.f || block_size % 16 ||
      groups > 16 || !amx_granted())
    return false;
  const int64_t rows_per_item = 16 / groups, row = num_kv_heads * head_dim;
  const auto npos_of = [&](int64_t b) { return (static_cast<int64_t>(seq_lens[b]) + 31) / 32 * 32; };
  // Sequences with at least kPackItems items a KV head get their K and V packed once (pack_head), in
  // rounds of whole sequences whose tiles fit about kPackBytes a thread, each round packed and then
  // attended while its tiles are still in the caches. The other items (decode rows, short chunks)
  // follow in one more round, through attend_item.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rounds(1);  // items' (sequence, first query row)
  std::vector<std::vector<int64_t>> round_seqs(1);
  std::vector<int64_t> packed_at(num_seqs, -1);  // the sequence's offset in its round's tiles, in elements
  std::vector<std::pair<int64_t, int64_t>> rest;
  int64_t round_elems = 0, scratch_elems = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t nq = query_start_loc[b + 1] - query_start_loc[b];
    if (nq < kPackItems * rows_per_item) {
      for (int64_t r = 0; r < nq; r += rows_per_item) rest.emplace_back(b, r);
      continue;
    }
    const int64_t elems = npos_of(b) * head_dim * 2 * num_kv_heads;  // K^T and V of every KV head
    if (round_elems > 0 && (round_elems + elems) * 2 > kPackBytes * num_threads) {
      rounds.emplace_back();
      round_seqs.emplace_back();
      round_elems = 0;
    }
    packed_at[b] = round_elems;
    round_elems += elems;
    scratch_elems = std::max(scratch_elems, round_elems);
    round_seqs.back().push_back(b);
    for (int64_t r = 0; r < nq; r += rows_per_item) rounds.back().emplace_back(b, r);
  }
  const PackScratch scratch(scratch_elems);
  uint16_t* const packed = scratch.data();
  // The rest runs in one contiguous run of items a thread rather than item by item: a thread then takes
  // every KV head of its sequences in turn, and the lines of a block of the cache that the hardware
  // prefetchers bring in beside its head's (the heads share each slot's 512 bytes for 4 KV heads of 64
  // dims) serve the next head from its own caches (decode at batch 32, context 256: 5 % less time).
  std::vector<int64_t> rest_cost(1, 0);  // positions the rest's items before each read, cumulated
  for (const auto& [b, r0] : rest)
    for (int64_t h = 0; h < num_kv_heads; ++h) rest_cost.push_back(rest_cost.back() + seq_lens[b] + 16);
  // where (sequence b, KV head h)'s K^T and V tiles start
  const auto pack_of = [&](int64_t b, int64_t h) {
    uint16_t* kt = packed + packed_at[b] + h * npos_of(b) * head_dim * 2;
    return std::make_pair(kt, kt + npos_of(b) * head_dim);
  };
  const auto pack = head_dim == 64 ? pack_head<64> : head_dim == 128 ? pack_head<128> : pack_head<256>;
  const auto attend_pack = head_dim == 64 ? attend_packed<64> : head_dim == 128 ? attend_packed<128> : attend_packed<256>;
  const auto attend = head_dim == 64 ? attend_item<64> : head_dim == 128 ? attend_item<128> : attend_item<256>;
#pragma omp parallel num_threads(num_threads)
  {
    configure_tiles();
    Buffers buf;
    for (size_t g = 0; g < rounds.size(); ++g) {
      const int64_t units = static_cast<int64_t>(round_seqs[g].size()) * num_kv_heads;
#pragma omp for schedule(dynamic, 1)
      for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t b = round_seqs[g][unit / num_kv_heads], h = unit % num_kv_heads;
        const auto [kt, vb] = pack_of(b, h);
        pack(kt, vb, k_cache, v_cache, block_tables + b * max_blocks, seq_lens[b], npos_of(b), h, row, block_size,
             buf.zero);
      }
      const int64_t items = static_cast<int64_t>(rounds[g].size()) * num_kv_heads;
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < items; ++item) {
        const auto [b, r0] = rounds[g][item / num_kv_heads];
        const int64_t h = item % num_kv_heads, nq = query_start_loc[b + 1] - query_start_loc[b];
        const auto [kt, vb] = pack_of(b, h);
        attend_pack(buf, out, q, kt, vb, r0, std::min(rows_per_item, nq - r0), h, nq, seq_lens[b], query_start_loc[b],
                    num_heads, groups, q_stride, scale, window);
      }
    }
    // each thread one run of the rest, about equal in positions read
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num(), total = rest_cost.back();
    const auto run_start = [&](int64_t i) {
      return std::lower_bound(rest_cost.begin(), rest_cost.end(), (total * i + team - 1) / team) - rest_cost.begin();
    };
    for (int64_t item = run_start(me); item < run_start(me + 1); ++item) {
      const auto [b, r0] = rest[item / num_kv_heads];
      const int64_t h = item % num_kv_heads, nq = query_start_loc[b + 1] - query_start_loc[b];
      attend(buf, out, q, k_cache, v_cache, block_tables + b * max_blocks, b, r0, std::min(rows_per_item, nq - r0), h,
             nq, seq_lens[b], query_start_loc[b], num_heads, groups, row, block_size, q_stride, scale, window);
    }
    _tile_release();
  }
  return true;
}

}  // namespace pdserve

#else

namespace pdserve {
bool amx_attention_bf16(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, const int32_t*, const int32_t*,
                        const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t,
                        float, int) {
  return false;
}
}  // namespace pdserve

#endif
