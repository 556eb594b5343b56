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
// channels are split over `threads` OpenMP threads; each thread runs every block of rows through its
// channels while their weights stay in the L2 cache. A row's result depends on its own row of x only,
// whatever the number of rows in the call (each tile product's element sums its own row and column).
// Rows past M in the last block of rows are read from a zero-padded copy. Needs N % 16 == 0 and
// K % 32 == 0.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "amx_tiles.h"
#include "vec_math.h"

#if defined(PDSERVE_AMX)

namespace {

using pdserve::configure_tiles;

// Rows of x taken through every channel before the next rows: about this many bytes of them, so that
// they stay in the L2 cache while each thread's blocks of channels pass over them
constexpr int64_t kChunkBytes = 1024 * 1024;

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

}  // namespace

// 1 where this CPU runs AMX bfloat16 and Linux granted the tile state, 0 where not.
extern "C" int pdserve_bf16_amx_linear_supported() { return pdserve::amx_granted(); }

// x [M, K] bfloat16 (row stride K), packed [N / 16, K / 2, 16, 2] bfloat16, bias [N] bfloat16 or null
// -> y [M, N] bfloat16.
extern "C" void pdserve_bf16_amx_linear(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                                        int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t pairs = (N / 16 + 1) / 2;  // blocks of 32 channels (the last may hold 16)
  const int64_t chunk_rows = std::max<int64_t>(32, kChunkBytes / (2 * K) / 32 * 32);
  std::unique_ptr<uint16_t[]> pad;  // the last block of rows, zero-padded to 32, when M % 32 != 0
  if (M % 32) {
    pad.reset(new uint16_t[32 * K]);
    std::memcpy(pad.get(), x + (M - M % 32) * K, (M % 32) * K * 2);
    std::memset(pad.get() + (M % 32) * K, 0, (32 - M % 32) * K * 2);
  }
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    alignas(64) float c[32 * 32];
    for (int64_t chunk = 0; chunk < M; chunk += chunk_rows) {
#pragma omp for schedule(static)
      for (int64_t p = 0; p < pairs; ++p) {
        const int64_t nb = 2 * p;
        const bool two = nb + 1 < N / 16;
        const __m512 b0 = bias != nullptr ? pdserve::load_bf16x16(bias + nb * 16) : _mm512_setzero_ps();
        const __m512 b1 = bias != nullptr && two ? pdserve::load_bf16x16(bias + nb * 16 + 16) : _mm512_setzero_ps();
        for (int64_t m0 = chunk; m0 < std::min(M, chunk + chunk_rows); m0 += 32) {
          const uint16_t* xr = m0 + 32 <= M ? x + m0 * K : pad.get();
          const int64_t rows = std::min<int64_t>(32, M - m0);
          tile_block(xr, K, packed, K, nb, c, two, rows > 16);
          for (int64_t r = 0; r < rows; ++r) {
            uint16_t* yr = y + (m0 + r) * N + nb * 16;
            pdserve::store_bf16x16(yr, _mm512_add_ps(_mm512_load_ps(c + r * 32), b0));
            if (two) pdserve::store_bf16x16(yr + 16, _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b1));
          }
        }
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
