// The top-p rows' normaliser over the whole row (sampling/sampler.py _logsumexp): per listed row,
// ln sum_j exp(x[row, j] - top) + top, top the row's largest value (known from its top-k; +-inf taken as 0 by
// the caller). torch's expression (subtract into a copy of the rows, exp, sum, log) makes four passes over
// [rows, V] float32 and a temporary of that size; this is one pass per row. Its exp is tdpipe's own (2^z by
// a degree-7 polynomial, scalef for the exponent, ~1e-7 relative), so the sum differs from torch's by float
// rounding: a top-p row's nucleus can differ only where its mass lands within ~1e-6 of top_p.
//   row_lse:  x fp32 / bf16 [N, V] contiguous, rows int64 [R], temps fp32 [R], top fp32 [R] -> fp32 [R]: of
//             x[rows[r]] / temps[r] (the sampler's scaled rows, without their copy)
// Compiled inside ops.cpp's extension after race.cpp (its row checks and bf16 conversions), with its options.
#include "torch_bind.h"
#include <omp.h>
#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")  // race.cpp's options, so its helpers inline here

namespace lse_detail {

using race_detail::to_f;
#if defined(__AVX512F__) && !defined(TDPIPE_NO_AVX512)
using int8_detail::load16;
#endif

template <typename T>
double row_sum_exp(const T* x, int64_t v, float t, float top) {
  int64_t i = 0;
  double total = 0.0;
#if defined(__AVX512F__) && !defined(TDPIPE_NO_AVX512)
  static const float poly[] = {1.525273380405984e-05f, 1.5403530393381608e-04f, 1.3333558146428443e-03f,
                               9.618129107628477e-03f, 5.550410866482158e-02f, 2.402265069591007e-01f,
                               6.931471805599453e-01f, 1.0f};  // 2^f on [-0.5, 0.5], highest first
  const __m512 vt = _mm512_set1_ps(top), tt = _mm512_set1_ps(t), l2e = _mm512_set1_ps(1.4426950408889634f);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; i + 64 <= v; i += 64) {
    for (int u = 0; u < 4; ++u) {
      const __m512 y = _mm512_div_ps(load16(x + i + 16 * u), tt);
      __m512 z = _mm512_mul_ps(_mm512_sub_ps(y, vt), l2e);
      z = _mm512_min_ps(_mm512_max_ps(z, _mm512_set1_ps(-200.0f)), _mm512_set1_ps(200.0f));  // -inf -> 0
      const __m512 n = _mm512_roundscale_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 f = _mm512_sub_ps(z, n);
      __m512 p = _mm512_set1_ps(poly[0]);
      for (int k = 1; k < 8; ++k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(poly[k]));
      acc[u] = _mm512_add_ps(acc[u], _mm512_scalef_ps(p, n));
    }
  }
  total = static_cast<double>(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                                                 _mm512_add_ps(acc[2], acc[3]))));
#endif
  for (; i < v; ++i) total += std::exp(static_cast<double>(to_f(x[i]) / t) - top);
  return total;
}

}  // namespace lse_detail

at::Tensor row_lse(at::Tensor x, at::Tensor rows, at::Tensor temps, at::Tensor top) {
  race_detail::check_rows(x, rows, temps, "row_lse");
  const int64_t n = rows.numel(), v = x.size(1);
  TORCH_CHECK(top.dtype() == at::kFloat && top.is_contiguous() && top.numel() == n, "row_lse: fp32 top [R]");
  auto out = at::empty({n}, top.options());
  const int64_t* r = rows.data_ptr<int64_t>();
  const float* tp = top.data_ptr<float>();
  const float* te = temps.data_ptr<float>();
  float* op = out.data_ptr<float>();
  race_detail::with_data(x, [&](const auto* xp) {
#pragma omp parallel for schedule(dynamic, 1) if (n * v > 65536)
    for (int64_t i = 0; i < n; ++i)
      op[i] = static_cast<float>(std::log(lse_detail::row_sum_exp(xp + r[i] * v, v, te[i], tp[i])) + tp[i]);
  });
  return out;
}

#pragma GCC pop_options
