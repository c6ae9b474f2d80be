// Dense linear with a fixed reduction order: y = x @ w.T (+ b) with x [M, K] and w [N, K] both
// fp32 or both bf16, w in torch's own row-major layout. A module of its own
// (engine/model/dense_cpu_linear.py builds it through engine/kernels/cpu.py).
// The panels and the micro-kernel are in dense_panels.h, shared with a mixture's grouped expert
// products (grouped_linear_cpu.cpp, bound here).
//
// Why: the vendor GEMMs choose their split of the K reduction by the number of rows and threads,
// and some shapes no padding makes batch-invariant. Measured on a 2-core Xeon (AVX-512, no
// AVX512-BF16): oneDNN's emulated bf16 (LM head and down_proj rows differ alone and in batches
// of 8 and 16 at 2 threads; its cost grows with every row, the LM head 5 ms at 1 row and 52 ms
// at 32) and MKL's fp32 down_proj (K = 1536: no padding up to 64 rows). Here each output
// element is chains of FMAs in k order, summed in k order:
//   acc = 0; for each block of kChain values of k in order: part = 0, part = fma(x[k], w[k],
//   part) for k in the block in order, acc += part; then acc += b; rounded once to bf16
//   (nearest even) for bf16 outputs,
// which depends on nothing but the row and the channel: not on the batch, the blocking or the
// thread count (deterministic mode relies on it, docs/determinism.md).
//
// The outer-product form of a GEMM (as BLAS micro-kernels are): `pack_dense` transposes the
// weight once (at load) into panels of kCols vectors of channels, [K][kCols x L] each, in the
// weight's dtype; every kRows rows of x pass over a panel, each k step one panel vector load
// (bf16 widened to fp32, exact) per column vector and one broadcast of x[r][k] per row feeding
// kRows x kCols FMAs into registers.
// (The earlier inner-product form, lanes along K and a horizontal sum per element, reloaded
// its activation vectors from L2 every channel tile: 120-160 GFLOP/s on a 2-core Xeon where
// MKL gives 250.) Threads split the channel tiles, and the rows too when there are few tiles;
// no split changes an element's chain.
//
// bf16 on a CPU with AMX takes AMX tiles instead (below, `pack_dense` then packs column pairs),
// also one fixed order per element: on a 2-core AMX Xeon oneDNN's packed bf16 was not
// batch-invariant at any padding for some of SmolLM2's shapes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
// Bindings only: torch/extension.h would also parse the whole C++ frontend.
#include <torch/python.h>
#include <pybind11/stl.h>  // grouped_dense_linear's counts, a list

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "cpu_simd.h"
#include "dense_dot.h"
#include "dense_panels.h"

namespace duet {
using namespace dense;
namespace {

// The threads' items of a product over `tiles` channel tiles: blocks of at most `block` rows in
// order, and, with few tiles, each block's rows split into parts for the threads to share (at
// least 4 micro-kernel calls of `unit` rows a part); f(tile, r0, r_end) for each non-empty one.
template <typename Fn>
void each_tile_part(int64_t m, int64_t block, int64_t tiles, int64_t unit, Fn&& f) {
  const int64_t threads = at::get_num_threads(), want = 4 * threads;
  for (int64_t r_begin = 0; r_begin < m; r_begin += block) {
    const int64_t rows = std::min(m - r_begin, block);
    const int64_t most = (rows + 4 * unit - 1) / (4 * unit);
    int64_t parts = std::clamp<int64_t>((want + tiles - 1) / tiles, 1, most);
    // parallel_for hands each thread one contiguous run of items: a count that is not a
    // multiple of the threads leaves one thread a whole item more (SmolLM2's 15 tiles of
    // q/k/v on 2 threads: 8 against 7). Split the rows further while the rows allow: 3-7%
    // faster at 32 to 2,048 rows where the tiles are odd (2-core Xeon).
    while (parts < most && (tiles * parts) % threads != 0) ++parts;
    const int64_t part_rows = (rows + parts - 1) / parts;
    at::parallel_for(0, tiles * parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t tile = item / parts, part = item % parts;
        const int64_t r0 = r_begin + part * part_rows;
        const int64_t r_end = std::min(r_begin + rows, r0 + part_rows);
        if (r0 < r_end) f(tile, r0, r_end);
      }
    });
  }
}

