// The one order of arithmetic that both paged attention kernels (paged_decode_cpu.cpp,
// paged_prefill_cpu.cpp) follow for a query row, so that a token's attention output has the
// same bits whichever kernel computes it, in a batch of any size, in a prefill chunk starting
// anywhere, after a prefix-cache hit or cold (deterministic inference: docs/determinism.md).
// bf16 on CPUs with AMX tiles takes the AMX order of attention_amx.h instead, in both kernels.
//
// For a query row q (fp32, already multiplied by the scale) at position pos, over keys
// 0..pos:
// - Partitions: keys in ranges of partition_tokens(BS) from position 0, each reduced on its
//   own to (m, l, acc) (running max, softmax sum, unnormalised output), then folded in
//   position order (fold_partition) and normalised once: out = O * (1 / L). The ranges are
//   fixed by position, never by the batch or the thread count, so threads may take them in
//   any order.
// - Runs: inside a partition, keys in runs of run_length(BS) (aligned to multiples of it),
//   each one online-softmax update (softmax_run): max over the run, exp, sum of the W lanes
//   (masked lanes 0), then acc += p_t v_t for the run's keys in order.
// - Scores: q . k for four keys at a time (dot4), q and k widened to fp32 in load_vec's lane
//   order: per key, the first vector product and then multiply-adds over the row's vectors,
//   all four reduced by one hsum4, whose tree per key does not depend on the other three
//   keys. A last group of fewer than four keys repeats a valid key and drops its score.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>

#include "cpu_simd.h"

namespace duet {

// Vector i (of nd) of a head row as fp32 lanes. bf16 rows whose vectors come in pairs are
// widened in a permuted order: one load of 2W bf16 (W 32-bit words) gives the W even elements
// (word << 16) and the W odd ones (word & 0xffff0000), one operation per vector instead of a
// zero-extension and a shift. Both kernels load q and
// k this way, so their dot products sum the same lanes; outputs go back in row order by
// widened_index.
template <typename E, int ND>
constexpr bool kPaired = std::is_same_v<E, BF16> && ND > 0 && ND % 2 == 0;

template <typename E, int W, int ND>
inline typename Vec<W>::F load_vec(const typename E::raw* row, int i) {
  using F = typename Vec<W>::F;
  if constexpr (kPaired<E, ND>) {
    const typename Vec<W>::I w =
        *reinterpret_cast<const typename Vec<W>::PU*>(row + (i & ~1) * W);
    return reinterpret_cast<F>((i & 1) ? (w & static_cast<int32_t>(0xffff0000u)) : (w << 16));
  } else {
    return E::template load<W>(row + i * W);
  }
}

template <typename E, int W, int ND>
inline int64_t widened_index(int64_t d) {  // where element d of a row sits after load_vec
  if constexpr (kPaired<E, ND>) {
    const int64_t r = d % (2 * W);
    return d - r + (r & 1) * W + (r >> 1);
  } else {
    return d;
  }
}

constexpr int64_t kPartitionTokens = 256;

// A cache entry of multi-head latent attention (DeepSeek-V2/V3): the latent (512) and the roped
// key part (64), read as the one KV head's key and value (engine/model/latent_attention.py).
// Both kernels take this width with its own vector count, so its rows load paired in both.
constexpr int64_t kLatentWidth = 576;

// Tokens per partition: the multiple of the block size nearest above kPartitionTokens, so a
// partition is whole blocks.
inline int64_t partition_tokens(int64_t block_size) {
  return (kPartitionTokens + block_size - 1) / block_size * block_size;
}

// Keys per softmax run: divides both the block size (runs never straddle blocks) and the
// vector width (a run fits one vector of scores).
template <int W>
inline int64_t run_length(int64_t block_size) {
  return std::gcd<int64_t>(block_size, W);
}

// Scores of four keys: key(r, i) gives vector i (of nd) of key r as fp32 lanes in row order;
// q holds the row's nd vectors.
template <int W, int ND, typename Key>
inline typename Vec<4>::F dot4(const float* q, int nd, Key key) {
  using F = typename Vec<W>::F;
  const int n = ND > 0 ? ND : nd;
  const F q0 = load_f32<W>(q);
  F a0 = q0 * key(0, 0), a1 = q0 * key(1, 0), a2 = q0 * key(2, 0), a3 = q0 * key(3, 0);
#pragma GCC unroll 16
  for (int i = 1; i < n; ++i) {
    const F qi = load_f32<W>(q + i * W);
    a0 += qi * key(0, i);
    a1 += qi * key(1, i);
    a2 += qi * key(2, i);
    a3 += qi * key(3, i);
  }
  if constexpr (W >= 4) {
    return hsum4<W>(a0, a1, a2, a3);
  } else {  // scalar lanes (head sizes off the vector width): nothing to reduce across
    return typename Vec<4>::F{hsum<W>(a0), hsum<W>(a1), hsum<W>(a2), hsum<W>(a3)};
  }
}

// One run's online-softmax update of a row: `x` holds the run's scores in its first lanes,
// `valid` marks the keys the row sees. Returns the weights p (0 where not valid); m and l are
// updated, and when the max grew `rescale` is the factor the row's accumulator must be
// multiplied by before the run's values are added (else 1 and nothing to do).
template <int W>
inline typename Vec<W>::F softmax_run(typename Vec<W>::F x, typename Vec<W>::I valid, float& m,
                                      float& l, float& rescale) {
  using F = typename Vec<W>::F;
  x = valid ? x : splat<W>(-INFINITY);
  const float mx = std::max(m, hmax<W>(x));
  F p = vexp<W>(x - mx);
  p = valid ? p : F{};
  rescale = 1.f;
  if (mx > m) {
    rescale = std::exp(m - mx);  // 0 on a row's first run
    l *= rescale;
    m = mx;
  }
  l += hsum<W>(p);
  return p;
}

// Lanes 0 .. n - 1 set.
template <int W>
inline typename Vec<W>::I first_lanes(int64_t n) {
  typename Vec<W>::I lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  return lane < static_cast<int32_t>(n);
}

// Folds the next partition (m, l, acc: D floats in row order) into a row's running result
// (M, L, O), which the first partition initialises by copy.
inline void fold_partition(float& M, float& L, float* O, float m, float l, const float* acc,
                           int64_t D) {
  const float mx = std::max(M, m);
  const float a = std::exp(M - mx), b = std::exp(m - mx);
  L = std::fma(L, a, l * b);
  for (int64_t d = 0; d < D; ++d) O[d] = std::fma(O[d], a, acc[d] * b);
  M = mx;
}

// A row's partition into its running result: the first partition (first) initialises
// (M, L, O) by copy, each later one is folded in (fold_partition).
inline void take_partition(bool first, float& M, float& L, float* O, float m, float l,
                           const float* acc, int64_t D) {
  if (first) {
    M = m;
    L = l;
    std::copy(acc, acc + D, O);
  } else {
    fold_partition(M, L, O, m, l, acc, D);
  }
}

}  // namespace duet
