// The Llama block's elementwise ops on the CPU, each one pass over memory where torch's eager
// code takes several (and allocates a tensor per step): RMSNorm, RMSNorm fused with the
// residual add before it, rotary embedding in place, and SiLU(gate) * up. They compute in fp32
// and round to bf16 where HF's torch code does, so they match the torch path up to summation
// order and fused multiply-adds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace duet {
namespace {

constexpr int W = kLanes;
using F = Vec<W>::F;

// Rows per task: below ~16K elements a thread costs more than it saves.
int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

// HF's LlamaRMSNorm on one row of n: y = w * dtype(x * rsqrt(mean(x^2) + eps)), in fp32.
template <typename E>
void norm_row(const typename E::raw* x, const typename E::raw* w, typename E::raw* y, int64_t n,
              float eps) {
  F squares = F{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const F v = E::template load<W>(x + i);
    squares += v * v;
  }
  float sum = hsum<W>(squares);
  for (int64_t j = i; j < n; ++j) sum += E::load1(x + j) * E::load1(x + j);
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i + W <= n; i += W)
    E::template store<W>(
        y + i, E::template round<W>(E::template load<W>(x + i) * r) * E::template load<W>(w + i));
  for (; i < n; ++i) y[i] = E::store1(E::load1(w + i) * E::round1(E::load1(x + i) * r));
}

template <typename E>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, float eps) {
  using raw = typename E::raw;
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const raw* xp = static_cast<const raw*>(x.data_ptr());
  const raw* wp = static_cast<const raw*>(weight.data_ptr());
  raw* yp = static_cast<raw*>(y.data_ptr());
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row<E>(xp + r * xs, wp, yp + r * n, n, eps);
  });
}

// residual = dtype(residual + x), then x = RMSNorm(residual): HF's residual add and the next
// norm in one pass.
template <typename E>
void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                             float eps) {
  using raw = typename E::raw;
  const int64_t rows = x.size(0), n = x.size(1);
  raw* xp = static_cast<raw*>(x.data_ptr());
  raw* rp = static_cast<raw*>(residual.data_ptr());
  const raw* wp = static_cast<const raw*>(weight.data_ptr());
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      raw* xr = xp + r * n;
      raw* rr = rp + r * n;
      int64_t i = 0;
      for (; i + W <= n; i += W)
        E::template store<W>(rr + i, E::template load<W>(rr + i) + E::template load<W>(xr + i));
      for (; i < n; ++i) rr[i] = E::store1(E::load1(rr + i) + E::load1(xr + i));
      norm_row<E>(rr, wp, xr, n, eps);
    }
  });
}

// x1, x2 = halves of each head row: (x1 cos - x2 sin, x2 cos + x1 sin), in place.
template <typename E>
void rotate_head(typename E::raw* x, const float* c, const float* s, int64_t half) {
  typename E::raw* x2p = x + half;
  int64_t i = 0;
  for (; i + W <= half; i += W) {
    const F x1 = E::template load<W>(x + i), x2 = E::template load<W>(x2p + i);
    const F cv = load_f32<W>(c + i), sv = load_f32<W>(s + i);
    E::template store<W>(x + i, x1 * cv - x2 * sv);
    E::template store<W>(x2p + i, x2 * cv + x1 * sv);
  }
  for (; i < half; ++i) {
    const float x1 = E::load1(x + i), x2 = E::load1(x2p + i);
    x[i] = E::store1(x1 * c[i] - x2 * s[i]);
    x2p[i] = E::store1(x2 * c[i] + x1 * s[i]);
  }
}

template <typename E>
void rotary_rows_impl(void* base, int64_t T, int64_t row_stride, int64_t heads, int64_t head_stride,
                      int64_t half, const int64_t* pos, const float* cp, const float* sp) {
  using raw = typename E::raw;
  raw* x = static_cast<raw*>(base);
  at::parallel_for(0, T, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) rotate_head<E>(x + t * row_stride + h * head_stride, c, s, half);
    }
  });
}

// gate = dtype(silu(gate)) * up in place, silu(g) = g / (1 + exp(-g)) as torch computes it.
template <typename E>
void silu_and_mul_impl(at::Tensor& gate_up) {
  using raw = typename E::raw;
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  raw* base = static_cast<raw*>(gate_up.data_ptr());
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      raw* g = base + r * stride;
      const raw* u = g + n;
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        const F gv = E::template load<W>(g + i);
        const F silu = E::template round<W>(gv / (1.f + vexp<W>(-gv)));
        E::template store<W>(g + i, silu * E::template load<W>(u + i));
      }
      for (; i < n; ++i) {
        const float gv = E::load1(g + i);
        g[i] = E::store1(E::round1(gv / (1.f + std::exp(-gv))) * E::load1(u + i));
      }
    }
  });
}

