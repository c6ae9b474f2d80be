// Dense linear with a fixed reduction order: y = x @ w.T (+ b) with x [M, K] and w [N, K] both
// fp32 or both bf16, w in torch's own row-major layout. A module of its own
// (engine/model/dense_cpu_linear.py builds it through engine/kernels/cpu.py).
//
// Why: the vendor GEMMs choose their split of the K reduction by the number of rows and threads,
// and some shapes no padding makes batch-invariant. Measured on a 2-core Xeon (AVX-512, no
// AVX512-BF16): oneDNN's emulated bf16 (LM head and down_proj rows differ alone and in batches
// of 8 and 16 at 2 threads; its cost grows with every row, the LM head 5 ms at 1 row and 52 ms
// at 32) and MKL's fp32 down_proj (K = 1536: no padding up to 64 rows). Here each output
// element is one dot product in one fixed order:
//   acc (kLanes fp32 lanes) += w[k:k+L] * x[k:k+L] for k in order (one FMA per lane),
//   s = the lanes' sum by halving, then s += w[k] * x[k] for the tail k in order, then + b,
//   rounded once to bf16 (nearest even),
// which depends on nothing but the row and the channel: not on the batch, the blocking or the
// thread count (deterministic mode relies on it, docs/determinism.md).
//
// Register blocking: kCols channels x kRows rows per tile; each weight vector feeds kRows FMAs
// and each activation vector kCols. Threads split the output channels; a tile's weights
// (kCols x K x 2 bytes) stay in cache while every row tile passes over them. Cache blocking:
// the rows go in blocks of about kBlockBytes of activations, so a block stays in L2 while
// every channel tile passes over it (unblocked, each channel tile streamed all M rows from L3
// or memory: 4.8x slower than MKL at 1024 rows of SmolLM2's gate_up on a 2-core Xeon). No
// blocking changes an element's reduction order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
// Bindings only: torch/extension.h would also parse the whole C++ frontend.
#include <torch/python.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"

namespace duet {
namespace {

constexpr int L = kLanes;
using F = Vec<L>::F;
// AVX-512: 32 registers (16 accumulators + 4 weights + 1 activation); AVX2: 16.
constexpr int kCols = 4;
constexpr int kRows = L >= 16 ? 4 : 2;

template <typename E>
struct Args {
  const float* x;            // [M, K] fp32 (bf16 activations converted, exact)
  const typename E::raw* w;  // [N, K]
  const float* b;            // [N] fp32 or null
  int64_t m, k, n;
};

// out rows r0 .. r0 + R, channels n0 .. n0 + C.
template <typename E, int R, int C>
void tile(const Args<E>& a, int64_t r0, int64_t n0, typename E::raw* out) {
  const int64_t K = a.k, body = K - K % L;
  const typename E::raw* w = a.w + n0 * K;
  const float* x = a.x + r0 * K;
  F acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = F{};
  for (int64_t k = 0; k < body; k += L) {
    F wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = E::template load<L>(w + c * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const F xv = load_f32<L>(x + r * K + k);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] += wv[c] * xv;  // one FMA (-ffp-contract=fast)
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      float s = hsum<L>(acc[r][c]);
      for (int64_t k = body; k < K; ++k) s += E::load1(w + c * K + k) * x[r * K + k];
      if (a.b != nullptr) s += a.b[n0 + c];
      out[(r0 + r) * a.n + n0 + c] = E::store1(s);
    }
}

template <typename E, int R, int C>
void rows_tail(const Args<E>& a, int64_t r0, int64_t rows, int64_t n0, typename E::raw* out) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tail<E, R - 1, C>(a, r0, rows, n0, out);
  }
  tile<E, R, C>(a, r0, n0, out);
}

// Rows r_begin .. r_end of channels n0 .. n0 + C.
template <typename E, int C>
void columns(const Args<E>& a, int64_t r_begin, int64_t r_end, int64_t n0, typename E::raw* out) {
  int64_t r0 = r_begin;
  for (; r0 + kRows <= r_end; r0 += kRows) tile<E, kRows, C>(a, r0, n0, out);
  if (r0 < r_end) rows_tail<E, kRows - 1, C>(a, r0, r_end - r0, n0, out);
}

constexpr int64_t kBlockBytes = 256 * 1024;  // fp32 activations per row block (half an L2)

template <typename E>
void run(const Args<E>& a, typename E::raw* o) {
  const int64_t tiles = (a.n + kCols - 1) / kCols;
  const int64_t fit = kBlockBytes / (a.k * static_cast<int64_t>(sizeof(float)));
  const int64_t block = std::max<int64_t>(kRows, fit - fit % kRows);
  for (int64_t r_begin = 0; r_begin < a.m; r_begin += block) {
    const int64_t r_end = std::min(a.m, r_begin + block);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kCols;
        switch (std::min<int64_t>(kCols, a.n - n0)) {
          case 4: columns<E, 4>(a, r_begin, r_end, n0, o); break;
          case 3: columns<E, 3>(a, r_begin, r_end, n0, o); break;
          case 2: columns<E, 2>(a, r_begin, r_end, n0, o); break;
          default: columns<E, 1>(a, r_begin, r_end, n0, o); break;
        }
      }
    });
  }
}

}  // namespace

// x [M, K] with contiguous rows and w [N, K] contiguous, both fp32 or both bf16; bias [N] (any
// float dtype) or None; returns [M, N] of x's dtype.
at::Tensor dense_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "x must be a CPU float32 or bfloat16 [rows, K] tensor with contiguous rows");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  w.scalar_type() == dtype && w.size(1) == x.size(1),
              "w must be a contiguous CPU [N, K] tensor of x's dtype and K");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return out;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    at::Tensor xc = x.stride(0) == k ? x : x.contiguous();
    run<F32>({xc.data_ptr<float>(), w.data_ptr<float>(), bp, m, k, n}, out.data_ptr<float>());
    return out;
  }
  // bf16 activations as fp32 once (exact), rows contiguous.
  std::vector<float> xf(m * k);
  const uint16_t* xb = static_cast<const uint16_t*>(x.data_ptr());
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* src = xb + r * x.stride(0);
    for (int64_t i = 0; i < k; ++i) xf[r * k + i] = BF16::load1(src + i);
  }
  run<BF16>({xf.data(), static_cast<const uint16_t*>(w.data_ptr()), bp, m, k, n},
            static_cast<uint16_t*>(out.data_ptr()));
  return out;
}

}  // namespace duet

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dense_linear", &duet::dense_linear,
        "x @ w.T (+ bias), x [M, K] and w [N, K] both fp32 or both bf16, one order per element",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("simd_lanes", [] { return duet::kLanes; }, "fp32 lanes of the kernel's vectors");
}
