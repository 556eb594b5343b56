// bfloat16 linears on AMX tiles (tdpbf16ps), over the same packed weight as dense_linear.cpp.
//
// y[m, n] = bias[n] + sum_k x[m, k] * w[n, k], accumulated in float32, rounded to bfloat16 once.
//
// dense_linear.cpp packs a bfloat16 weight as [N / 16, K / 2, 16, 2]: 16 consecutive pairs of inputs
// of one block of 16 channels are 16 rows of 64 bytes, which is the layout an AMX B tile reads (one
// row per pair of inputs, 16 channels of 2 bfloat16 each). So on AMX CPUs this file runs every call
// over the one packed copy: at one row it streams the weights as fast as dense_linear.cpp (a decode
// step reads them at the read probe's rate), and from a few rows on the multiply-adds are several
// times faster. A tile step multiplies 16 rows by 32 inputs by 16 channels.
//
// The work is split into blocks of 32 rows x 32 channels (four float32 C tiles: tmm0..3), the A tiles
// (tmm4, tmm5: 16 rows x 32 inputs each) read straight from x with its row stride, the B tiles (tmm6,
// tmm7: 32 inputs x 16 channels each) from the packed weight, 1 KB contiguous each. The blocks of
// channels are split over `threads` OpenMP threads. A call of up to 32 rows (decode) runs each block
// of channels over all K inputs at once. A longer call (prefill) takes kBlockM rows at a time and the
// inputs kBlockK at a time: a block of channels' weights for those inputs (16 KB) stays in the L1
// cache while every block of rows passes over it, the C tiles parked in float32 between spans of
// inputs (a tile store and load are exact). Against the whole K at once (the weights of a block of
// channels, 48 KB and more, streaming from L2 with x), the linears of the 80M model at 256 and 1,024
// rows took 10-15 % less time.
//
// Every element of y sums its own row of x times its own channel over k in ascending order, however
// the call is blocked, so a row's result depends on its own row of x only, whatever the number of
// rows in the call. Rows past M in the last block of rows are read from a zero-padded copy. Needs
// N % 16 == 0 and K % 32 == 0.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "amx_tiles.h"
#include "vec_math.h"

#if defined(PDSERVE_AMX)

