// Weight-only int8 linear for the CPU: y = x @ (q * scale).T with q int8 and one fp32 scale per
// output channel and group of G input columns (G = K: per channel; 32: GGUF Q8_0; 16: Q6_K).
// A module of its own (engine/quant/cpu_linear.py builds it through engine/kernels/cpu.py).
//
// Layout, packed at load (cpu_linear.pack_int8): q as [N / 16, K, 16] (each 16 output channels'
// column k is 16 contiguous bytes, so a block streams contiguously), scales as [N / 16, K / G,
// 16]; N padded to a multiple of 16 with zero rows.
//
// Per output element the reduction is one fp32 lane: for each group, acc = fma(w_k, x_k, acc)
// over k in order, then total = fma(acc, scale, total) in group order. Nothing in that order
// depends on the number of rows, on how rows or channels are blocked, or on the thread count,
// so a row's result is bit-identical whatever batch it is in (deterministic mode relies on it).
//
// Register blocking: kCols blocks of 16 channels and kRows rows per tile; every int8 weight
// vector converted to fp32 feeds kRows FMAs. GCC's vector extensions (cpu_simd.h) give the
// AVX-512 code (one zmm per 16 channels), AVX2 (two ymm), or SSE / scalar code from one source.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
// Bindings only: torch/extension.h would also parse the whole C++ frontend.
#include <torch/python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "cpu_simd.h"

#if defined(__SSE4_1__)
#include <immintrin.h>
#endif

namespace duet {
namespace {

constexpr int kBlock = 16;  // output channels per packed block
using F = Vec<kBlock>::F;
// Tiles: AVX-512 has 32 vector registers (kRows * kCols accumulators + kCols weights + 1);
// at 8 or 4 lanes a 16-channel vector takes 2 or 4 registers out of 16.
constexpr int kCols = kLanes >= 16 ? 4 : 2;
// One row: 6 blocks per tile, 6 accumulator chains instead of 4 (the same per-channel order,
// so the same bits). 30 SmolLM2 layers' products at one row, from memory, on a 2-core Zen 4:
// the bf16 dot int8 25.8 -> 27.0 GB/s, int4 19.3 -> 21.1; the fp32 FMA tiles (fp32
// activations) int8 19.7-21.5 -> 22.8-23.7, int4 14.5-16.2 -> 15.8-17.3 (8 blocks: alike or
// slower).
constexpr int kOneRowCols = 6;
constexpr int kRows = kLanes >= 16 ? 6 : (kLanes >= 8 ? 2 : 1);

// 16 bytes widened to 16 int32 lanes: sign-extended (int8 weights) or zero-extended (int4
// nibble pairs: low nibble column k, high k + 1).
// GCC scalarises the generic int8 -> int32 conversion, hence the intrinsics.
template <bool kSigned>
inline Vec<kBlock>::I widen(const void* p) {
  using I = Vec<kBlock>::I;
  I wide;
#if defined(__SSE4_1__)  // implied by AVX2 and AVX-512
  const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(p));
#endif
#if defined(__AVX512F__)
  if constexpr (kLanes >= 16) {
    const __m512i w = kSigned ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
    std::memcpy(&wide, &w, sizeof(wide));
    return wide;
  }
#endif
#if defined(__AVX2__)
  if constexpr (kLanes >= 8) {
    const __m128i hi = _mm_srli_si128(v, 8);
    const __m256i halves[2] = {kSigned ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v),
                               kSigned ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi)};
    std::memcpy(&wide, halves, sizeof(wide));
    return wide;
  }
#endif
#if defined(__SSE4_1__)
  __m128i quarters[4];
  const __m128i parts[4] = {v, _mm_srli_si128(v, 4), _mm_srli_si128(v, 8), _mm_srli_si128(v, 12)};
  for (int i = 0; i < 4; ++i)
    quarters[i] = kSigned ? _mm_cvtepi8_epi32(parts[i]) : _mm_cvtepu8_epi32(parts[i]);
  std::memcpy(&wide, quarters, sizeof(wide));
#else
  typedef std::conditional_t<kSigned, int8_t, uint8_t> B;
  typedef B Bytes __attribute__((vector_size(kBlock)));
  Bytes b;
  std::memcpy(&b, p, sizeof(b));
  wide = __builtin_convertvector(b, I);
#endif
  return wide;
}

// 16 int8 weights as fp32 (exact).
inline F load_weights(const int8_t* p) { return __builtin_convertvector(widen<true>(p), F); }

// 16 bytes zero-extended to 16 int32 lanes.
inline Vec<kBlock>::I load_bytes(const uint8_t* p) { return widen<false>(p); }

