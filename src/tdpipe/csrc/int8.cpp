// W8A8 on CPU: the two passes around torch._int_mm (oneDNN's s8 x s8 -> s32 GEMM, VNNI where the CPU has it).
//   quantize_rows:  x [M, K] (bf16 / fp32) -> q int8 [M, K], scale fp32 [M]: symmetric per row (per token),
//                   scale = max|x| / 127, q = round_half_even(x * (127 / max|x|)) (a zero row: q = 0, scale 0)
//   dequant_rows:   acc int32 [M, N], sx [M], sw [N], bias [N]? -> out [M, N] = acc * sx[m] * sw[n] (+ bias[n]),
//                   fp32 math, stored as bf16 (round to nearest even) or fp32
//   scale_rows_:    y [M, N] (bf16 / fp32) in place times s [M]: y[m, n] * s[m] in fp32, stored as y's dtype
//                   (torch's y.mul_(s[:, None]) bits; that mixed-dtype broadcast ran at 1/6 to 1/50 of this)
// One pass over memory each, where the torch expressions make four to six.
// quantize_rows(x, rotate): with rotate, each row is first multiplied by R = diag(H_64 / 8, H_64 / 8, ...)
// (rotate64 below): the W8A8 linears whose weights were rotated the same way at load (W R: their rows go
// through this same pass) compute x R (W R)^T = x W^T, with the outliers of x spread over their block.
//
// Compiled inside ops.cpp's extension (one build, not two: each costs 10 s of gcc on torch's
// headers), but without its fast-math: the results must be the torch fallback's bits, so no reassociation,
// no reciprocal for a division, no FMA contraction.
#include "torch_bind.h"
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace int8_detail {

// bf16_to_f, f_to_bf16, ld and st are ops.cpp's: bit manipulation, which these options do not change

#ifdef __AVX512F__
#include <immintrin.h>
// 16 values as fp32 (bf16: widened by a shift, exact)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// In place: each 64-wide block of v[0, k) times H_64 / 8, H_64 Sylvester's Hadamard matrix (+-1 entries,
// H H^T = 64 I, symmetric), so the block is rotated: its norm kept, one large entry spread over all 64. The
// fast Walsh-Hadamard transform: six butterfly stages (a, b) -> (a + b, a - b) over pairs h = 1, 2, ..., 32
// apart, then a multiplication by 1/8 (exact). The vector and scalar paths make the same operations in the same
// order: the same bits, and int8_linear.rotate64's torch fallback's. k: a multiple of 64. Not inline: ops.cpp's
// swiglu_quant calls it.
void rotate64(float* v, int64_t k) {
  for (int64_t b = 0; b + 64 <= k; b += 64) {
    float* x = v + b;
#if defined(__AVX512F__) && !defined(TDPIPE_NO_AVX512)
    __m512 r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_ps(x + 16 * i);
    // within a register, lane j pairs with lane j ^ h: in-lane permutes for h = 1, 2, 128-bit lane swaps for
    // 4, 8 (cheaper than a full permutation); lanes j + h of their pair take a - b
    const __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
    for (int s = 0; s < 4; ++s) {
      for (int i = 0; i < 4; ++i) {
        __m512 y;
        switch (s) {
          case 0: y = _mm512_permute_ps(r[i], 0xB1); break;
          case 1: y = _mm512_permute_ps(r[i], 0x4E); break;
          case 2: y = _mm512_shuffle_f32x4(r[i], r[i], 0xB1); break;
          default: y = _mm512_shuffle_f32x4(r[i], r[i], 0x4E); break;
        }
        r[i] = _mm512_mask_sub_ps(_mm512_add_ps(r[i], y), upper[s], y, r[i]);
      }
    }
    for (int h = 1; h <= 2; h <<= 1) {  // registers h apart: 16 and 32 values
      for (int i = 0; i < 4; ++i) {
        if (i & h) continue;
        const __m512 a = r[i], c = r[i + h];
        r[i] = _mm512_add_ps(a, c);
        r[i + h] = _mm512_sub_ps(a, c);
      }
    }
    const __m512 eighth = _mm512_set1_ps(0.125f);
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(x + 16 * i, _mm512_mul_ps(r[i], eighth));
#else
    for (int h = 1; h < 64; h <<= 1) {
      for (int j = 0; j < 64; ++j) {
        if (j & h) continue;
        const float a = x[j], c = x[j + h];
        x[j] = a + c;
        x[j + h] = a - c;
      }
    }
    for (int j = 0; j < 64; ++j) x[j] *= 0.125f;
#endif
  }
}

// A row's quantisation factors from its max |x|: 127 / amax (0 for a zero row) and the scale amax / 127, both
// exact divisions.
void row_scales(float amax, float* inv, float* scale) {
  *inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
}

// One row: its scale, and q = round_half_even(x * (127 / amax)) clamped to [-127, 127]. The vector and scalar
// paths give the same bits: the same fp32 product, rounded to nearest even (cvtps2dq under the default MXCSR;
// the scalar path by adding and subtracting 1.5 * 2^23, exact for |v| < 2^22).
template <typename T>
void quantize_row(const T* xr, int8_t* qr, float* scale, int64_t k) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(xr + i)));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; i < k; ++i) amax = std::max(amax, std::fabs(ld<T>(xr, i)));
  float inv;
  row_scales(amax, &inv, scale);
  i = 0;