template <typename E>
void run(const Args<E>& a, typename E::raw* o) {
  const int64_t tiles = (a.n + kTile - 1) / kTile;
  const int64_t block = row_block(a.k, sizeof(float), kRows);
  each_tile_part(a.m, block, tiles, kRows, [&](int64_t tile, int64_t r0, int64_t r_end) {
    const int64_t n0 = tile * kTile;
    const typename E::raw* panel = a.panels + tile * a.k * kTile;
    F bias[kCols];
    if (a.b != nullptr) {
      for (int c = 0; c < kCols; ++c)
        for (int i = 0; i < L; ++i) {
          const int64_t ch = n0 + c * L + i;
          bias[c][i] = ch < a.n ? a.b[ch] : 0.0f;
        }
    }
    const F* bp = a.b != nullptr ? bias : nullptr;
    for (; r0 + kRows <= r_end; r0 += kRows) micro<E, kRows>(a, panel, bp, r0, n0, o);
    if (r0 < r_end) rows_tail<E, kRows - 1>(a, panel, bp, r0, r_end - r0, n0, o);
  });
}

constexpr int kPairBlock = 16;

// One block of 16 channels as pairs: dst[j][c] = src row c's pair j ([16, K / 2] -> [K / 2,
// 16], 32-bit pairs of bf16); rows from `valid` on are zero (N past the last channel).
inline void pair_block(const uint32_t* src, int64_t valid, int64_t k, uint32_t* dst) {
  for (int64_t j = 0; j < k / 2; ++j)
    for (int64_t c = 0; c < kPairBlock; ++c)
      dst[j * kPairBlock + c] = c < valid ? src[c * (k / 2) + j] : 0u;
}

// bf16 weights (K even) in column pairs, [ceil(N / 16), K / 2, 16, 2]: AMX's tiles and the
// AVX512-BF16 dot (dense_dot.h) both read them.
at::Tensor pack_pairs(const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kPairBlock - 1) / kPairBlock;
  at::Tensor packed = at::empty({blocks, k / 2, kPairBlock, 2}, w.options());
  const uint32_t* src = static_cast<const uint32_t*>(w.data_ptr());  // pairs of bf16
  uint32_t* dst = static_cast<uint32_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      pair_block(src + b * kPairBlock * (k / 2), std::min<int64_t>(kPairBlock, n - b * kPairBlock),
                 k, dst + b * (k / 2) * kPairBlock);
  });
  return packed;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The dot's threads: as `run`'s (channel tiles of 4 pair blocks); no split changes an element's
// chain.
void run_dot(const dense_dot::Args& a, uint16_t* out) {
  each_tile_part(a.m, dense_dot::row_block(a.k), dense_dot::num_tiles(a.n), dense_dot::kRows,
                 [&](int64_t tile, int64_t r0, int64_t r_end) {
                   dense_dot::tile_rows(a, a.w, tile, r0, r_end - r0, out);
                 });
}
#endif

#if defined(DUET_AMX)
// bf16 on a CPU with AMX: `_tile_dpbf16ps` (amx_tiles.h) instead of fp32 FMAs. The weight is
// packed as column pairs, [ceil(N / 16), K / 2, 16, 2] (channel c's columns 2j and 2j + 1 side
// by side at pair j: 16 consecutive pairs of a block are one weight tile), and each output
// element is the tile products' fp32 sums over K in 32-column steps, in order, then + bias,
// rounded once to bf16. A tile's rows are independent, so the sums of a row depend on nothing
// but the row and the channel: batch-invariant by construction, as the FMA form, and every
// row count of a layer takes this path. Needs K a multiple of 32 (one tile's depth).
struct AmxArgs {
  const uint16_t* x;  // [M, K] bf16, rows xs apart
  const uint16_t* w;  // pack_pairs
  const float* b;     // [N] or null
  int64_t xs, m, k, n;
};