inline F broadcast(float x) {  // not F{} + x, which GCC computes as a scalar add first
  return F{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

// The first N accumulators of a tile (R x C, rows contiguous) set to zero. A pointer, not an
// array reference: the tail templates instantiate tiles of 0 rows.
template <int N>
inline void zero(F* acc) {
#pragma GCC unroll 48
  for (int i = 0; i < N; ++i) acc[i] = F{};
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = kLanes >= 16;
#else
constexpr bool kBf16Dot = false;
#endif

// Where a block's weights lie in the bf16 dot's layouts: the units of kPanel neighbouring
// blocks interleave (pack_int8, pack_int4), int8's pairs (32 bytes: a column pair of 16
// channels) and int4's quads (64 bytes: four pairs). A panel's unit t is its blocks' units t
// side by side, so block b's unit t sits at its panel's start + (t * width + b's place) * unit
// bytes, width the panel's blocks (kPanel; the last panel's may be fewer). A one-row tile of
// kPanel blocks then reads one stream, not kPanel streams of K * 16 or K * 8 bytes (9.2 or 4.6
// KB at K = 576, too short for the hardware prefetcher to settle in); a thread's share of the
// blocks may start inside a panel, and its tiles then straddle two (the same values, read from
// two streams). 30 SmolLM2 layers'
// products at one row from memory, panels of 6 against contiguous blocks, alternately in one
// process on a 2-core Zen 4: int4 21.5-22.5 -> 23.3-24.4 GB/s; int8 27.4-28.2 -> 29.4-30.7
// (against each stream prefetched 512 bytes ahead, +10% over none; prefetching the panel's
// one stream was slower 1 KB ahead and alike 3 KB ahead, so it does not).
constexpr int64_t kPanel = 6;
struct BlockStream {
  const int8_t* p;  // the block's pair 0 (int8) or quad 0 (int4)
  int64_t step;     // bytes from pair j to j + 1 (int8), or from quad t to t + 1 (int4)
};

// Block b's unit t (units of `bytes`, `units` a block) when panels of `panel` blocks interleave.
inline int64_t unit_offset(int64_t b, int64_t t, int64_t units, int64_t bytes, int64_t blocks,
                           int64_t panel) {
  const int64_t first = b - b % panel, width = std::min<int64_t>(panel, blocks - first);
  return (first * units + t * width + (b - first)) * bytes;
}

// A block's scales of group gi (int8: 16 fp32; int4: 16 bf16 scales and 16 offsets), 64 bytes,
// interleave in the same panels: a one-row tile reads them as one stream too, not 6 streams of
// K / G * 64 bytes (1.2 KB at K = 576, G = 32). int4's 30 SmolLM2 layers at one row from memory
// (alternately in one process, three runs, 2-core Zen 4): 21.4-23.9 -> 24.5-27.7 GB/s.
inline const void* scale_unit(const void* s, int64_t b, int64_t gi, int64_t groups,
                              int64_t blocks) {
  return static_cast<const char*>(s) + unit_offset(b, gi, groups, 64, blocks, kPanel);
}

template <bool kInt4>
inline BlockStream block_stream(const int8_t* q, int64_t b, int64_t k, int64_t blocks) {
  constexpr int64_t bytes = kInt4 ? 64 : 2 * kBlock;
  const int64_t width = std::min<int64_t>(kPanel, blocks - (b - b % kPanel));
  return {q + unit_offset(b, 0, kInt4 ? k / 8 : k / 2, bytes, blocks, kPanel), width * bytes};
}

struct Args {
  const int8_t* q;     // [NB, K, 16], or [NB, K / 2, 16, 2] for the bf16 dot
  const float* s;      // [NB, K / G, 16]
  const float* x;      // [M, K] fp32 (not for the bf16 dot)
  const uint16_t* xb;  // [M, K] bf16 rows xs apart (the bf16 dot)
  int64_t xs, m, k, g, n;
  const float* xsum = nullptr;  // int4: [M, K / G], each row's sum over each group
  int64_t blocks = (n + kBlock - 1) / kBlock;  // NB
};

// total[r][c] for rows r0 .. r0 + R, channel blocks b0 .. b0 + C, written to res (R x C*16).
template <int C, int R>
void tile(const Args& a, int64_t b0, int64_t r0, float* res) {
  const int64_t K = a.k, G = a.g, groups = K / G;
  const int8_t* q = a.q + b0 * K * kBlock;
  const float* s = a.s + b0 * groups * kBlock;
  const float* x = a.x + r0 * K;
  F total[R][C];
  zero<R * C>(*total);
  for (int64_t gi = 0; gi < groups; ++gi) {
    F acc[R][C];
    zero<R * C>(*acc);
    for (int64_t k = gi * G, end = k + G; k < end; ++k) {
      F w[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        w[c] = load_weights(q + (c * K + k) * kBlock);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const F xv = broadcast(x[r * K + k]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] += w[c] * xv;  // one FMA (-ffp-contract=fast)
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const F sv = load_f32<kBlock>(s + (c * groups + gi) * kBlock);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) total[r][c] += acc[r][c] * sv;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) store_f32<kBlock>(res + (r * C + c) * kBlock, total[r][c]);
}

// int4 with fp32 FMAs (fp32 activations, or bf16 ones without AVX512-BF16): q4 as nibbles
// [NB, K / 2, 16], byte c of column pair j holding channel c's column 2j (low nibble) and 2j + 1
// (high), bf16 (or, kF32Scales, fp32: GGUF's exact values) scales and offsets [NB, K / G, 2,
// 16]. Per group, acc = sum(q x) over k in order
// (q in 0 .. 15, exact in fp32), then total = fma(acc, scale, total), total = fma(sum(x),
// offset, total): w = q * scale + offset. The totals stay in `res` (L1) between groups, so the
// R x C accumulators and the converted weights fit the registers.
template <int C, int R, bool kF32Scales>
void tile4(const Args& a, int64_t b0, int64_t r0, float* res) {
  const int64_t K = a.k, G = a.g, groups = K / G;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(a.q) + b0 * (K / 2) * kBlock;
  using S = std::conditional_t<kF32Scales, F32, BF16>;
  const typename S::raw* sz =
      reinterpret_cast<const typename S::raw*>(a.s) + b0 * groups * 2 * kBlock;
  const float* x = a.x + r0 * K;
  using I = Vec<kBlock>::I;
  const I low = I{} + 0x0F;
  std::memset(res, 0, sizeof(float) * R * C * kBlock);
  for (int64_t gi = 0; gi < groups; ++gi) {
    F acc[R][C];
    zero<R * C>(*acc);
    for (int64_t k = gi * G, end = k + G; k < end; k += 2) {
      const uint8_t* col = q + (k / 2) * kBlock;
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        F w[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const I bytes = load_bytes(col + c * (K / 2) * kBlock);
          w[c] = __builtin_convertvector(half == 0 ? (bytes & low) : (bytes >> 4), F);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const F xv = broadcast(x[r * K + k + half]);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) acc[r][c] += w[c] * xv;  // one FMA (-ffp-contract=fast)
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const typename S::raw* p = sz + (c * groups + gi) * 2 * kBlock;
      const F sv = S::template load<kBlock>(p), ov = S::template load<kBlock>(p + kBlock);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* t = res + (r * C + c) * kBlock;
        F total = load_f32<kBlock>(t);
        total += acc[r][c] * sv;
        total += broadcast(a.xsum[(r0 + r) * groups + gi]) * ov;
        store_f32<kBlock>(t, total);
      }
    }
  }
}

#if defined(__AVX512BF16__)
inline __m512 bf16_to_f32(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// bf16 activations with AVX512-BF16: the weights of k and k + 1 sit side by side per channel
// ([NB, K / 2, 16, 2]), turn into bf16 exactly (|q| <= 127 needs 7 bits), and vdpbf16ps adds
// both products (exact in fp32) to the channel's lane: 32 multiply-adds per instruction, twice
// the fp32 FMA's. The order per output element is again fixed by k alone.
//
// int4 (kInt4): q as nibbles [NB, K / 2, 16] in quads of column pairs (64 bytes for pairs 4t ..
// 4t + 3, read as 32 16-bit words: bits 4s .. 4s + 3 of word v hold value v of pair 4t + s), w = q
// * scale + offset with bf16 [NB, K / G, 2, 16] scales and offsets. The dot runs on 128 + q (see
// convert_quad), so per group, with the row's group sums `xsum`:
// total += scale * (acc - 128 * sum(x)) + offset * sum(x).
// int8: q as bf16 (exact) through fp32.
inline __m512bh convert_pair(const int8_t* p) {  // channels 0-7's pairs, then 8-15's
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// int4: 128 + q, whose bf16 bits are 0x4300 | q (an exponent of 2^7 and q as the mantissa:
// exact), so a nibble becomes its bf16 operand in place, one shift and one bitwise op per 32:
// four pairs' operands from 64 bytes with no shuffle (the tile subtracts 128 times the row's
// group sum of x again). Before the quads, one pair's 16 bytes were widened to 16-bit words
// (a cross-lane shuffle), masked, shifted and joined: 7 instructions per operand against 2.
inline void convert_quad(const int8_t* p, __m512bh* out) {
  const __m512i v = _mm512_loadu_si512(p);
  const __m512i low = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
  // 0xEA: (a & b) | c
  out[0] = (__m512bh)_mm512_ternarylogic_epi32(v, low, exponent, 0xEA);
  out[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low, exponent, 0xEA);
  out[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low, exponent, 0xEA);
  out[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), exponent);
}

// Pairs j0 .. j0 + count of a block as operands (int4: j0 and count multiples of 4).
template <bool kInt4>
inline void convert_pairs(const BlockStream& s, int64_t j0, int64_t count, __m512bh* out) {
  if constexpr (kInt4) {
    for (int64_t j = 0; j < count; j += 4) convert_quad(s.p + (j0 + j) / 4 * s.step, out + j);
  } else {
    for (int64_t j = 0; j < count; ++j) out[j] = convert_pair(s.p + (j0 + j) * s.step);
  }
}

// `pre`: when not null, the C blocks' weights already converted ([C][K / 2] vectors, see
// `columns`), so row tiles after the first do not convert them again. Same values either way.
template <int C, int R, bool kInt4>
void tile_dot(const Args& a, int64_t b0, int64_t r0, float* res, const __m512bh* pre) {
  const int64_t K = a.k, G = a.g, groups = K / G;
  const uint16_t* x = a.xb + r0 * a.xs;
  __m512 total[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
  BlockStream streams[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) streams[c] = block_stream<kInt4>(a.q, b0 + c, K, a.blocks);
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    if (kInt4 && pre == nullptr) {
      // a quad (8 columns) per block at a time; each accumulator still takes k in order
      for (int64_t k = gi * G, end = k + G; k < end; k += 8) {
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          __m512bh w[4];
          convert_quad(streams[c].p + k / 8 * streams[c].step, w);
#pragma GCC unroll 4
          for (int s4 = 0; s4 < 4; ++s4)
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              int32_t pair;
              std::memcpy(&pair, x + r * a.xs + k + 2 * s4, sizeof(pair));
              acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[s4], (__m512bh)_mm512_set1_epi32(pair));
            }
        }
      }
    } else {
      for (int64_t k = gi * G, end = k + G; k < end; k += 2) {
        __m512bh w[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          w[c] = pre != nullptr ? pre[c * (K / 2) + k / 2]
                                : convert_pair(streams[c].p + k / 2 * streams[c].step);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + r * a.xs + k, sizeof(pair));
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], xv);
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      if constexpr (kInt4) {
        const auto* p = static_cast<const uint16_t*>(scale_unit(a.s, b0 + c, gi, groups, a.blocks));
        const __m512 sv = bf16_to_f32(p), ov = bf16_to_f32(p + kBlock);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 xs = _mm512_set1_ps(a.xsum[(r0 + r) * groups + gi]);
          const __m512 qx = _mm512_fmadd_ps(xs, _mm512_set1_ps(-128.f), acc[r][c]);  // sum(q x)
          total[r][c] = _mm512_fmadd_ps(qx, sv, total[r][c]);
          total[r][c] = _mm512_fmadd_ps(xs, ov, total[r][c]);
        }
      } else {
        const __m512 sv = _mm512_loadu_ps(scale_unit(a.s, b0 + c, gi, groups, a.blocks));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) total[r][c] = _mm512_fmadd_ps(acc[r][c], sv, total[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(res + (r * C + c) * kBlock, total[r][c]);
}
#endif

#if defined(DUET_AMX)
// AMX (Sapphire Rapids and later): the same bf16 pairs, multiplied by tiles. A tile product
// (_tile_dpbf16ps) takes 16 rows of x's 32 columns and 16 channels' converted weights (one
// column pair per tile row: exactly the bf16 dot's `converted` vectors, 64 bytes each) into a
// 16 x 16 fp32 tile: 8,192 multiply-adds per instruction against vdpbf16ps's 32. Per group the
// sums are stored and combined with the scales (and int4's offsets) in fp32 as the bf16 dot
// does (tiles: amx_tiles.h). A row's result depends only on that row (tile rows are
// independent; a partial chunk's tiles hold only its rows), and in deterministic mode every row count of
// a layer takes this path, so batching changes no bits. Groups must be a multiple of 32 columns
// (one tile's depth): every int8 and int4 format but Q6_K's 16.
//
// One group's sums for RT row tiles x CT channel blocks into acc ([RT * 16][CT * 16] fp32):
// x at the group's first column (row stride xs elements), w at the group's first column pair
// of block 0 (block stride ws elements), `steps` tile products of 32 columns.
// `q` (the first row tile only): the blocks' raw weights, whose pairs from j0 (the group's
// first) are converted into w step by step, so the conversions overlap the tile products.
template <int RT, int CT, bool kInt4>
inline void amx_group(const uint16_t* x, int64_t xs, uint16_t* w, int64_t ws, int64_t steps,
                      const BlockStream* q, int64_t j0, float* acc) {
  zero_sums<RT, CT>();
  for (int64_t s = 0; s < steps; ++s) {
    if (q != nullptr) {
      for (int c = 0; c < CT; ++c)
        convert_pairs<kInt4>(q[c], j0 + s * 16, 16,
                             reinterpret_cast<__m512bh*>(w + c * ws + s * 512));
    }
    tile_step<RT, CT>(x + s * 32, xs, w + s * 512, ws);
  }
  store_sums<RT, CT>(acc);
}

// All rows of channel blocks b0 .. b0 + CT through the tiles, 32 rows at a time (`configured`:
// see configure_tiles).
template <typename E, int CT, bool kInt4>
void columns_amx(const Args& a, int64_t b0, typename E::raw* out, int* configured) {
  const int64_t K = a.k, G = a.g, groups = K / G, pairs = K / 2;
  thread_local std::vector<__m512bh> converted;
  converted.resize(CT * pairs);
  uint16_t* w = reinterpret_cast<uint16_t*>(converted.data());
  BlockStream streams[CT];
  for (int c = 0; c < CT; ++c) streams[c] = block_stream<kInt4>(a.q, b0 + c, K, a.blocks);
  constexpr int kCols = CT * kBlock;
  alignas(64) float acc[32 * kCols];
  alignas(64) float total[32 * kCols];
  for (int64_t r0 = 0; r0 < a.m; r0 += 32) {
    const int64_t rows = std::min<int64_t>(32, a.m - r0);
    const int rt = rows > 16 ? 2 : 1;
    configure_tiles(rows, configured);
    const uint16_t* x = a.xb + r0 * a.xs;
    const int64_t xs = a.xs;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const BlockStream* raw = r0 == 0 ? streams : nullptr;
      if (rt == 2)
        amx_group<2, CT, kInt4>(x + gi * G, xs, w + gi * G * 16, pairs * 32, G / 32, raw,
                                gi * G / 2, acc);
      else
        amx_group<1, CT, kInt4>(x + gi * G, xs, w + gi * G * 16, pairs * 32, G / 32, raw,
                                gi * G / 2, acc);
      for (int c = 0; c < CT; ++c) {
        __m512 sv, ov;
        if constexpr (kInt4) {
          const auto* p = static_cast<const uint16_t*>(scale_unit(a.s, b0 + c, gi, groups, a.blocks));
          sv = bf16_to_f32(p);
          ov = bf16_to_f32(p + kBlock);
        } else {
          sv = _mm512_loadu_ps(scale_unit(a.s, b0 + c, gi, groups, a.blocks));
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = r * kCols + c * kBlock;
          const __m512 sum = _mm512_load_ps(acc + at);
          const __m512 before = gi == 0 ? _mm512_setzero_ps() : _mm512_load_ps(total + at);
          __m512 t;
          if constexpr (kInt4) {
            const __m512 xsum = _mm512_set1_ps(a.xsum[(r0 + r) * groups + gi]);
            const __m512 qx = _mm512_fmadd_ps(xsum, _mm512_set1_ps(-128.f), sum);  // sum(q x)
            t = _mm512_fmadd_ps(xsum, ov, _mm512_fmadd_ps(qx, sv, before));
          } else {
            t = _mm512_fmadd_ps(sum, sv, before);
          }
          _mm512_store_ps(total + at, t);
        }
      }
    }
    const int64_t n0 = b0 * kBlock, n1 = std::min<int64_t>(a.n, n0 + kCols);
    for (int64_t r = 0; r < rows; ++r) {
      typename E::raw* o = out + (r0 + r) * a.n;
      const float* v = total + r * kCols;
      for (int64_t n = n0; n < n1; ++n) o[n] = E::store1(v[n - n0]);
    }
  }
}

// Channel blocks two at a time (and a last one), the tiles released at the end of each thread's
// run for the next user of the tiles (oneDNN configures its own).
template <typename E, bool kInt4>
void run_amx(const Args& a, int64_t blocks, typename E::raw* out) {
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    int configured = -1;
    int64_t b = begin;
    for (; b + 2 <= end; b += 2) columns_amx<E, 2, kInt4>(a, b, out, &configured);
    if (b < end) columns_amx<E, 1, kInt4>(a, b, out, &configured);
    _tile_release();
  });
}
#endif

