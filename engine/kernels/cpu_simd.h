// SIMD building blocks of duet's CPU kernels: GCC vector extensions sized to the widest ISA that
// -march=native offers (AVX-512: 16 fp32 lanes, AVX: 8, else 4), so one source serves every x86
// (and other) CPU; fp32/bf16 element formats; horizontal sums; a vectorised exp.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#include <type_traits>

namespace duet {

// DUET_SIMD_LANES (4, 8 or 16) overrides the width, to run another width's code on one machine:
// GCC lowers vectors wider than the ISA to several native ones.
#if defined(DUET_SIMD_LANES)
constexpr int kLanes = DUET_SIMD_LANES;
#elif defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

template <int W>
struct Vec {
  typedef float F __attribute__((vector_size(W * 4)));
  typedef int32_t I __attribute__((vector_size(W * 4)));
  typedef uint16_t H __attribute__((vector_size(W * 2)));
  // Unaligned views of memory. Typed accesses (not memcpy, which may alias anything) let the
  // compiler keep strides and pointers in registers across stores.
  typedef float FU __attribute__((vector_size(W * 4), aligned(4)));
  typedef uint16_t HU __attribute__((vector_size(W * 2), aligned(2)));
  typedef int32_t PU __attribute__((vector_size(W * 4), aligned(2), may_alias));  // 2W bf16
};

template <int W>
inline typename Vec<W>::F load_f32(const float* p) {
  return *reinterpret_cast<const typename Vec<W>::FU*>(p);
}

template <int W>
inline void store_f32(float* p, typename Vec<W>::F v) {
  *reinterpret_cast<typename Vec<W>::FU*>(p) = v;
}

template <int W>
inline typename Vec<W>::F splat(float x) {
  return typename Vec<W>::F{} + x;
}

// Element formats: W elements load as W fp32 lanes; `round` gives what storing and loading
// again would (the dtype's rounding), for computations that round in between like torch does.
struct F32 {
  using raw = float;
  template <int W>
  static inline typename Vec<W>::F load(const raw* p) {
    return load_f32<W>(p);
  }
  template <int W>
  static inline void store(raw* p, typename Vec<W>::F v) {
    store_f32<W>(p, v);
  }
  template <int W>
  static inline typename Vec<W>::F round(typename Vec<W>::F v) {
    return v;
  }
  static inline float load1(const raw* p) { return *p; }
  static inline raw store1(float x) { return x; }
  static inline float round1(float x) { return x; }
};

struct BF16 {
  using raw = uint16_t;
  template <int W>
  static inline typename Vec<W>::F load(const raw* p) {  // bf16 is the top half of an fp32
    const typename Vec<W>::HU h = *reinterpret_cast<const typename Vec<W>::HU*>(p);
    return reinterpret_cast<typename Vec<W>::F>(__builtin_convertvector(h, typename Vec<W>::I)
                                                << 16);
  }
  // Round to nearest even in the fp32 bit pattern (bf16 in the top half), as torch does; NaNs
  // stay (quiet) NaNs.
  template <int W>
  static inline typename Vec<W>::I round_bits(typename Vec<W>::F v) {
    using I = typename Vec<W>::I;
    const I bits = reinterpret_cast<I>(v);
    const I rounded = (bits + 0x7fff + ((bits >> 16) & 1)) & static_cast<int32_t>(0xffff0000u);
    const I quiet_nan = I{} + 0x7fc00000;
    return (bits & 0x7fffffff) > 0x7f800000 ? quiet_nan : rounded;
  }
  template <int W>
  static inline typename Vec<W>::F round(typename Vec<W>::F v) {
    return reinterpret_cast<typename Vec<W>::F>(round_bits<W>(v));
  }
  template <int W>
  static inline void store(raw* p, typename Vec<W>::F v) {
    using U = typename Vec<W>::I;
    const U top = reinterpret_cast<U>(round_bits<W>(v)) >> 16;  // arithmetic shift: mask below
    *reinterpret_cast<typename Vec<W>::HU*>(p) =
        __builtin_convertvector(top & 0xffff, typename Vec<W>::H);
  }
  static inline float load1(const raw* p) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static inline raw store1(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<raw>(bits >> 16);
  }
  static inline float round1(float x) {
    const raw r = store1(x);
    return load1(&r);
  }
};

// Lanes From .. From + W / 2 of v, by a shuffle: copying a half out with memcpy took v's
// address, and GCC then kept every accumulator that reached a reduction on the stack (the
// dense kernel's 16 accumulators: a load and a store around each FMA).
template <int W, int From, int... I>
inline typename Vec<W / 2>::F half_of(typename Vec<W>::F v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, (From + I)...);
}