namespace {

using pdserve::configure_tiles;

constexpr int64_t kBlockM = 256;  // rows of a long call taken through every channel before the next ones
constexpr int64_t kBlockK = 256;  // inputs of a long call a block of channels runs before the next ones

// Rows 0 .. 16 * (kTwoM ? 2 : 1) of xr (row stride x_stride) times channels 16 nb .. 16 nb + 16 * (kTwoN ?
// 2 : 1) into c [32, 32] float32 (row stride 32).
template <bool kTwoN, bool kTwoM>
void tile_block(const uint16_t* xr, int64_t x_stride, const uint16_t* w, int64_t K, int64_t nb, float* c) {
  const int64_t block = K * 16;  // elements of one block of 16 channels in the packed weight
  const uint16_t* b0 = w + nb * block;
  const uint16_t* b1 = b0 + block;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, xr + k, x_stride * 2);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (kTwoM) {
      _tile_loadd(5, xr + 16 * x_stride + k, x_stride * 2);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (kTwoN) {
      _tile_loadd(7, b1 + k * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (kTwoM) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  if (kTwoN) _tile_stored(1, c + 16, 128);
  if (kTwoM) _tile_stored(2, c + 16 * 32, 128);
  if (kTwoN && kTwoM) _tile_stored(3, c + 16 * 32 + 16, 128);
}

void tile_block(const uint16_t* xr, int64_t x_stride, const uint16_t* w, int64_t K, int64_t nb, float* c, bool two_n,
                bool two_m) {
  if (two_n && two_m) tile_block<true, true>(xr, x_stride, w, K, nb, c);
  if (two_n && !two_m) tile_block<true, false>(xr, x_stride, w, K, nb, c);
  if (!two_n && two_m) tile_block<false, true>(xr, x_stride, w, K, nb, c);
  if (!two_n && !two_m) tile_block<false, false>(xr, x_stride, w, K, nb, c);
}

// Rows 0 .. 31 of xr times channels 16 nb .. 16 nb + 16 * (two ? 2 : 1) over inputs k0 .. k1, added to
// the float32 sums parked at c [32, 32] (row stride 32), or starting them when k0 is 0.
void tile_span(const uint16_t* xr, int64_t x_stride, const uint16_t* w, int64_t K, int64_t nb, float* c, bool two,
               int64_t k0, int64_t k1) {
  const uint16_t* b0 = w + nb * K * 16;
  const uint16_t* b1 = b0 + K * 16;
  if (k0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, 128);
    _tile_loadd(1, c + 16, 128);
    _tile_loadd(2, c + 16 * 32, 128);
    _tile_loadd(3, c + 16 * 32 + 16, 128);
  }
  for (int64_t k = k0; k < k1; k += 32) {
    _tile_loadd(4, xr + k, x_stride * 2);
    _tile_loadd(6, b0 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, xr + 16 * x_stride + k, x_stride * 2);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, b1 + k * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

}  // namespace

// 1 where this CPU runs AMX bfloat16 and Linux granted the tile state, 0 where not.
extern "C" int pdserve_bf16_amx_linear_supported() { return pdserve::amx_granted(); }

// x [M, K] bfloat16 (row stride K), packed [N / 16, K / 2, 16, 2] bfloat16, bias [N] bfloat16 or null
// -> y [M, N] bfloat16.
extern "C" void pdserve_bf16_amx_linear(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                                        int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t pairs = (N / 16 + 1) / 2;  // blocks of 32 channels (the last may hold 16)
  std::unique_ptr<uint16_t[]> pad;  // the last block of rows, zero-padded to 32, when M % 32 != 0
  if (M % 32) {
    pad.reset(new uint16_t[32 * K]);
    std::memcpy(pad.get(), x + (M - M % 32) * K, (M % 32) * K * 2);
    std::memset(pad.get() + (M % 32) * K, 0, (32 - M % 32) * K * 2);
  }
  // y's rows m0 .. m0 + 31 (those below M) of channels 16 nb .. 16 nb + 31, from c [32, 32] plus the bias
  const auto store = [&](const float* c, int64_t m0, int64_t nb, bool two) {
    const __m512 b0 = bias != nullptr ? pdserve::load_bf16x16(bias + nb * 16) : _mm512_setzero_ps();
    const __m512 b1 = bias != nullptr && two ? pdserve::load_bf16x16(bias + nb * 16 + 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < std::min<int64_t>(32, M - m0); ++r) {
      uint16_t* yr = y + (m0 + r) * N + nb * 16;
      pdserve::store_bf16x16(yr, _mm512_add_ps(_mm512_load_ps(c + r * 32), b0));
      if (two) pdserve::store_bf16x16(yr + 16, _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b1));
    }
  };
  if (M <= 32) {
#pragma omp parallel num_threads(threads)
    {
      configure_tiles();
      alignas(64) float c[32 * 32];
      const uint16_t* xr = M == 32 ? x : pad.get();
#pragma omp for schedule(static)
      for (int64_t p = 0; p < pairs; ++p) {
        const bool two = 2 * p + 1 < N / 16;
        tile_block(xr, K, packed, K, 2 * p, c, two, M > 16);
        store(c, 0, 2 * p, two);
      }
      _tile_release();
    }
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    alignas(64) float parked[kBlockM * 32];  // C tiles, [rows, 32]: 32 KB of the thread's stack
    for (int64_t chunk = 0; chunk < M; chunk += kBlockM) {
      const int64_t chunk_end = std::min(M, chunk + kBlockM);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < pairs; ++p) {
        const int64_t nb = 2 * p;
        const bool two = nb + 1 < N / 16;
        for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
          for (int64_t m0 = chunk; m0 < chunk_end; m0 += 32) {
            const uint16_t* xr = m0 + 32 <= M ? x + m0 * K : pad.get();
            float* c = parked + (m0 - chunk) * 32;
            tile_span(xr, K, packed, K, nb, c, two, k0, std::min(K, k0 + kBlockK));
          }
        }
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += 32) store(parked + (m0 - chunk) * 32, m0, nb, two);
      }
    }
    _tile_release();
  }
}

#else

extern "C" int pdserve_bf16_amx_linear_supported() { return 0; }
extern "C" void pdserve_bf16_amx_linear(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t,
                                        int64_t, int64_t, int) {}

#endif