// K steps s0 .. s1 (32 columns each) of RT row tiles x CT channel blocks added to the sums in
// acc (which start from zero at s0 = 0): x at column 0 (row stride xs elements), w at block 0's
// first pair (block stride ws elements). The sums leave the tiles and come back exactly
// (load_sums), so a product's sums are the same whatever the K steps are split into.
template <int RT, int CT>
inline void tiles(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws, int64_t s0,
                  int64_t s1, float* acc) {
  if (s0 == 0)
    zero_sums<RT, CT>();
  else
    load_sums<RT, CT>(acc);
  for (int64_t s = s0; s < s1; ++s) tile_step<RT, CT>(x + s * 32, xs, w + s * 512, ws);
  store_sums<RT, CT>(acc);
}

// K steps s0 .. s1 of rows r0 .. r0 + rows (at most 32) and channel blocks b0 .. b0 + CT.
template <int CT>
inline void chunk_part(const AmxArgs& a, int64_t b0, int64_t r0, int64_t rows, int64_t s0,
                       int64_t s1, float* acc) {
  const int64_t ws = (a.k / 2) * kPairBlock * 2;  // elements per block
  const uint16_t* x = a.x + r0 * a.xs;
  if (rows > 16)
    tiles<2, CT>(x, a.xs, a.w + b0 * ws, ws, s0, s1, acc);
  else
    tiles<1, CT>(x, a.xs, a.w + b0 * ws, ws, s0, s1, acc);
}

// The finished sums in acc ([rows][CT * 16] fp32) + bias, rounded once to bf16, into rows
// r0 .. r0 + rows and channel blocks b0 .. b0 + CT of out.
template <int CT>
void write_out(const AmxArgs& a, int64_t b0, int64_t r0, int64_t rows, const float* acc,
               uint16_t* out) {
  constexpr int kCols = CT * kPairBlock;
  const int64_t n0 = b0 * kPairBlock, n1 = std::min<int64_t>(a.n, n0 + kCols);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* o = out + (r0 + r) * a.n;
    const float* v = acc + r * kCols;
    for (int64_t ch = n0; ch < n1; ++ch)
      o[ch] = BF16::store1(a.b != nullptr ? v[ch - n0] + a.b[ch] : v[ch - n0]);
  }
}

// Each thread's channel blocks in groups of kGroup, swept by chunks of 32 rows (the tiles
// configured for each chunk's rows: a last partial chunk reads only its own rows). Within a
// chunk, K is split into parts of at most kKSteps steps (288 columns), and each part runs over
// every block pair of the group, the sums kept in a buffer between parts: the chunk's x columns
// of one part (32 rows x 288 columns, 18 KiB) then stay in L1 while the group's weights stream
// from L2. Without the split, a pair's weights over the whole of K (36 KiB at K = 576) pushed
// the chunk's x out of L1 between pairs, and both came from L2 (2026-11-28, 2-core AMX Xeon:
// the split takes 0.69-0.78x the time at 32-2,048 rows for K = 576, 0.82-0.98x for K = 1,536;
// kGroup 32 and kKSteps 9 were the best of a sweep of 4-64 and 3-12).
constexpr int64_t kGroup = 32;
constexpr int64_t kKSteps = 9;

// f(b, CT) for blocks g0 .. g1 taken two at a time (CT an integral_constant: 2, and 1 for a last
// block alone).
template <typename F>
inline void each_pair(int64_t g0, int64_t g1, F&& f) {
  int64_t b = g0;
  for (; b + 2 <= g1; b += 2) f(b, std::integral_constant<int, 2>{});
  if (b < g1) f(b, std::integral_constant<int, 1>{});
}

void run_amx(const AmxArgs& a, int64_t blocks, uint16_t* out) {
  const int64_t steps = a.k / 32;
  // Under 16 rows x is a few KiB, in L1 anyway: K in one part (no sums to keep in between).
  const int64_t parts = a.m < 16 ? 1 : (steps + kKSteps - 1) / kKSteps;
  const int64_t part_steps = (steps + parts - 1) / parts;  // the parts as even as can be
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kGroup / 2][32 * 2 * kPairBlock];  // a pair's sums each
    int configured = -1;
    for (int64_t g0 = begin; g0 < end; g0 += kGroup) {
      const int64_t g1 = std::min(end, g0 + kGroup);
      for (int64_t r0 = 0; r0 < a.m; r0 += 32) {
        const int64_t rows = std::min<int64_t>(32, a.m - r0);
        configure_tiles(rows, &configured);
        for (int64_t s0 = 0; s0 < steps; s0 += part_steps) {
          const int64_t s1 = std::min(steps, s0 + part_steps);
          each_pair(g0, g1, [&](int64_t b, auto ct) {
            chunk_part<decltype(ct)::value>(a, b, r0, rows, s0, s1, acc[(b - g0) / 2]);
          });
        }
        each_pair(g0, g1, [&](int64_t b, auto ct) {
          write_out<decltype(ct)::value>(a, b, r0, rows, acc[(b - g0) / 2], out);
        });
      }
    }
    _tile_release();
  });
}
#else
bool amx_dense(int64_t) { return false; }
#endif
}  // namespace