// Whether bf16 activations with groups of g columns can go through the tiles.
inline bool use_amx(int64_t g) { return kAmxBuild && g % 32 == 0 && amx_permitted(); }

// kDot: 0 int8 fp32 FMAs, 1 int8 bf16 dot, 2 int4 bf16 dot, kInt4Fma int4 fp32 FMAs with bf16
// scales, kInt4FmaF32 with fp32 scales.
constexpr int kInt4Fma = 3, kInt4FmaF32 = 4;

template <int C, int R, int kDot>
void tile_of(const Args& a, int64_t b0, int64_t r0, float* res, const void* pre) {
#if defined(__AVX512BF16__)
  if constexpr (kDot == 1 || kDot == 2)
    return tile_dot<C, R, kDot == 2>(a, b0, r0, res, static_cast<const __m512bh*>(pre));
#endif
  if constexpr (kDot == kInt4Fma || kDot == kInt4FmaF32)
    tile4<C, R, kDot == kInt4FmaF32>(a, b0, r0, res);
  else
    tile<C, R>(a, b0, r0, res);
}

template <int C, int R, int kDot>
void rows_tail(const Args& a, int64_t b0, int64_t r0, int64_t rows, float* res,
               const void* pre) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tail<C, R - 1, kDot>(a, b0, r0, rows, res, pre);
  }
  tile_of<C, R, kDot>(a, b0, r0, res, pre);
}

