// bf16 dense products on AVX512-BF16 without AMX (AMD Zen 4, Intel Cooper Lake): `vdpbf16ps`
// adds the products of two bf16 pairs to each fp32 lane, 32 multiply-adds an instruction, twice
// the fp32 FMA form's rate (dense_panels.h), which is what compute-bound shapes (prefill chunks,
// a mixture's experts over many rows) pay for. Shared by dense_linear_cpu.cpp and the grouped
// expert products (grouped_linear_cpu.cpp).
//
// The weight is packed as AMX's column pairs (`pack_pairs`: [ceil(N / 16), K / 2, 16, 2],
// channel c's k = 2j and 2j + 1 side by side at pair j), so a pair j of a block of 16 channels is
// one vector. Each micro-kernel call takes kRows rows x kCols blocks (64 channels): per pair,
// one load per block and one broadcast of the row's bf16 pair per row feed 6 x 4 vdpbf16ps.
// The order per output element, fixed by k alone (batch-invariant, docs/determinism.md):
//   acc = 0; for each chain of kChainPairs pairs in order: part = 0, part = dpbf16(part, x pair,
//   w pair) for each pair in order, acc += part; then acc += bias; rounded once to bf16,
// the same whatever the batch, the row's place, the blocking or the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_simd.h"
#include "dense_panels.h"

namespace duet {
namespace dense_dot {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBuild = true;
#else
constexpr bool kBuild = false;
#endif

constexpr int kBlock = 16;            // channels of a pair block (one vector of fp32 sums)
constexpr int kRows = 6;              // 6 x 4 accumulators + 4 weight vectors + 1 broadcast
constexpr int kCols = 4;              // pair blocks per micro-kernel call: 64 channels
constexpr int64_t kChainPairs = 64;   // 128 values of k per chain, as the FMA form's kChain

struct Args {
  const uint16_t* x;  // [M, K] bf16, rows xs elements apart
  const uint16_t* w;  // pack_pairs: [blocks, K / 2, 16, 2]
  const float* b;     // [N] fp32 or null
  int64_t xs, m, k, n;
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// Rows r0 .. r0 + R, pair blocks b0 .. b0 + C (w: block 0 of this weight), into out [M, N].
template <int R, int C>
void micro(const Args& a, const uint16_t* w, int64_t b0, int64_t r0, uint16_t* out) {
  const int64_t pairs = a.k / 2, ws = pairs * kBlock * 2;  // elements per block
  const uint16_t* wb = w + b0 * ws;
  __m512 acc[R][C], part[R][C];
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += kChainPairs) {
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) part[r][c] = _mm512_setzero_ps();
    const int64_t p1 = std::min(pairs, p0 + kChainPairs);
    for (int64_t p = p0; p < p1; ++p) {
      __m512bh wv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        wv[c] = (__m512bh)_mm512_loadu_si512(wb + c * ws + p * kBlock * 2);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // the row's x[2p], x[2p + 1]
        std::memcpy(&pair, a.x + (r0 + r) * a.xs + 2 * p, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) part[r][c] = _mm512_dpbf16_ps(part[r][c], xb, wv[c]);
      }
    }
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_add_ps(acc[r][c], part[r][c]);
  }
  using V = Vec<kBlock>::F;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    uint16_t* o = out + (r0 + r) * a.n;
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const int64_t ch0 = (b0 + c) * kBlock;
      V v = reinterpret_cast<V>(acc[r][c]);
      if (a.b != nullptr) {
        V bias;
        for (int i = 0; i < kBlock; ++i) bias[i] = ch0 + i < a.n ? a.b[ch0 + i] : 0.0f;
        v += bias;
      }
      if (ch0 + kBlock <= a.n) {
        BF16::store<kBlock>(o + ch0, v);
      } else {
        for (int64_t i = 0; ch0 + i < a.n; ++i) o[ch0 + i] = BF16::store1(v[i]);
      }
    }
  }
}

// Rows r0 .. r0 + rows (at most kRows) of blocks b0 .. b0 + C.
template <int C>
inline void micro_n(const Args& a, const uint16_t* w, int64_t b0, int64_t r0, int64_t rows,
                    uint16_t* out) {
  switch (rows) {
    case 6: micro<6, C>(a, w, b0, r0, out); break;
    case 5: micro<5, C>(a, w, b0, r0, out); break;
    case 4: micro<4, C>(a, w, b0, r0, out); break;
    case 3: micro<3, C>(a, w, b0, r0, out); break;
    case 2: micro<2, C>(a, w, b0, r0, out); break;
    case 1: micro<1, C>(a, w, b0, r0, out); break;
    default: break;
  }
}

// Rows r0 .. r0 + rows (any count) of blocks b0 .. b0 + C. Each call streams the blocks'
// weights once for its rows, so a last call of 1-3 rows after full ones is balanced with the
// one before (32 rows: 6, 6, 6, 6, 4, 4, not 6 x 5 and 2); a row's chain is the same in any call.
template <int C>
inline void rows_of(const Args& a, const uint16_t* w, int64_t b0, int64_t r0, int64_t rows,
                    uint16_t* out) {
  int64_t full = rows / kRows, rest = rows % kRows;
  if (full > 0 && rest > 0 && rest < 4) {
    --full;
    rest += kRows;
  }
  int64_t r = r0;
  for (int64_t i = 0; i < full; ++i, r += kRows) micro<kRows, C>(a, w, b0, r, out);
  if (rest > kRows) {
    const int64_t first = (rest + 1) / 2;
    micro_n<C>(a, w, b0, r, first, out);
    micro_n<C>(a, w, b0, r + first, rest - first, out);
  } else {
    micro_n<C>(a, w, b0, r, rest, out);
  }
}

// Rows r0 .. r0 + rows of tile t (blocks 4t .. 4t + 3, fewer in the last tile).
inline void tile_rows(const Args& a, const uint16_t* w, int64_t tile, int64_t r0, int64_t rows,
                      uint16_t* out) {
  const int64_t blocks = (a.n + kBlock - 1) / kBlock, b0 = tile * kCols;
  switch (std::min<int64_t>(kCols, blocks - b0)) {
    case 4: rows_of<4>(a, w, b0, r0, rows, out); break;
    case 3: rows_of<3>(a, w, b0, r0, rows, out); break;
    case 2: rows_of<2>(a, w, b0, r0, rows, out); break;
    default: rows_of<1>(a, w, b0, r0, rows, out); break;
  }
}
#endif

inline int64_t num_tiles(int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  return (blocks + kCols - 1) / kCols;
}

// Rows per block of work: a block's bf16 activations stay in L2 while the tiles pass.
inline int64_t row_block(int64_t k) { return dense::row_block(k, 2, kRows); }

}  // namespace dense_dot
}  // namespace duet
