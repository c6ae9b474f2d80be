// Paged prefill attention on the CPU: each request's query tokens (a prompt, a chunk of one, or
// the rest of one after a prefix-cache hit) attend causally to all of the request's KV, read
// from the paged cache (this step's K/V are already written there).
//
// out, query:   [T, H, D]            (fp32 or bf16); request i's rows start at query_start[i]
// key_cache:    [NB, BS, Hkv, D]     (same dtype)
// value_cache:  [NB, BS, Hkv, D]
// block_tables: [B, max_blocks] int64
// seq_lens:     [B] int64: KV tokens after this step; the query tokens are the last query_lens
// query_start, query_lens: [B] int64
//
// Unlike decode (one query row per sequence: memory-bound), prefill is a matrix product, so
// this kernel is tiled like one. A work item is (request, KV head, a tile of query tokens). It
// first copies the keys and values the tile can see into fp32 panels (one widening for every
// query row), then takes the tile's rows (a token's G query heads are consecutive rows) a
// group of R at a time: for each run of keys, R x run scores (four keys at a time, a quad of
// keys held in registers across the rows when it fits), an online softmax per row (a
// vectorised exp, masked past each row's position), and the run's value rows weighted into
// the R rows' outputs, a few vectors of them at a time in registers (the outputs wait in L1
// between runs); at each partition boundary the rows' partial results are folded. The
// arithmetic per query row is exactly the decode kernel's (attention_order.h): a row's output
// does not depend on the rows beside it, on where its chunk starts, or on which kernel runs
// it. Keys past the group's last position are never visited, so the causal half costs nothing.
//
// Threads take items from a shared counter, biggest first (the way decode attention shares
// work), so no thread waits for another's long prompt.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "attention_amx.h"
#include "attention_order.h"
#include "cpu_ops.h"
#include "cpu_simd.h"
#include "paged_common.h"

