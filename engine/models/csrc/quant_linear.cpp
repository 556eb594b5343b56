// Quantized weights times int8 activations, with AVX512-VNNI: int8 per channel and int4 per group of 32.
//
// Activations x [M, K] bfloat16 are quantized here per group of 32 inputs, as llama.cpp quantizes them
// for its Q8_0 / Q4_0 dots: x[m, k] ~ sx[m, g] * xq[m, k], xq in [-127, 127], sx = max |x| / 127 over
// the group, g = k / 32; xs[m, g] is the group's sum of xq. Then (engine/models/quant.py, int4.py):
//
//   int8:  w[n, k] = q[n, k] * sw[n],                 q in [-127, 127]
//          y[m, n] = sw[n] * sum_g sx[m, g] * (dot(q + 128, xq) - 128 * xs[m, g])
//   int4:  w[n, k] = (q[n, k] - 8) * s[g, n] + z[g, n], q in [0, 15]
//          y[m, n] = sum_g sx[m, g] * (s[g, n] * (dot(q, xq) - 8 * xs[m, g]) + z[g, n] * xs[m, g])
//
// with each dot over the group's 32 inputs, exact in int32. vpdpbusd multiplies unsigned by signed bytes,
// hence int8's weights stored as q + 128 and the 128 * xs taken off per group.
//
// The 16 lanes of a vector are 16 output channels, so scales apply lane by lane and no horizontal sum is
// needed: vpdpbusd multiplies each lane's 4 weight bytes by 4 bytes of x broadcast to every lane. The
// weights are packed by engine/models/quant.py and int4.py, in blocks of 16 channels nb:
//
//   int8 packed [N / 16, K / 32, 8, 16, 4] uint8: byte [nb, g, p, l, b] = q[16 nb + l, 32 g + 4 p + b] + 128
//        sw     [N] float32
//   int4 packed [N / 16, K / 32, 4, 16, 4] uint8: byte [nb, g, p, l, b] = q[16 nb + l, 32 g + 4 p + b]
//                                                  | q[16 nb + l, 32 g + 16 + 4 p + b] << 4
//        sz     [N / 16, K / 32, 2, 16] bfloat16: the 16 channels' scales s, then their zeros z
//
// so a group of 16 channels costs 8 loads and 8 vpdpbusd (int8), or 4 loads, 12 integer instructions and
// 8 vpdpbusd (int4: the low and high nibbles of one load feed two), per row of x.
//
// Calls of 16 rows or more run AMX tiles where the CPU has AMX-INT8 (amx_linear below), with
// the same bits.
//
// Blocks of 16 channels are split over `threads` OpenMP threads; each runs every row of x through its
// block (8 rows a pass, their accumulators in registers) while the block's weights stay in the L1 cache.
// A row of y depends on its own row of x only, so the result does not depend on the batch around it.
// Each group prefetches the weights (and int4's scales) 4 KB ahead of it: the hardware prefetchers
// alone streamed int4 weights at 6.7 GB/s where one thread reads 11.7 GB/s (SmolLM2's linears, batch
// 1, DRAM-cold: 7.9 -> 5.9 ms; int8's 10.9 ms did not move).
// Needs N % 16 == 0 and K % 32 == 0.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace {

using pdserve::load_bf16x16;
using pdserve::store_bf16x16;

constexpr int kGroup = 32;       // inputs per activation scale (and per int4 weight scale)
constexpr int kRowsPerPass = 8;  // rows of x whose accumulators one pass over a block keeps in registers
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of a group its weights are prefetched

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One row of x [K] bfloat16 -> xq [K] int8, its groups' scales sx [K / 32] and sums xs [K / 32].
void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* sx, int32_t* xs) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __m512 a = load_bf16x16(x + g * kGroup), b = load_bf16x16(x + g * kGroup + 16);
    float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
    __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * kGroup), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * kGroup + 16), _mm512_cvtsepi32_epi8(qb));
    sx[g] = m / 127.f;
    xs[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  }
}

