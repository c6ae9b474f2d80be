// The AMX order of paged attention (bf16 on CPUs with AMX tiles): both paged attention kernels
// (paged_decode_cpu.cpp, paged_prefill_cpu.cpp) run a query row through AmxRows, so a token's
// output has the same bits from either kernel, in a batch of any size, in a chunk starting
// anywhere (the contract of attention_order.h, with this arithmetic in place of its FMA order).
//
// For a query row q (bf16, as stored) at position pos, over keys 0..pos:
// - Partitions of partition_tokens(BS) keys from position 0, each reduced on its own to
//   (m, l, o) and folded in position order with fold_partition, as in attention_order.h.
// - Runs of 16 keys, aligned (the block size is a multiple of 16, so a run never straddles
//   blocks), each one online-softmax update.
// - Scores: s = scale * (q . k), the dot product as `_tile_dpbf16ps` steps over the head's
//   32-dim chunks in order, from zero.
// - Softmax per run: x = s where the key is visible (key <= pos), m' = max(m, max x); when
//   m' > m, l and o are multiplied by vexp(m - m'); p = vexp(x - m') rounded to bf16 (0 where
//   not visible); l += the 16 p in a fixed tree ((p_t + p_t+8), then +4, +2, +1).
// - Values: o += p . v as one `_tile_dpbf16ps` over the run's 16 keys (8 pairs) into o.
// - out = o * (1 / l), rounded to bf16.
// A tile's rows and columns are independent dot products, so a row's bits do not depend on how
// many rows share its tiles (3 heads of one decode token or 16 rows of a prefill tile), nor on
// which operand of the product holds it. Masked keys add 0 * v, and values past a sequence's
// end are zero, so a prefill row that sees a run's masked keys gets the bits of a decode row
// that never reads them.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>

#include "amx_tiles.h"
#include "attention_order.h"
#include "cpu_simd.h"

namespace duet {

// Whether the attention kernels take the AMX order for bf16 (switchable for tests and A/Bs;
// both kernels read the same flag, so they always agree).
inline std::atomic<bool> attention_amx_wanted{true};

constexpr int64_t kAmxRunKeys = 16;

// The head sizes the AMX kernels are built for (the prefill kernel's too), and blocks of whole
// runs.
inline bool amx_attention_shape(int64_t head_dim, int64_t block_size) {
  const bool built = head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
  return built && block_size % kAmxRunKeys == 0;
}

}  // namespace duet

