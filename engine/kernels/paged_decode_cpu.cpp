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
// A work item is a token range of one sequence, whole partitions of it (attention_order.h),
// with all its heads: whole sequences unless that leaves too few items to keep every thread
// busy, and a range of the query heads when even that does (one short sequence). It walks its blocks once, in order; a block's rows of all heads are contiguous in the
// cache, so memory is read in runs of block_size rows. Per block and KV head, its G = H / Hkv
// query heads are handled together: scores of the G query rows against the block's keys (four
// keys at a time, one horizontal reduction for four dot products, each key widened once for
// all G heads when the rows are short), an online softmax per run of keys (a vectorised exp),
// then the run's values weighted into G accumulators held in registers. At each partition
// boundary the partition's partial result (max, sum, unnormalised output) is set aside; a
// sequence of several partitions has them folded afterwards, in position order, so how the
// ranges are cut never changes a result. The arithmetic per query row is exactly the prefill
// kernel's, so a token's output has the same bits from either kernel. bf16 is widened to fp32
// in registers, two vectors per load (see load_vec).
//
// Threads take items from a shared counter, longest first, so a core slowed by another process
// just takes fewer items.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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

constexpr int64_t kMaxHeadDim = kLatentWidth;
constexpr int64_t kItemsPerThread = 4;  // split long sequences until there are this many

struct Item {
  int64_t b, begin, end;  // tokens [begin, end) of sequence b
  int64_t slot;           // -1: the whole sequence, written to out; else a partial slot
  int64_t h0, h1;         // its query heads [h0, h1)
};

struct Problem : PagedArgs {
  const int64_t* rows;  // the query row of each sequence
  const int64_t* lens;  // each sequence's length
  float* partials;      // per slot: H maxima, H sums, H x D unnormalised outputs
  bool amx;             // the AMX order (attention_amx.h): accumulators in row order
};

// Lines part, part + parts, ... of a row: spreads a row's prefetches over `parts` calls.
inline void prefetch_part(const void* row, int64_t bytes, int64_t part, int64_t parts) {
  for (int64_t off = part * 64; off < bytes; off += parts * 64)
    __builtin_prefetch(static_cast<const char*>(row) + off);
}

// The whole block kFarBlocks ahead (K and V, every KV head) is requested into L2 when a block
// starts; the per-head prefetches above then pull the next block's lines into L1. Both
// together read K/V 1.3-1.4x faster than the L1 prefetches alone (13.4 -> 18.2 GB/s fp32,
// 13.3 -> 17.1 bf16; 64 sequences of 100-700 tokens, 30 layers' caches beyond L3, 2 threads,
// 2-core AMD EPYC VM), and either alone is slower. 1 to 4 blocks ahead measured alike.
constexpr int64_t kFarBlocks = 2;

template <typename T>
inline void prefetch_block_l2(const T* kc, const T* vc, int64_t offset, int64_t elems) {
  const char* k = reinterpret_cast<const char*>(kc + offset);
  const char* v = reinterpret_cast<const char*>(vc + offset);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) {
    __builtin_prefetch(k + off, 0, 2);
    __builtin_prefetch(v + off, 0, 2);
  }
}

struct Scratch {  // per thread, reused across items
  std::vector<float> q, scores, weights, acc, maxima, sums;
};

// The value half of a block for a KV head: acc[g] += sum_t p[g, t] v_t for its G query
// heads. The heads go C at a time so that each value row is widened to fp32 once per C heads
// (not once per head), with C x ND accumulators held in registers.
template <typename E, int W>
struct PV {
  const float* scores;  // [G, BSpad]: softmax numerators of the block
  int64_t BSpad;
  const typename E::raw* v;  // row t at v + t * row
  int64_t row, n, D;
  const typename E::raw* v_next;  // the next block's rows to prefetch, or nullptr
  int64_t row_bytes;
};

// Accumulator vectors the head chunks may keep in registers (32 vector registers with
// AVX-512, 16 below it; the rest hold the widened value row).
template <int W>
constexpr int kAccRegs = W >= 16 ? 24 : 12;

