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

void write_kv(at::Tensor kv_cache, at::Tensor key, at::Tensor value, at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, Hkv, D] CPU tensor");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);
  for (at::Tensor* t : {&key, &value}) {
    const char* name = t == &key ? "key" : "value";
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3, name, " must be a [T, Hkv, D] CPU tensor");
    TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type(), name, " must have the cache's dtype");
    TORCH_CHECK(t->size(1) == kv_cache.size(3) && t->size(2) == kv_cache.size(4), name,
                " must have the cache's heads and head size");
    // A token's heads are one row of the copy (a view of q|k|v is); anything else is packed.
    if (t->stride(2) != 1 || (t->size(1) > 1 && t->stride(1) != t->size(2))) *t = t->contiguous();
  }
  if (slot_mapping.scalar_type() != at::kLong || !slot_mapping.is_contiguous()) {
    slot_mapping = slot_mapping.to(at::kLong).contiguous();
  }
  const int64_t tokens = key.size(0);
  TORCH_CHECK(value.size(0) == tokens && slot_mapping.numel() == tokens,
              "key, value and slot_mapping must have one row per token");
  check_index(slot_mapping, num_slots, "slot_mapping");
  const int64_t item = kv_cache.element_size();
  const int64_t row_bytes = row * item;
  char* k_dst = static_cast<char*>(kv_cache.data_ptr());
  char* v_dst = k_dst + num_slots * row_bytes;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * item;
  const int64_t v_stride = value.stride(0) * item;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  // A task moves at least ~1 MiB (K and V rows together), as in copy_rows.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, 2 * row_bytes));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(k_dst + slots[i] * row_bytes, k_src + i * k_stride, row_bytes);
      std::memcpy(v_dst + slots[i] * row_bytes, v_src + i * v_stride, row_bytes);
    }
  });
}

}  // namespace duet