// bf16 weights of this K pack as column pairs for AVX512-BF16's dot (no AMX: the tiles win).
bool dot_dense(int64_t k) { return dense_dot::kBuild && k % 2 == 0 && !amx_dense(k); }

namespace {
bool pairs_dense(int64_t k) { return amx_dense(k) || dot_dense(k); }
}  // namespace

// w [N, K] contiguous, fp32 or bf16 -> its panels [ceil(N / kTile), K, kTile], same dtype; bf16
// with AMX (K a multiple of 32): column pairs [ceil(N / 16), K / 2, 16, 2] for the tiles.
at::Tensor pack_dense(at::Tensor w) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "w must be a contiguous CPU float32 or bfloat16 [N, K] tensor");
  if (dtype == at::kBFloat16 && pairs_dense(w.size(1))) return pack_pairs(w);
  const int64_t n = w.size(0), k = w.size(1), tiles = (n + kTile - 1) / kTile;
  at::Tensor panels = at::empty({tiles, k, kTile}, w.options());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (dtype == at::kFloat) {
        pack_tile<F32>(w.data_ptr<float>(), n, k, t * kTile, panels.data_ptr<float>() + t * k * kTile);
      } else {
        const auto* src = static_cast<const uint16_t*>(w.data_ptr());
        auto* dst = static_cast<uint16_t*>(panels.data_ptr()) + t * k * kTile;
        pack_tile<BF16>(src, n, k, t * kTile, dst);
      }
    }
  });
  return panels;
}

// pack_dense's layout written over w's own storage, returned as a view of it: each block of
// channels (16 for pairs, kTile for panels) packs into exactly the bytes its rows held, through
// one block's scratch per thread, so packing a model allocates nothing per layer (glibc keeps
// freed memory: a new buffer per layer fragmented the heap). N not a whole number of blocks
// (the packed form is padded): pack_dense's new tensor instead. The caller owns w's storage.
at::Tensor pack_dense_(at::Tensor w) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "w must be a contiguous CPU float32 or bfloat16 [N, K] tensor");
  const int64_t n = w.size(0), k = w.size(1);
  const bool pairs = dtype == at::kBFloat16 && pairs_dense(k);
  const int64_t rows = pairs ? kPairBlock : kTile;
  if (n % rows != 0 || n == 0) return pack_dense(w);
  const int64_t blocks = n / rows, elems = rows * k;
  const int64_t esize = static_cast<int64_t>(w.element_size());
  auto* base = static_cast<uint8_t*>(w.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(elems * esize);
    for (int64_t b = begin; b < end; ++b) {
      uint8_t* block = base + b * elems * esize;
      std::memcpy(scratch.data(), block, elems * esize);
      if (pairs) {
        pair_block(reinterpret_cast<const uint32_t*>(scratch.data()), kPairBlock, k,
                   reinterpret_cast<uint32_t*>(block));
      } else if (dtype == at::kFloat) {
        pack_tile<F32>(reinterpret_cast<const float*>(scratch.data()), rows, k, 0,
                       reinterpret_cast<float*>(block));
      } else {
        pack_tile<BF16>(reinterpret_cast<const uint16_t*>(scratch.data()), rows, k, 0,
                        reinterpret_cast<uint16_t*>(block));
      }
    }
  });
  return pairs ? w.view({blocks, k / 2, kPairBlock, 2}) : w.view({blocks, k, kTile});
}