// All rows of channel blocks b0 .. b0 + C, written (+ nothing else) into out rows.
template <typename E, int C, int RB, int kDot>
void columns(const Args& a, int64_t b0, typename E::raw* out) {
  alignas(64) float res[RB * C * kBlock];
  // The bf16 dot over more than one row tile: convert the C blocks' weights to bf16 once (C x K
  // x 32 bytes, in L2) instead of once per tile, which cost about a third of the time.
  const void* pre = nullptr;
#if defined(__AVX512BF16__)
  // NOTE: one buffer per thread, grown and never cleared: a vector per call, value-initialised
  // (73 KB of zeros per 4 blocks at K = 576), cost 7-8% of 30 SmolLM2 layers' int8 and int4
  // products at 32 rows on a 2-core Zen 4 (24.8 -> 22.9 ms int8, 26.9 -> 24.9 int4).
  thread_local std::vector<__m512bh> converted;
  if constexpr (kDot == 1 || kDot == 2) {
    if (a.m > RB) {
      const int64_t pairs = a.k / 2;
      if (converted.size() < static_cast<size_t>(C * pairs)) converted.resize(C * pairs);
      for (int c = 0; c < C; ++c)
        convert_pairs<kDot == 2>(block_stream<kDot == 2>(a.q, b0 + c, a.k, a.blocks), 0, pairs,
                                 &converted[c * pairs]);
      pre = converted.data();
    }
  }
#endif
  for (int64_t r0 = 0; r0 < a.m; r0 += RB) {
    const int64_t rows = std::min<int64_t>(RB, a.m - r0);
    if (rows == RB) {
      tile_of<C, RB, kDot>(a, b0, r0, res, pre);
    } else {
      rows_tail<C, RB - 1, kDot>(a, b0, r0, rows, res, pre);
    }
    const int64_t n0 = b0 * kBlock, n1 = std::min<int64_t>(a.n, n0 + C * kBlock);
    for (int64_t r = 0; r < rows; ++r) {
      typename E::raw* o = out + (r0 + r) * a.n;
      const float* v = res + r * C * kBlock;
      for (int64_t n = n0; n < n1; ++n) o[n] = E::store1(v[n - n0]);
    }
  }
}

// Channel blocks b .. b + nb (nb <= CB: CB is 2, 4 or 6) in a tile of CB blocks, or for fewer
// in tiles of 4 and of what is left (3, 2 or 1).
template <typename E, int CB, int RB, int kDot>
void columns_upto(const Args& a, int64_t b, int64_t nb, typename E::raw* out) {
  if (nb == CB) return columns<E, CB, RB, kDot>(a, b, out);
  if constexpr (CB > 4) {
    if (nb >= 4) {
      columns<E, 4, RB, kDot>(a, b, out);
      b += 4;
      nb -= 4;
    }
  }
  switch (nb) {
    case 3: columns<E, (CB > 3 ? 3 : 1), RB, kDot>(a, b, out); break;
    case 2: columns<E, 2, RB, kDot>(a, b, out); break;
    case 1: columns<E, 1, RB, kDot>(a, b, out); break;
    default: break;
  }
}

// Channel blocks in tiles of CB blocks x RB rows (and the remainders).
template <typename E, int CB, int RB, int kDot>
void run_tiles(const Args& a, int64_t blocks, typename E::raw* out) {
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    int64_t b = begin;
    for (; b + CB <= end; b += CB) columns<E, CB, RB, kDot>(a, b, out);
    columns_upto<E, CB, RB, kDot>(a, b, end - b, out);
  });
}

