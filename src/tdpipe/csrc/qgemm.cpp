// Block-quantised GEMM for GGUF weights kept packed (model/gguf_linear.py): W4A8 and W8A8 with one scale per
// 32 weights along K, llama.cpp's block size.
//
//   weights  w[n, k] = s[n, b] * q[n, k] + m[n, b]     b = k / 32, q unsigned: 0..15 (4-bit) or 0..255 (8-bit)
//            Q4_0, Q4_1 and Q4_K hold exactly as 4-bit (Q4_K's 6-bit sub-block scales folded into s and m),
//            Q8_0 and Q5_0 as 8-bit (q + 128, q + 16 with m = -128 d, -16 d)
//   acts     x[r, k] ~ dx[r, b] * xq[r, k]             xq int8 in -127..127, symmetric per block of 32 (the
//            activation's Q8_0), cx[r, b] = dx[r, b] * sum_k xq[r, k] over the block
//   y[r, n]  = sum_b dx[r, b] * (s[n, b] * sum_k q[n, k] xq[r, k]) + m[n, b] * cx[r, b]   (+ bias[n])
//
// The integer dot of a block is VNNI's VPDPBUSD (u8 weights x s8 activations, 4 products per 32-bit lane,
// 16 output channels per register); the 4-bit weights are unpacked to bytes in registers, in the inner loop,
// and never stored wider. Without VNNI an AVX2 CPU runs vpmaddubsw on nibbles (tile_rows, QGEMM_AVX2), and
// anything else a plain C++ loop (portable, slower); all three give the same bits.
//
// Packed layout, per tile of 16 output channels and block b of 32 k, 64-byte groups g = 0..7 of 4 k each,
// byte [lane * 4 + j] = q[16 t + lane, 32 b + 4 g + j]; 4-bit: group g in the low nibbles of the stored
// group g, group g + 4 in the high ones (256 bytes a block), 8-bit: 512 bytes. scales [tiles, blocks, 2, 16]:
// s then m of the tile's 16 channels, fp32 or fp16 (fp16 where that holds them exactly).
#include "torch_bind.h"
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace qgemm_detail {

constexpr int BK = 32;  // weights and activations per block along K
constexpr int NT = 16;  // output channels per tile (one register of int32 / fp32 lanes)

// One switch for every VNNI-only piece (the register kernel, the notice); without it an AVX2
// build runs the AVX2 register kernel (QGEMM_AVX2), anything else the portable loop. -DTDPIPE_NO_AVX512 and
// -DTDPIPE_NO_AVX2 build the path below the CPU's, for the tests.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && !defined(TDPIPE_NO_AVX512)
#define QGEMM_VNNI 1
#else
#define QGEMM_VNNI 0
#endif
#if !QGEMM_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(TDPIPE_NO_AVX2)
#define QGEMM_AVX2 1
#include <immintrin.h>
inline __m256 load_scale8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scale8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
#define QGEMM_AVX2 0
#endif

#ifdef __AVX512F__
#include <immintrin.h>
inline __m512 load_scale(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scale(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
inline float scale_at(const float* p, int i) { return p[i]; }
inline float scale_at(const c10::Half* p, int i) { return static_cast<float>(p[i]); }

// One row's blocks: dx = amax / 127, xq = round_half_even(x * (127 / amax)), cx = dx * sum(xq); the same
// arithmetic as int8.cpp's per-row pass, per block of 32 (scalar and vector paths give the same bits).
#ifdef __AVX512F__
inline __m512 load16x(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16x(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

template <typename T>
void quantize_row_blocks(const T* xr, int8_t* qr, float* dx, float* cx, int64_t k) {
#ifdef __AVX512F__
  // two registers a block; cvtps_epi32 rounds half to even (default MXCSR): the scalar path's bits
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b * BK < k; ++b) {
    const __m512 a = load16x(xr + b * BK), c = load16x(xr + b * BK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, vinv)), lo), hi);
    const __m512i qc = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(c, vinv)), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * BK), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * BK + 16), _mm512_cvtepi32_epi8(qc));
    dx[b] = amax / 127.f;
    cx[b] = dx[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc)));
  }
  return;