namespace duet {
namespace {

constexpr int64_t kTileTokens = 32;  // query tokens per item: x G rows share one K/V panel

struct Item {
  int64_t req, kvh, j0, j1;  // query tokens [j0, j1) of request req, KV head kvh
  int64_t cost;              // rows x keys, for the biggest-first order
};

struct Problem : PagedArgs {
  const int64_t *seq_lens, *q_start, *q_lens;
};

struct Scratch {  // per thread, reused across items
  std::vector<float> kt, v, q, s, p, o, om;
};

// Rows per group and output vectors per pass of the value loop: R x NC accumulators stay in
// registers (32 vector registers with AVX-512, 16 below it). Each run of values is read once
// per R rows, so R sets how much of the panels' L2 traffic each multiply-add costs; the
// outputs wait in L1 between runs.
template <int W>
constexpr int kRows = W >= 16 ? 12 : 6;
template <int ND>
constexpr int kPassVecs = ND % 2 == 0 ? 2 : 1;
// Whether a quad of keys (4 x ND vectors) stays in registers across the group's rows.
template <int ND>
constexpr bool kSharedQuad = 4 * ND <= 16;

struct RowBuffers {  // per thread: a group's scores, weights, and partition / merged outputs
  float *q, *s, *p, *o, *om;
  int64_t sw;  // floats per row of s
};

// Rows [r0, r0 + R) of the item (row r: token j0 + r / G, head kvh * G + r % G), all keys, in
// the order of attention_order.h.
template <typename E, int W, int ND, int R>
void attend_rows(const Problem& P, const Item& it, int64_t r0, int64_t rows, const float* kp,
                 const float* vf, const RowBuffers& b) {
  using F = typename Vec<W>::F;
  using I = typename Vec<W>::I;
  using raw = typename E::raw;
  constexpr int64_t D = ND * W;
  constexpr int NC = kPassVecs<ND>;
  const int64_t G = P.G, H = P.H;
  const int64_t L = run_length<W>(P.BS), part = partition_tokens(P.BS);
  const int64_t ctx = P.seq_lens[it.req] - P.q_lens[it.req];  // KV before the query tokens
  float* qf = b.q;
  float* ob = b.o;
  int64_t pos[R];
  raw* orow[R];
  for (int r = 0; r < R; ++r) {
    const int64_t rr = std::min(r0 + r, rows - 1);  // a short last group repeats its last row
    const int64_t j = it.j0 + rr / G, h = it.kvh * G + rr % G;
    pos[r] = ctx + j;
    const int64_t t = P.q_start[it.req] + j;
    const raw* qrow = static_cast<const raw*>(P.q) + t * P.q_row + h * D;
    orow[r] = static_cast<raw*>(P.o) + (t * H + h) * D;
    for (int i = 0; i < ND; ++i)
      store_f32<W>(qf + r * D + i * W, load_vec<E, W, ND>(qrow, i) * P.scale);
  }
  std::fill(ob, ob + R * D, 0.f);
  const int64_t last_pos = pos[R - 1];
  float m[R], l[R], M[R], Lm[R];
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  bool first_partition = true;
  auto end_partition = [&]() {  // fold the partition into the merged result, start the next
    for (int r = 0; r < R; ++r) {
      take_partition(first_partition, M[r], Lm[r], b.om + r * D, m[r], l[r], ob + r * D, D);
      m[r] = -INFINITY;
      l[r] = 0.f;
    }
    std::fill(ob, ob + R * D, 0.f);
    first_partition = false;
  };
  I lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  for (int64_t k0 = 0; k0 <= last_pos; k0 += L) {
    if (k0 > 0 && k0 % part == 0) end_partition();
    // s[r, t] = q_r . k_{k0 + t} for the run's keys, four at a time.
    for (int64_t t4 = 0; t4 < L; t4 += 4) {
      const float* kq = kp + (k0 + t4) * D;  // four panel rows (the panel is padded for it)
      if constexpr (kSharedQuad<ND>) {
        F kv[4][ND];
#pragma GCC unroll 16
        for (int j = 0; j < 4; ++j)
#pragma GCC unroll 16
          for (int i = 0; i < ND; ++i) kv[j][i] = load_f32<W>(kq + j * D + i * W);
        for (int r = 0; r < R; ++r)
          store_f32<4>(b.s + r * b.sw + t4,
                       dot4<W, ND>(qf + r * D, ND, [&](int j, int i) { return kv[j][i]; }));
      } else {
        for (int r = 0; r < R; ++r)
          store_f32<4>(b.s + r * b.sw + t4, dot4<W, ND>(qf + r * D, ND, [&](int j, int i) {
                         return load_f32<W>(kq + j * D + i * W);
                       }));
      }
    }
    for (int r = 0; r < R; ++r) {
      const I valid = (lane < static_cast<int32_t>(L)) &
                      ((lane + static_cast<int32_t>(k0)) <= static_cast<int32_t>(pos[r]));
      float rescale;
      const F p = softmax_run<W>(load_f32<W>(b.s + r * b.sw), valid, m[r], l[r], rescale);
      if (rescale != 1.f)
        for (int i = 0; i < ND; ++i)
          store_f32<W>(ob + r * D + i * W, load_f32<W>(ob + r * D + i * W) * rescale);
      store_f32<W>(b.p + r * W, p);
    }
    // ob[r] += sum_t p[r, t] v_t, NC vectors of the row at a time.
    const int64_t n = std::min<int64_t>(L, last_pos + 1 - k0);
    for (int c0 = 0; c0 < ND; c0 += NC) {
      F acc[R][NC];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int i = 0; i < NC; ++i) acc[r][i] = load_f32<W>(ob + r * D + (c0 + i) * W);
      for (int64_t t = 0; t < n; ++t) {
        const float* vr = vf + (k0 + t) * D + c0 * W;
        F vv[NC];
#pragma GCC unroll 2
        for (int i = 0; i < NC; ++i) vv[i] = load_f32<W>(vr + i * W);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const F pt = splat<W>(b.p[r * W + t]);
#pragma GCC unroll 2
          for (int i = 0; i < NC; ++i) acc[r][i] += pt * vv[i];
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int i = 0; i < NC; ++i) store_f32<W>(ob + r * D + (c0 + i) * W, acc[r][i]);
    }
  }
  end_partition();
  for (int r = 0; r < R && r0 + r < rows; ++r) {
    const float inv = 1.f / Lm[r];
    for (int i = 0; i < ND; ++i)
      E::template store<W>(orow[r] + i * W, load_f32<W>(b.om + r * D + i * W) * inv);
  }
}

template <typename E, int W, int ND>
void attend_item(const Problem& P, const Item& it, Scratch& s) {
  using raw = typename E::raw;
  constexpr int64_t D = ND * W;
  constexpr int R = kRows<W>;
  const int64_t ctx = P.seq_lens[it.req] - P.q_lens[it.req];
  const int64_t keys = ctx + it.j1;  // what the tile's last token sees
  // Panels padded past the last run's vector and its last quad: finite, weighted by 0.
  const int64_t kpad = (keys + W - 1) / W * W + 4;
  const int64_t L = run_length<W>(P.BS);
  const int64_t sw = (L + 3) / 4 * 4 + W;
  s.kt.resize(kpad * D);
  s.v.resize(kpad * D);
  s.q.resize(R * D);
  s.s.resize(R * sw);
  s.p.resize(R * W);
  s.o.resize(R * D);
  s.om.resize(R * D);
  float* kp = s.kt.data();
  float* vf = s.v.data();
  const raw* kc = static_cast<const raw*>(P.kc);
  const raw* vc = static_cast<const raw*>(P.vc);
  const int64_t* table = P.tables + it.req * P.max_blocks;
  for (int64_t t = 0; t < kpad; ++t) {
    float* kt = kp + t * D;
    float* vt = vf + t * D;
    if (t >= keys) {
      std::fill(kt, kt + D, 0.f);
      std::fill(vt, vt + D, 0.f);
      continue;
    }
    const int64_t offset = table[t / P.BS] * P.block + (t % P.BS) * P.row + it.kvh * D;
    const raw* kr = kc + offset;
    const raw* vr = vc + offset;
    for (int i = 0; i < ND; ++i) {
      store_f32<W>(kt + i * W, load_vec<E, W, ND>(kr, i));  // the decode kernel's lanes
      store_f32<W>(vt + i * W, E::template load<W>(vr + i * W));
    }
  }
  const RowBuffers b{s.q.data(), s.s.data(), s.p.data(), s.o.data(), s.om.data(), sw};
  const int64_t rows = (it.j1 - it.j0) * P.G;
  for (int64_t r0 = 0; r0 < rows; r0 += R) attend_rows<E, W, ND, R>(P, it, r0, rows, kp, vf, b);
}


#if defined(DUET_AMX)
// The item in the AMX order (attention_amx.h): the values the tile can see are paired once
// into a panel; keys are read by the tiles straight from the cache; rows go 16 at a time.
template <int D>
void attend_item_amx(const Problem& P, const Item& it, std::vector<uint16_t>& panel,
                     AmxRows<D>& g, std::vector<float>& merged, int* configured) {
  const int64_t ctx = P.seq_lens[it.req] - P.q_lens[it.req];
  const int64_t keys = ctx + it.j1;
  const int64_t runs = (keys + kAmxRunKeys - 1) / kAmxRunKeys;
  const int64_t part = partition_tokens(P.BS);
  const uint16_t* kc = static_cast<const uint16_t*>(P.kc);
  const uint16_t* vc = static_cast<const uint16_t*>(P.vc);
  const int64_t* table = P.tables + it.req * P.max_blocks;
  panel.resize(runs * kAmxRunKeys * D);
  auto cache_row = [&](int64_t t) { return table[t / P.BS] * P.block + (t % P.BS) * P.row + it.kvh * D; };
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t k0 = r * kAmxRunKeys;
    pair_values<D>(vc + cache_row(k0), P.row, keys - k0, panel.data() + r * kAmxRunKeys * D);
  }
  merged.resize(16 * (D + 2));
  float* M = merged.data();
  float* L = M + 16;
  float* O = L + 16;
  const int64_t rows = (it.j1 - it.j0) * P.G;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, rows - r0));
    const uint16_t* q[16];
    uint16_t* out[16];
    int64_t pos[16];
    int64_t last_pos = 0;
    for (int r = 0; r < n; ++r) {  // row r: token j's head h
      const int64_t j = it.j0 + (r0 + r) / P.G, h = it.kvh * P.G + (r0 + r) % P.G;
      const int64_t t = P.q_start[it.req] + j;
      pos[r] = ctx + j;
      last_pos = std::max(last_pos, pos[r]);
      q[r] = static_cast<const uint16_t*>(P.q) + t * P.q_row + h * D;
      out[r] = static_cast<uint16_t*>(P.o) + (t * P.H + h) * D;
    }
    configure_attention_tiles(n, configured);
    g.begin(q, pos, n, P.scale);
    bool first = true;
    auto end_partition = [&]() {
      for (int r = 0; r < n; ++r)
        take_partition(first, M[r], L[r], O + r * D, g.max_of(r), g.sum_of(r), g.o[r], D);
      first = false;
      g.start_partition();
    };
    // Each run's scores are started before the previous run's softmax (two score tiles).
    const int64_t num_runs = last_pos / kAmxRunKeys + 1;
    g.scores(kc + cache_row(0), P.row, 0);
    for (int64_t i = 0; i < num_runs; ++i) {
      const int64_t k0 = i * kAmxRunKeys;
      if (k0 > 0 && k0 % part == 0) end_partition();
      if (i + 1 < num_runs) g.scores(kc + cache_row(k0 + kAmxRunKeys), P.row, (i + 1) & 1);
      g.finish(k0, i & 1, panel.data() + i * kAmxRunKeys * D);
    }
    end_partition();
    for (int r = 0; r < n; ++r) {
      const float inv = 1.f / L[r];
      for (int d = 0; d < D; d += 16)
        BF16::store<16>(out[r] + d, load_f32<16>(O + r * D + d) * inv);
    }
  }
}

