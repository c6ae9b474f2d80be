// The dense kernel's panels and micro-kernel (dense_linear_cpu.cpp explains the reduction
// order), shared by the plain product (dense_linear_cpu.cpp) and the grouped products of a
// mixture's experts (grouped_linear_cpu.cpp), so that both compute every element alike.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu_simd.h"

namespace duet {
namespace dense {

constexpr int L = kLanes;
using F = Vec<L>::F;
// AVX-512 (32 registers): 6 x 4 chain accumulators + 4 panel vectors + 1 broadcast; AVX2 (16):
// 6 x 2. The running totals, touched once per chain, may live on the stack.
constexpr int kRows = 6;
constexpr int kCols = L >= 16 ? 4 : 2;
constexpr int kTile = kCols * L;  // channels per panel
// Each chain runs over at most kChain values of k, and the chains' sums add up in k order: a
// chain over all of K = 1,536 was 1.5x the error of lane-wise sums (1.45e-6 of the largest
// output against fp64), these are within 1e-6.
constexpr int64_t kChain = 128;

// v[t] := column t of the L x L block whose rows are v[0 .. L - 1].
template <int W>
inline void transpose(typename Vec<W>::F* v) {
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = reinterpret_cast<__m512>(v[i]);
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + m]: column 4j + m of rows 4i .. 4i + 3 in lane j
      r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
      r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int m = 0; m < 4; ++m) {
      const __m512 u0 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
      const __m512 u1 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);
      const __m512 u2 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
      const __m512 u3 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
      v[m] = reinterpret_cast<typename Vec<W>::F>(_mm512_shuffle_f32x4(u0, u2, 0x88));
      v[4 + m] = reinterpret_cast<typename Vec<W>::F>(_mm512_shuffle_f32x4(u1, u3, 0x88));
      v[8 + m] = reinterpret_cast<typename Vec<W>::F>(_mm512_shuffle_f32x4(u0, u2, 0xdd));
      v[12 + m] = reinterpret_cast<typename Vec<W>::F>(_mm512_shuffle_f32x4(u1, u3, 0xdd));
    }
    return;
  }
#endif
#if defined(__AVX__)
  if constexpr (W == 8) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = reinterpret_cast<__m256>(v[i]);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
      r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int m = 0; m < 4; ++m) {
      v[m] = reinterpret_cast<typename Vec<W>::F>(_mm256_permute2f128_ps(r[m], r[4 + m], 0x20));
      v[4 + m] = reinterpret_cast<typename Vec<W>::F>(_mm256_permute2f128_ps(r[m], r[4 + m], 0x31));
    }
    return;
  }
#endif
  float a[W][W];
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < W; ++j) a[j][i] = v[i][j];
  for (int i = 0; i < W; ++i) v[i] = load_f32<W>(a[i]);
}

// *p in every lane, as a load (splat's `{} + x` costs an add and a port-5 shuffle on x86: a
// quarter of the FMA slots at 6 rows x 4 vectors).
template <int W>
inline typename Vec<W>::F broadcast(const float* p) {
#if defined(__AVX512F__)
  if constexpr (W == 16) return reinterpret_cast<typename Vec<W>::F>(_mm512_set1_ps(*p));
#endif
#if defined(__AVX__)
  if constexpr (W == 8) return reinterpret_cast<typename Vec<W>::F>(_mm256_broadcast_ss(p));
#endif
  return splat<W>(*p);
}

// The panel of channels n0 .. n0 + kTile: panel[k][c] = w[n0 + c][k] (channels past N: zero).
template <typename E>
void pack_tile(const typename E::raw* w, int64_t n, int64_t K, int64_t n0, typename E::raw* panel) {
  const int64_t body = K - K % L;
  for (int v = 0; v < kCols; ++v) {
    const int64_t c0 = n0 + v * L, rows = std::clamp<int64_t>(n - c0, 0, L);
    typename E::raw* dst = panel + v * L;
    for (int64_t k = 0; k < body; k += L) {
      F blk[L];
      for (int i = 0; i < L; ++i) blk[i] = i < rows ? E::template load<L>(w + (c0 + i) * K + k) : F{};
      transpose<L>(blk);
      for (int t = 0; t < L; ++t) E::template store<L>(dst + (k + t) * kTile, blk[t]);  // exact
    }
    for (int64_t k = body; k < K; ++k)
      for (int i = 0; i < L; ++i)
        dst[k * kTile + i] = i < rows ? w[(c0 + i) * K + k] : typename E::raw{};
  }
}

template <typename E>
struct Args {
  const float* x;                 // [M, K] fp32 (bf16 activations converted, exact)
  const typename E::raw* panels;  // [tiles, K, kTile]
  const float* b;                 // [N] fp32 or null
  int64_t m, k, n;
};

// Rows r0 .. r0 + R of the channels n0 .. n0 + kTile (those below N).
template <typename E, int R>
void micro(const Args<E>& a, const typename E::raw* panel, const F* bias, int64_t r0, int64_t n0,
           typename E::raw* out) {
  const int64_t K = a.k;
  const float* x = a.x + r0 * K;
  F acc[R][kCols], part[R][kCols];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) acc[r][c] = F{};
  for (int64_t k0 = 0; k0 < K; k0 += kChain) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) part[r][c] = F{};
    const int64_t k1 = std::min(K, k0 + kChain);
    for (int64_t k = k0; k < k1; ++k) {
      F wv[kCols];
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) wv[c] = E::template load<L>(panel + k * kTile + c * L);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const F xb = broadcast<L>(x + r * K + k);
#pragma GCC unroll 8
        for (int c = 0; c < kCols; ++c) part[r][c] += xb * wv[c];  // one FMA (-ffp-contract=fast)
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) acc[r][c] += part[r][c];
  }
  const int64_t valid = std::min<int64_t>(kTile, a.n - n0);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    typename E::raw* o = out + (r0 + r) * a.n + n0;
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) {
      const F v = bias != nullptr ? acc[r][c] + bias[c] : acc[r][c];
      if ((c + 1) * L <= valid) {
        E::template store<L>(o + c * L, v);
      } else {
        for (int64_t i = c * L; i < valid; ++i) o[i] = E::store1(v[i - c * L]);
      }
    }
  }
}

template <typename E, int R>
void rows_tail(const Args<E>& a, const typename E::raw* panel, const F* bias, int64_t r0,
               int64_t rows, int64_t n0, typename E::raw* out) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tail<E, R - 1>(a, panel, bias, r0, rows, n0, out);
  }
  micro<E, R>(a, panel, bias, r0, n0, out);
}

constexpr int64_t kBlockBytes = 256 * 1024;  // activations per row block (in L2)

// Rows per block of work, a whole number of `unit`s (a micro-kernel's rows, at least one): a
// block's activations (K values of `bytes` each per row) stay in L2 while the tiles pass.
inline int64_t row_block(int64_t k, int64_t bytes, int64_t unit) {
  const int64_t fit = kBlockBytes / (k * bytes);
  return std::max<int64_t>(unit, fit - fit % unit);
}

// Rows of bf16 (`stride` elements apart) as contiguous fp32 rows of k (exact).
inline void bf16_rows_to_fp32(const uint16_t* src, int64_t stride, int64_t m, int64_t k,
                              float* dst) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) dst[r * k + i] = BF16::load1(src + r * stride + i);
}

}  // namespace dense
}  // namespace duet