template <typename E, int kDot = 0>
void run(const Args& a, int64_t blocks, typename E::raw* out) {
  // NOTE: tiles of 2 blocks x 12 rows for the bf16 dot (fewer weight conversions per product)
  // measured slower than 4 x 6 at 16-128 rows (1.3-1.4x the 4 x 6 time).
  if constexpr (kLanes >= 16) {  // (at 8 lanes a block takes 2 registers: 6 would spill)
    if (a.m == 1) return run_tiles<E, kOneRowCols, 1, kDot>(a, blocks, out);
  }
  run_tiles<E, kCols, kRows, kDot>(a, blocks, out);
}

// x's rows as contiguous fp32 (exact for bf16): x itself when it already is, else `xf`.
const float* fp32_rows(const at::Tensor& x, std::vector<float>& xf) {
  const int64_t m = x.size(0), k = x.size(1);
  if (x.scalar_type() == at::kFloat && x.stride(0) == k) return x.data_ptr<float>();
  xf.resize(m * k);
  for (int64_t r = 0; r < m; ++r) {
    if (x.scalar_type() == at::kFloat) {
      const float* src = x.data_ptr<float>() + r * x.stride(0);
      std::copy(src, src + k, xf.data() + r * k);
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(x.data_ptr()) + r * x.stride(0);
      for (int64_t i = 0; i < k; ++i) xf[r * k + i] = BF16::load1(src + i);
    }
  }
  return xf.data();
}

// Each row's sums over each group of g columns ([M, K / G]): from fp32 `rows` (K apart) when
// given, else from bf16 `xb` (xs apart). One fixed order per group size (16 lanes, then
// halving; or k order): the same for any batch. Vectorised: a scalar chain of K adds per row
// took as long as the product itself on a 192 x 576 layer.
std::vector<float> group_sums(const float* rows, const uint16_t* xb, int64_t xs, int64_t m,
                              int64_t k, int64_t g) {
  const int64_t groups = k / g;
  std::vector<float> xsum(m * groups);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t at = r * xs + gi * g;
        float sum = 0.f;
        if (g % kBlock == 0) {
          F acc = F{};
          for (int64_t i = 0; i < g; i += kBlock)
            acc += rows ? load_f32<kBlock>(rows + at + i) : BF16::load<kBlock>(xb + at + i);
          sum = hsum<kBlock>(acc);
        } else {
          for (int64_t i = 0; i < g; ++i) sum += rows ? rows[at + i] : BF16::load1(xb + at + i);
        }
        xsum[r * groups + gi] = sum;
      }
  });
  return xsum;
}

// One expert's share of a grouped call: its rows, weights and sums (Args) and its output rows.
struct Job {
  Args a;
  void* out;
  int64_t blocks;
};

// The jobs' products, the threads sharing one list of (job, kCols channel blocks) items, each
// item exactly what `run` computes for those blocks (columns: every row of the job), so a
// row's result is the one a call of its own would give.
template <typename E, int kDot>
void run_jobs(const std::vector<Job>& jobs) {
  struct Item {
    int64_t job, b, nb;
  };
  std::vector<Item> items;
  for (int64_t j = 0; j < static_cast<int64_t>(jobs.size()); ++j) {
    // an expert with one row takes the one-row tiles (`run`): 8 of 64 experts at one row each,
    // 10 layers from memory, int8 2.50 -> 2.43 ms, int4 1.96 -> 1.89 (Zen 4, in-process A/B)
    const int64_t step = kLanes >= 16 && jobs[j].a.m == 1 ? kOneRowCols : kCols;
    for (int64_t b = 0; b < jobs[j].blocks; b += step)
      items.push_back({j, b, std::min<int64_t>(step, jobs[j].blocks - b)});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const Job& job = jobs[it.job];
      auto* out = static_cast<typename E::raw*>(job.out);
      if constexpr (kLanes >= 16) {
        if (job.a.m == 1) {
          columns_upto<E, kOneRowCols, 1, kDot>(job.a, it.b, it.nb, out);
          continue;
        }
      }
      columns_upto<E, kCols, kRows, kDot>(job.a, it.b, it.nb, out);
    }
  });
}

// The first row of each expert's rows (counts[e] rows each, in expert order), and a check that
// they cover x.
std::vector<int64_t> row_starts(const std::vector<int64_t>& counts, int64_t m) {
  std::vector<int64_t> starts(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) {
    TORCH_CHECK(counts[e] >= 0, "counts must not be negative");
    starts[e + 1] = starts[e] + counts[e];
  }
  TORCH_CHECK(starts.back() == m, "counts must sum to x's rows");
  return starts;
}

}  // namespace

