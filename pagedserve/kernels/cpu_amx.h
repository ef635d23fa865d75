// AMX's tile configuration, for the kernels built with AMX-TILE (cpu_blocks_bf16.cpp, cpu_prefill.cpp).
#pragma once
#if defined(__AMX_TILE__)
#include <immintrin.h>

#include <cstdint>

namespace pagedserve_amx {

// ldtilecfg's 64-byte operand, palette 1: each tile's rows and bytes a row (unused tiles 0)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Makes cfg this thread's tile configuration. GCC 12 does not see ldtilecfg read cfg and drops the
// stores that filled it without the barrier (a #GP in ldtilecfg, rows and columns all zero).
inline void load_tile_config(const TileConfig& cfg) {
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace pagedserve_amx
#endif