// A mixture's expert outputs back at their tokens: out[t] = p[t, 0] + p[t, 1] + ... in choice
// order, each add rounded to the dtype, p[t, k] = dtype(y[r] * scale[r]) for the row r of y
// that slot t * K + k was computed in, 0 for a slot no row has (another expert-parallel rank's
// expert). What moe.grouped_experts' scatter and its loop of adds compute, in one pass.
template <typename E, typename S>
void moe_combine_impl(const at::Tensor& y, const std::vector<int64_t>& row_of, const at::Tensor& scale,
                      at::Tensor& out, int64_t top_k) {
  using raw = typename E::raw;
  const int64_t tokens = out.size(0), n = out.size(1), ys = y.stride(0);
  const raw* yb = static_cast<const raw*>(y.data_ptr());
  const typename S::raw* sb = static_cast<const typename S::raw*>(scale.data_ptr());
  raw* ob = static_cast<raw*>(out.data_ptr());
  at::parallel_for(0, tokens, grain_rows(top_k * n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      raw* o = ob + t * n;
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        F total = F{};
        for (int64_t k = 0; k < top_k; ++k) {
          const int64_t r = row_of[t * top_k + k];
          const F p = r < 0 ? F{}
                            : E::template round<W>(E::template load<W>(yb + r * ys + i) *
                                                   (S::load1(sb + r) - F{}));  // a splat (-0 stays -0)
          total = k == 0 ? p : E::template round<W>(total + p);
        }
        E::template store<W>(o + i, total);
      }
      for (; i < n; ++i) {
        float total = 0.f;
        for (int64_t k = 0; k < top_k; ++k) {
          const int64_t r = row_of[t * top_k + k];
          const float p = r < 0 ? 0.f : E::round1(E::load1(yb + r * ys + i) * S::load1(sb + r));
          total = k == 0 ? p : E::round1(total + p);
        }
        o[i] = E::store1(total);
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, n] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(1),
              "weight must be [n] of x's dtype");
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<F32>(x, weight, y, static_cast<float>(eps));
  } else {
    rms_norm_impl<BF16>(x, weight, y, static_cast<float>(eps));
  }
  return y;
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
                  residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "x and residual must be contiguous [rows, n] of one dtype");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(1),
              "weight must be [n] of x's dtype");
  if (x.scalar_type() == at::kFloat) {
    fused_add_rms_norm_impl<F32>(x, residual, weight, static_cast<float>(eps));
  } else {
    fused_add_rms_norm_impl<BF16>(x, residual, weight, static_cast<float>(eps));
  }
}

void rotary_embedding(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor cos,
                      at::Tensor sin) {
  check_rows(query, "query");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1 &&
                  key.scalar_type() == query.scalar_type() && key.size(0) == query.size(0) &&
                  key.size(2) == query.size(2) && query.size(2) % 2 == 0,
              "query [T, H, D] and key [T, Hkv, D] of one dtype, even D, contiguous rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(1) == query.size(2) / 2,
              "cos and sin must be contiguous float32 [max_position, D / 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == query.size(0),
              "positions must be int64 [T]");
  positions = positions.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "positions[", t, "] = ", pos[t],
                " outside [0, ", cos.size(0), ")");
  const bool bf16 = query.scalar_type() == at::kBFloat16;
  const int64_t T = query.size(0), D = query.size(2);
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  rotary_rows(bf16, query.data_ptr(), T, query.stride(0), query.size(1), query.stride(1), D, pos, cp, sp);
  rotary_rows(bf16, key.data_ptr(), T, key.stride(0), key.size(1), key.stride(1), D, pos, cp, sp);
}

void rotary_rows(bool bf16, void* base, int64_t T, int64_t row_stride, int64_t heads,
                 int64_t head_stride, int64_t D, const int64_t* pos, const float* cos,
                 const float* sin) {
  if (bf16) {
    rotary_rows_impl<BF16>(base, T, row_stride, heads, head_stride, D / 2, pos, cos, sin);
  } else {
    rotary_rows_impl<F32>(base, T, row_stride, heads, head_stride, D / 2, pos, cos, sin);
  }
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * n] with contiguous rows");
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_impl<F32>(gate_up);
  } else {
    silu_and_mul_impl<BF16>(gate_up);
  }
  return gate_up.narrow(1, 0, gate_up.size(1) / 2);
}

at::Tensor moe_combine(at::Tensor y, at::Tensor order, at::Tensor scale, int64_t num_tokens,
                       int64_t top_k) {
  check_rows(y, "y");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "y must be [rows, n] with contiguous rows");
  TORCH_CHECK(num_tokens >= 0 && top_k > 0, "num_tokens must be >= 0 and top_k > 0");
  const int64_t rows = y.size(0), slots = num_tokens * top_k;
  TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 1 && order.size(0) == rows,
              "order must be int64 [rows]: the slot each row of y was computed for");
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == y.scalar_type()) &&
                  scale.dim() == 1 && scale.size(0) == rows,
              "scale must be [rows], float32 or y's dtype");
  order = order.contiguous();
  scale = scale.contiguous();
  std::vector<int64_t> row_of(slots, -1);
  const int64_t* ord = order.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ord[r] >= 0 && ord[r] < slots && row_of[ord[r]] < 0, "order[", r, "] = ", ord[r],
                ": must be a slot in [0, ", slots, ") no other row has");
    row_of[ord[r]] = r;
  }
  at::Tensor out = at::empty({num_tokens, y.size(1)}, y.options());
  const bool fp32_scale = scale.scalar_type() == at::kFloat;
  if (y.scalar_type() == at::kFloat) {
    moe_combine_impl<F32, F32>(y, row_of, scale, out, top_k);
  } else if (fp32_scale) {
    moe_combine_impl<BF16, F32>(y, row_of, scale, out, top_k);
  } else {
    moe_combine_impl<BF16, BF16>(y, row_of, scale, out, top_k);
  }
  return out;
}

}  // namespace duet