// x [M, K] fp32 or bf16 (rows contiguous); q [N' / 16, K, 16] int8, or [N' / 16, K / 2, 16, 2]
// (bf16 x, `bf16_dot()` builds only); scale [N' / 16, K / G, 16] fp32; returns [M, n] of x's
// dtype, N' = n rounded up to 16. Pairs take the AMX tiles (where `amx()`, groups of 32k) when
// x has at least amx_min_rows rows, else the bf16 dot.
at::Tensor int8_linear(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t n,
                       int64_t amx_min_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU [rows, K] tensor with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const bool dot = q.dim() == 4;
  const int64_t k = x.size(1);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() &&
                  (dot ? q.size(1) * 2 == k && q.size(2) == kBlock && q.size(3) == 2
                       : q.dim() == 3 && q.size(1) == k && q.size(2) == kBlock),
              "q must be contiguous int8 [N / 16, K, 16] or [N / 16, K / 2, 16, 2] with x's K");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 3 &&
                  scale.size(0) == q.size(0) && scale.size(2) == kBlock && scale.size(1) > 0 &&
                  k % scale.size(1) == 0,
              "scale must be contiguous float32 [N / 16, K / G, 16] matching q");
  TORCH_CHECK(n > 0 && n <= q.size(0) * kBlock && n > (q.size(0) - 1) * kBlock,
              "n must lie in the last block of q's rows");
  TORCH_CHECK(!dot || (kBf16Dot && x.scalar_type() == at::kBFloat16 && (k / scale.size(1)) % 2 == 0),
              "q in pairs [N / 16, K / 2, 16, 2] needs bfloat16 x, even groups and an "
              "AVX512-BF16 build (bf16_dot())");
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0) return out;
  Args a{q.data_ptr<int8_t>(), scale.data_ptr<float>(), nullptr, nullptr, x.stride(0), m, k,
         k / scale.size(1), n};
  if (dot) {
    a.xb = static_cast<const uint16_t*>(x.data_ptr());
#if defined(DUET_AMX)
    if (m >= amx_min_rows && use_amx(a.g)) {
      run_amx<BF16, false>(a, q.size(0), static_cast<uint16_t*>(out.data_ptr()));
      return out;
    }
#endif
    run<BF16, kBf16Dot>(a, q.size(0), static_cast<uint16_t*>(out.data_ptr()));
    return out;
  }
  std::vector<float> xf;
  a.x = fp32_rows(x, xf);
  if (x.scalar_type() == at::kFloat) {
    run<F32>(a, q.size(0), out.data_ptr<float>());
  } else {
    run<BF16>(a, q.size(0), static_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

// x [M, K] (rows contiguous) @ (q * scale + offset).T with q4 [N' / 16, K / 2, 16] uint8 nibbles
// and sz [N' / 16, K / G, 2, 16] scales and offsets, bf16 (or fp32 for the FMA layout).
// `pairs`: the bf16 dot's layout (bf16 x, AVX512-BF16 builds only, groups of 8k columns; quads
// of column pairs, see convert_quad: value v = 2 channel + column % 2 of pair j in nibble j % 4
// of 16-bit word v of the quad); else the FMA layout (fp32 or bf16 x, any build; byte c holds
// channel c's columns 2j low and 2j + 1 high). AMX as int8_linear's.
at::Tensor int4_linear(at::Tensor x, at::Tensor q4, at::Tensor sz, int64_t n, bool pairs,
                       int64_t amx_min_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a CPU float32 or bfloat16 [rows, K] tensor with contiguous rows");
  TORCH_CHECK(!pairs || (kBf16Dot && x.scalar_type() == at::kBFloat16),
              "q4 in column pairs needs bfloat16 x and an AVX512-BF16 build (bf16_dot())");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(!pairs || (sz.dim() == 4 && sz.size(1) > 0 && k % sz.size(1) == 0 &&
                         (k / sz.size(1)) % 8 == 0),
              "q4 in column pairs needs groups of a multiple of 8 columns (whole quads)");
  TORCH_CHECK(q4.scalar_type() == at::kByte && q4.is_contiguous() && q4.dim() == 3 &&
                  q4.size(1) * 2 == k && q4.size(2) == kBlock,
              "q4 must be contiguous uint8 [N / 16, K / 2, 16] with x's K");
  const bool f32_scales = sz.scalar_type() == at::kFloat;
  TORCH_CHECK((sz.scalar_type() == at::kBFloat16 || (f32_scales && !pairs)) &&
                  sz.is_contiguous() && sz.dim() == 4 && sz.size(0) == q4.size(0) &&
                  sz.size(1) > 0 && k % sz.size(1) == 0 && (k / sz.size(1)) % 2 == 0 &&
                  sz.size(2) == 2 && sz.size(3) == kBlock,
              "sz must be contiguous bfloat16 (or, without pairs, float32) [N / 16, K / G, 2, 16] "
              "matching q4, G even");
  TORCH_CHECK(n > 0 && n <= q4.size(0) * kBlock && n > (q4.size(0) - 1) * kBlock,
              "n must lie in the last block of q4's rows");
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0) return out;
  const int64_t groups = sz.size(1), g = k / groups;
  // The FMA path reads fp32 rows; the bf16 dot reads x as it is.
  std::vector<float> xf;
  const float* rows = pairs ? nullptr : fp32_rows(x, xf);
  const int64_t xs = pairs ? x.stride(0) : k;
  const uint16_t* xb = static_cast<const uint16_t*>(x.data_ptr());
  const std::vector<float> xsum = group_sums(rows, xb, xs, m, k, g);
  Args a{reinterpret_cast<const int8_t*>(q4.data_ptr()), static_cast<const float*>(sz.data_ptr()),
         rows, xb, xs, m, k, g, n, xsum.data()};
  if (pairs) {
#if defined(DUET_AMX)
    if (m >= amx_min_rows && use_amx(g)) {
      run_amx<BF16, true>(a, q4.size(0), static_cast<uint16_t*>(out.data_ptr()));
      return out;
    }
#endif
    run<BF16, kBf16Dot ? 2 : 0>(a, q4.size(0), static_cast<uint16_t*>(out.data_ptr()));
  } else if (x.scalar_type() == at::kFloat) {
    if (f32_scales)
      run<F32, kInt4FmaF32>(a, q4.size(0), out.data_ptr<float>());
    else
      run<F32, kInt4Fma>(a, q4.size(0), out.data_ptr<float>());
  } else if (f32_scales) {
    run<BF16, kInt4FmaF32>(a, q4.size(0), static_cast<uint16_t*>(out.data_ptr()));
  } else {
    run<BF16, kInt4Fma>(a, q4.size(0), static_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

// A mixture of experts' int8 products in one call: x [M, K] (rows contiguous) sorted by
// expert, counts[e] rows of expert e; q [E, N' / 16, K, 16] (or pairs [E, N' / 16, K / 2, 16,
// 2]) and scale [E, N' / 16, K / G, 16]: each expert's int8_linear operands, stacked. Returns
// [M, n]: each row times its expert's weight, bit for bit what int8_linear gives that
// expert's rows (AMX per expert as there). Experts with more than max_rows rows are skipped:
// their output rows are left unwritten for the caller (who takes another product for them).
at::Tensor grouped_int8_linear(at::Tensor x, at::Tensor q, at::Tensor scale,
                               std::vector<int64_t> counts, int64_t n, int64_t amx_min_rows,
                               int64_t max_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a CPU float32 or bfloat16 [rows, K] tensor with contiguous rows");
  const bool dot = q.dim() == 5;
  const int64_t m = x.size(0), k = x.size(1), experts = static_cast<int64_t>(counts.size());
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(0) == experts &&
                  (dot ? q.size(2) * 2 == k && q.size(3) == kBlock && q.size(4) == 2
                       : q.dim() == 4 && q.size(2) == k && q.size(3) == kBlock),
              "q must be contiguous int8 [E, N / 16, K, 16] or [E, N / 16, K / 2, 16, 2] with "
              "x's K and an expert per count");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 4 &&
                  scale.size(0) == experts && scale.size(1) == q.size(1) &&
                  scale.size(3) == kBlock && scale.size(2) > 0 && k % scale.size(2) == 0,
              "scale must be contiguous float32 [E, N / 16, K / G, 16] matching q");
  const int64_t blocks = q.size(1), groups = scale.size(2), g = k / groups;
  TORCH_CHECK(n > 0 && n <= blocks * kBlock && n > (blocks - 1) * kBlock,
              "n must lie in the last block of q's rows");
  TORCH_CHECK(!dot || (kBf16Dot && x.scalar_type() == at::kBFloat16 && g % 2 == 0),
              "q in pairs needs bfloat16 x, even groups and an AVX512-BF16 build (bf16_dot())");
  const std::vector<int64_t> starts = row_starts(counts, m);
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  std::vector<float> xf;
  const float* rows = dot ? nullptr : fp32_rows(x, xf);
  const int64_t xs = dot ? x.stride(0) : k;
  const auto* xb = static_cast<const uint16_t*>(x.data_ptr());
  const int64_t q_expert = q.numel() / experts, s_expert = scale.numel() / experts;
  const size_t elem = x.element_size();
  std::vector<Job> jobs;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = starts[e], rows_e = counts[e];
    if (rows_e == 0 || rows_e > max_rows) continue;
    Args a{q.data_ptr<int8_t>() + e * q_expert, scale.data_ptr<float>() + e * s_expert,
           rows ? rows + r0 * k : nullptr, dot ? xb + r0 * xs : nullptr, xs, rows_e, k, g, n};
    void* o = static_cast<char*>(out.data_ptr()) + r0 * n * elem;
#if defined(DUET_AMX)
    if (dot && rows_e >= amx_min_rows && use_amx(g)) {
      run_amx<BF16, false>(a, blocks, static_cast<uint16_t*>(o));
      continue;
    }
#endif
    jobs.push_back({a, o, blocks});
  }
  if (dot)
    run_jobs<BF16, kBf16Dot>(jobs);
  else if (x.scalar_type() == at::kFloat)
    run_jobs<F32, 0>(jobs);
  else
    run_jobs<BF16, 0>(jobs);
  return out;
}

// int4_linear's grouped form, as grouped_int8_linear is int8_linear's: q4 [E, N' / 16, K / 2,
// 16] nibbles and sz [E, N' / 16, K / G, 2, 16] of each expert, stacked.
at::Tensor grouped_int4_linear(at::Tensor x, at::Tensor q4, at::Tensor sz,
                               std::vector<int64_t> counts, int64_t n, bool pairs,
                               int64_t amx_min_rows, int64_t max_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a CPU float32 or bfloat16 [rows, K] tensor with contiguous rows");
  TORCH_CHECK(!pairs || (kBf16Dot && x.scalar_type() == at::kBFloat16),
              "q4 in column pairs needs bfloat16 x and an AVX512-BF16 build (bf16_dot())");
  const int64_t m = x.size(0), k = x.size(1), experts = static_cast<int64_t>(counts.size());
  TORCH_CHECK(q4.scalar_type() == at::kByte && q4.is_contiguous() && q4.dim() == 4 &&
                  q4.size(0) == experts && q4.size(2) * 2 == k && q4.size(3) == kBlock,
              "q4 must be contiguous uint8 [E, N / 16, K / 2, 16] with x's K and an expert "
              "per count");
  const bool f32_scales = sz.scalar_type() == at::kFloat;
  TORCH_CHECK((sz.scalar_type() == at::kBFloat16 || (f32_scales && !pairs)) &&
                  sz.is_contiguous() && sz.dim() == 5 && sz.size(0) == experts &&
                  sz.size(1) == q4.size(1) && sz.size(2) > 0 && k % sz.size(2) == 0 &&
                  (k / sz.size(2)) % 2 == 0 && sz.size(3) == 2 && sz.size(4) == kBlock,
              "sz must be contiguous bfloat16 (or, without pairs, float32) [E, N / 16, K / G, "
              "2, 16] matching q4, G even");
  const int64_t blocks = q4.size(1), groups = sz.size(2), g = k / groups;
  TORCH_CHECK(n > 0 && n <= blocks * kBlock && n > (blocks - 1) * kBlock,
              "n must lie in the last block of q4's rows");
  TORCH_CHECK(!pairs || g % 8 == 0,
              "q4 in column pairs needs groups of a multiple of 8 columns (whole quads)");
  const std::vector<int64_t> starts = row_starts(counts, m);
  at::Tensor out = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  std::vector<float> xf;
  const float* rows = pairs ? nullptr : fp32_rows(x, xf);
  const int64_t xs = pairs ? x.stride(0) : k;
  const auto* xb = static_cast<const uint16_t*>(x.data_ptr());
  const std::vector<float> xsum = group_sums(rows, xb, xs, m, k, g);
  const auto* q = reinterpret_cast<const int8_t*>(q4.data_ptr());
  const auto* s = static_cast<const char*>(sz.data_ptr());
  const int64_t q_expert = q4.numel() / experts, s_expert = sz.numel() / experts;
  const size_t elem = x.element_size();
  std::vector<Job> jobs;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = starts[e], rows_e = counts[e];
    if (rows_e == 0 || rows_e > max_rows) continue;
    Args a{q + e * q_expert,
           reinterpret_cast<const float*>(s + e * s_expert * sz.element_size()),
           rows ? rows + r0 * k : nullptr, xb + r0 * xs, xs, rows_e, k, g, n,
           xsum.data() + r0 * groups};
    void* o = static_cast<char*>(out.data_ptr()) + r0 * n * elem;
#if defined(DUET_AMX)
    if (pairs && rows_e >= amx_min_rows && use_amx(g)) {
      run_amx<BF16, true>(a, blocks, static_cast<uint16_t*>(o));
      continue;
    }
#endif
    jobs.push_back({a, o, blocks});
  }
  if (pairs)
    run_jobs<BF16, kBf16Dot ? 2 : 0>(jobs);
  else if (x.scalar_type() == at::kFloat)
    f32_scales ? run_jobs<F32, kInt4FmaF32>(jobs) : run_jobs<F32, kInt4Fma>(jobs);
  else
    f32_scales ? run_jobs<BF16, kInt4FmaF32>(jobs) : run_jobs<BF16, kInt4Fma>(jobs);
  return out;
}

