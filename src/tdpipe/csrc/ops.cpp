// Fused element-wise ops for the CPU decoder: each makes one pass over memory where the unfused torch
// expression makes five to eight (RMSNorm on a [8192, 576] bf16 tensor: ~60 ms in torch, ~2 ms here).
// Math in fp32; bf16 in and out with round-to-nearest-even, the rounding torch uses.
#include "torch_bind.h"
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace int8_detail {
// int8.cpp's, built without fast-math
void rotate64(float* v, int64_t k);
void quantize_float_row(const float* xr, int8_t* qr, float* scale, int64_t k);
}

namespace {

inline float bf16_to_f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// f rounded to bf16 (nearest even), as the high half of its fp32 bits; a NaN stays a NaN, made quiet. Written
// without a branch and without narrowing to 16 bits, so that a loop of them vectorises into masked adds on
// 32-bit lanes: the element-wise kernels below do up to four such roundings per element (1.35x on
// swiglu_quant against a branch and a round trip through uint16_t), same bits.
inline uint32_t bf16_rne_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t add = nan ? 0u : 0x7fffu + ((u >> 16) & 1u);
  return ((u | (nan ? 0x00400000u : 0u)) + add) & 0xffff0000u;
}

inline uint16_t f_to_bf16(float f) { return static_cast<uint16_t>(bf16_rne_bits(f) >> 16); }

template <typename T> inline float ld(const T* p, int64_t i);
template <> inline float ld<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float ld<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_f(p[i]); }
template <typename T> inline void st(T* p, int64_t i, float v);
template <> inline void st<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void st<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = f_to_bf16(v); }
// round a value to the storage type and back (what a torch op in that dtype would have produced)
template <typename T> inline float rnd(float v);
template <> inline float rnd<float>(float v) { return v; }
template <> inline float rnd<uint16_t>(float v) {
  const uint32_t r = bf16_rne_bits(v);
  float f;
  std::memcpy(&f, &r, 4);
  return f;
}

// One row of add_rms_norm: buf = x + residual (rounded to T, as torch adds in T; stored back to the residual
// stream when there is one), then buf = w * T(buf * rsqrt(mean(buf^2) + eps)) rounded to T, kept in fp32.
template <typename T>
inline void norm_row(const T* xr, T* rr, const T* w, float* buf, int64_t h, float eps, bool has_res) {
  float ss = 0.f;
  if (has_res) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) {
      float v = rnd<T>(ld<T>(xr, i) + ld<T>(rr, i));
      buf[i] = v;
      ss += v * v;
    }
    for (int64_t i = 0; i < h; ++i) st<T>(rr, i, buf[i]);
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) {
      float v = ld<T>(xr, i);
      buf[i] = v;
      ss += v * v;
    }
  }
  float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) buf[i] = rnd<T>(ld<T>(w, i) * rnd<T>(buf[i] * inv));
}

// residual = x + residual (rounded to T, as torch adds in T); out = w * T(residual * rsqrt(mean(residual^2) + eps))
template <typename T>
void add_rms_norm_impl(const T* x, T* res, const T* w, T* out, int64_t rows, int64_t h, float eps, bool has_res) {
#pragma omp parallel
  {
    float* buf = new float[h];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      norm_row<T>(x + r * h, res + r * h, w, buf, h, eps, has_res);
      T* orow = out + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) st<T>(orow, i, buf[i]);
    }
    delete[] buf;
  }
}

// W8A8's norm straight into its linear's int8 input (model/int8_linear.norm_into_linears): add_rms_norm's bf16
// row, then (`rotate`) rotated and quantised per row by int8.cpp's own passes, as quantize_rows(add_rms_norm(x),
// rotate) does: the same bits, without writing the normalised rows and reading them back in another op (at a
// decode batch of 256 each such hand-over between ops cost 50-90 us here, twice per layer).
void add_rms_norm_quant_impl(const uint16_t* x, uint16_t* res, const uint16_t* w, int8_t* q, float* scale,
                             int64_t rows, int64_t h, float eps, bool has_res, bool rotate) {
#pragma omp parallel
  {
    float* buf = new float[h];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      norm_row<uint16_t>(x + r * h, res + r * h, w, buf, h, eps, has_res);
      if (rotate) int8_detail::rotate64(buf, h);
      int8_detail::quantize_float_row(buf, q + r * h, scale + r, h);
    }
    delete[] buf;
  }
}