template <typename E, int W, int ND, int C>
inline void pv_heads(const PV<E, W>& P, float* acc, int64_t g0, int64_t part, int64_t parts) {
  using F = typename Vec<W>::F;
  F a[C][ND];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
    for (int i = 0; i < ND; ++i) a[c][i] = load_f32<W>(acc + (g0 + c) * P.D + i * W);
  const float* p = P.scores + g0 * P.BSpad;
  for (int64_t t = 0; t < P.n; ++t) {
    const typename E::raw* vr = P.v + t * P.row;
    if (P.v_next != nullptr) prefetch_part(P.v_next + t * P.row, P.row_bytes, part, parts);
    F vv[ND];
#pragma GCC unroll 16
    for (int i = 0; i < ND; ++i) vv[i] = load_vec<E, W, ND>(vr, i);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const F pt = F{} + p[c * P.BSpad + t];
#pragma GCC unroll 16
      for (int i = 0; i < ND; ++i) a[c][i] += pt * vv[i];
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
    for (int i = 0; i < ND; ++i) store_f32<W>(acc + (g0 + c) * P.D + i * W, a[c][i]);
}

template <typename E, int W, int ND, int C>
inline void pv_tail(const PV<E, W>& P, float* acc, int64_t g0, int64_t rem, int64_t part,
                    int64_t parts) {  // the last `rem` (< C + 1) heads, rem known at run time
  if constexpr (C > 0) {
    if (rem == C) return pv_heads<E, W, ND, C>(P, acc, g0, part, parts);
    pv_tail<E, W, ND, C - 1>(P, acc, g0, rem, part, parts);
  }
}

template <typename E, int W, int ND>
inline void pv_group(const PV<E, W>& P, float* acc, int64_t G) {
  constexpr int C = std::min(8, std::max(1, kAccRegs<W> / ND));
  const int64_t parts = (G + C - 1) / C;
  int64_t g0 = 0, part = 0;
  for (; g0 + C <= G; g0 += C, ++part) pv_heads<E, W, ND, C>(P, acc, g0, part, parts);
  pv_tail<E, W, ND, C - 1>(P, acc, g0, G - g0, part, parts);
}

// Whether the score loop widens four keys once for all of a KV head's query heads (4 x ND
// vectors must fit in registers beside the accumulators).
template <int W, int ND>
constexpr bool kSharedKeys = W >= 4 && ND > 0 && 4 * ND <= kAccRegs<W> - 8;

// One item (a partition of a sequence), block by block, in the order of attention_order.h;
// the next block is prefetched: blocks sit anywhere in the cache, which hardware prefetchers
// cannot guess. E: element format; W: lanes; ND: vectors per head row (0: known only at run
// time).
template <typename E, int W, int ND>
void attend(const Problem& P, const Item& it, Scratch& s) {
  using F = typename Vec<W>::F;
  using raw = typename E::raw;
  constexpr int kMaxND = ND > 0 ? ND : static_cast<int>(kMaxHeadDim / W);
  // Locals, not P's fields: the compiler can then keep them in registers across stores.
  const int64_t D = P.D, G = P.G, H = P.H, BS = P.BS, row = P.row,
                block = P.block;
  const int64_t L = run_length<W>(BS);
  // Score rows: BS keys, rounded up to whole quads, and room for a run's full vector.
  const int64_t begin = it.begin, end = it.end, BSpad = (BS + 3) / 4 * 4 + W;
  const int nd = ND > 0 ? ND : static_cast<int>(D / W);
  const raw* q = static_cast<const raw*>(P.q) + P.rows[it.b] * P.q_row;
  const raw* kc = static_cast<const raw*>(P.kc);
  const raw* vc = static_cast<const raw*>(P.vc);
  const int64_t* table = P.tables + it.b * P.max_blocks;
  s.q.resize(H * D);
  s.scores.assign(G * BSpad, 0.f);
  s.weights.assign(G * BSpad, 0.f);
  s.acc.assign(H * D, 0.f);
  s.maxima.assign(H, -INFINITY);
  s.sums.assign(H, 0.f);
  float* __restrict__ qf = s.q.data();
  float* __restrict__ scores = s.scores.data();
  float* __restrict__ weights = s.weights.data();  // a run's p, at the run's offset
  float* __restrict__ acc_all = s.acc.data();
  float* __restrict__ maxima = s.maxima.data();
  float* __restrict__ sums = s.sums.data();
  // q in load_vec's lane order, as the keys (attention_order.h: the prefill kernel's too).
  const int64_t h0 = it.h0, h1 = it.h1;
  for (int64_t h = h0; h < h1; ++h)
    for (int i = 0; i < nd; ++i)
      store_f32<W>(qf + h * D + i * W, load_vec<E, W, ND>(q + h * D, i) * P.scale);

  // A partition's partial result (maxima, sums, accumulators in row order) into its slot,
  // and a fresh start for the next partition.
  const int64_t part_tokens = partition_tokens(BS);
  int64_t slot = it.slot;
  auto end_partition = [&]() {
    // (only this item's heads: another item may hold the slot's other heads)
    float* part = P.partials + slot * H * (D + 2);  // accumulators in load_vec's order
    std::copy(maxima + h0, maxima + h1, part + h0);
    std::copy(sums + h0, sums + h1, part + H + h0);
    std::copy(acc_all + h0 * D, acc_all + h1 * D, part + 2 * H + h0 * D);
    ++slot;
    std::fill(acc_all, acc_all + H * D, 0.f);
    std::fill(maxima, maxima + H, -INFINITY);
    std::fill(sums, sums + H, 0.f);
  };

  const int64_t j0 = begin / BS, j1 = (end + BS - 1) / BS;
  for (int64_t j = j0; j < j1; ++j) {
    if (j > j0 && (j * BS) % part_tokens == 0) end_partition();
    const int64_t t0 = std::max(begin, j * BS), t1 = std::min(end, (j + 1) * BS), n = t1 - t0;
    // The next block's rows, prefetched a few lines at a time alongside this block's work
    // (spread over all G query heads' loops): a burst for the whole block would stall on the
    // core's few miss buffers instead of overlapping with the arithmetic.
    const int64_t next_block = j + 1 < j1 ? table[j + 1] * block : -1;
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(raw));
    if (j + kFarBlocks < j1) prefetch_block_l2(kc, vc, table[j + kFarBlocks] * block, BS * row);
    for (int64_t kvh = h0 / G; kvh * G < h1; ++kvh) {
      // this KV head's query heads g_lo .. g_hi - 1 of the item's
      const int64_t g_lo = std::max<int64_t>(h0 - kvh * G, 0), g_hi = std::min(h1 - kvh * G, G);
      const int64_t offset = table[j] * block + (t0 - j * BS) * row + kvh * D;
      const raw* k = kc + offset;  // row t at k + t * row
      const raw* v = vc + offset;
      float* acc = acc_all + kvh * G * D;
      const raw* k_next = next_block >= 0 ? kc + next_block + kvh * D : nullptr;
      const raw* v_next = next_block >= 0 ? vc + next_block + kvh * D : nullptr;
      // scores[g, t] = q_g . k_t, four keys at a time; a last partial quad repeats key n - 1.
      for (int64_t t = 0; t < n; t += 4) {
        const raw* kr[4];
        for (int r = 0; r < 4; ++r) kr[r] = k + std::min(t + r, n - 1) * row;
        if (k_next != nullptr)
          for (int r = 0; r < 4; ++r) prefetch_part(k_next + (t + r) * row, row_bytes, 0, 1);
        if constexpr (kSharedKeys<W, ND>) {  // each key widened once for all G heads
          F kv[4][ND];
#pragma GCC unroll 16
          for (int r = 0; r < 4; ++r)
#pragma GCC unroll 16
            for (int i = 0; i < ND; ++i) kv[r][i] = load_vec<E, W, ND>(kr[r], i);
          for (int64_t g = g_lo; g < g_hi; ++g)
            store_f32<4>(scores + g * BSpad + t,
                         dot4<W, ND>(qf + (kvh * G + g) * D, nd,
                                     [&](int r, int i) { return kv[r][i]; }));
        } else {
          for (int64_t g = g_lo; g < g_hi; ++g)
            store_f32<4>(scores + g * BSpad + t,
                         dot4<W, ND>(qf + (kvh * G + g) * D, nd, [&](int r, int i) {
                           return load_vec<E, W, ND>(kr[r], i);
                         }));
        }
      }
      for (int64_t r0 = 0; r0 < n; r0 += L) {  // the block's runs, in order
        const int64_t nv = std::min(L, n - r0);
        const typename Vec<W>::I valid = first_lanes<W>(nv);
        for (int64_t g = g_lo; g < g_hi; ++g) {
          const int64_t h = kvh * G + g;
          float rescale;
          const F p = softmax_run<W>(load_f32<W>(scores + g * BSpad + r0), valid, maxima[h],
                                     sums[h], rescale);
          if (rescale != 1.f)
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= rescale;
          store_f32<W>(weights + g * BSpad + r0, p);
        }
        // acc[g] += sum_t p[g, t] v_t over the run, each v_t widened once for C heads.
        const raw* vr = v + r0 * row;
        if constexpr (ND > 0) {
          const PV<E, W> pv{weights + g_lo * BSpad + r0, BSpad, vr, row, nv, D, v_next, row_bytes};
          pv_group<E, W, ND>(pv, acc + g_lo * D, g_hi - g_lo);
        } else {
          for (int64_t g = g_lo; g < g_hi; ++g) {
            F a[kMaxND];
            float* accg = acc + g * D;
#pragma GCC unroll 16
            for (int i = 0; i < nd; ++i) a[i] = load_f32<W>(accg + i * W);
            const float* p = weights + g * BSpad + r0;
            for (int64_t t = 0; t < nv; ++t) {
              const F pt = F{} + p[t];
#pragma GCC unroll 16
              for (int i = 0; i < nd; ++i) a[i] += pt * load_vec<E, W, ND>(vr + t * row, i);
            }
#pragma GCC unroll 16
            for (int i = 0; i < nd; ++i) store_f32<W>(accg + i * W, a[i]);
          }
        }
      }
    }
  }

  if (it.slot >= 0) {  // the sequence has several partitions: they are merged afterwards
    end_partition();
    return;
  }
  raw* o = static_cast<raw*>(P.o) + P.rows[it.b] * H * D;
  for (int64_t h = h0; h < h1; ++h) {
    const float inv = 1.f / sums[h];
    for (int64_t d = 0; d < D; ++d)
      o[h * D + d] = E::store1(acc_all[h * D + widened_index<E, W, ND>(d)] * inv);
  }
}


