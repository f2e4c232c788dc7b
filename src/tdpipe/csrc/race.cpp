// Random sampling by the exponential race (sampling/race.py), on logits: per listed row r, the first index of the
// largest x[r, j] / t[r] - ln q[r, j], q ~ Exp(1) drawn from a counter-based hash of (key[r], j). That is the
// race argmax p_j / q_j with p = softmax(x / t) taken in logs: no softmax pass, no copy of the rows, and a
// row's draw depends on its key and the number of columns alone, so rows split over threads freely.
//   race_rows:  x fp32 / bf16 [N, V] contiguous, rows int64 [R] (indices into x), temps fp32 [R], keys int64 [R]
//               -> int64 [R]
//   race_perturb_: x fp32 [R, V] in place -> x / t - ln q (hashed as columns col0 ..): the scores themselves, for
//               the last stage's Gumbel-max over a vocabulary shard (sampling/device_sampler.py)
// torch's exponential_ (a sequential Mersenne twister and a libm log per value) took 240 ms for 256 x 49,152
// here, and the softmax and the scaled copy before it 25 ms each; this is one pass over the logits. race.py's
// torch reference makes the same float32 operations in the same order: the same bits, so a seeded request's
// tokens do not depend on whether this kernel was built.
//
// Compiled inside ops.cpp's extension without its fast-math (no reassociation, no FMA contraction). AVX-512:
// 16 columns per instruction (vscore); elsewhere the scalar score(), the same operations (gcc does not
// vectorise it: its selects count as control flow).
#include "torch_bind.h"
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace race_detail {

constexpr int64_t kTile = 256;  // columns scored per vector pass before the argmax scan

inline uint32_t fmix32(uint32_t h) {  // murmur3's finaliser: a bijection with full avalanche
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

inline float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float to_f(float x) { return x; }
inline float to_f(uint16_t x) { return bits_f(static_cast<uint32_t>(x) << 16); }  // bf16: exact

// ln y for a positive normal y (0 gives about -88): y = m 2^e, m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(t),
// t = (m - 1) / (m + 1), by its series to t^9 (|t| < 0.172: error below 1e-9 relative)
inline float ln(float y) {
  const uint32_t b = f_bits(y);
  int32_t e = static_cast<int32_t>((b >> 23) & 0xffu) - 127;
  float m = bits_f((b & 0x007fffffu) | 0x3f800000u);
  const bool big = m > 0x1.6a09e6p+0f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const float t = (m - 1.0f) / (m + 1.0f);
  const float t2 = t * t;
  float p = t2 * 0x1.c71c72p-4f;
  p = p + 0x1.24924ap-3f;
  p = p * t2;
  p = p + 0x1.99999ap-3f;
  p = p * t2;
  p = p + 0x1.555556p-2f;
  p = p * t2;
  p = p + 1.0f;
  const float lnm = (t * p) * 2.0f;
  return static_cast<float>(e) * 0x1.62e430p-1f + lnm;
}

// x / t - ln q for column j of a row keyed (k0, k1): v in (0, 1) from 32 + 32 hashed bits, q = -ln(1 - v) ~
// Exp(1) (a series for small v, where 1 - v would lose the bits that decide the race)
inline float score(float x, float t, uint32_t j, uint32_t k0, uint32_t k1) {
  const uint32_t a = fmix32(j * 0x9e3779b9u + k0);
  const uint32_t hi = fmix32(a ^ k1);
  const uint32_t lo = fmix32(a + k1 + 0x632be5abu);
  float v = static_cast<float>(hi) * 0x1p-32f;
  v = v + (static_cast<float>(lo) + 0.5f) * 0x1p-64f;
  float c = v * 0.25f;
  c = c + 0x1.555556p-2f;
  c = c * v;
  c = c + 0.5f;
  c = c * v;
  c = c + 1.0f;
  const float q_small = v * c;
  const float q_log = 0.0f - ln(1.0f - v);
  const float q = v < 0x1p-7f ? q_small : q_log;
  return x / t - ln(q);
}

#if defined(__AVX512F__) && !defined(TDPIPE_NO_AVX512)
using int8_detail::load16;  // 16 fp32 / bf16 values as fp32 (int8.cpp, built with these options)

inline __m512i vfmix32(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

inline __m512 vln(__m512 y) {  // ln() on 16 lanes: the same operations
  const __m512i b = _mm512_castps_si512(y);
  __m512i e = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(0xff)),
                               _mm512_set1_epi32(127));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0x007fffff)),
                                                 _mm512_set1_epi32(0x3f800000)));
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0x1.6a09e6p+0f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_epi32(e, big, e, _mm512_set1_epi32(1));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
  const __m512 t2 = _mm512_mul_ps(t, t);
  __m512 p = _mm512_mul_ps(t2, _mm512_set1_ps(0x1.c71c72p-4f));
  p = _mm512_add_ps(p, _mm512_set1_ps(0x1.24924ap-3f));
  p = _mm512_mul_ps(p, t2);
  p = _mm512_add_ps(p, _mm512_set1_ps(0x1.99999ap-3f));
  p = _mm512_mul_ps(p, t2);
  p = _mm512_add_ps(p, _mm512_set1_ps(0x1.555556p-2f));
  p = _mm512_mul_ps(p, t2);
  p = _mm512_add_ps(p, one);
  const __m512 lnm = _mm512_mul_ps(_mm512_mul_ps(t, p), _mm512_set1_ps(2.0f));
  return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(0x1.62e430p-1f)), lnm);
}