// Horizontal reductions by halving: vextractf128 + one operation per step on x86.
template <int W, typename Op>
inline float hreduce(typename Vec<W>::F v, Op op) {
  static_assert(W == 1 || W == 2 || W == 4 || W == 8 || W == 16, "1 to 16 lanes");
  if constexpr (W == 1) {
    return v[0];
  } else {
    constexpr auto half = std::make_integer_sequence<int, W / 2>{};
    return hreduce<W / 2>(op(half_of<W, 0>(v, half), half_of<W, W / 2>(v, half)), op);
  }
}

template <int W>
inline float hsum(typename Vec<W>::F v) {
  return hreduce<W>(v, [](auto a, auto b) { return a + b; });
}

template <int W>
inline float hmax(typename Vec<W>::F v) {
  return hreduce<W>(v, [](auto a, auto b) { return a > b ? a : b; });
}

template <int W>
inline typename Vec<4>::F fold_to4(typename Vec<W>::F v) {  // sum the W / 4 quarters of v
  if constexpr (W == 4) {
    return v;
  } else {
    typename Vec<W / 2>::F lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
    return fold_to4<W / 2>(lo + hi);
  }
}

// Pairwise sums of a and b within each 4-lane quarter, as x86's haddps does:
// [a0+a1, a2+a3, b0+b1, b2+b3] per quarter.
template <int W>
inline typename Vec<W>::F hadd(typename Vec<W>::F a, typename Vec<W>::F b) {
  using I = typename Vec<W>::I;
  if constexpr (W == 4) {
    return __builtin_shuffle(a, b, I{0, 2, 4, 6}) + __builtin_shuffle(a, b, I{1, 3, 5, 7});
  } else if constexpr (W == 8) {
    return __builtin_shuffle(a, b, I{0, 2, 8, 10, 4, 6, 12, 14}) +
           __builtin_shuffle(a, b, I{1, 3, 9, 11, 5, 7, 13, 15});
  } else {
    static_assert(W == 16, "4, 8 or 16 lanes");
    return __builtin_shuffle(a, b, I{0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30}) +
           __builtin_shuffle(a, b, I{1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31});
  }
}

// [sum(a0), sum(a1), sum(a2), sum(a3)] in 3 + log2(W / 4) vector operations instead of four
// separate reductions.
template <int W>
inline typename Vec<4>::F hsum4(typename Vec<W>::F a0, typename Vec<W>::F a1,
                                typename Vec<W>::F a2, typename Vec<W>::F a3) {
  return fold_to4<W>(hadd<W>(hadd<W>(a0, a1), hadd<W>(a2, a3)));
}

// exp(x), Cephes' expf polynomial after reduction by ln 2: within 2 ulp of std::exp on
// [-87, 88]. Inputs are clamped to that range, so exp(-inf) gives ~1e-38 instead of 0 (no
// softmax sum, which is >= 1, can tell) and large inputs give 1.7e38 instead of inf.
template <int W>
inline typename Vec<W>::F vexp(typename Vec<W>::F x) {
  using F = typename Vec<W>::F;
  using I = typename Vec<W>::I;
  const F lo = splat<W>(-87.0f), hi = splat<W>(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const F magic = splat<W>(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const F n = (x * 1.44269504088896341f + magic) - magic;
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = splat<W>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I pow2 = (__builtin_convertvector(n, I) + 127) << 23;
  return p * reinterpret_cast<F>(pow2);
}

}  // namespace duet