#endif
  for (int64_t b = 0; b * BK < k; ++b) {
    const T* xb = xr + b * BK;
    int8_t* qb = qr + b * BK;
    float amax = 0.f;
    for (int i = 0; i < BK; ++i) amax = std::max(amax, std::fabs(ld<T>(xb, i)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < BK; ++i) {
      float v = (ld<T>(xb, i) * inv + 12582912.f) - 12582912.f;
      const int8_t q = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      qb[i] = q;
      sum += q;
    }
    dx[b] = amax / 127.f;
    cx[b] = dx[b] * static_cast<float>(sum);
  }
}

// Output rows [r0, r0 + R) of tiles [t, t + TT). y accumulates in fp32 per block, in block order; each
// row's arithmetic is the same whatever R and TT are (a row's result does not depend on its batch).
#if QGEMM_VNNI
template <int BITS, typename S, typename O, int R, int TT>
void tile_rows(const int8_t* xq, const float* dx, const float* cx, int64_t k, int64_t kb, const uint8_t* w,
               const S* sc, const float* bias, O* out, int64_t n, int64_t t, int64_t r0) {
  constexpr int BPB = BITS == 4 ? 256 : 512;  // bytes per (tile, block)
  __m512 y[R][TT];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < TT; ++u) y[r][u] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < kb; ++b) {
    __m512i acc[R][TT];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < TT; ++u) acc[r][u] = _mm512_setzero_si512();
    const int8_t* xb = xq + r0 * k + b * BK;
    // g-outer: a group's weights are loaded (and unpacked) once for all R rows; R x TT independent sums
    for (int g = 0; g < (BITS == 4 ? 4 : 8); ++g) {
      __m512i wl[TT], wh[TT];
      for (int u = 0; u < TT; ++u) {
        const __m512i v = _mm512_loadu_si512(w + ((t + u) * kb + b) * BPB + 64 * g);
        if constexpr (BITS == 4) {
          wl[u] = _mm512_and_si512(v, lo4);
          wh[u] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        } else {
          wl[u] = v;
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xl = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + r * k + 4 * g));
        for (int u = 0; u < TT; ++u) acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], wl[u], xl);
        if constexpr (BITS == 4) {
          const __m512i xh = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + r * k + 4 * (g + 4)));
          for (int u = 0; u < TT; ++u) acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], wh[u], xh);
        }
      }
    }
    for (int u = 0; u < TT; ++u) {
      const S* sb = sc + ((t + u) * kb + b) * 2 * NT;
      const __m512 s = load_scale(sb), m = load_scale(sb + NT);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * kb + b;
        y[r][u] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(dx[i])), _mm512_cvtepi32_ps(acc[r][u]), y[r][u]);
        y[r][u] = _mm512_fmadd_ps(m, _mm512_set1_ps(cx[i]), y[r][u]);
      }
    }
  }
  alignas(64) float tmp[NT];
  for (int u = 0; u < TT; ++u) {
    const int64_t c0 = (t + u) * NT;
    const int valid = static_cast<int>(std::min<int64_t>(NT, n - c0));
    for (int r = 0; r < R; ++r) {
      O* orow = out + (r0 + r) * n + c0;
      if (valid == NT && std::is_same<O, float>::value && !bias) {
        _mm512_storeu_ps(reinterpret_cast<float*>(orow), y[r][u]);
        continue;
      }
      _mm512_store_ps(tmp, y[r][u]);
      for (int j = 0; j < valid; ++j) st<O>(orow, j, bias ? tmp[j] + bias[c0 + j] : tmp[j]);
    }
  }
}
#endif