// x quantized: xq [rows, K], sx and xs [rows, K / 32]; rows = M, or M rounded up to a multiple of 16
// for the AMX tiles (`padded`), the rows past M zero.
struct Activations {
  std::vector<int8_t> xq;
  std::vector<float> sx;
  std::vector<int32_t> xs;
  Activations(const uint16_t* x, int64_t M, int64_t K, bool padded)
      : xq(rows(M, padded) * K), sx(rows(M, padded) * K / kGroup), xs(rows(M, padded) * K / kGroup) {
    const int64_t G = K / kGroup;
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, &xq[m * K], &sx[m * G], &xs[m * G]);
  }
  static int64_t rows(int64_t M, bool padded) { return padded ? (M + 15) / 16 * 16 : M; }
};

// The group's int32 dots of 16 channels with M rows of xq (rows at xg, stride K): two chains of 4
// vpdpbusd a row, inputs 0-15 and 16-31 of the group.
template <int M, int Bits>
inline void group_dots(const uint8_t* wg, const int8_t* xg, int64_t K, __m512i* d) {
  __m512i d2[M];
  for (int m = 0; m < M; ++m) d[m] = d2[m] = _mm512_setzero_si512();
  for (int p = 0; p < 4; ++p) {
    __m512i a, b;
    if constexpr (Bits == 4) {
      const __m512i low = _mm512_set1_epi8(0x0f);
      __m512i v = _mm512_loadu_si512(wg + p * 64);
      a = _mm512_and_si512(v, low), b = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    } else {
      a = _mm512_loadu_si512(wg + p * 64), b = _mm512_loadu_si512(wg + (p + 4) * 64);
    }
    for (int m = 0; m < M; ++m) {
      d[m] = _mm512_dpbusd_epi32(d[m], a, bcast4(xg + m * K + 4 * p));
      d2[m] = _mm512_dpbusd_epi32(d2[m], b, bcast4(xg + m * K + 16 + 4 * p));
    }
  }
  for (int m = 0; m < M; ++m) d[m] = _mm512_add_epi32(d[m], d2[m]);
}

// Rows m0 .. m0 + M of y for the 16 channels of block nb; `scales` is sw (int8) or sz (int4).
template <int M, int Bits>
void channel_block(const uint8_t* w, const void* scales, const Activations& a, uint16_t* y, int64_t N, int64_t K,
                   int64_t nb, int64_t m0) {
  const int64_t G = K / kGroup;
  constexpr int64_t kGroupBytes = 16 * kGroup * Bits / 8;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const char* wg = reinterpret_cast<const char*>(w + (nb * G + g) * kGroupBytes);
    for (int64_t c = 0; c < kGroupBytes; c += 64) _mm_prefetch(wg + kPrefetchBytes + c, _MM_HINT_T0);
    if constexpr (Bits == 4)
      _mm_prefetch(reinterpret_cast<const char*>(static_cast<const uint16_t*>(scales) + (nb * G + g) * 32) +
                       kPrefetchBytes / 4, _MM_HINT_T0);
    __m512i d[M];
    group_dots<M, Bits>(w + (nb * G + g) * kGroupBytes, &a.xq[m0 * K + g * kGroup], K, d);
    __m512 s, z;
    if constexpr (Bits == 4) {
      const uint16_t* szg = static_cast<const uint16_t*>(scales) + (nb * G + g) * 32;
      s = load_bf16x16(szg), z = load_bf16x16(szg + 16);
    }
    for (int m = 0; m < M; ++m) {
      const float sxm = a.sx[(m0 + m) * G + g];
      const int32_t xsm = a.xs[(m0 + m) * G + g];
      const int32_t offset = (Bits == 4 ? 8 : 128) * xsm;
      __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(d[m], _mm512_set1_epi32(offset)));
      if constexpr (Bits == 4) {
        acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(sxm)), acc[m]);
        acc[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(sxm * static_cast<float>(xsm)), acc[m]);
      } else {
        acc[m] = _mm512_fmadd_ps(dot, _mm512_set1_ps(sxm), acc[m]);
      }
    }
  }
  if constexpr (Bits == 8) {
    __m512 sw = _mm512_loadu_ps(static_cast<const float*>(scales) + nb * 16);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_mul_ps(acc[m], sw);
  }
  for (int m = 0; m < M; ++m) store_bf16x16(y + (m0 + m) * N + nb * 16, acc[m]);
}

