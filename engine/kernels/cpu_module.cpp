// duet's CPU kernel module: the Python bindings of cpu_ops.h, plus the per-thread denormal
// setting the kernels rely on. Compiled by engine/kernels/cpu.py on first use.
#include <ATen/Parallel.h>
// Bindings only: torch/extension.h would also parse the whole C++ frontend (~15 s more).
#include <torch/python.h>

#include <optional>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "attention_amx.h"
#include "cpu_ops.h"
#include "cpu_simd.h"

// torch.set_flush_denormal only sets the calling thread's MXCSR; intra-op worker threads
// (OpenMP) keep denormals on, and fp32 softmax/attention on them crawls. Run one tiny task on
// every worker so each sets flush-to-zero / denormals-are-zero for good (the pool persists).
int64_t flush_denormals_on_all_threads() {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> done(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
#if defined(__SSE__)
    _mm_setcsr(_mm_getcsr() | 0x8040);
#endif
    for (int64_t i = begin; i < end; ++i) done[i] = 1;
  });
  int64_t total = 0;
  for (int64_t d : done) total += d;
  return total;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flush_denormals_on_all_threads", &flush_denormals_on_all_threads,
        "Set FTZ/DAZ on every intra-op worker thread; returns the number of tasks run");
  m.def("simd_lanes", [] { return duet::kLanes; }, "fp32 lanes of the kernels' vectors");
  m.def(
      "attention_amx",
      [](std::optional<bool> wanted) {
        if (wanted.has_value()) duet::attention_amx_wanted.store(*wanted);
        return duet::attention_amx_wanted.load();
      },
      pybind11::arg("wanted") = pybind11::none(),
      "Whether bf16 paged attention may take the AMX order (attention_amx.h) where the CPU has "
      "AMX; sets it first when `wanted` is given");
  m.def("attention_amx_used", &duet::use_amx_attention,
        "Whether bf16 paged attention takes the AMX order for (head_dim, block_size) now");
  m.def("paged_decode_attention", &duet::paged_decode_attention,
        "Paged decode attention over a block-table KV cache (CPU), written into out in place");
  m.def("decode_attention_step", &duet::decode_attention_step,
        "A layer's rotary embedding, KV write and paged decode attention for a step of decodes "
        "only (qkv [T, (H + 2 Hkv) D] -> [T, H D]), in one call");
  m.def("paged_prefill_attention", &duet::paged_prefill_attention,
        "Causal paged attention of prefill query tokens (CPU), written into out in place");
  m.def("prefill_head_dim_supported", &duet::prefill_head_dim_supported,
        "Whether paged_prefill_attention takes this head size");
  m.def("rms_norm", &duet::rms_norm, "HF RMSNorm of x [rows, n] into a new tensor");
  m.def("fused_add_rms_norm", &duet::fused_add_rms_norm,
        "residual += x (rounded to the dtype), then x = RMSNorm(residual); both in place");
  m.def("rotary_embedding", &duet::rotary_embedding,
        "Rotate query [T, H, D] and key [T, Hkv, D] in place (rotate-half layout)");
  m.def("copy_rows", &duet::copy_rows,
        "dst[dst_rows[i]] = src[src_rows[i]] for 2-D tensors with contiguous rows (memcpy each)");
  m.def("write_kv", &duet::write_kv,
        "Store key/value [T, Hkv, D] at cache slots slot_mapping [T] of kv_cache "
        "[2, num_blocks, block_size, Hkv, D] (memcpy each token's row)");
  m.def("top_p_threshold", &duet::top_p_threshold,
        "Per row of probs [rows, vocab] float32: the probability of the last token its top-p "
        "set needs ([rows, 1]; 0 where top_p >= 1)");
  m.def("sample_inverse_cdf", &duet::sample_inverse_cdf,
        "Per row: the first token whose cumulative probability (double) exceeds u * total");
  m.def("argmax_rows", &duet::argmax_rows,
        "torch.argmax(logits, -1) of float32 [rows, vocab]: first maximal index, NaN the max");
  m.def("apply_token_bitmask", &duet::apply_token_bitmask,
        "logits [rows, vocab] float32 in place: -inf where the int32 bitmask's bit is clear");
  m.def("moe_combine", &duet::moe_combine,
        "A mixture's expert rows y [rows, n] (row r computed for slot order[r] = token * top_k + "
        "choice), scaled by scale[r] and rounded, summed per token in choice order: [num_tokens, "
        "n]; a slot no row has adds zero",
        py::arg("y"), py::arg("order"), py::arg("scale"), py::arg("num_tokens"), py::arg("top_k"));
  m.def("silu_and_mul", &duet::silu_and_mul, "silu(gate) * up of gate_up [rows, 2n], written over gate; returns that [rows, n] view");
}
