// The sampler's two full-vocabulary walks on the CPU, with exactly the arithmetic of the torch
// path in engine/sampler.py (so both give the same bits), one row per task:
//
// - top_p_threshold: the probability of the last token a row's top-p set needs. torch sorts
//   the whole row (values and indices) and takes a cumulative sum; here the largest 256 are
//   selected and sorted first, and only a row whose set reaches past them has the rest
//   sorted, by a radix sort of the values alone: linear time either way.
// - argmax_rows: greedy decoding's argmax, torch's semantics (the first maximal index; a NaN
//   counts as the maximum), in one vectorised pass per row: torch's CPU argmax over the last
//   dim walked [64, 49152] at about 1.2 elements per ns on one thread.
// - sample_inverse_cdf: the first token whose cumulative probability exceeds u * total, with
//   the cumulative sum in double in token order, as torch's cumsum + searchsorted compute it,
//   without materialising the [rows, vocab] double tensor.
// - apply_token_bitmask: a grammar's bitmask (one bit per token, set = allowed) applied to the
//   logits in place, -inf where the bit is clear. A word of 32 allowed tokens is skipped and
//   a word of none is one fill, so a row without a grammar (all ones) costs a scan of its
//   words; rows run in parallel. xgrammar's own CPU kernel tests every bit on one thread
//   (about 0.3 ms a 49,152-token row on a 2-core Xeon).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace duet {
namespace {

void check_probs(const at::Tensor& probs, const at::Tensor& per_row, const char* name) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2 &&
                  probs.is_contiguous(),
              "probs must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(per_row.device().is_cpu() && per_row.scalar_type() == at::kFloat &&
                  per_row.dim() == 1 && per_row.is_contiguous() &&
                  per_row.size(0) == probs.size(0),
              name, " must be a contiguous float32 CPU tensor of one value per row");
  TORCH_CHECK(probs.size(1) > 0, "probs must have at least one column");
}

// Sorts n floats in descending order (values only) by an LSD radix sort of their bits: three
// passes of 11 bits over keys that order like the values. The same sequence std::sort gives,
// in linear time (a flat row's set spans most of the vocabulary).
void radix_sort_descending(float* first, int64_t n, std::vector<uint32_t>& keys,
                           std::vector<uint32_t>& spare) {
  keys.resize(n);
  spare.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, first + i, sizeof bits);
    const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    keys[i] = ~ascending;  // ascending keys: descending values
  }
  uint32_t* src = keys.data();
  uint32_t* dst = spare.data();
  for (int shift = 0; shift < 32; shift += 11) {
    int64_t start[2049] = {0};
    for (int64_t i = 0; i < n; ++i) ++start[((src[i] >> shift) & 2047u) + 1];
    for (int b = 0; b < 2048; ++b) start[b + 1] += start[b];
    for (int64_t i = 0; i < n; ++i) dst[start[(src[i] >> shift) & 2047u]++] = src[i];
    std::swap(src, dst);
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t ascending = ~src[i];
    const uint32_t bits = (ascending & 0x80000000u) ? (ascending & 0x7fffffffu) : ~ascending;
    std::memcpy(first + i, &bits, sizeof bits);
  }
}

// The top-p set of one row: torch computes ordered = sort(row, descending), cum =
// cumsum(ordered) (accumulated in double, each prefix rounded to float), keeps the count of
// positions where float(cum_i) - ordered_i < p and returns ordered[max(count, 1) - 1]. That
// difference never decreases along the order, so the kept positions are a prefix: walk the
// order until the first position that fails. The largest kHead tokens are selected and
// sorted first (a peaked row's set is nearly always among them); only a row whose set
// reaches past them has the rest sorted. A row with p >= 1 keeps everything (0).
constexpr int64_t kHead = 256;

float row_threshold(const float* row, int64_t vocab, float p, std::vector<float>& work,
                    std::vector<uint32_t>& keys, std::vector<uint32_t>& spare) {
  if (p >= 1.0f) return 0.0f;  // top_p = 1: every token (never masks by rounding of the sum)
  work.assign(row, row + vocab);
  auto desc = std::greater<float>();
  const int64_t head = std::min(vocab, kHead);
  if (head < vocab) {
    std::nth_element(work.begin(), work.begin() + head, work.end(), desc);
  }
  std::sort(work.begin(), work.begin() + head, desc);
  double cum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (i == head) radix_sort_descending(work.data() + head, vocab - head, keys, spare);
    cum += static_cast<double>(work[i]);
    const float prefix = static_cast<float>(cum);
    if (!(prefix - work[i] < p)) return work[std::max<int64_t>(i, 1) - 1];
  }
  return work[vocab - 1];
}

}  // namespace

at::Tensor top_p_threshold(at::Tensor probs, at::Tensor top_p) {
  check_probs(probs, top_p, "top_p");
  const int64_t rows = probs.size(0);
  const int64_t vocab = probs.size(1);
  at::Tensor out = at::empty({rows, 1}, probs.options());
  const float* src = probs.data_ptr<float>();
  const float* p = top_p.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    std::vector<uint32_t> keys, spare;
    for (int64_t r = begin; r < end; ++r) {
      dst[r] = row_threshold(src + r * vocab, vocab, p[r], work, keys, spare);
    }
  });
  return out;
}