// exp for the bf16 SwiGLU: 2^(x log2 e) split into integer and fraction, 2^f by its degree-6 Taylor series.
// Relative error < 1e-5, far below bf16's 4e-3, and it vectorises (std::exp stays scalar here: ~10x slower).
inline float exp_approx(float x) {
  x = std::fmin(std::fmax(x, -87.f), 88.f);
  float t = x * 1.4426950408889634f;
  float fi = std::floor(t);
  float f = t - fi;
  float p = 1.f + f * (0.69314718f + f * (0.24022651f + f * (0.05550411f + f * (0.00961813f + f * (0.00133336f + f * 0.00015404f)))));
  int32_t e = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}
template <typename T> inline float silu(float a);
template <> inline float silu<float>(float a) { return a / (1.f + std::exp(-a)); }  // fp32: exact, matches torch
template <> inline float silu<uint16_t>(float a) { return a / (1.f + exp_approx(-a)); }

// y = silu(gate) * up over the fused [rows, 2*inter] gate_up projection
template <typename T>
void silu_mul_impl(const T* gu, T* y, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * inter;
    const T* u = g + inter;
    T* yr = y + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      float a = ld<T>(g, i);
      float s = rnd<T>(silu<T>(a));
      st<T>(yr, i, s * ld<T>(u, i));
    }
  }
}

// W8A8's SwiGLU middle in one pass (model/int8_linear.swiglu_w8a8): gate_up's int32 GEMM output scaled
// (acc * sx[r] * sw[n], rounded to bf16 as dequant_rows writes it), silu(gate) * up rounded as silu_mul_impl
// rounds it, then quantised per row for down as quantize_rows does. The unfused path writes [rows, 2 inter]
// bf16, reads it back, writes [rows, inter] bf16 and reads it twice more; this reads the int32 once and
// writes int8. The same bits as that path, although this file has fast-math, which turns (acc * sx) * sw
// into acc * (sx * sw) within a loop and a division into a multiplication by a reciprocal: acc * sx is
// stored to an L1-sized row buffer by one loop and multiplied by sw in the next, and the row is quantised
// by int8.cpp's quantize_rows pass (quantize_float_row), built without fast-math.
// (A 1-ulp change of one scale moves W8A8's perplexity on the bundled model by about 0.3%.)
// `rotate`: down's input rotated as quantize_rows(x, rotate) does (int8.cpp rotate64), by int8.cpp's code.
void swiglu_quant_impl(const int32_t* acc, const float* sx, const float* sw, int8_t* q, float* scale, int64_t rows,
                       int64_t inter, bool rotate) {
#pragma omp parallel
  {
    float* buf = new float[inter];
    float* xs = new float[2 * inter];  // the row's acc * sx, gate then up
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* ar = acc + r * 2 * inter;
      const float s = sx[r];
#pragma omp simd
      for (int64_t i = 0; i < 2 * inter; ++i) xs[i] = static_cast<float>(ar[i]) * s;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        float a = rnd<uint16_t>(xs[i] * sw[i]);
        float b = rnd<uint16_t>(xs[inter + i] * sw[inter + i]);
        buf[i] = rnd<uint16_t>(rnd<uint16_t>(silu<uint16_t>(a)) * b);
      }
      if (rotate) int8_detail::rotate64(buf, inter);
      int8_detail::quantize_float_row(buf, q + r * inter, scale + r, inter);  // quantize_rows' own pass
    }
    delete[] xs;
    delete[] buf;
  }
}

// In-place rotary embedding, rotate_half convention: for i < d/2,
// x[i] <- x[i]*cos[i] - x[i+d/2]*sin[i];  x[i+d/2] <- x[i+d/2]*cos[i] + x[i]*sin[i]  (cos/sin rounded to T, like HF)
template <typename T>
void rope_impl(T* x, int64_t rows, int64_t heads, int64_t d, int64_t row_stride, const int64_t* pos,
               const float* cos_sin, int64_t table_stride) {
  const int64_t half = d / 2;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos_sin + pos[r] * table_stride;  // [cos(d/2) | sin(d/2)] per position
    const float* s = c + half;
    for (int64_t hh = 0; hh < heads; ++hh) {
      T* v = x + r * row_stride + hh * d;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        float a = ld<T>(v, i), b = ld<T>(v, i + half);
        float ci = rnd<T>(c[i]), si = rnd<T>(s[i]);
        float na = rnd<T>(a * ci) - rnd<T>(b * si);
        float nb = rnd<T>(b * ci) + rnd<T>(a * si);
        st<T>(v, i, na);
        st<T>(v, i + half, nb);
      }
    }
  }
}