// x [M, K] with contiguous rows and the panels of an [N, K] weight (`pack_dense`), both fp32 or
// both bf16; bias [N] (any float dtype) or None; returns [M, N] of x's dtype.
at::Tensor dense_linear_packed(at::Tensor x, at::Tensor panels, int64_t n,
                               c10::optional<at::Tensor> bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "x must be a CPU float32 or bfloat16 [rows, K] tensor with contiguous rows");
  const bool pairs = panels.dim() == 4;
  TORCH_CHECK(panels.device().is_cpu() && panels.is_contiguous() && panels.scalar_type() == dtype &&
                  (pairs ? dtype == at::kBFloat16 && pairs_dense(x.size(1)) &&
                               panels.size(1) * 2 == x.size(1) && panels.size(2) == 16 &&
                               panels.size(3) == 2 && panels.size(0) == (n + 15) / 16
                         : panels.dim() == 3 && panels.size(1) == x.size(1) &&
                               panels.size(2) == kTile && panels.size(0) == (n + kTile - 1) / kTile),
              "panels must be pack_dense's [ceil(N / tile), K, tile] (or, bf16 with AMX or "
              "AVX512-BF16, [ceil(N / 16), K / 2, 16, 2]) of x's dtype and K");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return out;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(DUET_AMX)
  if (pairs && amx_dense(k)) {
    run_amx({static_cast<const uint16_t*>(x.data_ptr()), static_cast<const uint16_t*>(panels.data_ptr()),
             bp, x.stride(0), m, k, n},
            panels.size(0), static_cast<uint16_t*>(out.data_ptr()));
    return out;
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (pairs) {
    run_dot({static_cast<const uint16_t*>(x.data_ptr()), static_cast<const uint16_t*>(panels.data_ptr()),
             bp, x.stride(0), m, k, n},
            static_cast<uint16_t*>(out.data_ptr()));
    return out;
  }
#endif
  if (dtype == at::kFloat) {
    at::Tensor xc = x.stride(0) == k ? x : x.contiguous();
    run<F32>({xc.data_ptr<float>(), panels.data_ptr<float>(), bp, m, k, n}, out.data_ptr<float>());
    return out;
  }
  // bf16 activations as fp32 once (exact), rows contiguous.
  std::vector<float> xf(m * k);
  bf16_rows_to_fp32(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0), m, k, xf.data());
  run<BF16>({xf.data(), static_cast<const uint16_t*>(panels.data_ptr()), bp, m, k, n},
            static_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// The same product from the plain weight, packing it first (tests; probes of one call).
at::Tensor dense_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type() && w.size(1) == x.size(1),
              "w must be a contiguous CPU [N, K] tensor of x's dtype and K");
  return dense_linear_packed(x, pack_dense(w), w.size(0), bias);
}

// grouped_linear_cpu.cpp
at::Tensor grouped_dense_linear(at::Tensor x, at::Tensor panels, std::vector<int64_t> counts,
                                int64_t n);

}  // namespace duet

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dense_linear", &duet::dense_linear,
        "x @ w.T (+ bias), x [M, K] and w [N, K] both fp32 or both bf16, one order per element",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("pack_dense", &duet::pack_dense, "w [N, K] -> its panels for dense_linear_packed",
        pybind11::arg("w"));
  m.def("pack_dense_", &duet::pack_dense_,
        "pack_dense's layout over w's own storage (a view of it; a new tensor where the packed "
        "form is padded)",
        pybind11::arg("w"));
  m.def("dense_linear_packed", &duet::dense_linear_packed,
        "x @ w.T (+ bias) from w's panels (pack_dense) and N", pybind11::arg("x"),
        pybind11::arg("panels"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("grouped_dense_linear", &duet::grouped_dense_linear,
        "rows sorted by expert, counts[e] of expert e, each times its expert's weight "
        "(panels [E, tiles, K, tile]: each expert's pack_dense panels) and N",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("counts"), pybind11::arg("n"));
  m.def("simd_lanes", [] { return duet::kLanes; }, "fp32 lanes of the kernel's vectors");
  m.def("amx", [] { return duet::kAmxBuild && duet::amx_permitted(); },
        "Whether bf16 weights (K a multiple of 32) are packed for AMX tiles");
  m.def("bf16_dot", [] { return duet::dot_dense(2); },
        "Whether bf16 weights (K even) are packed as pairs for AVX512-BF16's dot (no AMX); "
        "grouped_dense_linear then takes them too");
}