// Rows `ids` of a packed linear's dense weight, [T, K] of `out`'s dtype: a tied embedding's
// lookup in its quantized head (engine/model/quantized_embedding.py). int8: w = q * scale;
// int4: w = q * scale + offset; in fp32, each product and sum rounded as torch's elementwise
// ops round them (the product goes through memory, so it is never fused into an FMA), then
// once to the output's dtype: the values of the torch gather this replaces, which took about
// 15 indexing ops (150 us for one int4 row on a 2-core Zen 4).
template <typename E>
void int8_rows_impl(const at::Tensor& q, const at::Tensor& scale, const int64_t* ids,
                    int64_t t, int64_t k, bool pairs, typename E::raw* out) {
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t groups = scale.size(1), g = k / groups;
  for (int64_t r = 0; r < t; ++r) {
    const int64_t block = ids[r] / kBlock, lane = ids[r] % kBlock;
    for (int64_t c = 0; c < k; ++c) {
      const int64_t at =
          pairs ? unit_offset(block, c / 2, k / 2, 2 * kBlock, q.size(0), kPanel) + lane * 2 +
                      c % 2
                : (block * k + c) * kBlock + lane;
      const int64_t unit = pairs ? unit_offset(block, c / g, groups, 64, q.size(0), kPanel) / 4
                                 : (block * groups + c / g) * kBlock;
      const float s = sp[unit + lane];
      out[r * k + c] = E::store1(static_cast<float>(qp[at]) * s);
    }
  }
}