template <int D>
void run_amx(const Problem& P, const std::vector<Item>& items) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1,
                   [&](int64_t, int64_t) {
                     _mm_setcsr(_mm_getcsr() | 0x8040);
                     std::vector<uint16_t> panel;
                     std::vector<float> merged;
                     auto g = std::make_unique<AmxRows<D>>();
                     int configured = -1;
                     for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
                       attend_item_amx<D>(P, items[i], panel, *g, merged, &configured);
                     _tile_release();
                   });
}
#endif

template <typename E, int W, int ND>
void run(const Problem& P, int64_t B) {
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ctx = P.seq_lens[b] - P.q_lens[b];
    for (int64_t j0 = 0; j0 < P.q_lens[b]; j0 += kTileTokens) {
      const int64_t j1 = std::min(P.q_lens[b], j0 + kTileTokens);
      for (int64_t h = 0; h < P.Hkv; ++h) items.push_back({b, h, j0, j1, (j1 - j0) * (ctx + j1)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
#if defined(DUET_AMX)
  if constexpr (std::is_same_v<E, BF16>) {
    if (use_amx_attention(P.D, P.BS)) {
      switch (P.D) {
        case 32: return run_amx<32>(P, items);
        case 64: return run_amx<64>(P, items);
        case 128: return run_amx<128>(P, items);
        case 256: return run_amx<256>(P, items);
        default: break;
      }
    }
  }
#endif
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1,
                   [&](int64_t, int64_t) {
#if defined(__SSE__)
                     _mm_setcsr(_mm_getcsr() | 0x8040);  // flush denormals (see decode)
#endif
                     Scratch scratch;
                     for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
                       attend_item<E, W, ND>(P, items[i], scratch);
                   });
}

template <typename E>
void dispatch(const Problem& P, int64_t B) {
  switch (P.D / kLanes) {
    case 1: return run<E, kLanes, 1>(P, B);
    case 2: return run<E, kLanes, 2>(P, B);
    case 4: return run<E, kLanes, 4>(P, B);
    case 8: return run<E, kLanes, 8>(P, B);
    case 16: return run<E, kLanes, 16>(P, B);
    case kLatentWidth / kLanes: return run<E, kLanes, kLatentWidth / kLanes>(P, B);
    default: TORCH_CHECK(false, "paged_prefill_attention: head_dim ", P.D, " unsupported");
  }
}

}  // namespace

bool prefill_head_dim_supported(int64_t head_dim) {
  if (head_dim % kLanes != 0) return false;
  const int64_t nd = head_dim / kLanes;
  return nd == 1 || nd == 2 || nd == 4 || nd == 8 || nd == 16 || head_dim == kLatentWidth;
}

void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_start, at::Tensor query_lens,
                             double scale) {
  if (!query_rows_contiguous(query)) query = query.contiguous();
  check_paged_attention_args(out, query, key_cache, value_cache);
  TORCH_CHECK(prefill_head_dim_supported(query.size(2)), "head_dim ", query.size(2),
              " unsupported: a multiple of ", kLanes, " times 1, 2, 4, 8 or 16, or ", kLatentWidth);
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start, &query_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong, "index tensors must be int64");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  query_start = query_start.contiguous();
  query_lens = query_lens.contiguous();
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(seq_lens.size(0) == B && query_start.size(0) == B && query_lens.size(0) == B,
              "one length, start and query length per table");
  Problem P{};
  fill_paged_args(P, out, query, key_cache, value_cache, block_tables, scale);
  P.seq_lens = seq_lens.data_ptr<int64_t>();
  P.q_start = query_start.data_ptr<int64_t>();
  P.q_lens = query_lens.data_ptr<int64_t>();
  const int64_t num_blocks = key_cache.size(0), T = query.size(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = P.seq_lens[b], q_len = P.q_lens[b], start = P.q_start[b];
    check_block_row(P.tables, b, P.max_blocks, P.BS, len, num_blocks);
    TORCH_CHECK(q_len >= 1 && q_len <= len, "query_lens[", b, "] = ", q_len, " outside [1, ",
                len, "]");
    TORCH_CHECK(start >= 0 && start + q_len <= T, "query rows of request ", b,
                " outside the batch");
  }
  if (query.scalar_type() == at::kFloat) {
    dispatch<F32>(P, B);
  } else if (query.scalar_type() == at::kBFloat16) {
    dispatch<BF16>(P, B);
  } else {
    TORCH_CHECK(false, "paged_prefill_attention: float32 or bfloat16 only");
  }
}

}  // namespace duet
