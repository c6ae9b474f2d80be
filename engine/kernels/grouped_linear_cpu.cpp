// A mixture of experts' products in one call: rows sorted by expert (expert e's rows follow
// expert e - 1's), each group of rows times its own expert's weight, all on the dense
// kernel's panels and micro-kernel (dense_panels.h), so every element is the same chain of
// FMAs in k order as dense_linear_packed gives it: a row's result depends on its expert and
// nothing else, not on how many rows that expert or the others received (batch-invariant,
// docs/determinism.md). Bound in dense_linear_cpu.cpp's module.
//
// Why one call: a decode step of 32 sequences with 64 experts, top-8, sends a few rows to
// nearly every expert; a product per expert from Python (two linears, the activation, a
// scale and a scatter) cost several torch calls each, per layer, for a few rows' work.
// Here the threads share one list of (expert, row block, channel tile) items. bf16 on
// AVX512-BF16 without AMX takes the dot (dense_dot.h) over pack_dense's pairs instead, in the
// same items: again one order per element, fixed by k alone.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#include "dense_dot.h"
#include "dense_panels.h"

namespace duet {
using namespace dense;
bool dot_dense(int64_t k);  // dense_linear_cpu.cpp

namespace {

struct Item {
  int64_t expert, r0, rows, tile;
};

// The items of `counts` rows per expert: blocks of at most `block` rows (whose activations stay
// in L2 while the tiles pass), every channel tile of each.
std::vector<Item> items_of(const std::vector<int64_t>& counts, int64_t block, int64_t tiles) {
  std::vector<Item> items;
  int64_t first = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    for (int64_t b = 0; b < counts[e]; b += block)
      for (int64_t t = 0; t < tiles; ++t)
        items.push_back({e, first + b, std::min(block, counts[e] - b), t});
    first += counts[e];
  }
  return items;
}

template <typename E>
void run_grouped(const float* x, const typename E::raw* panels, const std::vector<int64_t>& counts,
                 int64_t m, int64_t k, int64_t n, typename E::raw* out) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t block = row_block(k, sizeof(float), kRows);
  const std::vector<Item> items = items_of(counts, block, tiles);
  const Args<E> a{x, panels, nullptr, m, k, n};
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const typename E::raw* panel = panels + (it.expert * tiles + it.tile) * k * kTile;
      const int64_t n0 = it.tile * kTile, r_end = it.r0 + it.rows;
      int64_t r0 = it.r0;
      for (; r0 + kRows <= r_end; r0 += kRows) micro<E, kRows>(a, panel, nullptr, r0, n0, out);
      if (r0 < r_end) rows_tail<E, kRows - 1>(a, panel, nullptr, r0, r_end - r0, n0, out);
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The same items on the AVX512-BF16 dot (dense_dot.h): pairs [E, blocks, K / 2, 16, 2].
void run_grouped_dot(const dense_dot::Args& a, const std::vector<int64_t>& counts,
                     uint16_t* out) {
  const int64_t tiles = dense_dot::num_tiles(a.n);
  const int64_t expert_elems = ((a.n + dense_dot::kBlock - 1) / dense_dot::kBlock) * a.k *
                               dense_dot::kBlock;
  const std::vector<Item> items = items_of(counts, dense_dot::row_block(a.k), tiles);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      dense_dot::tile_rows(a, a.w + it.expert * expert_elems, it.tile, it.r0, it.rows, out);
    }
  });
}
#endif

}  // namespace

// x [M, K] (rows contiguous; any row stride) sorted by expert, counts[e] rows of expert e
// (summing to M), panels [E, tiles, K, tile]: each expert's pack_dense panels of its [N, K]
// weight, stacked; x and panels both fp32 or both bf16. Returns [M, N] of x's dtype: row r
// times its expert's weight, transposed.
at::Tensor grouped_dense_linear(at::Tensor x, at::Tensor panels, std::vector<int64_t> counts,
                                int64_t n) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "x must be a CPU float32 or bfloat16 [rows, K] tensor with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  const bool pairs = panels.dim() == 5;  // bf16 on AVX512-BF16 (dense_dot.h)
  TORCH_CHECK(panels.device().is_cpu() && panels.is_contiguous() && panels.scalar_type() == dtype &&
                  panels.size(0) == static_cast<int64_t>(counts.size()) &&
                  (pairs ? dtype == at::kBFloat16 && dot_dense(k) && panels.size(1) == (n + 15) / 16 &&
                               panels.size(2) * 2 == k && panels.size(3) == 16 && panels.size(4) == 2
                         : panels.dim() == 4 && panels.size(1) == (n + kTile - 1) / kTile &&
                               panels.size(2) == k && panels.size(3) == kTile),
              "panels must be [experts, ceil(N / tile), K, tile]: each expert's pack_dense "
              "panels of x's dtype and K, one expert per count (or, bf16 with AVX512-BF16 and "
              "no AMX, pack_dense's pairs [experts, ceil(N / 16), K / 2, 16, 2])");
  int64_t total = 0;
  for (const int64_t c : counts) {
    TORCH_CHECK(c >= 0, "counts must be >= 0");
    total += c;
  }
  TORCH_CHECK(total == m, "counts must add up to x's rows");
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return out;
  if (dtype == at::kFloat) {
    at::Tensor xc = x.stride(0) == k ? x : x.contiguous();
    run_grouped<F32>(xc.data_ptr<float>(), panels.data_ptr<float>(), counts, m, k, n,
                     out.data_ptr<float>());
    return out;
  }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (pairs) {
    run_grouped_dot({static_cast<const uint16_t*>(x.data_ptr()),
                     static_cast<const uint16_t*>(panels.data_ptr()), nullptr, x.stride(0), m, k, n},
                    counts, static_cast<uint16_t*>(out.data_ptr()));
    return out;
  }
#endif
  std::vector<float> xf(m * k);  // bf16 activations as fp32 once (exact), rows contiguous
  bf16_rows_to_fp32(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0), m, k, xf.data());
  run_grouped<BF16>(xf.data(), static_cast<const uint16_t*>(panels.data_ptr()), counts, m, k, n,
                    static_cast<uint16_t*>(out.data_ptr()));
  return out;
}

}  // namespace duet