#ifdef __AVX512F__
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (; i + 16 <= k; i += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr + i), vinv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i), _mm512_cvtepi32_epi8(v));
  }
#endif
  for (; i < k; ++i) {
    float v = (ld<T>(xr, i) * inv + 12582912.f) - 12582912.f;
    qr[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

// quantize_row of an fp32 row, for ops.cpp's fast-math swiglu_quant (these bits, not its compiler's; not
// inline, so that it is compiled here, without fast-math)
void quantize_float_row(const float* xr, int8_t* qr, float* scale, int64_t k) { quantize_row<float>(xr, qr, scale, k); }

template <typename T>
void quantize_impl(const T* x, int8_t* q, float* scale, int64_t rows, int64_t k, bool rotate) {
  if (!rotate) {
#pragma omp parallel for schedule(static) if (rows * k > 16384)
    for (int64_t r = 0; r < rows; ++r) quantize_row<T>(x + r * k, q + r * k, scale + r, k);
    return;
  }
#pragma omp parallel if (rows * k > 16384)
  {
    float* buf = new float[k];  // the row in fp32, rotated in place
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * k;
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= k; i += 16) _mm512_storeu_ps(buf + i, load16(xr + i));
#endif
      for (; i < k; ++i) buf[i] = ld<T>(xr, i);  // ops.cpp's ld is not inlined here (other optimize flags)
      rotate64(buf, k);
      quantize_row<float>(buf, q + r * k, scale + r, k);
    }
    delete[] buf;
  }
}

template <typename T, typename B>
void dequant_impl(const int32_t* acc, const float* sx, const float* sw, const B* bias, T* out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* ar = acc + r * n;
    T* orow = out + r * n;
    const float s = sx[r];
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) st<T>(orow, j, static_cast<float>(ar[j]) * s * sw[j] + ld<B>(bias, j));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) st<T>(orow, j, static_cast<float>(ar[j]) * s * sw[j]);
    }
  }
}

