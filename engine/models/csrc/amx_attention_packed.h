// amx_attention.cpp's path for prompts: a sequence's K and V of one KV head packed once as tiles
// (pack_head) for all the items of its query rows (attend_packed). Included by amx_attention.cpp only,
// inside its anonymous namespace, after its Buffers and constants.
#pragma once

// pack_head's tiles of one call. A round holds about kPackBytes a thread, more only for one long
// sequence; the calling thread keeps a buffer of up to kKeptPackBytes from call to call, so most calls
// neither allocate nor zero one, and a larger round (a long context) gets its own, freed with the call.
class PackScratch {
 public:
  explicit PackScratch(int64_t elems) {
    thread_local Buffer kept;
    Buffer& buf = elems * static_cast<int64_t>(sizeof(uint16_t)) <= kKeptPackBytes ? kept : own_;
    buf.reserve(elems);
    data_ = buf.data;
  }
  uint16_t* data() const { return data_; }

 private:
  struct Buffer {
    uint16_t* data = nullptr;
    int64_t size = 0;
    void reserve(int64_t elems) {
      if (elems <= size) return;
      ::operator delete(data, std::align_val_t(64));
      data = static_cast<uint16_t*>(::operator new(elems * sizeof(uint16_t), std::align_val_t(64)));
      size = elems;
    }
    ~Buffer() { ::operator delete(data, std::align_val_t(64)); }
  };
  Buffer own_;
  uint16_t* data_ = nullptr;
};

// One sequence's K and V of one KV head, packed once for all the items of its query rows (a prompt of
// many rows has 16 / groups rows an item, each of which would read K and interleave V afresh):
//   kt: K^T as pass 1's B tiles, [position / 16][step of 32 dims][16 pairs of dims][16 positions, 2];
//   vb: V as pass 2's B tiles, [position / 32][64 dims][4][16 pairs of positions][32], interleaved as
//       attend_item interleaves them (acc_slot order), positions at and past seq_len zero.
// Both cover npos positions (a multiple of 32, at least seq_len).
template <int kDim>
void pack_head(uint16_t* kt, uint16_t* vb, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table,
               int64_t seq_len, int64_t npos, int64_t h, int64_t row, int64_t block_size, const uint16_t* zero) {
  constexpr int kSteps = kDim / 32;
  const auto slot = [&](int64_t t) { return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size; };
  // 16 positions t .. t + 15 lie in one block: rows `row` apart
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(row / 2)));
  for (int64_t t = 0; t < npos; t += 16)
    for (int s = 0; s < kSteps; ++s) {
      uint16_t* dst = kt + ((t / 16) * kSteps + s) * 512;
      if (t >= seq_len) {
        std::memset(dst, 0, 1024);
        continue;
      }
      const uint16_t* kr = k_cache + slot(t) * row + h * kDim + 32 * s;
      for (int i = 0; i < 16; ++i)
        _mm512_store_si512(dst + 32 * i, _mm512_i32gather_epi32(rows, kr + 2 * i, 4));
    }
  for (int64_t t = 0; t < npos; t += 32)
    for (int half = 0; half < kDim / 64; ++half) {
      uint16_t* dst = vb + ((t / 32) * (kDim / 64) + half) * 2048;
      for (int i = 0; i < 16; ++i) {
        const int64_t ta = t + 2 * i, tb = ta + 1;
        const uint16_t* va = ta < seq_len ? v_cache + slot(ta) * row + h * kDim + 64 * half : zero;
        const uint16_t* vr = tb < seq_len ? v_cache + slot(tb) * row + h * kDim + 64 * half : zero;
        for (int x = 0; x < 2; ++x) {
          const __m512i ra = _mm512_loadu_si512(va + 32 * x), rb = _mm512_loadu_si512(vr + 32 * x);
          _mm512_store_si512(dst + (2 * x) * 512 + 32 * i, _mm512_unpacklo_epi16(ra, rb));
          _mm512_store_si512(dst + (2 * x + 1) * 512 + 32 * i, _mm512_unpackhi_epi16(ra, rb));
        }
      }
    }
}