#if defined(DUET_AMX)
// One item in the AMX order (attention_amx.h): each KV head's G query rows (16 at a time) go
// through the item's runs of 16 keys; the keys are read by the tiles from the cache, each
// run's values paired once for all of a head's rows.
template <int D>
struct AmxScratch {
  std::vector<std::unique_ptr<AmxRows<D>>> groups;  // KV head kvh's row groups, in order
  std::vector<uint16_t> vpairs;
};

template <int D>
void attend_amx(const Problem& P, const Item& it, AmxScratch<D>& s, int* configured) {
  const int64_t G = P.G, H = P.H, BS = P.BS, row = P.row, block = P.block;
  const int64_t per_head = (G + 15) / 16, num_groups = P.Hkv * per_head;
  while (static_cast<int64_t>(s.groups.size()) < num_groups)
    s.groups.push_back(std::make_unique<AmxRows<D>>());
  s.vpairs.resize(2 * P.Hkv * kAmxRunKeys * D);
  const uint16_t* q = static_cast<const uint16_t*>(P.q) + P.rows[it.b] * P.q_row;
  const uint16_t* kc = static_cast<const uint16_t*>(P.kc);
  const uint16_t* vc = static_cast<const uint16_t*>(P.vc);
  const int64_t* table = P.tables + it.b * P.max_blocks;
  const int64_t len = P.lens[it.b];
  auto group_of = [&](int64_t kvh, int64_t c, int* n) {
    *n = static_cast<int>(std::min<int64_t>(16, G - c * 16));
    return s.groups[kvh * per_head + c].get();
  };
  // f(group, rows, first head) for each row group of the item's KV heads, in head order.
  auto each_group = [&](auto&& f) {
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh)
      for (int64_t c = 0; c < per_head; ++c) {
        int n;
        AmxRows<D>* g = group_of(kvh, c, &n);
        f(*g, n, kvh * G + c * 16);
      }
  };
  each_group([&](AmxRows<D>& g, int n, int64_t h0) {
    const uint16_t* qr[16];
    int64_t pos[16];
    for (int r = 0; r < n; ++r) {
      qr[r] = q + (h0 + r) * D;
      pos[r] = len - 1;
    }
    g.begin(qr, pos, n, P.scale);
  });
  int64_t slot = it.slot;
  auto end_partition = [&]() {  // into the item's next slot, rows in order
    float* part = P.partials + slot * H * (D + 2);
    each_group([&](AmxRows<D>& g, int n, int64_t h0) {
      for (int r = 0; r < n; ++r) {
        part[h0 + r] = g.max_of(r);
        part[H + h0 + r] = g.sum_of(r);
        std::copy(g.o[r], g.o[r] + D, part + 2 * H + (h0 + r) * D);
      }
      g.start_partition();
    });
    ++slot;
  };
  // With one row group per KV head (G <= 16: one tile shape), each group's scores are started
  // before the previous group's softmax (two score tiles, values paired per run parity).
  const bool pipelined = per_head == 1;
  struct Pending {
    AmxRows<D>* g = nullptr;
    int64_t k0 = 0;
    const uint16_t* vpairs = nullptr;
    int buffer = 0;
  } pending;
  int next_buffer = 0;
  auto flush = [&]() {
    if (pending.g != nullptr) pending.g->finish(pending.k0, pending.buffer, pending.vpairs);
    pending.g = nullptr;
  };
  const int64_t part_tokens = partition_tokens(BS);
  const int64_t j0 = it.begin / BS, j1 = (it.end + BS - 1) / BS;
  int64_t parity = 0;
  for (int64_t j = j0; j < j1; ++j) {
    if (j + kFarBlocks < j1) prefetch_block_l2(kc, vc, table[j + kFarBlocks] * block, BS * row);
    const int64_t t1 = std::min(it.end, (j + 1) * BS);
    for (int64_t k0 = std::max(it.begin, j * BS); k0 < t1; k0 += kAmxRunKeys, parity ^= 1) {
      if (k0 > it.begin && k0 % part_tokens == 0) {
        flush();
        end_partition();
      }
      const int64_t offset = table[j] * block + (k0 - j * BS) * row;
      for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
        uint16_t* vp = s.vpairs.data() + (parity * P.Hkv + kvh) * kAmxRunKeys * D;
        pair_values<D>(vc + offset + kvh * D, row, t1 - k0, vp);
        for (int64_t c = 0; c < per_head; ++c) {
          int n;
          AmxRows<D>* g = group_of(kvh, c, &n);
          if (!pipelined) {
            configure_attention_tiles(n, configured);
            g->run(k0, kc + offset + kvh * D, row, vp);
            continue;
          }
          configure_attention_tiles(n, configured);  // one shape: loads only once per thread
          g->scores(kc + offset + kvh * D, row, next_buffer);
          flush();
          pending = {g, k0, vp, next_buffer};
          next_buffer ^= 1;
        }
      }
    }
  }
  flush();
  if (it.slot >= 0) {  // the sequence has several partitions: they are merged afterwards
    end_partition();
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(P.o) + P.rows[it.b] * H * D;
  each_group([&](AmxRows<D>& g, int n, int64_t h0) {
    for (int r = 0; r < n; ++r) {
      const float inv = 1.f / g.sum_of(r);
      for (int d = 0; d < D; d += 16)
        BF16::store<16>(o + (h0 + r) * D + d, load_f32<16>(g.o[r] + d) * inv);
    }
  });
}