#if QGEMM_AVX2
// AVX2 + FMA without VNNI. A tile's 16 lanes as two 8-lane halves (the half's 32 bytes of each 64-byte group),
// one half at a time so that R rows' sums stay in registers. vpmaddubsw multiplies u8 weights by s8
// activations and adds neighbouring products into int16 with saturation, so the weights go in as 4-bit
// nibbles: a pair is at most 2 x 15 x 127 = 3810, a block's eight pairs per lane at most 30480, inside int16.
// 8-bit weights go as two nibbles, q = 16 hi + lo, each summed apart. Once a block, vpmaddwd widens the sums
// to int32: the same exact block sums as VNNI's, and the epilogue is the portable loop's fma sequence, so the
// result is the portable loop's to the bit.
template <int BITS, typename S, typename O, int R, int TT>
void tile_rows(const int8_t* xq, const float* dx, const float* cx, int64_t k, int64_t kb, const uint8_t* w,
               const S* sc, const float* bias, O* out, int64_t n, int64_t t, int64_t r0) {
  constexpr int BPB = BITS == 4 ? 256 : 512;  // bytes per (tile, block)
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  alignas(32) float tmp[R][NT];
  for (int u = 0; u < TT; ++u) {
    for (int h = 0; h < 2; ++h) {
      __m256 y[R];
      for (int r = 0; r < R; ++r) y[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < kb; ++b) {
        const uint8_t* wb = w + ((t + u) * kb + b) * BPB + 32 * h;
        const int8_t* xb = xq + r0 * k + b * BK;
        __m256i lo[R], hi[R];  // int16 pair sums of the low nibbles (4-bit: all of it) and the high ones
        for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
        for (int g = 0; g < (BITS == 4 ? 4 : 8); ++g) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * g));
          const __m256i wl = _mm256_and_si256(v, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
          for (int r = 0; r < R; ++r) {
            const __m256i xl = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xb + r * k + 4 * g));
            lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(wl, xl));
            if constexpr (BITS == 4) {
              const __m256i xh = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xb + r * k + 4 * (g + 4)));
              lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(wh, xh));
            } else {
              hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(wh, xl));
            }
          }
        }
        const S* sb = sc + ((t + u) * kb + b) * 2 * NT + 8 * h;
        const __m256 s = load_scale8(sb), m = load_scale8(sb + NT);
        for (int r = 0; r < R; ++r) {
          __m256i acc = _mm256_madd_epi16(lo[r], ones);
          if constexpr (BITS == 8) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(hi[r], sixteen));
          const int64_t i = (r0 + r) * kb + b;
          y[r] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(dx[i])), _mm256_cvtepi32_ps(acc), y[r]);
          y[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(cx[i]), y[r]);
        }
      }
      for (int r = 0; r < R; ++r) _mm256_store_ps(tmp[r] + 8 * h, y[r]);
    }
    const int64_t c0 = (t + u) * NT;
    const int valid = static_cast<int>(std::min<int64_t>(NT, n - c0));
    for (int r = 0; r < R; ++r) {
      O* orow = out + (r0 + r) * n + c0;
      for (int j = 0; j < valid; ++j) st<O>(orow, j, bias ? tmp[r][j] + bias[c0 + j] : tmp[r][j]);
    }
  }
}
#endif

// Portable: the same sums, one lane at a time (fma as the vector paths, so the bits agree). What a CPU
// without VNNI or AVX2 runs, and compiled everywhere, so a vector build checks it against its own
// (qgemm_portable).
template <int BITS, typename S, typename O>
void tile_rows_portable(const int8_t* xq, const float* dx, const float* cx, int64_t k, int64_t kb,
                        const uint8_t* w, const S* sc, const float* bias, O* out, int64_t n, int64_t t,
                        int64_t r0, int64_t R, int64_t TT) {
  constexpr int BPB = BITS == 4 ? 256 : 512;  // bytes per (tile, block)
  for (int u = 0; u < TT; ++u) {
    const uint8_t* wt = w + (t + u) * kb * BPB;
    const S* st_ = sc + (t + u) * kb * 2 * NT;
    const int64_t c0 = (t + u) * NT;
    const int valid = static_cast<int>(std::min<int64_t>(NT, n - c0));
    for (int r = 0; r < R; ++r) {
      float y[NT] = {0};
      for (int64_t b = 0; b < kb; ++b) {
        const uint8_t* wb = wt + b * BPB;
        const int8_t* xb = xq + (r0 + r) * k + b * BK;
        const int64_t i = (r0 + r) * kb + b;
        for (int lane = 0; lane < NT; ++lane) {
          int32_t acc = 0;
          for (int g = 0; g < 8; ++g) {
            for (int j = 0; j < 4; ++j) {
              int32_t q;
              if constexpr (BITS == 4) {
                const uint8_t byte = wb[64 * (g & 3) + lane * 4 + j];
                q = g < 4 ? (byte & 0x0F) : (byte >> 4);
              } else {
                q = wb[64 * g + lane * 4 + j];
              }
              acc += q * static_cast<int32_t>(xb[4 * g + j]);
            }
          }
          const float s = scale_at(st_ + b * 2 * NT, lane), m = scale_at(st_ + b * 2 * NT + NT, lane);
          y[lane] = std::fma(s * dx[i], static_cast<float>(acc), y[lane]);
          y[lane] = std::fma(m, cx[i], y[lane]);
        }
      }
      O* orow = out + (r0 + r) * n + c0;
      for (int j = 0; j < valid; ++j) st<O>(orow, j, bias ? y[j] + bias[c0 + j] : y[j]);
    }
  }
}