// score() on 16 columns j0 .. j0 + 15: the same operations in the same order, so the same bits
inline __m512 vscore(__m512 x, __m512 t, uint32_t j0, uint32_t k0, uint32_t k1) {
  const __m512i j = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j0)),
                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i a = vfmix32(_mm512_add_epi32(_mm512_mullo_epi32(j, _mm512_set1_epi32(static_cast<int>(0x9e3779b9u))),
                                             _mm512_set1_epi32(static_cast<int>(k0))));
  const __m512i kk = _mm512_set1_epi32(static_cast<int>(k1));
  const __m512i hi = vfmix32(_mm512_xor_si512(a, kk));
  const __m512i lo = vfmix32(_mm512_add_epi32(_mm512_add_epi32(a, kk), _mm512_set1_epi32(0x632be5ab)));
  __m512 v = _mm512_mul_ps(_mm512_cvtepu32_ps(hi), _mm512_set1_ps(0x1p-32f));
  v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepu32_ps(lo), _mm512_set1_ps(0.5f)),
                                     _mm512_set1_ps(0x1p-64f)));
  __m512 c = _mm512_mul_ps(v, _mm512_set1_ps(0.25f));
  c = _mm512_add_ps(c, _mm512_set1_ps(0x1.555556p-2f));
  c = _mm512_mul_ps(c, v);
  c = _mm512_add_ps(c, _mm512_set1_ps(0.5f));
  c = _mm512_mul_ps(c, v);
  c = _mm512_add_ps(c, _mm512_set1_ps(1.0f));
  const __m512 q_small = _mm512_mul_ps(v, c);
  const __m512 q_log = _mm512_sub_ps(_mm512_setzero_ps(), vln(_mm512_sub_ps(_mm512_set1_ps(1.0f), v)));
  const __mmask16 small = _mm512_cmp_ps_mask(v, _mm512_set1_ps(0x1p-7f), _CMP_LT_OQ);
  return _mm512_sub_ps(_mm512_div_ps(x, t), vln(_mm512_mask_blend_ps(small, q_log, q_small)));
}
#endif

// s[0, n) = score of columns c0 .. c0 + n - 1 of row `xr`, hashed as columns j0 + c0 ..
template <typename T>
inline void score_tile(const T* xr, float t, float* s, int64_t c0, int64_t n, uint32_t k0, uint32_t k1,
                       int64_t j0 = 0) {
  int64_t i = 0;
#if defined(__AVX512F__) && !defined(TDPIPE_NO_AVX512)
  const __m512 vt = _mm512_set1_ps(t);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, vscore(load16(xr + c0 + i), vt, static_cast<uint32_t>(j0 + c0 + i), k0, k1));
#endif
  for (; i < n; ++i) s[i] = score(to_f(xr[c0 + i]), t, static_cast<uint32_t>(j0 + c0 + i), k0, k1);
}