template <int D>
void run_items_amx(const Problem& P, const std::vector<Item>& items) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1,
                   [&](int64_t, int64_t) {
                     _mm_setcsr(_mm_getcsr() | 0x8040);
                     AmxScratch<D> scratch;
                     int configured = -1;
                     for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
                       attend_amx<D>(P, items[i], scratch, &configured);
                     _tile_release();
                   });
}
#endif

// A sequence's partitions, folded in position order (attention_order.h; element by element,
// so in the accumulators' lane order) and normalised into row order.
template <typename E, int W, int ND>
void merge(const Problem& P, int64_t b, int64_t first_slot, int64_t num_slots) {
  const int64_t H = P.H, D = P.D, slot_size = H * (D + 2);
  const float* parts = P.partials + first_slot * slot_size;
  typename E::raw* o = static_cast<typename E::raw*>(P.o) + P.rows[b] * H * D;
  std::vector<float> acc(D);
  for (int64_t h = 0; h < H; ++h) {
    float mx, sum;
    for (int64_t c = 0; c < num_slots; ++c) {
      const float* part = parts + c * slot_size;
      take_partition(c == 0, mx, sum, acc.data(), part[h], part[H + h], part + 2 * H + h * D, D);
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d)
      o[h * D + d] = E::store1(acc[P.amx ? d : widened_index<E, W, ND>(d)] * inv);
  }
}