#if defined(DUET_AMX)
namespace duet {

constexpr bool kAmxAttentionBuild = kLanes == 16;

// bf16 attention uses the AMX order for this head size and block size.
inline bool use_amx_attention(int64_t head_dim, int64_t block_size) {
  return kAmxAttentionBuild && attention_amx_wanted.load(std::memory_order_relaxed) &&
         amx_attention_shape(head_dim, block_size) && amx_permitted();
}

// Tiles (literal numbers: the tile intrinsics are macros that paste their argument): scores
// [16 keys x n rows], keys [16 x 32 dims], q^T [16 dim pairs x n rows], p [n rows x 16 keys],
// values [8 key pairs x 16 dims x 2], o [n rows x 16 dims]; a second score tile and a second o tile.
#define DUET_TS 0
#define DUET_TK 1
#define DUET_TQ 2
#define DUET_TP 3
#define DUET_TV 4
#define DUET_TO 5
#define DUET_TS2 6
#define DUET_TO2 7

// Loads the tile shapes for groups of n rows (1..16) unless *configured already is n.
inline void configure_attention_tiles(int n, int* configured) {
  if (n == *configured) return;
  TileConfig cfg;
  cfg.rows[DUET_TS] = 16;
  cfg.colsb[DUET_TS] = static_cast<uint16_t>(n * 4);
  cfg.rows[DUET_TK] = 16;
  cfg.colsb[DUET_TK] = 64;
  cfg.rows[DUET_TQ] = 16;
  cfg.colsb[DUET_TQ] = static_cast<uint16_t>(n * 4);
  cfg.rows[DUET_TP] = static_cast<uint8_t>(n);
  cfg.colsb[DUET_TP] = 32;
  cfg.rows[DUET_TV] = 8;
  cfg.colsb[DUET_TV] = 64;
  cfg.rows[DUET_TO] = static_cast<uint8_t>(n);
  cfg.colsb[DUET_TO] = 64;
  cfg.rows[DUET_TO2] = static_cast<uint8_t>(n);
  cfg.colsb[DUET_TO2] = 64;
  cfg.rows[DUET_TS2] = 16;
  cfg.colsb[DUET_TS2] = static_cast<uint16_t>(n * 4);
  load_tile_config(cfg);
  *configured = n;
}

// A run's 16 value rows (row t at v + t * stride; rows >= valid read as zero) as the 8 key
// pairs `_tile_dpbf16ps` reads: out[i][2d + e] = v[2i + e][d], 2D elements per pair.
template <int D>
inline void pair_values(const uint16_t* v, int64_t stride, int64_t valid, uint16_t* out) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6, 38, 7, 39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                   53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                   27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int i = 0; i < 8; ++i) {
    const uint16_t* a = v + (2 * i) * stride;
    const uint16_t* b = a + stride;
    uint16_t* o = out + i * 2 * D;
    for (int d = 0; d < D; d += 32) {
      const __m512i x = 2 * i < valid ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
      const __m512i y = 2 * i + 1 < valid ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(o + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// 16 x 16 fp32 transpose in registers.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] =
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4a + b] now holds, per 128-bit lane L, row 4L' ... : finish with 128-bit lane shuffles.
  for (int i = 0; i < 4; ++i) {
    const __m512 a = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);  // lanes 0, 2 of each
    const __m512 b = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);  // lanes 1, 3 of each
    const __m512 c = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    t[i] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[i + 8] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[i + 4] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

inline __m512 vexp16(__m512 x) {
  using F = Vec<16>::F;
  return reinterpret_cast<__m512>(vexp<16>(reinterpret_cast<F>(x)));
}

// Up to 16 query rows of one sequence and KV head, through runs of 16 keys in the AMX order.
// The calling thread must have configured its tiles for n rows (configure_attention_tiles).
template <int D>
struct AmxRows {
  static_assert(D % 32 == 0 && D <= 256, "head_dim a multiple of 32, at most 256");
  static constexpr int kChunks = D / 32;
  alignas(64) uint32_t qt[kChunks][16][16];  // q^T: [chunk][dim pair][row]
  alignas(64) float s[16][16];               // a run's scores: [key][row]
  alignas(64) uint16_t p[16][16];            // a run's weights: [row][key]
  alignas(64) float o[16][D];                // unnormalised outputs: [row][dim]
  __m512 m, l, scale;
  __m512i pos;
  __mmask16 rows;
  int n;

  // Rows q[0..n) (bf16, D elements each) at positions pos[0..n).
  void begin(const uint16_t* const* q, const int64_t* positions, int count, float scale_) {
    n = count;
    rows = static_cast<__mmask16>((1u << n) - 1);
    alignas(64) int32_t p32[16] = {};
    for (int r = 0; r < n; ++r) {
      p32[r] = static_cast<int32_t>(positions[r]);
      const uint32_t* w = reinterpret_cast<const uint32_t*>(q[r]);
      for (int c = 0; c < kChunks; ++c)
        for (int i = 0; i < 16; ++i) qt[c][i][r] = w[c * 16 + i];
    }
    pos = _mm512_load_si512(p32);
    scale = _mm512_set1_ps(scale_);
    start_partition();
  }

  void start_partition() {
    m = _mm512_set1_ps(-INFINITY);
    l = _mm512_setzero_ps();
    for (int r = 0; r < n; ++r)
      for (int d = 0; d < D; d += 16) _mm512_store_ps(&o[r][d], _mm512_setzero_ps());
  }

  // Keys k0 .. k0 + 15 (k0 a multiple of 16): key rows at k (row stride ks elements), their
  // values as pair_values made them.
  void run(int64_t k0, const uint16_t* k, int64_t ks, const uint16_t* vpairs) {
    scores(k, ks, 0);
    finish(k0, 0, vpairs);
  }

  // The two halves of a run, so that a caller can start the next run's scores (the tiles work
  // on them while the vector units take this run's softmax): q.k of the run's keys into score
  // tile `buffer` (0 or 1), then, for keys k0.., the softmax and p.v from that buffer.
  void scores(const uint16_t* k, int64_t ks, int buffer) {
    if (buffer == 0) {
      _tile_zero(DUET_TS);
    } else {
      _tile_zero(DUET_TS2);
    }
    for (int c = 0; c < kChunks; ++c) {
      _tile_loadd(DUET_TK, k + c * 32, ks * 2);
      _tile_loadd(DUET_TQ, &qt[c][0][0], 64);
      if (buffer == 0) {
        _tile_dpbf16ps(DUET_TS, DUET_TK, DUET_TQ);
      } else {
        _tile_dpbf16ps(DUET_TS2, DUET_TK, DUET_TQ);
      }
    }
  }

  void finish(int64_t k0, int buffer, const uint16_t* vpairs) {
    if (buffer == 0) {
      _tile_stored(DUET_TS, &s[0][0], 64);
    } else {
      _tile_stored(DUET_TS2, &s[0][0], 64);
    }
    if (n <= kFewRows) {
      softmax_by_row(k0);
    } else {
      softmax_by_key(k0);
    }
    // o += p . v, 16 dims at a time, in two output tiles taken in turn so that one tile's
    // product runs while the other is stored and reloaded.
    _tile_loadd(DUET_TP, &p[0][0], 32);
    for (int d = 0; d < D; d += 32) {
      _tile_loadd(DUET_TO, &o[0][d], D * 4);
      _tile_loadd(DUET_TV, vpairs + 2 * d, 2 * D * 2);
      _tile_dpbf16ps(DUET_TO, DUET_TP, DUET_TV);
      _tile_loadd(DUET_TO2, &o[0][d + 16], D * 4);
      _tile_loadd(DUET_TV, vpairs + 2 * d + 32, 2 * D * 2);
      _tile_dpbf16ps(DUET_TO2, DUET_TP, DUET_TV);
      _tile_stored(DUET_TO, &o[0][d], D * 4);
      _tile_stored(DUET_TO2, &o[0][d + 16], D * 4);
    }
  }

  // Up to this many rows take the run's softmax a row at a time (a vector of the 16 keys);
  // more rows take it a key at a time (a vector of the rows). Both do the same operations on
  // each score, and the key sums in the same tree (hsum's halving is the per-key tree), so the
  // choice never changes a bit.
  static constexpr int kFewRows = 6;

  // o[r] *= f where a row's max grew (f = vexp(m - m')).
  void rescale_row(int r, float f) {
    const __m512 fr = _mm512_set1_ps(f);
    for (int d = 0; d < D; d += 16)
      _mm512_store_ps(&o[r][d], _mm512_mul_ps(_mm512_load_ps(&o[r][d]), fr));
  }

  void softmax_by_key(int64_t k0) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 x[16];
    __mmask16 valid[16];
    __m512 mx = m;
    for (int t = 0; t < 16; ++t) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(k0 + t));
      valid[t] = rows & _mm512_cmple_epi32_mask(key, pos);
      x[t] = _mm512_mask_mul_ps(neg_inf, valid[t], _mm512_load_ps(s[t]), scale);
      mx = _mm512_max_ps(mx, x[t]);
    }
    const __mmask16 grew = _mm512_cmp_ps_mask(mx, m, _CMP_GT_OQ);
    if (grew) {
      const __m512 f = _mm512_mask_blend_ps(grew, _mm512_set1_ps(1.f), vexp16(m - mx));
      l = _mm512_mul_ps(l, f);
      alignas(64) float fs[16];
      _mm512_store_ps(fs, f);
      for (int r = 0; r < n; ++r)
        if ((grew >> r) & 1) rescale_row(r, fs[r]);
      m = _mm512_mask_blend_ps(grew, m, mx);
    }
    for (int t = 0; t < 16; ++t) {  // p, rounded to bf16 and widened back
      const __m512 e = _mm512_maskz_mov_ps(valid[t], vexp16(_mm512_sub_ps(x[t], mx)));
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e));
      x[t] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    __m512 sum[8];
    for (int t = 0; t < 8; ++t) sum[t] = _mm512_add_ps(x[t], x[t + 8]);
    for (int t = 0; t < 4; ++t) sum[t] = _mm512_add_ps(sum[t], sum[t + 4]);
    for (int t = 0; t < 2; ++t) sum[t] = _mm512_add_ps(sum[t], sum[t + 2]);
    l = _mm512_add_ps(l, _mm512_add_ps(sum[0], sum[1]));
    transpose16(x);  // x[r]: row r's 16 weights
    for (int r = 0; r < n; ++r)
      _mm256_store_si256(reinterpret_cast<__m256i*>(p[r]),
                         reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x[r])));
  }

  void softmax_by_row(int64_t k0) {
    alignas(64) float ms[16], ls[16];
    alignas(64) int32_t ps[16];
    _mm512_store_ps(ms, m);
    _mm512_store_ps(ls, l);
    _mm512_store_si512(ps, pos);
    const __m512i by_key = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(k0)),
                                          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < n; ++r) {
      const __mmask16 valid = _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(ps[r]));
      const __m512 sr = _mm512_i32gather_ps(by_key, &s[0][r], 4);
      const __m512 x = _mm512_mask_mul_ps(neg_inf, valid, sr, scale);
      const float mx = std::max(ms[r], _mm512_reduce_max_ps(x));
      if (mx > ms[r]) {
        const float f = vexp16(_mm512_set1_ps(ms[r] - mx))[0];
        ls[r] *= f;
        rescale_row(r, f);
        ms[r] = mx;
      }
      const __m512 e = _mm512_maskz_mov_ps(valid, vexp16(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e));
      _mm256_store_si256(reinterpret_cast<__m256i*>(p[r]), h);
      const __m512 pr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      ls[r] += hsum<16>(reinterpret_cast<Vec<16>::F>(pr));
    }
    m = _mm512_load_ps(ms);
    l = _mm512_load_ps(ls);
  }

  float max_of(int r) const { return reinterpret_cast<const float*>(&m)[r]; }
  float sum_of(int r) const { return reinterpret_cast<const float*>(&l)[r]; }
};

}  // namespace duet
#else
namespace duet {
constexpr bool kAmxAttentionBuild = false;
inline bool use_amx_attention(int64_t, int64_t) { return false; }
}  // namespace duet
#endif