template <typename E, typename S>
void int4_rows_impl(const at::Tensor& q4, const at::Tensor& sz, const int64_t* ids, int64_t t,
                    int64_t k, bool pairs, typename E::raw* out) {
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  const auto* zp = static_cast<const typename S::raw*>(sz.data_ptr());
  const int64_t groups = sz.size(1), g = k / groups;
  for (int64_t r = 0; r < t; ++r) {
    const int64_t block = ids[r] / kBlock, lane = ids[r] % kBlock;
    for (int64_t c = 0; c < k; ++c) {
      int q;
      if (pairs) {  // value v = 2 lane + column % 2 of pair j: word v of j's quad, nibble j % 4
        const int64_t j = c / 2, v = 2 * lane + c % 2;
        const uint8_t* quad = qp + unit_offset(block, j / 4, k / 8, 64, q4.size(0), kPanel);
        q = (quad[2 * v + (j % 4) / 2] >> (4 * (j % 2))) & 0x0F;
      } else {  // byte lane: column 2j low, 2j + 1 high
        q = c % 2 == 0 ? qp[(block * (k / 2) + c / 2) * kBlock + lane] & 0x0F
                       : qp[(block * (k / 2) + c / 2) * kBlock + lane] >> 4;
      }
      // (bytes / raw: a unit is 2 x 16 values, 64 bytes in bf16, 128 in fp32)
      constexpr int64_t raw = sizeof(typename S::raw);
      const int64_t unit =
          pairs ? unit_offset(block, c / g, groups, 2 * kBlock * raw, q4.size(0), kPanel) / raw
                : (block * groups + c / g) * 2 * kBlock;
      const typename S::raw* gz = zp + unit + lane;
      volatile float product = static_cast<float>(q) * S::load1(gz);
      out[r * k + c] = E::store1(product + S::load1(gz + kBlock));
    }
  }
}

void check_rows_args(const at::Tensor& ids, const at::Tensor& out, int64_t n) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be 1-D int64");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "out must be float32 or bfloat16");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == ids.size(0) && out.is_contiguous(),
              "out must be contiguous [T, K]");
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.size(0); ++r)
    TORCH_CHECK(p[r] >= 0 && p[r] < n, "ids[", r, "] = ", p[r], " out of range [0, ", n, ")");
}

void int8_rows(at::Tensor q, at::Tensor scale, at::Tensor ids, at::Tensor out, bool pairs) {
  ids = ids.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 3,
              "scale must be contiguous fp32 [N / 16, K / G, 16]");
  check_rows_args(ids, out, q.size(0) * kBlock);
  const int64_t t = ids.size(0), k = out.size(1);
  TORCH_CHECK(q.numel() == q.size(0) * k * kBlock && k % scale.size(1) == 0, "q, scale and K disagree");
  if (out.scalar_type() == at::kFloat)
    int8_rows_impl<F32>(q, scale, ids.data_ptr<int64_t>(), t, k, pairs, out.data_ptr<float>());
  else
    int8_rows_impl<BF16>(q, scale, ids.data_ptr<int64_t>(), t, k, pairs,
                         static_cast<uint16_t*>(out.data_ptr()));
}

void int4_rows(at::Tensor q4, at::Tensor sz, at::Tensor ids, at::Tensor out, bool pairs) {
  ids = ids.contiguous();
  TORCH_CHECK(q4.scalar_type() == at::kByte && q4.is_contiguous(), "q4 must be contiguous uint8");
  TORCH_CHECK((sz.scalar_type() == at::kFloat || sz.scalar_type() == at::kBFloat16) &&
                  sz.is_contiguous() && sz.dim() == 4,
              "sz must be contiguous fp32 or bf16 [N / 16, K / G, 2, 16]");
  check_rows_args(ids, out, q4.size(0) * kBlock);
  const int64_t t = ids.size(0), k = out.size(1);
  TORCH_CHECK(q4.numel() == q4.size(0) * (k / 2) * kBlock && k % sz.size(1) == 0,
              "q4, sz and K disagree");
  const int64_t* ip = ids.data_ptr<int64_t>();
  const bool f32 = sz.scalar_type() == at::kFloat;
  if (out.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    f32 ? int4_rows_impl<F32, F32>(q4, sz, ip, t, k, pairs, o)
        : int4_rows_impl<F32, BF16>(q4, sz, ip, t, k, pairs, o);
  } else {
    auto* o = static_cast<uint16_t*>(out.data_ptr());
    f32 ? int4_rows_impl<BF16, F32>(q4, sz, ip, t, k, pairs, o)
        : int4_rows_impl<BF16, BF16>(q4, sz, ip, t, k, pairs, o);
  }
}

}  // namespace duet

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &duet::int8_linear,
        "x @ (q * scale).T for int8 q packed [N / 16, K, 16], fp32 scales [N / 16, K / G, 16]; "
        "AMX tiles (where amx()) from amx_min_rows rows",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("n"), py::arg("amx_min_rows") = 1);
  m.def("simd_lanes", [] { return duet::kLanes; }, "fp32 lanes of the kernels' vectors");
  m.def("int4_linear", &duet::int4_linear,
        "x @ (q * scale + offset).T for int4 nibbles [N / 16, K / 2, 16] (pairs: the bf16 dot's "
        "layout), scales and offsets [N / 16, K / G, 2, 16] (bf16; fp32 without pairs); AMX "
        "tiles (pairs, where amx()) from amx_min_rows rows",
        py::arg("x"), py::arg("q4"), py::arg("sz"), py::arg("n"), py::arg("pairs"),
        py::arg("amx_min_rows") = 1);
  m.def("grouped_int8_linear", &duet::grouped_int8_linear,
        "Rows sorted by expert (counts[e] each) times their expert's int8 weight: q [E, N / 16, "
        "K, 16] (or pairs [E, N / 16, K / 2, 16, 2]), scale [E, N / 16, K / G, 16]; experts with "
        "more than max_rows rows are left unwritten",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("counts"), py::arg("n"),
        py::arg("amx_min_rows"), py::arg("max_rows"));
  m.def("grouped_int4_linear", &duet::grouped_int4_linear,
        "Rows sorted by expert (counts[e] each) times their expert's int4 weight: q4 [E, N / 16, "
        "K / 2, 16], sz [E, N / 16, K / G, 2, 16]; experts with more than max_rows rows are left "
        "unwritten",
        py::arg("x"), py::arg("q4"), py::arg("sz"), py::arg("counts"), py::arg("n"),
        py::arg("pairs"), py::arg("amx_min_rows"), py::arg("max_rows"));
  m.def("amx", [] { return duet::kAmxBuild && duet::amx_permitted(); },
        "Whether bf16 pairs can go through AMX tiles (groups of a multiple of 32 columns)");
  m.def("int8_rows", &duet::int8_rows,
        "Rows ids of int8_linear's dense weight (q * scale) into out [T, K] (fp32 or bf16)",
        py::arg("q"), py::arg("scale"), py::arg("ids"), py::arg("out"), py::arg("pairs"));
  m.def("panel", [] { return duet::kPanel; },
        "Blocks of 16 channels whose units interleave in the bf16 dot's layouts");
  m.def("int4_rows", &duet::int4_rows,
        "Rows ids of int4_linear's dense weight (q * scale + offset) into out [T, K]",
        py::arg("q4"), py::arg("sz"), py::arg("ids"), py::arg("out"), py::arg("pairs"));
  m.def("bf16_dot", [] { return duet::kBf16Dot; },
        "Whether bf16 activations take weights in pairs [N / 16, K / 2, 16, 2] (AVX512-BF16)");
}
