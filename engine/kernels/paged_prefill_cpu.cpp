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
// first copies the keys the tile can see into a transposed fp32 panel (Kt[d][key]) and the
// values into an fp32 panel (one widening for every query row), then takes the tile's rows (a
// token's G query heads are consecutive rows) a group of R at a time: for each run of W keys,
// R x W scores from R x D broadcasts against D key vectors, an online softmax (running max and
// sum per row, a vectorised exp, masked past each row's position), and the W value rows
// weighted into the R rows' outputs, a few vectors of them at a time in registers (the outputs
// wait in L1 between runs of keys). Keys past the group's last position are never visited, so
// the causal half costs nothing.
//
// Threads take items from a shared counter, biggest first (the way decode attention shares
// work), so no thread waits for another's long prompt.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

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
  std::vector<float> kt, v, q, p, o;
};

// Rows per group and output vectors per pass of the value loop: R score vectors, then R x NC
// accumulators, stay in registers (32 vector registers with AVX-512, 16 below it). Each run of
// keys and values is read once per R rows, so R sets how much of the panels' L2 traffic each
// multiply-add costs; the outputs wait in L1 between runs.
template <int W>
constexpr int kRows = W >= 16 ? 12 : 6;
template <int ND>
constexpr int kPassVecs = ND % 2 == 0 ? 2 : 1;

// Rows [r0, r0 + R) of the item (row r: token j0 + r / G, head kvh * G + r % G), all keys.
template <typename E, int W, int ND, int R>
void attend_rows(const Problem& P, const Item& it, int64_t r0, int64_t rows, const float* kt,
                 int64_t kpad, const float* vf, float* qf, float* pbuf, float* ob) {
  using F = typename Vec<W>::F;
  using I = typename Vec<W>::I;
  using raw = typename E::raw;
  constexpr int64_t D = ND * W;
  constexpr int NC = kPassVecs<ND>;
  const int64_t G = P.G, H = P.H;
  const int64_t ctx = P.seq_lens[it.req] - P.q_lens[it.req];  // KV before the query tokens
  int64_t pos[R];
  raw* orow[R];
  for (int r = 0; r < R; ++r) {
    const int64_t rr = std::min(r0 + r, rows - 1);  // a short last group repeats its last row
    const int64_t j = it.j0 + rr / G, h = it.kvh * G + rr % G;
    pos[r] = ctx + j;
    const int64_t t = P.q_start[it.req] + j;
    const raw* qrow = static_cast<const raw*>(P.q) + (t * H + h) * D;
    orow[r] = static_cast<raw*>(P.o) + (t * H + h) * D;
    for (int i = 0; i < ND; ++i)
      store_f32<W>(qf + r * D + i * W, E::template load<W>(qrow + i * W) * P.scale);
  }
  std::fill(ob, ob + R * D, 0.f);
  const int64_t first_pos = pos[0], last_pos = pos[R - 1];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  I lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  for (int64_t k0 = 0; k0 <= last_pos; k0 += W) {
    F s[R];  // s[r] = q_r . k for the W keys [k0, k0 + W)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) s[r] = F{};
    const float* ktk = kt + k0;
#pragma GCC unroll 4
    for (int64_t d = 0; d < D; ++d) {
      const F kd = load_f32<W>(ktk + d * kpad);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) s[r] += qf[r * D + d] * kd;
    }
    const bool masked = k0 + W - 1 > first_pos;  // some key here lies past some row's position
    for (int r = 0; r < R; ++r) {
      F x = s[r];
      I valid{};
      if (masked) {
        valid = (lane + static_cast<int32_t>(k0)) <= static_cast<int32_t>(pos[r]);
        x = valid ? x : splat<W>(-INFINITY);
      }
      const float mx = std::max(m[r], hmax<W>(x));
      F p = vexp<W>(x - mx);
      if (masked) p = valid ? p : F{};
      if (mx > m[r]) {  // rescale what came before (nothing on the first run of keys)
        const float c = std::exp(m[r] - mx);
        l[r] *= c;
        if (k0 > 0)
          for (int i = 0; i < ND; ++i)
            store_f32<W>(ob + r * D + i * W, load_f32<W>(ob + r * D + i * W) * c);
        m[r] = mx;
      }
      l[r] += hsum<W>(p);
      store_f32<W>(pbuf + r * W, p);
    }
    // ob[r] += sum_t p[r, t] v_t, NC vectors of the row at a time.
    const int64_t n = std::min<int64_t>(W, last_pos + 1 - k0);
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
          const F pt = splat<W>(pbuf[r * W + t]);
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
  for (int r = 0; r < R && r0 + r < rows; ++r) {
    const float inv = 1.f / l[r];
    for (int i = 0; i < ND; ++i)
      E::template store<W>(orow[r] + i * W, load_f32<W>(ob + r * D + i * W) * inv);
  }
}

template <typename E, int W, int ND>
void attend_item(const Problem& P, const Item& it, Scratch& s) {
  using raw = typename E::raw;
  constexpr int64_t D = ND * W;
  constexpr int R = kRows<W>;
  const int64_t ctx = P.seq_lens[it.req] - P.q_lens[it.req];
  const int64_t keys = ctx + it.j1;  // what the tile's last token sees
  const int64_t kpad = (keys + W - 1) / W * W;
  s.kt.resize(D * kpad);
  s.v.resize(kpad * D);
  s.q.resize(R * D);
  s.p.resize(R * W);
  s.o.resize(R * D);
  float* kt = s.kt.data();
  float* vf = s.v.data();
  const raw* kc = static_cast<const raw*>(P.kc);
  const raw* vc = static_cast<const raw*>(P.vc);
  const int64_t* table = P.tables + it.req * P.max_blocks;
  for (int64_t t = 0; t < kpad; ++t) {
    float* vt = vf + t * D;
    if (t >= keys) {  // padding: finite, and weighted by 0
      for (int64_t d = 0; d < D; ++d) kt[d * kpad + t] = 0.f;
      std::fill(vt, vt + D, 0.f);
      continue;
    }
    const int64_t offset = table[t / P.BS] * P.block + (t % P.BS) * P.row + it.kvh * D;
    const raw* kr = kc + offset;
    const raw* vr = vc + offset;
    for (int64_t d = 0; d < D; ++d) kt[d * kpad + t] = E::load1(kr + d);
    for (int i = 0; i < ND; ++i) store_f32<W>(vt + i * W, E::template load<W>(vr + i * W));
  }
  const int64_t rows = (it.j1 - it.j0) * P.G;
  for (int64_t r0 = 0; r0 < rows; r0 += R)
    attend_rows<E, W, ND, R>(P, it, r0, rows, kt, kpad, vf, s.q.data(), s.p.data(), s.o.data());
}

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
    default: TORCH_CHECK(false, "paged_prefill_attention: head_dim ", P.D, " unsupported");
  }
}

}  // namespace

bool prefill_head_dim_supported(int64_t head_dim) {
  if (head_dim % kLanes != 0) return false;
  const int64_t nd = head_dim / kLanes;
  return nd == 1 || nd == 2 || nd == 4 || nd == 8 || nd == 16;
}

void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_start, at::Tensor query_lens,
                             double scale) {
  check_paged_attention_args(out, query, key_cache, value_cache);
  TORCH_CHECK(prefill_head_dim_supported(query.size(2)), "head_dim ", query.size(2),
              " unsupported: a multiple of ", kLanes, " times 1, 2, 4, 8 or 16");
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
