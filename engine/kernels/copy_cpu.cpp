// Row copies by index, for moving KV blocks between a paged cache and a staging buffer: one
// memcpy per row. torch's index_copy_ walks elements through TensorIterator and writes ~2.5x
// slower per byte (9-10 vs 23 GB/s, one thread, 12 KiB rows, a 2-core EPYC VM).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_ops.h"

namespace duet {
namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void check_index(const at::Tensor& idx, int64_t rows, const char* name) {
  TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == at::kLong && idx.dim() == 1 &&
                  idx.is_contiguous(),
              name, " must be a contiguous 1-D int64 CPU tensor");
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < rows, name, "[", i, "] = ", p[i], " is outside [0, ",
                rows, ")");
  }
}

}  // namespace

void copy_rows(at::Tensor dst, at::Tensor dst_rows, at::Tensor src, at::Tensor src_rows) {
  check_rows(dst, "dst");
  check_rows(src, "src");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "dst and src must have one dtype");
  TORCH_CHECK(dst.size(1) == src.size(1), "dst and src rows differ in length: ", dst.size(1),
              " vs ", src.size(1));
  TORCH_CHECK(dst_rows.numel() == src_rows.numel(), "dst_rows and src_rows differ in length");
  check_index(dst_rows, dst.size(0), "dst_rows");
  check_index(src_rows, src.size(0), "src_rows");
  const int64_t item = dst.element_size();
  const int64_t row_bytes = dst.size(1) * item;
  const int64_t dst_stride = dst.stride(0) * item;
  const int64_t src_stride = src.stride(0) * item;
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  const int64_t* di = dst_rows.data_ptr<int64_t>();
  const int64_t* si = src_rows.data_ptr<int64_t>();
  // A task moves at least ~1 MiB: below that a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, dst_rows.numel(), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(d + di[i] * dst_stride, s + si[i] * src_stride, row_bytes);
    }
  });
}

}  // namespace duet