void check_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.dtype() == at::kBFloat16 || t.dtype() == at::kFloat, "tdpipe ops: bf16 or fp32 only");
}

}  // namespace

// Returns the normalised output; when `residual` is given it is updated in place to x + residual.
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  check_dtype(x);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dtype() == x.dtype(), "add_rms_norm: layout");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  auto out = at::empty_like(x);
  bool has = residual.has_value();
  at::Tensor res = has ? residual.value() : x;
  if (has) TORCH_CHECK(res.is_contiguous() && res.dtype() == x.dtype(), "add_rms_norm: residual layout");
  if (x.dtype() == at::kBFloat16) {
    add_rms_norm_impl<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<uint16_t*>(res.data_ptr()),
                                reinterpret_cast<const uint16_t*>(weight.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                                rows, h, static_cast<float>(eps), has);
  } else {
    add_rms_norm_impl<float>(x.data_ptr<float>(), res.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(),
                             rows, h, static_cast<float>(eps), has);
  }
  return out;
}

// add_rms_norm (bf16) whose output goes to a W8A8 linear: (q int8 [rows, h], scale fp32 [rows]) of
// quantize_rows(norm, rotate); the residual, when given, updated in place as add_rms_norm does.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_quant(at::Tensor x, c10::optional<at::Tensor> residual,
                                                      at::Tensor weight, double eps, bool rotate) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && x.is_contiguous() && weight.is_contiguous() && weight.dtype() == x.dtype(),
              "add_rms_norm_quant: contiguous bf16 x and weight");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  TORCH_CHECK(!rotate || h % 64 == 0, "add_rms_norm_quant: rotate needs a width that is a multiple of 64");
  bool has = residual.has_value();
  at::Tensor res = has ? residual.value() : x;
  if (has) TORCH_CHECK(res.is_contiguous() && res.dtype() == x.dtype(), "add_rms_norm_quant: residual layout");
  auto q = at::empty({rows, h}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows}, x.options().dtype(at::kFloat));
  add_rms_norm_quant_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<uint16_t*>(res.data_ptr()),
                          reinterpret_cast<const uint16_t*>(weight.data_ptr()), q.data_ptr<int8_t>(),
                          scale.data_ptr<float>(), rows, h, static_cast<float>(eps), has, rotate);
  return {q, scale};
}

at::Tensor silu_and_mul(at::Tensor gu) {
  check_dtype(gu);
  TORCH_CHECK(gu.is_contiguous() && gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_and_mul: [rows, 2*inter]");
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  auto y = at::empty({rows, inter}, gu.options());
  if (gu.dtype() == at::kBFloat16) {
    silu_mul_impl<uint16_t>(reinterpret_cast<const uint16_t*>(gu.data_ptr()), reinterpret_cast<uint16_t*>(y.data_ptr()), rows, inter);
  } else {
    silu_mul_impl<float>(gu.data_ptr<float>(), y.data_ptr<float>(), rows, inter);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_quant(at::Tensor acc, at::Tensor sx, at::Tensor sw, bool rotate) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.dtype() == at::kInt && acc.size(1) % 2 == 0,
              "swiglu_quant: contiguous int32 [M, 2 * inter]");
  const int64_t rows = acc.size(0), inter = acc.size(1) / 2;
  TORCH_CHECK(sx.dtype() == at::kFloat && sx.is_contiguous() && sx.numel() == rows, "swiglu_quant: fp32 sx [M]");
  TORCH_CHECK(sw.dtype() == at::kFloat && sw.is_contiguous() && sw.numel() == 2 * inter, "swiglu_quant: fp32 sw [2 * inter]");
  TORCH_CHECK(!rotate || inter % 64 == 0, "swiglu_quant: rotate needs inter a multiple of 64");
  auto q = at::empty({rows, inter}, acc.options().dtype(at::kChar));
  auto scale = at::empty({rows}, acc.options().dtype(at::kFloat));
  swiglu_quant_impl(acc.data_ptr<int32_t>(), sx.data_ptr<float>(), sw.data_ptr<float>(), q.data_ptr<int8_t>(),
                    scale.data_ptr<float>(), rows, inter, rotate);
  return {q, scale};
}

// x: [T, H, D] view whose rows may be strided (a slice of the fused qkv output); head and dim contiguous.
void rope_(at::Tensor x, at::Tensor positions, at::Tensor cos_sin) {
  check_dtype(x);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope_: [T, H, D] with contiguous heads");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous(), "rope_: int64 positions");
  TORCH_CHECK(cos_sin.dtype() == at::kFloat && cos_sin.is_contiguous() && cos_sin.size(1) == x.size(2),
              "rope_: cos_sin table [max_pos, D] float32");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  if (x.dtype() == at::kBFloat16) {
    rope_impl<uint16_t>(reinterpret_cast<uint16_t*>(x.data_ptr()), rows, heads, d, x.stride(0), positions.data_ptr<int64_t>(),
                        cos_sin.data_ptr<float>(), cos_sin.size(1));
  } else {
    rope_impl<float>(x.data_ptr<float>(), rows, heads, d, x.stride(0), positions.data_ptr<int64_t>(), cos_sin.data_ptr<float>(),
                     cos_sin.size(1));
  }
}

// Row-wise argmax of bf16 logits [rows, vocab] (greedy sampling): torch's bf16 argmax runs at ~1 GB/s here.
// Two vectorisable passes per row (max, then its first index: the tie rule of torch and transformers).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "argmax_rows: contiguous bf16 [R, V]");
  const int64_t rows = x.size(0), v = x.size(1);
  auto out = at::empty({rows}, at::kLong);
  const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr());
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = p + r * v;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < v; ++i) m = std::max(m, bf16_to_f(row[i]));
    int64_t idx = 0;
    for (int64_t i = 0; i < v; ++i) {
      if (bf16_to_f(row[i]) == m) { idx = i; break; }
    }
    o[r] = idx;
  }
  return out;
}