// Fewer items than threads (one short sequence: a single-stream decode step): each split into
// ranges of query heads, as even as they go, so every thread has one. A head's arithmetic does
// not depend on which other heads its item holds, so the split never changes a result.
inline std::vector<Item> split_heads(const std::vector<Item>& items, int64_t num_threads,
                                     int64_t H) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0 || n >= num_threads) return items;
  const int64_t ways = std::min(H, (num_threads + n - 1) / n);
  std::vector<Item> out;
  for (const Item& it : items)
    for (int64_t s = 0; s < ways; ++s) {
      Item part = it;
      part.h0 = s * H / ways;
      part.h1 = (s + 1) * H / ways;
      out.push_back(part);
    }
  return out;
}

// Work items are token ranges of whole partitions (attention_order.h): whole sequences, unless
// that leaves too few items to keep every thread busy, and then ranges of query heads too. Each partition is reduced on its own
// and a sequence of several has them folded afterwards, so how the ranges are cut (which
// depends on the batch and the threads) never changes a result.
template <typename E, int W, int ND>
void run(Problem& P, const int64_t* lens, int64_t B) {
  const int64_t part = partition_tokens(P.BS);
  const int64_t num_threads = at::get_num_threads();
  int64_t total = 0, longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    total += lens[b];
    longest = std::max(longest, lens[b]);
  }
  int64_t chunk = longest;  // tokens per item
  if (num_threads > 1) {
    const int64_t per_item = (total + num_threads * kItemsPerThread - 1) /
                             (num_threads * kItemsPerThread);
    chunk = std::max(part, per_item);
  }
  chunk = (chunk + part - 1) / part * part;
  std::vector<Item> items;
  struct Split { int64_t b, first_slot, num_slots; };
  std::vector<Split> splits;
  int64_t num_slots = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t parts = (lens[b] + part - 1) / part;
    const int64_t first = num_slots;
    if (parts > 1) {
      splits.push_back({b, first, parts});
      num_slots += parts;
    }
    for (int64_t c = 0; c < lens[b]; c += chunk)
      items.push_back(
          {b, c, std::min(lens[b], c + chunk), parts > 1 ? first + c / part : -1, 0, P.H});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
    return x.end - x.begin > y.end - y.begin;
  });
  std::vector<float> partials(num_slots * P.H * (P.D + 2));
  P.partials = partials.data();
  P.amx = false;
