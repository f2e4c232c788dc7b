// Structured output: a grammar's token bitmask (xgrammar's layout: bit j % 32 of int32 word j / 32 set when token
// j is allowed) applied to logits rows.
//   apply_bitmask_:      x fp32 [R, V] in place: forbidden tokens -> -inf (the rows the sampler draws from)
//   masked_argmax_rows:  x fp32 / bf16 [R, V], rows int64 [N] -> int64 [N]: per listed row, the first index of its
//                        largest allowed logit, -1 where it allows nothing (greedy rows: no copy of the logits)
// xgrammar's own CPU kernel tests bit by bit (35 ms for 256 rows of 49,152 here); these keep a word in a
// register, select 16 lanes at a time and split the rows over the threads.
//
// Compiled inside ops.cpp's extension without its fast-math: -inf must stay -inf and comparisons exact.
#include "torch_bind.h"
#include <omp.h>
#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace bitmask_detail {

inline void check(const at::Tensor& x, const at::Tensor& mask) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "bitmask kernels: contiguous logits [R, V]");
  TORCH_CHECK(mask.dtype() == at::kInt && mask.dim() == 2 && mask.is_contiguous() && mask.size(0) == x.size(0) &&
              mask.size(1) * 32 >= x.size(1), "bitmask kernels: contiguous int32 bitmask [R, >= V / 32]");
}

template <typename T>
void argmax_impl(const T* x, const int32_t* mask, const int64_t* rows, int64_t* out, int64_t n, int64_t v,
                 int64_t words) {
#pragma omp parallel for schedule(static) if (n > 8)
  for (int64_t k = 0; k < n; ++k) {
    const int64_t r = rows[k];
    const T* row = x + r * v;
    const uint32_t* m = reinterpret_cast<const uint32_t*>(mask + r * words);
    float best = -INFINITY;
    int64_t at = -1;
    for (int64_t w = 0; w * 32 < v; ++w) {
      uint32_t bits = m[w];
      while (bits) {  // only the allowed tokens are read: a JSON state allows a few dozen of 49k
        const int b = __builtin_ctz(bits);
        bits &= bits - 1;
        const int64_t j = w * 32 + b;
        if (j >= v) break;
        const float val = ld(row, j);
        if (val > best || at < 0) { best = val; at = j; }
      }
    }
    out[k] = at;
  }
}

}  // namespace bitmask_detail

at::Tensor masked_argmax_rows(at::Tensor x, at::Tensor mask, at::Tensor rows) {
  bitmask_detail::check(x, mask);
  TORCH_CHECK(rows.dtype() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "masked_argmax_rows: int64 rows");
  const int64_t n = rows.size(0), v = x.size(1), words = mask.size(1);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) TORCH_CHECK(r[k] >= 0 && r[k] < x.size(0), "masked_argmax_rows: row out of range");
  auto out = at::empty({n}, at::kLong);
  if (x.dtype() == at::kFloat) {
    bitmask_detail::argmax_impl<float>(x.data_ptr<float>(), mask.data_ptr<int32_t>(), r, out.data_ptr<int64_t>(), n, v,
                                       words);
  } else {
    TORCH_CHECK(x.dtype() == at::kBFloat16, "masked_argmax_rows: fp32 or bf16 logits");
    bitmask_detail::argmax_impl<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), mask.data_ptr<int32_t>(), r,
                                          out.data_ptr<int64_t>(), n, v, words);
  }
  return out;
}

void apply_bitmask_(at::Tensor x, at::Tensor mask) {
  bitmask_detail::check(x, mask);
  TORCH_CHECK(x.dtype() == at::kFloat, "apply_bitmask_: fp32 logits");
  const int64_t rows = x.size(0), v = x.size(1), words = mask.size(1);
  float* p = x.data_ptr<float>();
  const uint32_t* mk = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
#pragma omp parallel for schedule(static) if (rows * v > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = p + r * v;
    const uint32_t* m = mk + r * words;
    const int64_t full = v / 32;
    for (int64_t w = 0; w < full; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      float* q = row + w * 32;
#ifdef __AVX512F__
      const __m512 ninf = _mm512_set1_ps(-INFINITY);
      _mm512_storeu_ps(q, _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(bits & 0xFFFF), _mm512_loadu_ps(q)));
      _mm512_storeu_ps(q + 16, _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(bits >> 16), _mm512_loadu_ps(q + 16)));
#else
      for (int b = 0; b < 32; ++b) {
        if (!((bits >> b) & 1u)) q[b] = -INFINITY;
      }
#endif
    }
    for (int64_t j = full * 32; j < v; ++j) {
      if (!((m[j / 32] >> (j % 32)) & 1u)) row[j] = -INFINITY;
    }
  }
}

#pragma GCC pop_options