#if defined(PDSERVE_AMX) && defined(__AMX_INT8__)
#define PDSERVE_AMX_INT8 1
// int8 and int4 on AMX tiles (tdpbsud: signed x times unsigned weights), for calls of kAmxMinRows rows
// or more. The packed int8 block of one group, [8, 16, 4] uint8, is the B tile of a 32-input step as
// it lies (8 rows of 64 bytes); int4's is unpacked to that form, one block of 16 channels at a time,
// its values 0-15. xq's 16 rows x 32 inputs of that group are the A tile. Each group's int32 product
// goes through the same float32 steps as the VNNI path above, so a row gets the same bits on either
// path. Tiles 0-1: A, 2-3: B, 4-5: C, alternating between groups: the next group's tile work is issued before
// this group's scaling. One thread, SmolLM2's weights in cache, us a call at 16 / 32 / 256 rows:
// int8 3,072 x 576 203 / 372 / 2,706 against 258 / 458 / 3,193 on the VNNI path; int4 246 / 434 /
// 3,025 against 245 / 489 / 4,074. AMX's bfloat16 tiles over the bf16 weight took 235 / 263 / 994:
// a group's product and scaling cost more than a bf16 tile step over 32 inputs.
constexpr int64_t kAmxMinRows = 16;

constexpr pdserve::TileConfig int8_tiles() {
  pdserve::TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.colsb[t] = t < 2 ? 32 : 64;
    cfg.rows[t] = t == 2 || t == 3 ? 8 : 16;
  }
  return cfg;
}

// One group's int32 product into c [16, 16] through tile set t of the two (A tile t, B tile 2 + t, C
// tile 4 + t); the tile intrinsics take their tile numbers as literals.
#define PDSERVE_GROUP_PRODUCT(A, B, C, xg, K, wg, c) \
  do {                                              \
    _tile_loadd(A, xg, K);                          \
    _tile_loadd(B, wg, 64);                         \
    _tile_zero(C);                                  \
    _tile_dpbsud(C, A, B);                          \
    _tile_stored(C, c, 64);                         \
  } while (0)

// Rows m0 .. m0 + 16 of y for the 16 channels of block nb; wb: the block's B tiles, one of 512 bytes
// per group (int8's packed block as it lies, int4's unpacked by unpack_int4_block).
template <int Bits>
void amx_block(const uint8_t* wb, const void* scales, const Activations& a, uint16_t* y, int64_t M, int64_t N,
               int64_t K, int64_t nb, int64_t m0) {
  const int64_t G = K / kGroup;
  alignas(64) int32_t c[2][16 * 16];
  __m512 acc[16];  // all 16 rows, those past M zero, so that the loops unroll and acc stays in registers
  for (auto& v : acc) v = _mm512_setzero_ps();
  const float* sx = &a.sx[m0 * G];
  const int32_t* xs = &a.xs[m0 * G];
  const auto product = [&](int64_t g) {
    const int8_t* xg = &a.xq[m0 * K + g * kGroup];
    if (g % 2 == 0) PDSERVE_GROUP_PRODUCT(0, 2, 4, xg, K, wb + g * 512, c[0]);
    else PDSERVE_GROUP_PRODUCT(1, 3, 5, xg, K, wb + g * 512, c[1]);
  };
  product(0);
  for (int64_t g = 0; g < G; ++g) {  // the next group's tile work is issued before this group's scaling
    if (g + 1 < G) product(g + 1);
    const int32_t* cg = c[g % 2];
    __m512 s, z;
    if constexpr (Bits == 4) {
      const uint16_t* szg = static_cast<const uint16_t*>(scales) + (nb * G + g) * 32;
      s = load_bf16x16(szg), z = load_bf16x16(szg + 16);
    }
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {  // channel_block's float32 steps, in its order
      const float sxr = sx[r * G + g];
      const int32_t xsr = xs[r * G + g];
      const __m512i d = _mm512_sub_epi32(_mm512_load_si512(cg + 16 * r), _mm512_set1_epi32((Bits == 4 ? 8 : 128) * xsr));
      if constexpr (Bits == 4) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_set1_ps(sxr)), acc[r]);
        acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(sxr * static_cast<float>(xsr)), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(sxr), acc[r]);
      }
    }
  }
  if constexpr (Bits == 8) {
    const __m512 sw = _mm512_loadu_ps(static_cast<const float*>(scales) + nb * 16);
    for (auto& v : acc) v = _mm512_mul_ps(v, sw);
  }
  const int64_t rows = std::min<int64_t>(16, M - m0);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    if (r < rows) store_bf16x16(y + (m0 + r) * N + nb * 16, acc[r]);
}