#include "int8.cpp"  // W8A8's quantise / scale passes (model/int8_linear.py), built without fast-math
#include "bitmask.cpp"  // structured output's token masks (sampling/grammar.py), built without fast-math
#include "race.cpp"  // random sampling's exponential race (sampling/race.py), built without fast-math
#include "topk.cpp"  // the top-k / top-p rows' candidates in a fixed order (sampling/sampler.py)
#include "lse.cpp"  // the top-p rows' normaliser over a whole row (sampling/sampler.py)
#include "qgemm.cpp"  // GGUF weights kept packed: W4A8 / W8A8 per block of 32 (model/gguf_linear.py)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm");
  m.def("add_rms_norm_quant", &add_rms_norm_quant, "add_rms_norm into a W8A8 linear's int8 rows: (q, scale)");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation on the fused gate_up output");
  m.def("swiglu_quant", &swiglu_quant, "W8A8 SwiGLU: gate_up's int32 output -> int8 rows for down, and their scales");
  m.def("argmax_rows", &argmax_rows, "row-wise argmax of bf16 logits");
  m.def("rope_", &rope_, "in-place rotary embedding (rotate_half convention)");
  m.def("quantize_rows", &quantize_rows, "per-row symmetric int8 quantisation: (q, scale)");
  m.def("dequant_rows", &dequant_rows, "int32 GEMM output times row and column scales (+ bias), bf16 or fp32");
  m.def("scale_rows_", &scale_rows_, "in place: each row times its fp32 scale, bf16 or fp32");
  m.def("apply_bitmask_", &apply_bitmask_, "in place: tokens a grammar's bitmask forbids -> -inf (fp32 logits)");
  m.def("quantize_blocks", &quantize_blocks, "int8 activations per block of 32: (xq, dx, cx)");
  m.def("qgemm", &qgemm, "block-quantised GEMM: packed 4- or 8-bit weights x int8 activations (VNNI)");
  m.def("qgemm_portable", &qgemm_portable, "qgemm by the portable loop, whatever the CPU (tests)");
  m.def("qgemm_path", &qgemm_path, "which code path qgemm was compiled to");
  m.def("race_rows", &race_rows, "exponential race per row: argmax x / t - ln q, q ~ Exp(1) hashed from (key, column)");
  m.def("top_candidates", &top_candidates, "per row: the k largest values, descending, ties by lower column");
  m.def("row_lse", &row_lse, "per listed row: ln sum exp(x - top) + top (one pass)");
  m.def("race_perturb_", &race_perturb_, "in place: x / t - ln q, the race's scores (Gumbel-max noise)");
  m.def("masked_argmax_rows", &masked_argmax_rows, "row-wise argmax over the tokens a bitmask allows (-1: none)");
}
