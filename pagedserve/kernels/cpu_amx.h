// AMX's tile configuration, for the kernels built with AMX-TILE (cpu_blocks_bf16.cpp, cpu_prefill.cpp,
// cpu_decode.cpp); and the bf16 pair layout that its tdpbf16ps and AVX512-BF16's vdpbf16ps take.
#pragma once
#if defined(__AVX512BW__) || defined(__AMX_TILE__)
#include <immintrin.h>

#include <cstdint>
#endif

namespace pagedserve_amx {

#if defined(__AVX512BW__)
// The vpermw index that interleaves the two halves of 32 bf16 into pairs: lane 2q takes element q,
// lane 2q + 1 element 16 + q (two keys' probabilities or values, as the pairs the dot products take).
inline __m512i pair_interleave() {
  alignas(64) int16_t order[32];
  for (int q = 0; q < 16; ++q) order[2 * q] = static_cast<int16_t>(q), order[2 * q + 1] = static_cast<int16_t>(16 + q);
  return _mm512_load_si512(order);
}
#endif

#if defined(__AMX_TILE__)
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
#endif

}  // namespace pagedserve_amx