// attend_item over pack_head's tiles: the same products in the same order (scores S [columns,
// positions] = Q . K^T rather than S^T = K . Q^T: each element sums the same pairs), so the same bits.
// C tile c = Q (tmm4, tmm5: 16 columns x 64 dims) . K^T, K^T's two B tiles at k0 (through tmm6, tmm7)
#define PDSERVE_QK_TILE(c, k0)      \
  do {                              \
    _tile_zero(c);                  \
    _tile_loadd(6, (k0), 64);       \
    _tile_dpbf16ps(c, 4, 6);        \
    _tile_loadd(7, (k0) + 512, 64); \
    _tile_dpbf16ps(c, 5, 7);        \
  } while (0)

template <int kDim>
void attend_packed(Buffers& buf, uint16_t* out, const uint16_t* q, const uint16_t* kt, const uint16_t* vb, int64_t r0,
                   int64_t rows, int64_t h, int64_t nq, int64_t seq_len, int64_t q_start, int64_t num_heads,
                   int64_t groups, int64_t q_stride, float scale, int64_t window) {
  constexpr int kSteps = kDim / 32;
  const int64_t cols = rows * groups;
  int64_t lo[16], hi[16];
  for (int64_t j = 0; j < cols; ++j) {
    hi[j] = seq_len - nq + r0 + j / groups + 1;
    lo[j] = window > 0 ? std::max<int64_t>(0, hi[j] - window) : 0;
  }
  const int64_t lo_min = lo[0], hi_max = hi[cols - 1];
  const int64_t p0 = lo_min / 32 * 32, p1 = (hi_max + 31) / 32 * 32, npos = p1 - p0;
  for (int64_t j = 0; j < 16; ++j) {
    if (j < cols)
      std::memcpy(buf.qa[j], q + (q_start + r0 + j / groups) * q_stride + (h * groups + j % groups) * kDim, kDim * 2);
    else
      std::memset(buf.qa[j], 0, kDim * 2);
  }
  buf.s.resize(16 * npos);
  buf.p.resize(16 * npos);
  std::memset(buf.p.data() + cols * npos, 0, (16 - cols) * npos * sizeof(uint16_t));
  float* S = buf.s.data();
  const int64_t s0 = lo_min / 16 * 16;
  // pass 1: S rows are the columns, 16 positions a tile product
  for (int64_t t = s0; t < std::min(p1, (hi_max + 15) / 16 * 16); t += 16) {
    _tile_zero(0);
    for (int s = 0; s < kSteps; ++s) {
      _tile_loadd(4, &buf.qa[0][32 * s], kMaxDim * 2);
      _tile_loadd(6, kt + ((t / 16) * kSteps + s) * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, S + t - p0, npos * 4);
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float l[16];
  for (int64_t j = 0; j < cols; ++j) {
    float* Sj = S + j * npos;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = p0; t < p1; t += 16) {
      if (t < s0 || t >= hi_max) {
        _mm512_storeu_ps(Sj + t - p0, _mm512_set1_ps(-INFINITY));
        continue;
      }
      const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(t)));
      const __mmask16 valid = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(lo[j]))) &
                              _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(hi[j])));
      const __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(Sj + t - p0), _mm512_set1_ps(scale));
      const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sc);
      _mm512_storeu_ps(Sj + t - p0, sv);
      mx = _mm512_max_ps(mx, sv);
    }
    l[j] = softmax_row(Sj, buf.p.data() + j * npos, npos, mx);
  }
  // pass 2: P . V over the packed V tiles
  for (int half = 0; half < kDim / 64; ++half)
    pv_half(buf, p0, p1, npos, half, [&](int64_t t) { return vb + ((t / 32) * (kDim / 64) + half) * 2048; });
  store_out<kDim>(buf, out, l, cols, q_start + r0, num_heads, h, groups);
}