#if defined(DUET_AMX)
  if constexpr (std::is_same_v<E, BF16>) P.amx = use_amx_attention(P.D, P.BS);
#endif
  if (!P.amx) items = split_heads(items, num_threads, P.H);
#if defined(DUET_AMX)
  if constexpr (std::is_same_v<E, BF16>) {
    if (P.amx) {
      switch (P.D) {
        case 32: run_items_amx<32>(P, items); break;
        case 64: run_items_amx<64>(P, items); break;
        case 128: run_items_amx<128>(P, items); break;
        case 256: run_items_amx<256>(P, items); break;
        default: TORCH_CHECK(false, "unreachable: AMX attention head_dim ", P.D);
      }
      for (const Split& sp : splits) merge<E, W, ND>(P, sp.b, sp.first_slot, sp.num_slots);
      return;
    }
  }
#endif
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(num_threads, num_items), 1, [&](int64_t, int64_t) {
#if defined(__SSE__)
    // Worker threads do not inherit torch.set_flush_denormal: flush denormals here too, or the
    // tiny softmax weights of far-away tokens make every multiply ~100x slower.
    _mm_setcsr(_mm_getcsr() | 0x8040);
#endif
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
      attend<E, W, ND>(P, items[i], scratch);
  });
  for (const Split& sp : splits) merge<E, W, ND>(P, sp.b, sp.first_slot, sp.num_slots);
}