namespace {

// The argmax of row[begin, end): the largest value, its first index, and the first NaN's
// index (-1 when none). Every value -inf gives (-inf, begin).
struct ArgmaxPart {
  float top;
  int64_t index;
  int64_t first_nan;
};

ArgmaxPart argmax_range(const float* row, int64_t begin, int64_t end) {
  using F = Vec<kLanes>::F;
  using I = Vec<kLanes>::I;
  F best = splat<kLanes>(-__builtin_inff());
  I where{};
  I lane{};
  for (int l = 0; l < kLanes; ++l) {
    lane[l] = l;
    where[l] = static_cast<int32_t>(begin);
  }
  I unordered{};
  int64_t i = begin;
  // Per lane: the largest value so far and its first index (strictly greater replaces).
  for (; i + kLanes <= end; i += kLanes) {
    const F x = load_f32<kLanes>(row + i);
    const I greater = x > best;
    best = greater ? x : best;
    where = greater ? lane + static_cast<int32_t>(i) : where;
    unordered |= (x != x);
  }
  bool nan = false;
  for (int l = 0; l < kLanes; ++l) nan = nan || unordered[l] != 0;
  float top = -__builtin_inff();
  int64_t index = -1;  // none yet (a range shorter than a vector)
  if (i > begin) {  // lanes that never rose above -inf hold `begin`: right for all -inf
    top = best[0];
    index = where[0];
    for (int l = 1; l < kLanes; ++l) {
      if (best[l] > top || (best[l] == top && where[l] < index)) {
        top = best[l];
        index = where[l];
      }
    }
  }
  for (; i < end; ++i) {  // the tail comes after every lane's index
    nan = nan || row[i] != row[i];
    if (row[i] > top || index < 0) {
      top = row[i];
      index = i;
    }
  }
  int64_t first_nan = -1;
  if (nan) {
    for (int64_t j = begin; j < end; ++j) {
      if (row[j] != row[j]) {
        first_nan = j;
        break;
      }
    }
  }
  return {top, index < 0 ? begin : index, first_nan};
}

// torch's argmax of one row: the first NaN if any (a NaN is the maximum), else the first
// maximal index.
int64_t row_argmax(const float* row, int64_t vocab) {
  const ArgmaxPart part = argmax_range(row, 0, vocab);
  return part.first_nan >= 0 ? part.first_nan : part.index;
}

// Columns per part when fewer rows than threads split a row (each part a multiple of the
// vector width). A row written by a multi-threaded LM head lies in several cores' caches, and
// each thread reads its share.
constexpr int64_t kArgmaxPartColumns = 8192;

}  // namespace

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "logits must be a contiguous 2-D float32 CPU tensor with columns");
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* src = logits.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::min<int64_t>(threads, vocab / kArgmaxPartColumns);
  if (rows < threads && parts > 1 && !at::in_parallel_region()) {
    // Split each row into `parts` column ranges, then combine in column order: the first NaN,
    // else the largest value with the earliest index (a later part must be strictly greater).
    const int64_t width = (vocab / parts + kLanes - 1) / kLanes * kLanes;
    std::vector<ArgmaxPart> found(rows * parts);
    at::parallel_for(0, rows * parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const int64_t r = k / parts, c = (k % parts) * width;
        found[k] = argmax_range(src + r * vocab, std::min(c, vocab), std::min(c + width, vocab));
      }
    });
    for (int64_t r = 0; r < rows; ++r) {
      ArgmaxPart best = found[r * parts];
      for (int64_t q = 1; q < parts; ++q) {
        const ArgmaxPart& next = found[r * parts + q];
        if (best.first_nan >= 0) break;
        if (next.first_nan >= 0 || next.top > best.top) best = next;
      }
      dst[r] = best.first_nan >= 0 ? best.first_nan : best.index;
    }
    return out;
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = row_argmax(src + r * vocab, vocab);
  });
  return out;
}

at::Tensor sample_inverse_cdf(at::Tensor probs, at::Tensor uniform) {
  check_probs(probs, uniform, "uniform");
  const int64_t rows = probs.size(0);
  const int64_t vocab = probs.size(1);
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* src = probs.data_ptr<float>();
  const float* u = uniform.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = src + r * vocab;
      double total = 0.0;
      for (int64_t i = 0; i < vocab; ++i) total += static_cast<double>(row[i]);
      const double target = static_cast<double>(u[r]) * total;
      // searchsorted(cdf, target, right=True): the first i with cdf[i] > target.
      double cum = 0.0;
      int64_t token = vocab - 1;
      for (int64_t i = 0; i < vocab; ++i) {
        cum += static_cast<double>(row[i]);
        if (cum > target) {
          token = i;
          break;
        }
      }
      dst[r] = token;
    }
  });
  return out;
}

void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt &&
                  bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "bitmask must be a contiguous int32 CPU tensor [rows, ceil(vocab / 32)]");
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const int64_t words = bitmask.size(1);
  const int64_t row_stride = logits.stride(0);
  float* base = logits.data_ptr<float>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = base + r * row_stride;
      const uint32_t* mask = masks + r * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t bits = mask[w];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t first = w * 32;
        const int64_t n = std::min<int64_t>(32, vocab - first);
        if (bits == 0) {
          std::fill(row + first, row + first + n, neg_inf);
          continue;
        }
        for (int64_t b = 0; b < n; ++b)
          if (!((bits >> b) & 1u)) row[first + b] = neg_inf;
      }
    }
  });
}

}  // namespace duet
