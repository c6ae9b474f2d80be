// Paged decode attention on the CPU: one query token per sequence attends to all of that
// sequence's KV, read straight from the paged cache (no gather copy).
//
// out, query:   [T, H, D]            (fp32 or bf16); rows token_indices[b] are read/written
// key_cache:    [NB, BS, Hkv, D]     (same dtype)
// value_cache:  [NB, BS, Hkv, D]
// block_tables: [B, max_blocks] int64
// seq_lens:     [B] int64
// token_indices:[B] int64
//
// Work is split over (sequence, kv head); the G = H / Hkv query heads sharing a KV head are
// processed together so each K/V row is read once. Scores are kept in a per-task buffer, then a
// numerically stable softmax (max-subtracted, fp32) weights the V rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

// Element loads/stores as plain bit operations so the compiler vectorizes them.
struct F32 {
  using raw = float;
  static inline float load(raw x) { return x; }
  static inline raw store(float x) { return x; }
};
struct BF16 {
  using raw = uint16_t;
  static inline float load(raw x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static inline raw store(float x) {  // round to nearest even, as torch does
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<raw>(bits >> 16);
  }
};

template <typename E>
static void decode_impl(torch::Tensor& out, const torch::Tensor& query,
                        const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                        const torch::Tensor& token_indices, double scale) {
  using raw = typename E::raw;
  const int64_t B = block_tables.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const raw* q = reinterpret_cast<const raw*>(query.data_ptr());
  const raw* kc = reinterpret_cast<const raw*>(key_cache.data_ptr());
  const raw* vc = reinterpret_cast<const raw*>(value_cache.data_ptr());
  raw* o = reinterpret_cast<raw*>(out.data_ptr());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* rows = token_indices.data_ptr<int64_t>();
  const int64_t row = Hkv * D;        // stride between tokens inside a block
  const int64_t block = BS * row;     // stride between blocks
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
#if defined(__SSE__)
    // Worker threads do not inherit torch.set_flush_denormal: flush denormals here too, or the
    // tiny softmax weights of far-away tokens make every multiply ~100x slower.
    _mm_setcsr(_mm_getcsr() | 0x8040);
#endif
    std::vector<float> qf(G * D), acc(G * D), kf(D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kvh = task % Hkv;
      const int64_t len = lens[b];
      const int64_t qrow = rows[b];
      scores.resize(G * len);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = E::load(q[(qrow * H + kvh * G + g) * D + d]) * fscale;
      for (int64_t t = 0; t < len; ++t) {  // scores[g, t] = q_g . k_t
        const raw* k = kc + tables[b * max_blocks + t / BS] * block + (t % BS) * row + kvh * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kf[d] = E::load(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        const float mx = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const raw* v = vc + tables[b * max_blocks + t / BS] * block + (t % BS) * row + kvh * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kf[d] = E::load(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * kf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          o[(qrow * H + kvh * G + g) * D + d] = E::store(acc[g * D + d]);
    }
  });
}

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, torch::Tensor token_indices, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && out.sizes() == query.sizes(), "bad out");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads not a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64 &&
                  token_indices.scalar_type() == torch::kInt64, "index tensors must be int64");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  token_indices = token_indices.contiguous();
  if (query.scalar_type() == torch::kFloat32) {
    decode_impl<F32>(out, query, key_cache, value_cache, block_tables, seq_lens, token_indices, scale);
  } else if (query.scalar_type() == torch::kBFloat16) {
    decode_impl<BF16>(out, query, key_cache, value_cache, block_tables, seq_lens, token_indices, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
}

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
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a block-table KV cache (CPU), written into out in place");
}