template <typename E>
void dispatch(Problem& P, const int64_t* lens, int64_t B) {
  if (P.D % kLanes != 0) return run<E, 1, 0>(P, lens, B);  // odd head sizes: scalar lanes
  switch (P.D / kLanes) {
    case 1: return run<E, kLanes, 1>(P, lens, B);
    case 2: return run<E, kLanes, 2>(P, lens, B);
    case 4: return run<E, kLanes, 4>(P, lens, B);
    case 8: return run<E, kLanes, 8>(P, lens, B);
    case 16: return run<E, kLanes, 16>(P, lens, B);
    case kLatentWidth / kLanes: return run<E, kLanes, kLatentWidth / kLanes>(P, lens, B);
    default: return run<E, kLanes, 0>(P, lens, B);
  }
}


// Every block a sequence reads must exist (a bad table would read outside the cache), every
// query row inside the query; then the kernel of the element format.
void run_checked(Problem& P, const int64_t* lens, int64_t B, int64_t num_blocks, int64_t q_rows,
                 bool bf16) {
  P.lens = lens;
  for (int64_t b = 0; b < B; ++b) {
    check_block_row(P.tables, b, P.max_blocks, P.BS, lens[b], num_blocks);
    TORCH_CHECK(P.rows[b] >= 0 && P.rows[b] < q_rows, "token_indices[", b, "] out of range");
  }
  if (bf16) {
    dispatch<BF16>(P, lens, B);
  } else {
    dispatch<F32>(P, lens, B);
  }
}

bool is_long_vector(const at::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == n && t.is_contiguous();
}

}  // namespace

void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables, at::Tensor seq_lens,
                            at::Tensor token_indices, double scale) {
  if (!query_rows_contiguous(query)) query = query.contiguous();
  check_paged_attention_args(out, query, key_cache, value_cache);
  TORCH_CHECK(query.size(2) <= kMaxHeadDim, "head_dim must be <= ", kMaxHeadDim);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  token_indices.scalar_type() == at::kLong, "index tensors must be int64");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_decode_attention: float32 or bfloat16 only");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  token_indices = token_indices.contiguous();
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(seq_lens.size(0) == B && token_indices.size(0) == B, "one length and row per table");
  Problem P{};
  fill_paged_args(P, out, query, key_cache, value_cache, block_tables, scale);
  P.rows = token_indices.data_ptr<int64_t>();
  run_checked(P, seq_lens.data_ptr<int64_t>(), B, key_cache.size(0), query.size(0),
              query.scalar_type() == at::kBFloat16);
}