constexpr int RB = 4;  // rows per register block: 4 rows x 2 tiles = 8 independent sums (bench gemm)

#if QGEMM_VNNI || QGEMM_AVX2
template <int BITS, typename S, typename O, int TT>
void rows_of(const int8_t* xq, const float* dx, const float* cx, int64_t k, int64_t kb, const uint8_t* w,
             const S* sc, const float* bias, O* out, int64_t n, int64_t t, int64_t r0, int64_t nr) {
  switch (nr) {
    case 4: tile_rows<BITS, S, O, 4, TT>(xq, dx, cx, k, kb, w, sc, bias, out, n, t, r0); break;
    case 3: tile_rows<BITS, S, O, 3, TT>(xq, dx, cx, k, kb, w, sc, bias, out, n, t, r0); break;
    case 2: tile_rows<BITS, S, O, 2, TT>(xq, dx, cx, k, kb, w, sc, bias, out, n, t, r0); break;
    default: tile_rows<BITS, S, O, 1, TT>(xq, dx, cx, k, kb, w, sc, bias, out, n, t, r0); break;
  }
}
#endif

template <int BITS, typename S, typename O, bool PORTABLE>
void gemm_impl(const int8_t* xq, const float* dx, const float* cx, int64_t rows, int64_t k, const uint8_t* w,
               const S* sc, const float* bias, O* out, int64_t n) {
  const int64_t kb = k / BK, tiles = (n + NT - 1) / NT, pairs = (tiles + 1) / 2, chunks = (rows + RB - 1) / RB;
#pragma omp parallel for collapse(2) schedule(static) if (rows * n * k > 65536)
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t t = 2 * p, r0 = c * RB, nr = std::min<int64_t>(RB, rows - r0), tt = t + 1 < tiles ? 2 : 1;
#if QGEMM_VNNI || QGEMM_AVX2
      if constexpr (!PORTABLE) {
        if (tt == 2) rows_of<BITS, S, O, 2>(xq, dx, cx, k, kb, w, sc, bias, out, n, t, r0, nr);
        else rows_of<BITS, S, O, 1>(xq, dx, cx, k, kb, w, sc, bias, out, n, t, r0, nr);
        continue;
      }
#endif
      tile_rows_portable<BITS, S, O>(xq, dx, cx, k, kb, w, sc, bias, out, n, t, r0, nr, tt);
    }
  }
}

}  // namespace qgemm_detail

// x [M, K] bf16 / fp32 -> (xq int8 [M, K], dx fp32 [M, K / 32], cx fp32 [M, K / 32])
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_blocks(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_blocks: contiguous [M, K]");
  TORCH_CHECK(x.dtype() == at::kBFloat16 || x.dtype() == at::kFloat, "quantize_blocks: bf16 or fp32");
  const int64_t rows = x.size(0), k = x.size(1), kb = k / qgemm_detail::BK;
  TORCH_CHECK(k % qgemm_detail::BK == 0, "quantize_blocks: K must be a multiple of 32");
  auto q = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto dx = at::empty({rows, kb}, x.options().dtype(at::kFloat));
  auto cx = at::empty({rows, kb}, x.options().dtype(at::kFloat));
  int8_t* pq = q.data_ptr<int8_t>();
  float* pd = dx.data_ptr<float>();
  float* pc = cx.data_ptr<float>();
  const bool bf16 = x.dtype() == at::kBFloat16;
  const void* px = x.data_ptr();
#pragma omp parallel for schedule(static) if (rows * k > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    if (bf16) {
      qgemm_detail::quantize_row_blocks<uint16_t>(static_cast<const uint16_t*>(px) + r * k, pq + r * k, pd + r * kb,
                                                  pc + r * kb, k);
    } else {
      qgemm_detail::quantize_row_blocks<float>(static_cast<const float*>(px) + r * k, pq + r * k, pd + r * kb,
                                               pc + r * kb, k);
    }
  }
  return {q, dx, cx};
}