// int4's packed block of 16 channels, [G, 4, 16, 4] bytes of two nibbles, as G B tiles [8, 16, 4] of
// values 0-15: rows 0-3 the low nibbles (inputs 0-15 of the group), rows 4-7 the high ones.
void unpack_int4_block(const uint8_t* w, int64_t G, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < G; ++g)
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(w + g * 256 + p * 64);
      _mm512_store_si512(out + g * 512 + p * 64, _mm512_and_si512(v, low));
      _mm512_store_si512(out + g * 512 + (p + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

template <int Bits>
void amx_linear(const Activations& a, const uint8_t* w, const void* scales, uint16_t* y, int64_t M, int64_t N,
                int64_t K, int threads) {
  const int64_t G = K / kGroup;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) static constexpr pdserve::TileConfig kConfig = int8_tiles();
    _tile_loadconfig(&kConfig);
    std::vector<uint8_t> unpacked(Bits == 4 ? G * 512 + 64 : 0);
    uint8_t* ub = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(unpacked.data()) + 63) / 64 * 64);
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < N / 16; ++nb) {
      const uint8_t* wb = w + nb * G * 16 * kGroup * Bits / 8;
      if constexpr (Bits == 4) unpack_int4_block(wb, G, ub), wb = ub;
      for (int64_t m0 = 0; m0 < M; m0 += 16) amx_block<Bits>(wb, scales, a, y, M, N, K, nb, m0);
    }
    _tile_release();
  }
}
#endif

template <int Bits>
void linear(const uint16_t* x, const uint8_t* w, const void* scales, uint16_t* y, int64_t M, int64_t N, int64_t K,
            int threads) {
#if defined(PDSERVE_AMX_INT8)
  if (M >= kAmxMinRows && pdserve::amx_granted()) {
    amx_linear<Bits>(Activations(x, M, K, true), w, scales, y, M, N, K, threads);
    return;
  }
#endif
  const Activations a(x, M, K, false);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t nb = 0; nb < N / 16; ++nb) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      switch (std::min<int64_t>(kRowsPerPass, M - m0)) {
        case 1: channel_block<1, Bits>(w, scales, a, y, N, K, nb, m0); break;
        case 2: channel_block<2, Bits>(w, scales, a, y, N, K, nb, m0); break;
        case 3: channel_block<3, Bits>(w, scales, a, y, N, K, nb, m0); break;
        case 4: channel_block<4, Bits>(w, scales, a, y, N, K, nb, m0); break;
        case 5: channel_block<5, Bits>(w, scales, a, y, N, K, nb, m0); break;
        case 6: channel_block<6, Bits>(w, scales, a, y, N, K, nb, m0); break;
        case 7: channel_block<7, Bits>(w, scales, a, y, N, K, nb, m0); break;
        default: channel_block<kRowsPerPass, Bits>(w, scales, a, y, N, K, nb, m0); break;
      }
    }
  }
}

}  // namespace

// 1 where this CPU has AVX512-VNNI, 0 where not (the caller keeps torch's kernels).
extern "C" int pdserve_quant_linear_supported() { return 1; }

// x [M, K] bfloat16, packed and sw as above -> y [M, N] bfloat16.
extern "C" void pdserve_int8_linear_bf16(const uint16_t* x, const uint8_t* packed, const float* sw, uint16_t* y,
                                         int64_t M, int64_t N, int64_t K, int threads) {
  linear<8>(x, packed, sw, y, M, N, K, threads);
}

// x [M, K] bfloat16, packed and sz as above -> y [M, N] bfloat16.
extern "C" void pdserve_int4_linear_bf16(const uint16_t* x, const uint8_t* packed, const uint16_t* sz, uint16_t* y,
                                         int64_t M, int64_t N, int64_t K, int threads) {
  linear<4>(x, packed, sz, y, M, N, K, threads);
}

#else

extern "C" int pdserve_quant_linear_supported() { return 0; }
extern "C" void pdserve_int8_linear_bf16(const uint16_t*, const uint8_t*, const float*, uint16_t*, int64_t, int64_t,
                                         int64_t, int) {}
extern "C" void pdserve_int4_linear_bf16(const uint16_t*, const uint8_t*, const uint16_t*, uint16_t*, int64_t,
                                         int64_t, int64_t, int) {}

#endif