// NOTE: on raw pointers, with no view of qkv or of the cache: each ATen view (narrow, view,
// select) costs a few hundred nanoseconds, and the three calls' views cost about 5 us of a
// layer's 10-20 (30 layers a SmolLM2 token).
at::Tensor decode_attention_step(at::Tensor qkv, at::Tensor positions, at::Tensor cos,
                                 at::Tensor sin, at::Tensor kv_cache, at::Tensor slot_mapping,
                                 at::Tensor block_tables, at::Tensor seq_lens,
                                 at::Tensor token_indices, int64_t num_heads,
                                 int64_t num_kv_heads, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && kv_cache.dim() == 5 &&
                  kv_cache.is_contiguous() && kv_cache.size(0) == 2,
              "decode_attention_step: qkv [T, (H + 2 Hkv) D] and kv_cache [2, NB, BS, Hkv, D] "
              "contiguous");
  TORCH_CHECK((qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16) &&
                  kv_cache.scalar_type() == qkv.scalar_type(),
              "decode_attention_step: qkv and kv_cache float32 or bfloat16, one dtype");
  const int64_t T = qkv.size(0), NB = kv_cache.size(1), BS = kv_cache.size(2), D = kv_cache.size(4);
  const int64_t H = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && qkv.size(1) == (H + 2 * Hkv) * D &&
                  kv_cache.size(3) == Hkv && D % 2 == 0 && D <= kMaxHeadDim,
              "decode_attention_step: qkv's width must be (", H, " + 2 x ", Hkv, ") x ", D,
              ", the cache hold ", Hkv, " KV heads dividing ", H, ", and D even, at most ",
              kMaxHeadDim);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(1) == D / 2,
              "cos and sin must be contiguous float32 [max_position, D / 2]");
  TORCH_CHECK(is_long_vector(positions, T) && is_long_vector(slot_mapping, T),
              "positions and slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [B, max_blocks]");
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(is_long_vector(seq_lens, B) && is_long_vector(token_indices, B),
              "seq_lens and token_indices must be contiguous int64 [B]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "positions[", t, "] = ", pos[t],
                " outside [0, ", cos.size(0), ")");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < NB * BS, "slot_mapping[", t, "] = ", slots[t],
                " outside [0, ", NB * BS, ")");
  }
  const bool bf16 = qkv.scalar_type() == at::kBFloat16;
  const int64_t item = qkv.element_size(), row = Hkv * D;
  char* base = static_cast<char*>(qkv.data_ptr());
  // q's and k's heads are the first H + Hkv head rows of each token's row
  rotary_rows(bf16, base, T, qkv.stride(0), H + Hkv, D, D, pos, cos.data_ptr<float>(),
              sin.data_ptr<float>());
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + NB * BS * row * item;
  for (int64_t t = 0; t < T; ++t) {  // write_kv's copies
    const char* k = base + (t * qkv.stride(0) + H * D) * item;
    std::memcpy(k_cache + slots[t] * row * item, k, row * item);
    std::memcpy(v_cache + slots[t] * row * item, k + row * item, row * item);
  }
  at::Tensor out = at::empty({T, H * D}, qkv.options());
  Problem P{};
  P.H = H;
  P.Hkv = Hkv;
  P.G = H / Hkv;
  P.D = D;
  P.BS = BS;
  P.max_blocks = block_tables.size(1);
  P.row = row;
  P.q_row = qkv.stride(0);
  P.block = BS * row;
  P.q = base;
  P.kc = k_cache;
  P.vc = v_cache;
  P.o = out.data_ptr();
  P.tables = block_tables.data_ptr<int64_t>();
  P.scale = static_cast<float>(scale);
  P.rows = token_indices.data_ptr<int64_t>();
  run_checked(P, seq_lens.data_ptr<int64_t>(), B, NB, T, bf16);
  return out;
}

}  // namespace duet