// y [M, n] = the block-quantised product (header); bits 4 or 8; scales fp32 or fp16; bias fp32 [n] or none
template <bool PORTABLE>
at::Tensor qgemm_run(at::Tensor xq, at::Tensor dx, at::Tensor cx, at::Tensor w, at::Tensor scales,
                        int64_t n, int64_t bits, c10::optional<at::Tensor> bias, at::ScalarType out_dtype) {
  using namespace qgemm_detail;
  TORCH_CHECK(xq.dim() == 2 && xq.is_contiguous() && xq.dtype() == at::kChar, "qgemm: xq contiguous int8 [M, K]");
  const int64_t rows = xq.size(0), k = xq.size(1), kb = k / BK, tiles = (n + NT - 1) / NT;
  TORCH_CHECK(k % BK == 0, "qgemm: K must be a multiple of 32");
  TORCH_CHECK(dx.is_contiguous() && cx.is_contiguous() && dx.numel() == rows * kb && cx.numel() == rows * kb &&
              dx.dtype() == at::kFloat && cx.dtype() == at::kFloat, "qgemm: dx, cx fp32 [M, K / 32]");
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm: bits 4 or 8");
  TORCH_CHECK(w.is_contiguous() && w.dtype() == at::kByte && w.numel() == tiles * kb * (bits == 4 ? 256 : 512),
              "qgemm: packed weights uint8 [tiles, K / 32, 256 | 512]");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == tiles * kb * 2 * NT &&
              (scales.dtype() == at::kFloat || scales.dtype() == at::kHalf), "qgemm: scales [tiles, K / 32, 2, 16]");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "qgemm: bf16 or fp32 out");
  const float* pb = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->dtype() == at::kFloat && bias->numel() == n, "qgemm: fp32 bias [n]");
    pb = bias->data_ptr<float>();
  }
  auto out = at::empty({rows, n}, xq.options().dtype(out_dtype));
  const int8_t* px = xq.data_ptr<int8_t>();
  const float* pd = dx.data_ptr<float>();
  const float* pc = cx.data_ptr<float>();
  const uint8_t* pw = w.data_ptr<uint8_t>();
  auto with_scales = [&](auto* ps) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(ps)>>;
    auto with_out = [&](auto* po) {
      using O = std::remove_pointer_t<decltype(po)>;
      if (bits == 4) gemm_impl<4, S, O, PORTABLE>(px, pd, pc, rows, k, pw, ps, pb, po, n);
      else gemm_impl<8, S, O, PORTABLE>(px, pd, pc, rows, k, pw, ps, pb, po, n);
    };
    if (out_dtype == at::kBFloat16) with_out(reinterpret_cast<uint16_t*>(out.data_ptr()));
    else with_out(out.data_ptr<float>());
  };
  if (scales.dtype() == at::kFloat) with_scales(scales.data_ptr<float>());
  else with_scales(scales.data_ptr<c10::Half>());
  return out;
}

at::Tensor qgemm(at::Tensor xq, at::Tensor dx, at::Tensor cx, at::Tensor w, at::Tensor scales,
                    int64_t n, int64_t bits, c10::optional<at::Tensor> bias, at::ScalarType out_dtype) {
  return qgemm_run<false>(xq, dx, cx, w, scales, n, bits, bias, out_dtype);
}

// The portable loop whatever the CPU: the VNNI path is tested against it without a second build.
at::Tensor qgemm_portable(at::Tensor xq, at::Tensor dx, at::Tensor cx, at::Tensor w,
                             at::Tensor scales, int64_t n, int64_t bits, c10::optional<at::Tensor> bias,
                             at::ScalarType out_dtype) {
  return qgemm_run<true>(xq, dx, cx, w, scales, n, bits, bias, out_dtype);
}

// Which path qgemm compiled to, for the one-line notice.
std::string qgemm_path() {
#if QGEMM_VNNI
  return "AVX-512 VNNI";
#elif QGEMM_AVX2
  return "AVX2 (no AVX-512 VNNI)";
#else
  return "portable C++ (no AVX-512 VNNI)";
#endif
}

#pragma GCC pop_options