template <typename T>
void race_impl(const T* x, const int64_t* rows, const float* temps, const int64_t* keys, int64_t* out, int64_t n,
               int64_t v) {
#pragma omp parallel for schedule(dynamic, 1) if (n * v > 65536)
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + rows[r] * v;
    const uint64_t key = static_cast<uint64_t>(keys[r]);
    const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
    float s[kTile];
    float best = -INFINITY;
    int64_t at = 0;
    bool nan = false;
    for (int64_t c0 = 0; c0 < v && !nan; c0 += kTile) {
      const int64_t m_n = v - c0 < kTile ? v - c0 : kTile;
      score_tile(xr, temps[r], s, c0, m_n, k0, k1);
      float m = -INFINITY;
      int nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
      for (int64_t i = 0; i < m_n; ++i) {
        m = s[i] > m ? s[i] : m;
        nans += s[i] != s[i];
      }
      if (nans) {  // torch's argmax: the first NaN wins
        for (int64_t i = 0; i < m_n; ++i) {
          if (s[i] != s[i]) { at = c0 + i; break; }
        }
        nan = true;
      } else if (m > best) {  // strictly: the first index of the maximum, as torch's argmax
        for (int64_t i = 0; i < m_n; ++i) {
          if (s[i] == m) { at = c0 + i; break; }
        }
        best = m;
      }
    }
    out[r] = at;
  }
}

// In place: x[r, j] = x[r, j] / t[r] - ln q(key[r], col0 + j), the race's scores (the stage's Gumbel-max noise)
void perturb_impl(float* x, const float* temps, const int64_t* keys, int64_t n, int64_t v, int64_t col0) {
#pragma omp parallel for schedule(dynamic, 1) if (n * v > 65536)
  for (int64_t r = 0; r < n; ++r) {
    float* xr = x + r * v;
    const uint64_t key = static_cast<uint64_t>(keys[r]);
    const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
    float s[kTile];
    for (int64_t c0 = 0; c0 < v; c0 += kTile) {
      const int64_t m_n = v - c0 < kTile ? v - c0 : kTile;
      score_tile(xr, temps[r], s, c0, m_n, k0, k1, col0);
      std::memcpy(xr + c0, s, sizeof(float) * m_n);
    }
  }
}

// The checks the row-listing kernels (race_rows, top_candidates, row_lse) share: x fp32 / bf16 [N, V]
// contiguous, rows int64 [R] within N, temps fp32 [R]
void check_rows(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& temps, const char* name) {
  TORCH_CHECK((x.dtype() == at::kFloat || x.dtype() == at::kBFloat16) && x.dim() == 2 && x.is_contiguous(), name,
              ": contiguous fp32 / bf16 [N, V]");
  const int64_t n = rows.numel();
  TORCH_CHECK(rows.dtype() == at::kLong && rows.is_contiguous(), name, ": int64 rows [R]");
  TORCH_CHECK(temps.dtype() == at::kFloat && temps.is_contiguous() && temps.numel() == n, name, ": fp32 temps [R]");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < x.size(0), name, ": row index out of range");
}

// f(p) with x's data as const float* or const uint16_t* (bf16)
template <typename F>
void with_data(const at::Tensor& x, F&& f) {
  if (x.dtype() == at::kFloat) {
    f(x.data_ptr<float>());
  } else {
    f(reinterpret_cast<const uint16_t*>(x.data_ptr()));
  }
}

}  // namespace race_detail

at::Tensor race_rows(at::Tensor x, at::Tensor rows, at::Tensor temps, at::Tensor keys) {
  race_detail::check_rows(x, rows, temps, "race_rows");
  const int64_t n = rows.numel();
  TORCH_CHECK(keys.dtype() == at::kLong && keys.is_contiguous() && keys.numel() == n, "race_rows: int64 keys [R]");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) <= (int64_t{1} << 32), "race_rows: 1 to 2^32 columns");
  auto out = at::empty({n}, keys.options());
  race_detail::with_data(x, [&](const auto* p) {
    race_detail::race_impl(p, rows.data_ptr<int64_t>(), temps.data_ptr<float>(), keys.data_ptr<int64_t>(),
                           out.data_ptr<int64_t>(), n, x.size(1));
  });
  return out;
}

void race_perturb_(at::Tensor x, at::Tensor temps, at::Tensor keys, int64_t col0) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "race_perturb_: contiguous fp32 [R, V]");
  const int64_t n = x.size(0);
  TORCH_CHECK(temps.dtype() == at::kFloat && temps.is_contiguous() && temps.numel() == n, "race_perturb_: fp32 temps [R]");
  TORCH_CHECK(keys.dtype() == at::kLong && keys.is_contiguous() && keys.numel() == n, "race_perturb_: int64 keys [R]");
  TORCH_CHECK(col0 >= 0 && col0 + x.size(1) <= (int64_t{1} << 32), "race_perturb_: columns within 2^32");
  race_detail::perturb_impl(x.data_ptr<float>(), temps.data_ptr<float>(), keys.data_ptr<int64_t>(), n, x.size(1), col0);
}

#pragma GCC pop_options
