// What the paged attention kernels (paged_decode_cpu.cpp, paged_prefill_cpu.cpp) share: their
// argument checks (a bad shape or index must fail with a message, never read or write outside
// the tensors) and the cache geometry and pointers every work item reads.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace duet {

// Whether query [T, H, D] has the layout the kernels read: each token's H * D values contiguous,
// tokens at any stride (a view of the q|k|v projection is). Otherwise the caller packs it.
inline bool query_rows_contiguous(const at::Tensor& query) {
  return query.dim() == 3 && query.stride(2) == 1 &&
         (query.size(1) == 1 || query.stride(1) == query.size(2));
}

// out [T, H, D] contiguous and query alike (each token's row contiguous, see
// query_rows_contiguous), one dtype; caches [NB, BS, Hkv, D] alike, Hkv dividing H.
inline void check_paged_attention_args(const at::Tensor& out, const at::Tensor& query,
                                       const at::Tensor& key_cache,
                                       const at::Tensor& value_cache) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "query and cache dtypes differ");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && out.sizes() == query.sizes(), "bad out");
  TORCH_CHECK(query_rows_contiguous(query) && out.is_contiguous(),
              "query rows and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim differs between query and cache");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads not a multiple of kv heads");
}

// Row b of the block table: seq_len in [1, max_blocks * block_size], and every block the
// sequence reads inside the cache.
inline void check_block_row(const int64_t* tables, int64_t b, int64_t max_blocks,
                            int64_t block_size, int64_t seq_len, int64_t num_blocks) {
  TORCH_CHECK(seq_len >= 1 && seq_len <= max_blocks * block_size, "seq_lens[", b, "] = ", seq_len,
              " outside [1, ", max_blocks * block_size, "]");
  for (int64_t j = 0; j < (seq_len + block_size - 1) / block_size; ++j) {
    const int64_t id = tables[b * max_blocks + j];
    TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id,
                " outside [0, ", num_blocks, ")");
  }
}

// Shapes, strides and pointers of one call; each kernel's Problem extends it.
struct PagedArgs {
  int64_t H, Hkv, G, D, BS, max_blocks;
  int64_t row, block;  // element strides between tokens in a block, and between blocks
  int64_t q_row;       // element stride between query tokens
  const void *q, *kc, *vc;
  void* o;
  const int64_t* tables;
  float scale;
};

// Fills `a` from checked arguments (check_paged_attention_args; block_tables contiguous int64).
inline void fill_paged_args(PagedArgs& a, const at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, double scale) {
  a.H = query.size(1);
  a.Hkv = key_cache.size(2);
  a.G = a.H / a.Hkv;
  a.D = query.size(2);
  a.BS = key_cache.size(1);
  a.max_blocks = block_tables.size(1);
  a.row = a.Hkv * a.D;
  a.q_row = query.stride(0);
  a.block = a.BS * a.row;
  a.q = query.data_ptr();
  a.kc = key_cache.data_ptr();
  a.vc = value_cache.data_ptr();
  a.o = out.data_ptr();
  a.tables = block_tables.data_ptr<int64_t>();
  a.scale = static_cast<float>(scale);
}

}  // namespace duet
