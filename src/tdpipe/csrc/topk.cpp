// The top-k / top-p rows' candidates (sampling/sampler.py candidate_masks): per row of x, its k largest values
// in descending order, ties by the lower column (what a stable descending sort keeps first: the torch fallback).
//   top_candidates:  x fp32 [R, V] contiguous, k -> (vals fp32 [R, k], ids int64 [R, k])
// torch.topk orders equal values arbitrarily, and a seeded row's draw is keyed by its candidates' positions:
// this order is fixed. Every 16th value estimates a threshold with about 2k values above it; one vector pass
// collects them (every column when fewer than k, or with a NaN), and nth_element and a sort of k order them by
// (an order-preserving uint32 key, -column). -0 counts as +0; a NaN ranks above +inf, as torch's sort puts it.
// Compiled inside ops.cpp's extension without its fast-math, after race.cpp (its row checks and bf16 loads).
#include "torch_bind.h"
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")  // NaN tests must hold; race.cpp's options (its helpers)

namespace topk_detail {

inline uint32_t order_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (u == 0x80000000u) u = 0;  // -0 ties with +0
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;  // NaN: above everything
  return (u >> 31) ? ~u : (u | 0x80000000u);
}

// (key, -column) in one integer: a larger one ranks first, equal values by the lower column
inline uint64_t packed(float f, int64_t j) {
  return (static_cast<uint64_t>(order_key(f)) << 32) | (0xffffffffu - static_cast<uint32_t>(j));
}

// The candidates at or above `thr` (all of them when thr is -inf) as packed (key, -column), appended to cand;
// returns whether the row holds a NaN (never >= thr)
inline bool collect(const float* x, int64_t v, float thr, std::vector<uint64_t>& cand) {
  int64_t j = 0;
  bool nan = false;
#if defined(__AVX512F__) && !defined(TDPIPE_NO_AVX512)
  const __m512 vt = _mm512_set1_ps(thr);
  alignas(64) int32_t idx[16];
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 unord = 0;
  for (; j + 16 <= v; j += 16) {
    const __m512 xv = _mm512_loadu_ps(x + j);
    unord |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    const __mmask16 m = _mm512_cmp_ps_mask(xv, vt, _CMP_GE_OQ);
    if (!m) continue;
    _mm512_mask_compressstoreu_epi32(idx, m, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j))));
    for (int i = 0, n = __builtin_popcount(m); i < n; ++i) cand.push_back(packed(x[idx[i]], idx[i]));
  }
  nan = unord != 0;
#endif
  for (; j < v; ++j) {
    nan |= x[j] != x[j];
    if (x[j] >= thr)
      cand.push_back(packed(x[j], j));
  }
  return nan;
}

void row_top(const float* x, int64_t v, int64_t k, float* vals, int64_t* ids, std::vector<float>& sample,
             std::vector<uint64_t>& cand) {
  constexpr int64_t kStride = 16;  // every 16th value estimates where the k-th largest lies
  cand.clear();
  bool nan = false;
  float thr = -INFINITY;
  if (v > 8 * k + 1024) {
    sample.clear();
    for (int64_t j = 0; j < v; j += kStride) {
      nan |= x[j] != x[j];
      sample.push_back(x[j]);
    }
    // about 2k + 128 values lie above the m-th largest of the sample: almost always k or more, far fewer than V
    const int64_t m = std::min<int64_t>(static_cast<int64_t>(sample.size()), 2 * k / kStride + 8);
    std::nth_element(sample.begin(), sample.begin() + (m - 1), sample.end(), std::greater<float>());
    thr = nan ? -INFINITY : sample[m - 1];
  }
  const bool any_nan = collect(x, v, thr, cand);
  // NaNs (never >= thr) or too few at or above the estimate: every column, exact
  if (static_cast<int64_t>(cand.size()) < k || any_nan) {
    cand.clear();
    for (int64_t j = 0; j < v; ++j)
      cand.push_back(packed(x[j], j));
  }
  std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), std::greater<uint64_t>());
  std::sort(cand.begin(), cand.begin() + k, std::greater<uint64_t>());
  for (int64_t i = 0; i < k; ++i) {
    const int64_t j = 0xffffffffu - static_cast<uint32_t>(cand[i]);
    ids[i] = j;
    vals[i] = x[j];
  }
}

}  // namespace topk_detail

// x fp32 / bf16 [N, V] contiguous, rows int64 [R], temps fp32 [R]: the candidates of x[rows[r]] / temps[r] (the
// division in float32, as the sampler's scaled copy makes it), each row scaled into a thread's buffer
std::tuple<at::Tensor, at::Tensor> top_candidates(at::Tensor x, at::Tensor rows, at::Tensor temps, int64_t k) {
  race_detail::check_rows(x, rows, temps, "top_candidates");
  const int64_t n = rows.numel(), v = x.size(1);
  TORCH_CHECK(k >= 1 && k <= v && v < (int64_t{1} << 32), "top_candidates: 1 <= k <= V < 2^32");
  auto vals = at::empty({n, k}, x.options().dtype(at::kFloat));
  auto ids = at::empty({n, k}, x.options().dtype(at::kLong));
  const int64_t* rp = rows.data_ptr<int64_t>();
  const float* tp = temps.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  race_detail::with_data(x, [&](const auto* xp) {
#pragma omp parallel if (n * v > 65536)
    {
      std::vector<float> y(v), sample;
      std::vector<uint64_t> cand;
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < n; ++r) {
        const auto* xr = xp + rp[r] * v;
        const float t = tp[r];  // a local: y's stores could alias temps, and the loop would not vectorise
        for (int64_t j = 0; j < v; ++j) y[j] = race_detail::to_f(xr[j]) / t;
        topk_detail::row_top(y.data(), v, k, vp + r * k, ip + r * k, sample, cand);
      }
    }
  });
  return {vals, ids};
}

#pragma GCC pop_options
