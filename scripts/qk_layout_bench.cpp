// QK of decode attention on AVX-512 BF16, one thread: key-major rows with horizontal sums (the layout of
// tdpipe's CPU KV cache and csrc/paged_attention.cpp's qk_tile_bf16) against keys stored transposed per
// 16-key block (dim pairs x 16 keys: one dpbf16 per dim pair serves 16 keys, no horizontal sums), for a
// query group of R rows per KV head (GQA). A measurement for docs/quantization.md, not part of tdpipe.
//   g++ -O3 -march=native -o /tmp/qk_layout_bench scripts/qk_layout_bench.cpp && /tmp/qk_layout_bench
// (needs a CPU with AVX512_BF16)
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
using vf = __m512;
static inline vf vhsum16(const vf* a) {
  vf s[8];
  for (int i = 0; i < 8; ++i) s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2*i], a[2*i+1]), _mm512_unpackhi_ps(a[2*i], a[2*i+1]));
  vf w[4];
  for (int i = 0; i < 4; ++i) w[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2*i], s[2*i+1], _MM_SHUFFLE(1,0,1,0)), _mm512_shuffle_ps(s[2*i], s[2*i+1], _MM_SHUFFLE(3,2,3,2)));
  vf y[2];
  for (int i = 0; i < 2; ++i) y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2*i], w[2*i+1], _MM_SHUFFLE(2,0,2,0)), _mm512_shuffle_f32x4(w[2*i], w[2*i+1], _MM_SHUFFLE(3,1,3,1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2,0,2,0)), _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3,1,3,1)));
}
template <int D, int R>
void rows(const uint16_t* K, size_t nkeys, const uint16_t* q, float* out) {
  // as tdpipe's kernel: per group of 16 keys (in L1 after the first row), every query row of the group
  constexpr int NC = D / 32;
  __m512bh qv[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) qv[r][c] = (__m512bh)_mm512_loadu_si512(q + r * D + c * 32);
  for (size_t g = 0; g < nkeys; g += 16) {
    for (int r = 0; r < R; ++r) {
      vf a[16];
      for (int u = 0; u < 16; ++u) {
        const uint16_t* k = K + (g + u) * D;
        vf acc = _mm512_setzero_ps();
        for (int c = 0; c < NC; ++c) acc = _mm512_dpbf16_ps(acc, qv[r][c], (__m512bh)_mm512_loadu_si512(k + c * 32));
        a[u] = acc;
      }
      _mm512_storeu_ps(out + r * nkeys + g, vhsum16(a));
    }
  }
}
template <int D, int R>
void transposed(const uint32_t* KT, size_t nkeys, const uint16_t* q, float* out) {
  // KT: per 16-key block, D/2 rows of 16 u32 (a dim pair of 16 keys)
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);
  for (size_t g = 0; g < nkeys; g += 16) {
    const uint32_t* blk = KT + g * (D / 2);
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int j = 0; j < D / 2; ++j) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(blk + j * 16);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)q32[r * (D / 2) + j]), kv);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * nkeys + g, acc[r]);
  }
}
static uint16_t bf(float x) { uint32_t u; __builtin_memcpy(&u, &x, 4); return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); }
template <int D, int R>
void run(size_t nkeys, int reps) {
  std::vector<uint16_t> K(nkeys * D), q(R * D);
  std::vector<uint32_t> KT(nkeys * D / 2);
  srand(1);
  for (auto& x : K) x = bf((rand() / (float)RAND_MAX) - 0.5f);
  for (auto& x : q) x = bf((rand() / (float)RAND_MAX) - 0.5f);
  for (size_t g = 0; g < nkeys; g += 16)
    for (int j = 0; j < D / 2; ++j)
      for (int u = 0; u < 16; ++u)
        KT[g * (D / 2) + j * 16 + u] = K[(g + u) * D + 2 * j] | ((uint32_t)K[(g + u) * D + 2 * j + 1] << 16);
  std::vector<float> o1(R * nkeys), o2(R * nkeys);
  rows<D, R>(K.data(), nkeys, q.data(), o1.data());
  transposed<D, R>(KT.data(), nkeys, q.data(), o2.data());
  double maxd = 0;  // vhsum16's output order is a permutation within 16 lanes: compare sorted groups' sums
  for (size_t i = 0; i < o1.size(); i += 16) { double s1 = 0, s2 = 0; for (int u = 0; u < 16; ++u) { s1 += o1[i+u]; s2 += o2[i+u]; } maxd = std::max(maxd, std::abs(s1 - s2)); }
  auto t = [&](auto f) { double best = 1e30; for (int i = 0; i < reps; ++i) { auto a = std::chrono::steady_clock::now(); f(); auto b = std::chrono::steady_clock::now(); best = std::min(best, std::chrono::duration<double>(b - a).count()); } return best; };
  double ta = t([&] { rows<D, R>(K.data(), nkeys, q.data(), o1.data()); });
  double tb = t([&] { transposed<D, R>(KT.data(), nkeys, q.data(), o2.data()); });
  double mb = nkeys * D * 2 / 1e6;
  printf("D=%3d R=%d keys=%zu (%.0f MB of K): rows+hsum %.2f ms (%.1f GB/s), transposed %.2f ms (%.1f GB/s): %.2fx  [check %.2g]\n",
         D, R, nkeys, mb, ta * 1e3, mb / ta / 1e3, tb * 1e3, mb / tb / 1e3, ta / tb, maxd);
}
int main() {
  size_t n = 256 * 208;  // sequences x tokens of one KV head
  run<64, 3>(n, 20);   // SmolLM2: 9 q heads over 3 kv heads
  run<64, 7>(n, 20);   // Qwen2.5-0.5B: 14 over 2
  run<128, 4>(n, 20);  // Llama-3 8B shape: 32 over 8
  run<64, 1>(n, 20);
}
