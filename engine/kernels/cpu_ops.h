// The operations of duet's CPU kernel module (bound to Python in cpu_module.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace duet {

// Attention of one query token per sequence over its paged KV (paged_decode_cpu.cpp).
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables, at::Tensor seq_lens,
                            at::Tensor token_indices, double scale);

// A layer's attention for a step of decodes only, in one call (paged_decode_cpu.cpp): the
// rotary embedding of q and k (views of qkv [T, (H + 2 Hkv) D]), the step's K/V into kv_cache
// [2, num_blocks, block_size, Hkv, D] at slot_mapping, then paged_decode_attention; returns
// the output [T, H D]. Exactly the three separate calls' arithmetic.
at::Tensor decode_attention_step(at::Tensor qkv, at::Tensor positions, at::Tensor cos,
                                 at::Tensor sin, at::Tensor kv_cache, at::Tensor slot_mapping,
                                 at::Tensor block_tables, at::Tensor seq_lens,
                                 at::Tensor token_indices, int64_t num_heads,
                                 int64_t num_kv_heads, double scale);

// Causal attention of each request's query tokens over its paged KV (paged_prefill_cpu.cpp).
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_start, at::Tensor query_lens,
                             double scale);
// Whether paged_prefill_attention takes this head size (a multiple of the vector width).
bool prefill_head_dim_supported(int64_t head_dim);

// Elementwise ops of the Llama block (elementwise_cpu.cpp), with HF's rounding points.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor cos,
                      at::Tensor sin);
// rotary_embedding on raw rows: `heads` head rows of D values (head_stride apart) at the start
// of each of T rows (row_stride apart), bf16 or fp32, in place; pos [T] already checked to lie
// inside cos/sin [max_position, D / 2].
void rotary_rows(bool bf16, void* base, int64_t T, int64_t row_stride, int64_t heads,
                 int64_t head_stride, int64_t D, const int64_t* pos, const float* cos,
                 const float* sin);
// Overwrites the gate half of gate_up and returns it (a view).
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor moe_combine(at::Tensor y, at::Tensor order, at::Tensor scale, int64_t num_tokens,
                       int64_t top_k);

// dst[dst_rows[i]] = src[src_rows[i]] for 2-D tensors of one dtype and row length, one memcpy
// per row (copy_cpu.cpp). Indices are bounds-checked.
void copy_rows(at::Tensor dst, at::Tensor dst_rows, at::Tensor src, at::Tensor src_rows);
// kv_cache[0] slot slot_mapping[i] = key[i], kv_cache[1] slot slot_mapping[i] = value[i]:
// kv_cache [2, num_blocks, block_size, Hkv, D] contiguous; key/value [T, Hkv, D] with each
// token's Hkv * D values contiguous (views of the q|k|v projection); one memcpy per row.
void write_kv(at::Tensor kv_cache, at::Tensor key, at::Tensor value, at::Tensor slot_mapping);

// The sampler's full-vocabulary walks (sampling_cpu.cpp), bitwise equal to engine/sampler.py's
// torch path: each row's top-p threshold [rows, 1] (0 where top_p >= 1), and each row's
// inverse-CDF draw [rows] int64 (cumulative sum in double, first token above u * total).
at::Tensor top_p_threshold(at::Tensor probs, at::Tensor top_p);
at::Tensor sample_inverse_cdf(at::Tensor probs, at::Tensor uniform);
// torch.argmax(logits, dim=-1) of contiguous float32 [rows, vocab]: the first maximal index,
// a NaN counting as the maximum.
at::Tensor argmax_rows(at::Tensor logits);
// A grammar's token bitmask (int32 [rows, ceil(vocab / 32)], bit set = allowed) applied to
// float32 logits [rows, vocab] in place: -inf where the bit is clear.
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask);

}  // namespace duet
