// What the AMX kernels (amx_linear.cpp, amx_attention.cpp) share: whether they are compiled in
// (PDSERVE_AMX), the process's permission to use the tiles, and the one tile shape they use.
//
// Linux gives a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, the
// kernel's Documentation/arch/x86/xstate.rst); amx_granted() asks once.
#pragma once
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define PDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace pdserve {

// Whether Linux granted this process the AMX tile data state (asked on the first call).
inline bool amx_granted() {
  constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl code, asm/prctl.h
  constexpr int kXfeatureXtiledata = 18;     // the AMX tile data state component
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

struct TileConfig {  // the 64-byte operand of ldtilecfg, palette 1
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr TileConfig tiles_16x64() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  return cfg;
}

// Every one of the 8 tiles as 16 rows of 64 bytes: float32 [16, 16] or bfloat16 [16, 32] (A, or a
// B of 16 pairs of rows). Per thread: each OpenMP thread configures its own. The configuration is a
// constant in memory: GCC does not see ldtilecfg read its operand, and may drop or reorder the stores
// that would fill a local one (a general-protection fault).
inline void configure_tiles() {
  alignas(64) static constexpr TileConfig kConfig = tiles_16x64();
  _tile_loadconfig(&kConfig);
}

}  // namespace pdserve
#endif
