// AMX tiles (Sapphire Rapids and later: amx_tile, amx_bf16) for duet's CPU kernels: whether a
// build has them, the process's permission to use them, and the tile configuration the bf16
// products share (engine/kernels/quant_linear_cpu.cpp, dense_linear_cpu.cpp).
//
// Tiles 0-3 hold fp32 sums (row tile i, channel block j in tile 2i + j: 16 x 16), 4-5 rows of x
// (16 x 32 bf16), 6-7 weights as column pairs of 16 channels (16 pairs x 16 channels x 2 bf16,
// 64 bytes per pair: the layout `_tile_dpbf16ps` reads). A tile's rows are independent, so a
// row's sums never depend on the other rows sharing its tile.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define DUET_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace duet {

constexpr bool kAmxBuild = true;

// Linux hands a process AMX's tile state only on request (once; every thread then has it).
inline bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXFeatureXTileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXFeatureXTileData) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a configuration. GCC's _tile_loadconfig tells the compiler it reads only the first 8
// bytes of the configuration, which then may store the rest after the instruction (a tile
// configuration of stack garbage, seen as a SIGSEGV in the attention kernels): this asm
// names the whole struct as its input.
inline void load_tile_config(const TileConfig& cfg) {
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// The tiles for a chunk of `rows` (1 to 32) rows of x: row tile 0 holds min(rows, 16) rows of x
// and of the sums, row tile 1 the rest, so a chunk reads and computes only its own rows.
// `configured` is the chunk size the calling thread's tiles hold now (-1: none); the
// configuration is loaded only when that changes. Each thread calls _tile_release() after its
// products, as oneDNN does around its own AMX kernels.
inline void configure_tiles(int64_t rows, int* configured) {
  if (rows == *configured) return;
  const int rows0 = static_cast<int>(rows < 16 ? rows : 16);
  const int rows1 = static_cast<int>(rows > 16 ? rows - 16 : 1);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = rows0;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = rows1;
  cfg.rows[6] = cfg.rows[7] = 16;
  load_tile_config(cfg);
  *configured = static_cast<int>(rows);
}

// The sums of RT row tiles x CT channel blocks (tiles 0-3) set to zero.
template <int RT, int CT>
inline void zero_sums() {
  _tile_zero(0);
  if constexpr (CT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && CT > 1) _tile_zero(3);
}

// One step of 32 columns: x's RT row tiles at their column (row stride xs elements) times CT
// blocks' weight tiles (w: block 0's 16 pairs, 64 bytes each; block stride ws elements), added
// to the sums. Each load comes just before its first product.
template <int RT, int CT>
inline void tile_step(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws) {
  _tile_loadd(4, x, xs * 2);
  _tile_loadd(6, w, 64);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (CT > 1) {
    _tile_loadd(7, w + ws, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  if constexpr (RT > 1) {
    _tile_loadd(5, x + 16 * xs, xs * 2);
    _tile_dpbf16ps(2, 5, 6);
  }
  if constexpr (RT > 1 && CT > 1) _tile_dpbf16ps(3, 5, 7);
}

// The sums into acc, [RT * 16][CT * 16] fp32 rows.
template <int RT, int CT>
inline void store_sums(float* acc) {
  constexpr int64_t kStride = CT * 16 * 4;  // bytes per acc row
  _tile_stored(0, acc, kStride);
  if constexpr (CT > 1) _tile_stored(1, acc + 16, kStride);
  if constexpr (RT > 1) _tile_stored(2, acc + 16 * CT * 16, kStride);
  if constexpr (RT > 1 && CT > 1) _tile_stored(3, acc + 16 * CT * 16 + 16, kStride);
}

// The sums in acc (store_sums' layout) back into tiles 0-3, to go on adding to them: fp32 out
// and back exactly, so a product's sums do not depend on where its K steps were split.
template <int RT, int CT>
inline void load_sums(const float* acc) {
  constexpr int64_t kStride = CT * 16 * 4;  // bytes per acc row
  _tile_loadd(0, acc, kStride);
  if constexpr (CT > 1) _tile_loadd(1, acc + 16, kStride);
  if constexpr (RT > 1) _tile_loadd(2, acc + 16 * CT * 16, kStride);
  if constexpr (RT > 1 && CT > 1) _tile_loadd(3, acc + 16 * CT * 16 + 16, kStride);
}

}  // namespace duet
#else
namespace duet {
constexpr bool kAmxBuild = false;
inline bool amx_permitted() { return false; }
}  // namespace duet
#endif