#if defined(__AVX512F__) && !defined(TDPIPE_NO_AVX512)
// 16 products stored: fp32 as is, bf16 rounded as ops.cpp's bf16_rne_bits (a NaN kept, made quiet). Written out
// because ld / st, ops.cpp's, are not inlined across this file's optimize options (a scalar loop at 1/7 speed).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i add = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                       _mm512_set1_epi32(0x7fff));
  const __m512i r = _mm512_mask_or_epi32(_mm512_add_epi32(u, add), nan, u, _mm512_set1_epi32(0x00400000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#endif

template <typename T>
void scale_rows_impl(T* y, const float* s, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    T* yr = y + r * n;
    const float sr = s[r];
    int64_t j = 0;
#if defined(__AVX512F__) && !defined(TDPIPE_NO_AVX512)
    const __m512 vs = _mm512_set1_ps(sr);
    for (; j + 16 <= n; j += 16) store16(yr + j, _mm512_mul_ps(load16(yr + j), vs));
#endif
    for (; j < n; ++j) st<T>(yr, j, ld<T>(yr, j) * sr);
  }
}

}  // namespace int8_detail

void scale_rows_(at::Tensor y, at::Tensor s) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "scale_rows_: contiguous [M, N]");
  TORCH_CHECK(s.dtype() == at::kFloat && s.is_contiguous() && s.numel() == y.size(0), "scale_rows_: fp32 s [M]");
  if (y.dtype() == at::kBFloat16) {
    int8_detail::scale_rows_impl<uint16_t>(reinterpret_cast<uint16_t*>(y.data_ptr()), s.data_ptr<float>(), y.size(0),
                                           y.size(1));
  } else {
    TORCH_CHECK(y.dtype() == at::kFloat, "scale_rows_: bf16 or fp32");
    int8_detail::scale_rows_impl<float>(y.data_ptr<float>(), s.data_ptr<float>(), y.size(0), y.size(1));
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(at::Tensor x, bool rotate) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows: contiguous [M, K]");
  TORCH_CHECK(!rotate || x.size(1) % 64 == 0, "quantize_rows: rotate needs K a multiple of 64");
  TORCH_CHECK(x.dtype() == at::kBFloat16 || x.dtype() == at::kFloat, "quantize_rows: bf16 or fp32");
  const int64_t rows = x.size(0), k = x.size(1);
  auto q = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows}, x.options().dtype(at::kFloat));
  if (x.dtype() == at::kBFloat16) {
    int8_detail::quantize_impl<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                            rows, k, rotate);
  } else {
    int8_detail::quantize_impl<float>(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, k, rotate);
  }
  return {q, scale};
}

at::Tensor dequant_rows(at::Tensor acc, at::Tensor sx, at::Tensor sw, c10::optional<at::Tensor> bias,
                           at::ScalarType out_dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.dtype() == at::kInt, "dequant_rows: contiguous int32 [M, N]");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(sx.dtype() == at::kFloat && sx.is_contiguous() && sx.numel() == rows, "dequant_rows: fp32 sx [M]");
  TORCH_CHECK(sw.dtype() == at::kFloat && sw.is_contiguous() && sw.numel() == n, "dequant_rows: fp32 sw [N]");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "dequant_rows: bf16 or fp32 out");
  auto out = at::empty({rows, n}, acc.options().dtype(out_dtype));
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* px = sx.data_ptr<float>();
  const float* pw = sw.data_ptr<float>();
  const bool has_bias = bias.has_value();
  at::Tensor b;
  if (has_bias) {
    b = bias.value();
    TORCH_CHECK(b.is_contiguous() && b.numel() == n && (b.dtype() == at::kBFloat16 || b.dtype() == at::kFloat),
                "dequant_rows: bias [N] bf16 or fp32");
  }
  auto run = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    if (!has_bias) {
      int8_detail::dequant_impl<T, float>(a, px, pw, nullptr, o, rows, n);
    } else if (b.dtype() == at::kBFloat16) {
      int8_detail::dequant_impl<T, uint16_t>(a, px, pw, reinterpret_cast<const uint16_t*>(b.data_ptr()), o, rows, n);
    } else {
      int8_detail::dequant_impl<T, float>(a, px, pw, b.data_ptr<float>(), o, rows, n);
    }
  };
  if (out_dtype == at::kBFloat16) {
    run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else {
    run(out.data_ptr<float>());
  }
  return out;
}

#pragma GCC pop_options
