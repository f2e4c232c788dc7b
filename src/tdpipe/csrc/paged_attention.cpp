// CPU attention over tdpipe's block-paged KV cache.
//
// Cache layout, per layer: cache[num_blocks, num_kv_heads, block_size, row] (bf16 or fp32 with row =
// head_dim, contiguous), so the keys of one (block, kv head) pair are block_size * row contiguous elements.
// An int8 cache (tdpipe/model/kv_quant.py) has row = head_dim padded to 4 bytes + 4: the int8 values, then
// the row's float32 scale s (x ~= s * q). A key's scale multiplies its row as it is converted to fp32; a
// value's multiplies its softmax weight in the P.V pass.
//
// paged_attention splits the batch into work items (sequence, kv head, tile of query rows). An item
// holds every query head of its GQA group and, for prefill chunks, several query positions, so each
// K/V row is streamed from memory once per item. Keys are consumed in tiles of kTokTile tokens with an
// online softmax (running max / sum per query row); everything is accumulated in fp32. Software
// prefetch keeps the next tiles' K/V in flight while the current one is computed.
//
// Sliding window W (0: none): query position p sees keys p-W+1 .. p (transformers' meaning). An item's
// key loop starts at its first query's window start, so blocks wholly before it are neither read nor
// looked up in the block table (the cache manager frees them; their entries may hold stale ids); rows
// of a prefill item whose windows start later mask the keys before theirs.
//
// Soft-capping c (0: none; Gemma 2): each score s becomes c * tanh(s / c) before the mask and softmax.
//
// Vector layout trick: a "chunk" is 32 head_dim elements held in two 16-lane fp32 vectors. For bf16 the
// two vectors are the even and the odd elements (one AND + one shift per 64-byte load, no shuffles),
// so q and the output accumulator are kept in that same permuted order and un-permuted at the end.

#include "torch_bind.h"
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(TDPIPE_NO_AVX512)
#define TDPIPE_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && !defined(TDPIPE_NO_AVX2)
#define TDPIPE_AVX2 1
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

constexpr int kLanes = 16;
constexpr int kChunk = 32;         // head_dim elements per chunk (two vectors)
// Tunables (overridable with -D for experiments).
#ifndef TDPIPE_TOK_TILE
#define TDPIPE_TOK_TILE 32
#endif
constexpr int kTokTile = TDPIPE_TOK_TILE;  // keys per online-softmax step; multiple of kLanes
constexpr int kMaxChunks = 8;      // head_dim <= 256
constexpr int kRowGroup = 8;       // max query rows sharing one pass over V (accumulators in registers)
constexpr int kRowsPerItem = 16;   // target query rows per work item for prefill chunks
#ifndef TDPIPE_PF_TILES
#define TDPIPE_PF_TILES 2
#endif
#ifndef TDPIPE_PF_HINT
#define TDPIPE_PF_HINT _MM_HINT_T1
#endif
constexpr int kPrefetchTiles = TDPIPE_PF_TILES;  // software prefetch distance, in key tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegBig = -1e30f;  // finite initial running max: keeps m_old - m_new free of NaN
// 2^f for f in [-0.5, 0.5]: degree-7 polynomial (~1e-9 rel. error), highest coefficient first (Horner);
// every vector path's vexp2 evaluates it
constexpr float kExp2Poly[] = {1.525273380405984e-05f, 1.5403530393381608e-04f, 1.3333558146428443e-03f,
                               9.618129107628477e-03f, 5.550410866482158e-02f,  2.402265069591007e-01f,
                               6.931471805599453e-01f, 1.0f};

// ---------------------------------------------------------------------------------------------
// Minimal SIMD layer: AVX-512 when available, otherwise plain loops over 16 floats.
// ---------------------------------------------------------------------------------------------
inline int round_up(int x, int m) { return (x + m - 1) / m * m; }
inline int cdiv(int x, int m) { return (x + m - 1) / m; }

#ifdef TDPIPE_AVX512
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
inline float vhadd(vf a) { return _mm512_reduce_add_ps(a); }
inline __mmask16 mask16(int n) {
  return n >= 16 ? (__mmask16)0xFFFF : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1));
}
inline __mmask32 mask32(int n) {
  return n >= 32 ? (__mmask32)0xFFFFFFFFu : (n <= 0 ? (__mmask32)0 : (__mmask32)((1u << n) - 1));
}
// Lanes outside [lo, n) become -inf (sliding-window start, causal limit, tail). lo <= 0 without a window.
inline vf vkeep_range(vf a, int lo, int n) {
  return _mm512_mask_blend_ps(_kandn_mask16(mask16(lo), mask16(n)), vset1(-INFINITY), a);
}

// 2^x for x <= 0: round-to-nearest split, kExp2Poly on the fraction, scalef for the exponent. Clamping
// at -200 maps -inf and NaN (max_ps returns its 2nd operand on NaN)
// to an argument whose result underflows to exactly 0.
inline vf vexp2(vf x) {
  x = _mm512_max_ps(x, vset1(-200.0f));
  const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = vsub(x, n);
  vf p = vset1(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = vfma(p, f, vset1(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// Transposing reduction: lane u of the result = horizontal sum of a[u]. ~45 ops for 16 vectors
// instead of 16 separate horizontal reductions.
inline vf vhsum16(const vf* a) {
  vf s[8];
  for (int i = 0; i < 8; ++i)
    s[i] = vadd(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  vf w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = vadd(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  vf y[2];
  for (int i = 0; i < 2; ++i)
    y[i] = vadd(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return vadd(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Load n (1..32) elements of a chunk as two fp32 vectors, zero filled past n.
inline void load_chunk(const float* p, int n, vf& lo, vf& hi) {
  if (n >= kChunk) {
    lo = _mm512_loadu_ps(p);
    hi = _mm512_loadu_ps(p + 16);
  } else {
    lo = _mm512_maskz_loadu_ps(mask16(n), p);
    hi = _mm512_maskz_loadu_ps(mask16(n - 16), p + 16);
  }
}
// bf16 -> fp32 is a 16-bit shift: low halves of each 32-bit lane (even elements) are shifted up,
// high halves (odd elements) are already in place once the low bits are masked off.
inline void load_chunk(const bf16* p, int n, vf& lo, vf& hi) {
  const __m512i raw = n >= kChunk ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask32(n), p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000u)));
}
// int8 -> fp32 in natural order (lo: elements 0-15, hi: 16-31); the row's scale is applied by the caller.
inline void load_chunk(const int8_t* p, int n, vf& lo, vf& hi) {
  const __m256i raw = n >= kChunk ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                  : _mm256_maskz_loadu_epi8(mask32(n), p);
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), TDPIPE_PF_HINT); }
constexpr const char* kIsa = "avx512";

#elif defined(TDPIPE_AVX2)
// AVX2 + FMA (AMD Zen 1-3, Intel before Skylake-SP): the 16-lane vector as two 8-lane halves, the same
// algorithm and the same polynomial as the AVX-512 path; masks are lane-index compares.
struct vf {
  __m256 a, b;  // lanes 0-7, 8-15
};
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
inline vf vfma(vf x, vf y, vf z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline vf vmul(vf x, vf y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline vf vadd(vf x, vf y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline vf vsub(vf x, vf y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
inline vf vmax(vf x, vf y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
inline vf vdiv(vf x, vf y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float hadd8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vhmax(vf x) { return hmax8(_mm256_max_ps(x.a, x.b)); }
inline float vhadd(vf x) { return hadd8(_mm256_add_ps(x.a, x.b)); }
// Lanes outside [lo, n) become -inf.
inline vf vkeep_range(vf x, int lo, int n) {
  const __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
  const __m256i vlo = _mm256_set1_epi32(lo - 1), vn = _mm256_set1_epi32(n);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  auto keep = [&](__m256 v, __m256i idx) {  // lo - 1 < idx < n
    const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, vlo), _mm256_cmpgt_epi32(vn, idx));
    return _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(in));
  };
  return {keep(x.a, i0), keep(x.b, i1)};
}
// 2^x for x <= 0: the AVX-512 path's split and polynomial; 2^n built in the exponent field, and 0 where
// n < -126 (so -inf, NaN and anything below -126 give exactly 0, as scalef's underflow does there).
inline __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-200.0f));  // NaN -> -200 (max returns its 2nd operand on NaN)
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
  const __m256 normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(ni, _mm256_set1_epi32(-127)));
  return _mm256_and_ps(_mm256_mul_ps(p, two_n), normal);
}
inline vf vexp2(vf x) { return {exp2_8(x.a), exp2_8(x.b)}; }
// lane u of the result = horizontal sum of a[u]: the halves added, then 8 vectors transposed and summed
inline __m256 hsum8x8(const __m256* s) {
  const __m256 t0 = _mm256_hadd_ps(s[0], s[1]), t1 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 t2 = _mm256_hadd_ps(s[4], s[5]), t3 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per-128-bit-half partial sums
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline vf vhsum16(const vf* a) {
  __m256 s[16];
  for (int u = 0; u < 16; ++u) s[u] = _mm256_add_ps(a[u].a, a[u].b);
  return {hsum8x8(s), hsum8x8(s + 8)};
}
// n (1..32) elements of a chunk as two vectors, zero filled past n (a short chunk goes through a buffer).
inline void load_chunk(const float* p, int n, vf& lo, vf& hi) {
  if (n < kChunk) {
    alignas(32) float buf[kChunk] = {0};
    std::memcpy(buf, p, sizeof(float) * std::max(n, 0));
    lo = vload(buf);
    hi = vload(buf + 16);
    return;
  }
  lo = vload(p);
  hi = vload(p + 16);
}
// bf16: even elements shifted up (lo), odd ones with the low half masked off (hi), as on AVX-512
inline void load_chunk(const bf16* p, int n, vf& lo, vf& hi) {
  alignas(32) uint16_t buf[kChunk];
  if (n < kChunk) {
    std::memset(buf, 0, sizeof(buf));
    std::memcpy(buf, p, sizeof(uint16_t) * std::max(n, 0));
    p = reinterpret_cast<const bf16*>(buf);
  }
  const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + 1);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  lo = {_mm256_castsi256_ps(_mm256_slli_epi32(r0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(r1, 16))};
  hi = {_mm256_castsi256_ps(_mm256_and_si256(r0, high)), _mm256_castsi256_ps(_mm256_and_si256(r1, high))};
}
// int8 -> fp32 in natural order (lo: elements 0-15, hi: 16-31); the row's scale is applied by the caller.
inline void load_chunk(const int8_t* p, int n, vf& lo, vf& hi) {
  alignas(32) int8_t buf[kChunk];
  if (n < kChunk) {
    std::memset(buf, 0, sizeof(buf));
    std::memcpy(buf, p, std::max(n, 0));
    p = buf;
  }
  auto eight = [](const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  };
  lo = {eight(p), eight(p + 8)};
  hi = {eight(p + 16), eight(p + 24)};
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), TDPIPE_PF_HINT); }
constexpr const char* kIsa = "avx2";

#else  // portable fallback, same algorithm on 16-float structs

struct vf {
  float x[kLanes];
};
inline vf vzero() { vf r; for (int i = 0; i < kLanes; ++i) r.x[i] = 0.f; return r; }
inline vf vset1(float a) { vf r; for (int i = 0; i < kLanes; ++i) r.x[i] = a; return r; }
inline vf vload(const float* p) { vf r; std::memcpy(r.x, p, sizeof(r.x)); return r; }
inline void vstore(float* p, vf a) { std::memcpy(p, a.x, sizeof(a.x)); }
#define TDPIPE_VBIN(name, expr)                                   \
  inline vf name(vf a, vf b) {                                    \
    vf r;                                                         \
    for (int i = 0; i < kLanes; ++i) r.x[i] = (expr);             \
    return r;                                                     \
  }
TDPIPE_VBIN(vmul, a.x[i] * b.x[i])
TDPIPE_VBIN(vadd, a.x[i] + b.x[i])
TDPIPE_VBIN(vsub, a.x[i] - b.x[i])
TDPIPE_VBIN(vmax, std::max(a.x[i], b.x[i]))
TDPIPE_VBIN(vdiv, a.x[i] / b.x[i])
#undef TDPIPE_VBIN
inline vf vfma(vf a, vf b, vf c) {
  vf r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = a.x[i] * b.x[i] + c.x[i];
  return r;
}
inline float vhmax(vf a) {
  float m = a.x[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, a.x[i]);
  return m;
}
inline float vhadd(vf a) { float s = 0.f; for (int i = 0; i < kLanes; ++i) s += a.x[i]; return s; }
inline vf vkeep_range(vf a, int lo, int n) {
  for (int i = 0; i < kLanes; ++i)
    if (i < lo || i >= n) a.x[i] = -INFINITY;
  return a;
}
inline vf vexp2(vf a) {
  for (int i = 0; i < kLanes; ++i) {
    const float x = a.x[i];
    a.x[i] = (x >= -200.0f) ? std::exp2(x) : 0.0f;  // also maps NaN / -inf to 0
  }
  return a;
}
inline vf vhsum16(const vf* a) { vf r; for (int u = 0; u < kLanes; ++u) r.x[u] = vhadd(a[u]); return r; }
inline void load_chunk(const float* p, int n, vf& lo, vf& hi) {
  for (int i = 0; i < kLanes; ++i) {
    lo.x[i] = i < n ? p[i] : 0.f;
    hi.x[i] = i + 16 < n ? p[i + 16] : 0.f;
  }
}
inline void load_chunk(const bf16* p, int n, vf& lo, vf& hi) {
  for (int i = 0; i < kLanes; ++i) {
    lo.x[i] = 2 * i < n ? static_cast<float>(p[2 * i]) : 0.f;
    hi.x[i] = 2 * i + 1 < n ? static_cast<float>(p[2 * i + 1]) : 0.f;
  }
}
inline void load_chunk(const int8_t* p, int n, vf& lo, vf& hi) {
  for (int i = 0; i < kLanes; ++i) {
    lo.x[i] = i < n ? float(p[i]) : 0.f;
    hi.x[i] = i + 16 < n ? float(p[i + 16]) : 0.f;
  }
}
inline void prefetch(const void* p) { __builtin_prefetch(p); }
constexpr const char* kIsa = "scalar";
#endif

// Software prefetch of a future key tile, trickled out a few lines at a time between compute steps:
// issuing a whole tile at once fills the miss buffers and stalls the core, which serialises memory
// traffic and math instead of overlapping them. K and V are separate streams of contiguous segments
// (the rows of one block are adjacent) advanced together, so DRAM sees both interleaved.
constexpr int kMaxPfSegs = 2 * kTokTile;
struct PfStream {
  const char* seg[kMaxPfSegs];
  int seg_bytes[kMaxPfSegs];
  int nseg = 0, cur = 0, left = 0;  // left: 128-byte steps in the current segment
  const char* p = nullptr;
  void add(const void* start, int bytes) {
    const char* s0 = static_cast<const char*>(start);
    if (nseg > 0 && seg[nseg - 1] + seg_bytes[nseg - 1] == s0) {
      seg_bytes[nseg - 1] += bytes;  // physically adjacent runs (e.g. consecutive blocks) merge
    } else if (nseg < kMaxPfSegs) {  // (a full queue just prefetches less; it is only a hint)
      seg[nseg] = s0;
      seg_bytes[nseg++] = bytes;
    }
  }
  void start() {
    cur = 0;
    left = nseg ? cdiv(seg_bytes[0], 128) : 0;
    p = nseg ? seg[0] : nullptr;
  }
  inline void step() {
    if (left > 0) {
      prefetch(p);
      prefetch(p + 64);
      p += 128;
      if (--left == 0 && ++cur < nseg) {
        p = seg[cur];
        left = cdiv(seg_bytes[cur], 128);
      }
    }
  }
};
struct PfQueue {
  PfStream k, v;
  void clear() { k.nseg = v.nseg = 0; }
  void start() { k.start(); v.start(); }
  inline void step() { k.step(); v.step(); }
  void drain() {
    while (k.left > 0 || v.left > 0) step();
  }
};

// Position of head_dim element e in the permuted (two vectors per chunk) fp32 layout used for q/acc.
template <typename T>
inline int chunk_pos(int e) {
  if constexpr (std::is_same_v<T, bf16>) {
    const int w = e & (kChunk - 1);
    return (e - w) + (w & 1) * kLanes + (w >> 1);
  } else {
    return e;
  }
}

// An int8 row's scale (after its values, padded to 4 bytes); 1 for float rows.
constexpr int kScaleBytes = 4;
inline int int8_row(int D) { return (D + kScaleBytes - 1) / kScaleBytes * kScaleBytes + kScaleBytes; }
template <typename T>
inline float row_scale(const T* row, int row_len) {
  if constexpr (std::is_same_v<T, int8_t>) {
    float s;
    std::memcpy(&s, row + row_len - kScaleBytes, sizeof(float));
    return s;
  } else {
    (void)row; (void)row_len;
    return 1.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels
// ---------------------------------------------------------------------------------------------

// scores[r][t] = q_r . k_t for the R rows and nt (<= kTokTile) keys of one tile, with lanes outside the
// row's keys [lo[r], lim[r]] set to -inf (lo: the sliding window's first key, 0 without a window). ks holds the tile's keys in fp32, rows padded with zeros to a
// multiple of 16; q is already scaled by softmax_scale * log2(e).
template <int NC>
void qk_tile(const float* qs, int Dp, int R, const float* ks, int nt, const int* lo, const int* lim, int t0,
             float* sc, PfQueue& pf) {
  for (int r = 0; r < R; ++r) {
    vf q[2 * NC];
    for (int c = 0; c < 2 * NC; ++c) q[c] = vload(qs + r * Dp + c * kLanes);
    for (int g0 = 0; g0 < nt; g0 += kLanes) {
      const float* kb = ks + g0 * Dp;
      vf a[kLanes];
      for (int u = 0; u < kLanes; ++u) {
        vf acc = vmul(q[0], vload(kb + u * Dp));
        for (int c = 1; c < 2 * NC; ++c) acc = vfma(q[c], vload(kb + u * Dp + c * kLanes), acc);
        a[u] = acc;
      }
      pf.step();
      const int nvalid = std::min(nt - g0, lim[r] - (t0 + g0) + 1);
      vstore(sc + r * kTokTile + g0, vkeep_range(vhsum16(a), lo[r] - (t0 + g0), nvalid));
    }
  }
}

using QkFn = void (*)(const float*, int, int, const float*, int, const int*, const int*, int, float*, PfQueue&);
constexpr QkFn kQkFns[kMaxChunks] = {qk_tile<1>, qk_tile<2>, qk_tile<3>, qk_tile<4>,
                                     qk_tile<5>, qk_tile<6>, qk_tile<7>, qk_tile<8>};

#if defined(TDPIPE_AVX512) && defined(__AVX512BF16__)
#define TDPIPE_BF16_DOT 1
// bf16 q and bf16 cache: vdpbf16ps multiplies bf16 pairs exactly and accumulates in fp32, so keys are
// used straight from the cache (no conversion, no scratch copy). q stays unscaled (scaling it would
// round it), the scale is applied to the 16 scores instead. krow has round_up(nt, 16) entries (the
// padding ones repeat a real row; their lanes are masked).
// ksc (int8 cache): the tile's key scales, round_up(nt, 16) of them; null for a float cache.
template <int NC>
void qk_tile_bf16(const uint16_t* qb, int Dp, int R, const bf16* const* krow, int nt, __mmask32 tail,
                  const int* lo, const int* lim, int t0, float scale, const float* ksc, float* sc, PfQueue& pf) {
  const vf vscale = vset1(scale);
  for (int r = 0; r < R; ++r) {
    __m512bh q[NC];
    for (int c = 0; c < NC; ++c) q[c] = (__m512bh)_mm512_loadu_si512(qb + r * Dp + c * kChunk);
    for (int g0 = 0; g0 < nt; g0 += kLanes) {
      vf a[kLanes];
      for (int u = 0; u < kLanes; ++u) {
        const bf16* k = krow[g0 + u];
        vf acc = vzero();
        for (int c = 0; c < NC - 1; ++c)
          acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(k + c * kChunk));
        const __m512i kt = _mm512_maskz_loadu_epi16(tail, k + (NC - 1) * kChunk);
        acc = _mm512_dpbf16_ps(acc, q[NC - 1], (__m512bh)kt);
        a[u] = acc;
      }
      pf.step();
      const int nvalid = std::min(nt - g0, lim[r] - (t0 + g0) + 1);
      const vf s = ksc ? vmul(vload(ksc + g0), vscale) : vscale;
      vstore(sc + r * kTokTile + g0, vkeep_range(vmul(vhsum16(a), s), lo[r] - (t0 + g0), nvalid));
    }
  }
}
using QkBf16Fn = void (*)(const uint16_t*, int, int, const bf16* const*, int, __mmask32, const int*,
                          const int*, int, float, const float*, float*, PfQueue&);

// An int8 cache's key tile as bf16 rows Dp apart (int8 values are exact in bf16, so q . k stays the bf16
// dot product of the float path; each row's scale goes to ksc and multiplies its score).
inline void int8_tile_to_bf16(const int8_t* const* krow, int nt, int ntp, int D, int Dp, int row, uint16_t* dst,
                              float* ksc, const bf16** out) {
  for (int i = 0; i < nt; ++i) {
    uint16_t* d = dst + size_t(i) * Dp;
    for (int c = 0; c < Dp / kChunk; ++c) {
      vf lo, hi;
      load_chunk(krow[i] + c * kChunk, std::min(kChunk, D - c * kChunk), lo, hi);
      _mm512_storeu_si512(d + c * kChunk, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    ksc[i] = row_scale(krow[i], row);
    out[i] = reinterpret_cast<const bf16*>(d);
  }
  for (int i = nt; i < ntp; ++i) {  // padding lanes: a real row, masked out of the scores
    ksc[i] = 0.f;
    out[i] = out[nt - 1];
  }
}
constexpr QkBf16Fn kQkBf16Fns[kMaxChunks] = {qk_tile_bf16<1>, qk_tile_bf16<2>, qk_tile_bf16<3>,
                                             qk_tile_bf16<4>, qk_tile_bf16<5>, qk_tile_bf16<6>,
                                             qk_tile_bf16<7>, qk_tile_bf16<8>};

constexpr bool kHaveDot = true;
#else
constexpr bool kHaveDot = false;
#endif

// acc[r] = acc[r] * corr[r] + sum_t p[r][t] * v_t for NR rows and NCB chunks at a time (NC % NCB == 0).
// Each V row is converted once and reused by all NR rows; with NCB == NC the rows are read front to
// back (sequential for the prefetchers), else NC / NCB strided passes. 2 * NR * NCB accumulators.
template <typename T, int NR, int NCB>
void pv_tile(const T* const* vrow, int nt, int D, int NC, const float* p, const float* corr, float* acc, int Dp,
             PfQueue& pf) {
  for (int c0 = 0; c0 < NC; c0 += NCB) {
    vf lo[NR][NCB], hi[NR][NCB];
    for (int r = 0; r < NR; ++r) {
      const vf cr = vset1(corr[r]);
      for (int cc = 0; cc < NCB; ++cc) {
        lo[r][cc] = vmul(vload(acc + r * Dp + (c0 + cc) * kChunk), cr);
        hi[r][cc] = vmul(vload(acc + r * Dp + (c0 + cc) * kChunk + kLanes), cr);
      }
    }
    for (int i = 0; i < nt; ++i) {
      vf vl[NCB], vh[NCB];
      for (int cc = 0; cc < NCB; ++cc) {
        load_chunk(vrow[i] + (c0 + cc) * kChunk, std::min(kChunk, D - (c0 + cc) * kChunk), vl[cc], vh[cc]);
        pf.step();
      }
      for (int r = 0; r < NR; ++r) {
        const vf pb = vset1(p[r * kTokTile + i]);
        for (int cc = 0; cc < NCB; ++cc) {
          lo[r][cc] = vfma(pb, vl[cc], lo[r][cc]);
          hi[r][cc] = vfma(pb, vh[cc], hi[r][cc]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int cc = 0; cc < NCB; ++cc) {
        vstore(acc + r * Dp + (c0 + cc) * kChunk, lo[r][cc]);
        vstore(acc + r * Dp + (c0 + cc) * kChunk + kLanes, hi[r][cc]);
      }
  }
}

// p: the softmax weights, with an int8 cache already times each value row's scale.
template <typename T>
void pv_rows(const T* const* vrow, int nt, int D, int NC, const float* p, const float* corr, float* acc, int Dp,
             int R, PfQueue& pf) {
  for (int r0 = 0; r0 < R;) {
    // Widest chunk block whose accumulators fit in registers (<= 24 of 32).
    const int nr = std::min(kRowGroup, R - r0);
    const int ncb = (NC % 4 == 0 && nr <= 3) ? 4 : (NC % 2 == 0 && nr <= 6) ? 2 : 1;
    const float* pp = p + r0 * kTokTile;
    const float* cc = corr + r0;
    float* aa = acc + size_t(r0) * Dp;
#define TDPIPE_PV(NR, NCB) pv_tile<T, NR, NCB>(vrow, nt, D, NC, pp, cc, aa, Dp, pf)
    if (ncb == 4) {
      switch (nr) {
        case 1: TDPIPE_PV(1, 4); break;
        case 2: TDPIPE_PV(2, 4); break;
        default: TDPIPE_PV(3, 4); break;
      }
    } else if (ncb == 2) {
      switch (nr) {
        case 1: TDPIPE_PV(1, 2); break;
        case 2: TDPIPE_PV(2, 2); break;
        case 3: TDPIPE_PV(3, 2); break;
        case 4: TDPIPE_PV(4, 2); break;
        case 5: TDPIPE_PV(5, 2); break;
        default: TDPIPE_PV(6, 2); break;
      }
    } else {
      switch (nr) {
        case 1: TDPIPE_PV(1, 1); break;
        case 2: TDPIPE_PV(2, 1); break;
        case 3: TDPIPE_PV(3, 1); break;
        case 4: TDPIPE_PV(4, 1); break;
        case 5: TDPIPE_PV(5, 1); break;
        case 6: TDPIPE_PV(6, 1); break;
        case 7: TDPIPE_PV(7, 1); break;
        default: TDPIPE_PV(8, 1); break;
      }
    }
#undef TDPIPE_PV
    r0 += nr;
  }
}

// ---------------------------------------------------------------------------------------------
// Work items
// ---------------------------------------------------------------------------------------------

// A work item: query positions j0 .. j0 + nq - 1 of sequence s, all G query heads of kv head kvh.
// Row r = jj * G + g of the item is (query position j0 + jj, query head kvh * G + g).
struct Item {
  int s, kvh, j0, nq;
  int64_t cost;
};

template <typename T>
struct Args {
  const T* kc;
  const T* vc;
  int64_t block_stride, head_stride;  // elements
  int row;                            // elements per cache row: D, or int8_row(D) for an int8 cache
  int bs, D, Dp, NC, G, Hq;
  const int32_t* bt;
  int64_t bt_stride;
  const int32_t* cu;
  const int32_t* lens;
  const char* q;
  at::ScalarType qdt;
  int64_t qs0, qs1;  // bytes
  char* out;         // contiguous [T, Hq, D] of dtype qdt
  float qscale;      // softmax scale * log2(e)
  int window;        // sliding window W (query p sees keys p-W+1 .. p); 0: none
  float cap2;        // soft-cap c * log2(e) on the base-2 scores (Gemma 2's attn_logit_softcapping); 0: none
};

// Soft-capping (Gemma 2): a score s becomes c * tanh(s / c) before the softmax. The scores here are
// already base 2 (times log2(e)), so the cap is C = c * log2(e) on them. With u = s / C and
// e = exp(-2|u|) (vexp2 takes arguments <= 0): tanh(u) = u * (1 - e) / ((1 + e) |u|), so C tanh(u) =
// s * (1 - e) / ((1 + e) (|u| + tiny)), which is 0 at s = 0. Masked lanes (-inf) are clamped for the
// arithmetic and added back as (s - clamped): -inf stays -inf, finite lanes add 0.
inline void softcap_rows(float* sc, int R, int ntp, float cap2) {
  const vf inv = vset1(1.0f / cap2), m2log2e = vset1(-2.0f * kLog2e), one = vset1(1.0f);
  const vf floor = vset1(-1e30f), tiny = vset1(1e-30f);
  for (int r = 0; r < R; ++r) {
    float* sr = sc + r * kTokTile;
    for (int g = 0; g < ntp; g += kLanes) {
      const vf s = vload(sr + g);
      const vf x = vmax(s, floor);
      const vf u = vmul(x, inv);
      const vf au = vmax(u, vsub(vzero(), u));
      const vf e = vexp2(vmul(au, m2log2e));
      const vf t = vdiv(vsub(one, e), vmul(vadd(one, e), vadd(au, tiny)));
      vstore(sr + g, vadd(vmul(x, t), vsub(s, x)));
    }
  }
}

template <typename Q>
inline void load_q_row(const Q* src, int D, float scale, float* dst, int (*pos)(int)) {
  for (int e = 0; e < D; ++e) dst[pos(e)] = static_cast<float>(src[e]) * scale;
}
template <typename Q>
inline void store_out_row(const float* acc, int D, float inv_l, Q* dst, int (*pos)(int)) {
  for (int e = 0; e < D; ++e) dst[e] = static_cast<Q>(acc[pos(e)] * inv_l);
}

// Per-thread scratch, sized for the largest item.
struct Scratch {
  float* buf = nullptr;
  float *qs, *acc, *m, *l, *corr, *ks, *sc;
  int *lim, *lo;
  Scratch(int Rmax, int Dp) {
    const size_t rq = size_t(Rmax) * Dp, rr = round_up(Rmax, 16);
    const size_t n = 2 * rq + 2 * rr + rr * kLanes + size_t(kTokTile) * Dp + size_t(Rmax) * kTokTile + 2 * rr;
    buf = static_cast<float*>(::operator new[](n * sizeof(float), std::align_val_t(64)));
    float* p = buf;
    qs = p; p += rq;
    acc = p; p += rq;
    m = p; p += rr;
    l = p; p += rr * kLanes;
    corr = p; p += rr;
    ks = p; p += size_t(kTokTile) * Dp;
    sc = p; p += size_t(Rmax) * kTokTile;
    lim = reinterpret_cast<int*>(p);
    lo = lim + rr;
  }
  ~Scratch() { ::operator delete[](buf, std::align_val_t(64)); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

inline int item_kv_end(const int32_t* cu, const int32_t* lens, const Item& it) {
  return lens[it.s] - (cu[it.s + 1] - cu[it.s]) + it.j0 + it.nq;
}
// The first key any row of the item sees: its first query's window start (0 without a window). Blocks
// wholly before it are never read, nor their block table entries (freed blocks may hold stale ids).
inline int item_kv_start(const int32_t* cu, const int32_t* lens, int window, const Item& it) {
  return window > 0 ? std::max(0, lens[it.s] - (cu[it.s + 1] - cu[it.s]) + it.j0 - window + 1) : 0;
}

// Queue the K and V runs (one per block touched) of the key tile starting at t0 of an item.
template <typename T>
void queue_item_tile(const Args<T>& a, const Item& it, int t0, PfQueue& pf) {
  if (kPrefetchTiles <= 0) return;
  const int t1 = std::min(t0 + kTokTile, item_kv_end(a.cu, a.lens, it));
  const int32_t* bt = a.bt + int64_t(it.s) * a.bt_stride;
  const T* kbase = a.kc + int64_t(it.kvh) * a.head_stride;
  const T* vbase = a.vc + int64_t(it.kvh) * a.head_stride;
  const int row_bytes = a.row * int(sizeof(T));
  for (int t = t0; t < t1;) {
    const int b = t / a.bs, o = t - b * a.bs, n = std::min(a.bs - o, t1 - t);
    const int64_t off = int64_t(bt[b]) * a.block_stride + int64_t(o) * a.row;
    pf.k.add(kbase + off, n * row_bytes);
    pf.v.add(vbase + off, n * row_bytes);
    t += n;
  }
}

// One work item (see Item). kDot: bf16 q and cache with vdpbf16ps (keys read straight from the cache).
// next: the item this thread runs afterwards (or null), first: no earlier item prefetched this one.
template <typename T, bool kDot>
void run_item(const Args<T>& a, const Item& it, const Item* next, bool first, Scratch& w) {
  const int D = a.D, Dp = a.Dp, NC = a.NC, G = a.G, bs = a.bs;
  const int R = it.nq * G;
  const int n_s = a.cu[it.s + 1] - a.cu[it.s];
  const int first_pos = a.lens[it.s] - n_s + it.j0;  // absolute position of the item's first query
  const int kv_end = first_pos + it.nq;               // keys [kv_start, kv_end) are visible to some row
  const int kv_start = item_kv_start(a.cu, a.lens, a.window, it);
  auto pos = &chunk_pos<T>;

  std::fill(w.qs, w.qs + size_t(R) * Dp, 0.f);
  std::fill(w.acc, w.acc + size_t(R) * Dp, 0.f);
  uint16_t* qb = reinterpret_cast<uint16_t*>(w.qs);  // kDot: raw bf16 rows, Dp apart
  for (int jj = 0; jj < it.nq; ++jj) {
    const int64_t qrow = a.cu[it.s] + it.j0 + jj;
    for (int g = 0; g < G; ++g) {
      const int r = jj * G + g;
      const char* src = a.q + qrow * a.qs0 + int64_t(it.kvh * G + g) * a.qs1;
      if constexpr (kDot) {
        std::memcpy(qb + size_t(r) * Dp, src, size_t(D) * sizeof(uint16_t));
      } else {
        float* dst = w.qs + size_t(r) * Dp;
        switch (a.qdt) {
          case at::kFloat: load_q_row(reinterpret_cast<const float*>(src), D, a.qscale, dst, pos); break;
          case at::kBFloat16: load_q_row(reinterpret_cast<const bf16*>(src), D, a.qscale, dst, pos); break;
          default: load_q_row(reinterpret_cast<const c10::Half*>(src), D, a.qscale, dst, pos); break;
        }
      }
      w.lim[r] = first_pos + jj;
      w.lo[r] = a.window > 0 ? first_pos + jj - a.window + 1 : 0;
      w.m[r] = kNegBig;
      std::fill(w.l + r * kLanes, w.l + (r + 1) * kLanes, 0.f);
    }
  }

  const int32_t* bt = a.bt + int64_t(it.s) * a.bt_stride;
  const T* kbase = a.kc + int64_t(it.kvh) * a.head_stride;
  const T* vbase = a.vc + int64_t(it.kvh) * a.head_stride;

  // Row pointers of the tile at t0; K and V rows share the in-block offset.
  auto fill_rows = [&](int t0, const T** kr, const T** vr) {
    const int nt = std::min(kTokTile, kv_end - t0);
    int b = t0 / bs, o = t0 - b * bs;
    int64_t base = int64_t(bt[b]) * a.block_stride;
    for (int i = 0; i < nt; ++i) {
      kr[i] = kbase + base + int64_t(o) * a.row;
      vr[i] = vbase + base + int64_t(o) * a.row;
      if (++o == bs && i + 1 < nt) {
        o = 0;
        base = int64_t(bt[++b]) * a.block_stride;
      }
    }
    return nt;
  };
  // Prefetch plan: tile j + kPrefetchTiles is queued while tile j is computed; past this item's last
  // tile it continues with the first tiles of the item this thread runs next, so the next item starts
  // warm. Only a thread's first item pays for an unhidden start.
  PfQueue pf;
  const int ntiles = cdiv(kv_end - kv_start, kTokTile);
  const int next_start = next ? item_kv_start(a.cu, a.lens, a.window, *next) : 0;
  auto queue_tile = [&](int j) {
    pf.clear();
    if (j < ntiles) queue_item_tile(a, it, kv_start + j * kTokTile, pf);
    else if (next) queue_item_tile(a, *next, next_start + (j - ntiles) * kTokTile, pf);
    pf.start();
  };
  if (first)
    for (int j = 0; j < kPrefetchTiles; ++j) {
      queue_tile(j);
      pf.drain();
    }

  const T* krow[kTokTile];
  const T* vrow[kTokTile];
  alignas(64) float vscale[kTokTile];  // int8 cache: the tile's value scales (0 past its keys)
  alignas(64) float kscale[kTokTile];  // int8 cache, dot path: the tile's key scales
  for (int t0 = kv_start; t0 < kv_end; t0 += kTokTile) {
    const int nt = fill_rows(t0, krow, vrow);
    const int ntp = round_up(nt, kLanes);
    for (int i = nt; i < ntp; ++i) krow[i] = krow[nt - 1];  // padding lanes: valid memory, masked
    if constexpr (std::is_same_v<T, int8_t>) {
      for (int i = 0; i < nt; ++i) vscale[i] = row_scale(vrow[i], a.row);
      for (int i = nt; i < ntp; ++i) vscale[i] = 0.f;
    }
    queue_tile((t0 - kv_start) / kTokTile + kPrefetchTiles);

    if constexpr (kDot) {
#ifdef TDPIPE_BF16_DOT
      if constexpr (std::is_same_v<T, int8_t>) {
        const bf16* k16[kTokTile];
        int8_tile_to_bf16(krow, nt, ntp, D, Dp, a.row, reinterpret_cast<uint16_t*>(w.ks), kscale, k16);
        kQkBf16Fns[NC - 1](qb, Dp, R, k16, nt, mask32(D - (NC - 1) * kChunk), w.lo, w.lim, t0, a.qscale,
                           kscale, w.sc, pf);
      } else {
        kQkBf16Fns[NC - 1](qb, Dp, R, reinterpret_cast<const bf16* const*>(krow), nt,
                           mask32(D - (NC - 1) * kChunk), w.lo, w.lim, t0, a.qscale, nullptr, w.sc, pf);
      }
#endif
    } else {
      // Keys of the tile -> fp32 scratch (converted once, reused by all R rows; int8 rows times their scale).
      for (int i = 0; i < nt; ++i) {
        const vf ksc = vset1(row_scale(krow[i], a.row));
        for (int c = 0; c < NC; ++c) {
          vf lo, hi;
          load_chunk(krow[i] + c * kChunk, std::min(kChunk, D - c * kChunk), lo, hi);
          if constexpr (std::is_same_v<T, int8_t>) {
            lo = vmul(lo, ksc);
            hi = vmul(hi, ksc);
          }
          vstore(w.ks + i * Dp + c * kChunk, lo);
          vstore(w.ks + i * Dp + c * kChunk + kLanes, hi);
        }
      }
      if (ntp != nt) std::fill(w.ks + size_t(nt) * Dp, w.ks + size_t(ntp) * Dp, 0.f);
      kQkFns[NC - 1](w.qs, Dp, R, w.ks, nt, w.lo, w.lim, t0, w.sc, pf);
    }

    if (a.cap2 > 0.f) softcap_rows(w.sc, R, ntp, a.cap2);

    // Online softmax (base 2; the scale and log2(e) are folded into the scores). The running sum is
    // kept as 16 lanes per row (no horizontal add per tile) and the rescale factor is only computed
    // when the running max actually moves.
    for (int r = 0; r < R; ++r) {
      float* sr = w.sc + r * kTokTile;
      vf mx = vload(sr);
      for (int g = kLanes; g < ntp; g += kLanes) mx = vmax(mx, vload(sr + g));
      const float m_old = w.m[r];
      const float m_new = std::max(m_old, vhmax(mx));
      const float corr = m_new > m_old ? std::exp2(m_old - m_new) : 1.0f;
      w.corr[r] = corr;
      w.m[r] = m_new;
      const vf mv = vset1(m_new);
      vf lsum = vload(w.l + r * kLanes);
      if (corr != 1.0f) lsum = vmul(lsum, vset1(corr));
      for (int g = 0; g < ntp; g += kLanes) {
        const vf e = vexp2(vsub(vload(sr + g), mv));
        lsum = vadd(lsum, e);
        // int8 cache: P.V reads the weight times the value row's scale (the sum above keeps the weight)
        vstore(sr + g, std::is_same_v<T, int8_t> ? vmul(e, vload(vscale + g)) : e);
      }
      vstore(w.l + r * kLanes, lsum);
    }

    pv_rows<T>(vrow, nt, D, NC, w.sc, w.corr, w.acc, Dp, R, pf);
    pf.drain();
  }

  // Normalise and write out (un-permuting the chunk layout).
  const size_t esz = c10::elementSize(a.qdt);
  for (int jj = 0; jj < it.nq; ++jj) {
    const int64_t qrow = a.cu[it.s] + it.j0 + jj;
    for (int g = 0; g < G; ++g) {
      const int r = jj * G + g;
      const float inv_l = 1.0f / vhadd(vload(w.l + r * kLanes));
      char* dst = a.out + ((qrow * a.Hq + it.kvh * G + g) * int64_t(D)) * esz;
      const float* src = w.acc + size_t(r) * Dp;
      switch (a.qdt) {
        case at::kFloat: store_out_row(src, D, inv_l, reinterpret_cast<float*>(dst), pos); break;
        case at::kBFloat16: store_out_row(src, D, inv_l, reinterpret_cast<bf16*>(dst), pos); break;
        default: store_out_row(src, D, inv_l, reinterpret_cast<c10::Half*>(dst), pos); break;
      }
    }
  }
}

void check_cache(const at::Tensor& kc, const at::Tensor& vc) {
  TORCH_CHECK(kc.device().is_cpu() && vc.device().is_cpu(), "KV cache must be on CPU");
  TORCH_CHECK(kc.dim() == 4, "cache must be [num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(kc.sizes() == vc.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16 || kc.scalar_type() == at::kChar,
              "cache dtype must be float32, bfloat16 or int8 (rows with their scales)");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "KV cache must be contiguous");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& seq_lens, double scale, int64_t sliding_window, double softcap) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX, "sliding_window must be >= 0 (0: none)");
  const int window = int(sliding_window);
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3, "q must be a CPU tensor [T, Hq, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                  q.scalar_type() == at::kHalf,
              "q dtype must be float32, bfloat16 or float16");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t nblocks = k_cache.size(0), Hkv = k_cache.size(1), bs = k_cache.size(2);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const int64_t row = int8_cache ? int8_row(int(D)) : D;
  TORCH_CHECK(k_cache.size(3) == row,
              int8_cache ? "an int8 cache row must be head_dim padded to 4 bytes + 4 (its scale)"
                         : "head_dim mismatch between q and cache");
  TORCH_CHECK(D >= 1 && D <= kChunk * kMaxChunks, "head_dim must be in [1, 256]");
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "num_q_heads must be a multiple of num_kv_heads");
  for (const at::Tensor* t : {&block_tables, &cu_seqlens_q, &seq_lens})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt && t->is_contiguous(),
                "block_tables / cu_seqlens_q / seq_lens must be contiguous int32 CPU tensors");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && cu_seqlens_q.dim() == 1, "bad index ranks");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(cu_seqlens_q.size(0) == S + 1 && block_tables.size(0) >= S, "index tensors disagree on S");

  at::Tensor out = at::empty({T, Hq, D}, q.options());
  if (T == 0 || S == 0) return out;

  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  const int G = int(Hq / Hkv);
  TORCH_CHECK(cu[0] == 0 && cu[S] == T, "cu_seqlens_q must start at 0 and end at T");

  // Validate everything the kernel will dereference, then build the work list.
  std::vector<Item> items;
  int Rmax = 1;
  for (int64_t s = 0; s < S; ++s) {
    const int n_s = cu[s + 1] - cu[s];
    TORCH_CHECK(n_s >= 0, "cu_seqlens_q must be non-decreasing");
    if (n_s == 0) continue;
    TORCH_CHECK(lens[s] >= n_s, "seq_lens[", s, "] = ", lens[s], " is shorter than its ", n_s, " queries");
    const int64_t used = (int64_t(lens[s]) + bs - 1) / bs;
    TORCH_CHECK(used <= max_blocks, "seq_lens[", s, "] exceeds its block table");
    // with a window, blocks wholly before the first query's window are never read (nor checked)
    const int64_t first = window > 0 ? std::max<int64_t>(0, int64_t(lens[s]) - n_s - window + 1) / bs : 0;
    for (int64_t b = first; b < used; ++b) {
      const int32_t id = bt[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < nblocks, "block id ", id, " out of range (sequence ", s, ")");
    }
    const int nq = std::min(n_s, std::max(1, kRowsPerItem / G));
    Rmax = std::max(Rmax, nq * G);
    for (int j0 = 0; j0 < n_s; j0 += nq) {
      const int cnt = std::min(nq, n_s - j0);
      const int64_t end = int64_t(lens[s]) - n_s + j0 + cnt;
      const int64_t keys = window > 0 ? std::min<int64_t>(end, window + cnt - 1) : end;
      for (int h = 0; h < Hkv; ++h) items.push_back({int(s), h, j0, cnt, keys * (cnt * G + 4)});
    }
  }
  // Longest first: with a dynamic schedule this keeps the last items short (less tail imbalance).
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

  const int Dp = round_up(int(D), kChunk);
  const int nthreads = int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size())));

  auto launch = [&](auto tag) {
    using T = decltype(tag);
    Args<T> a;
    a.kc = k_cache.data_ptr<T>();
    a.vc = v_cache.data_ptr<T>();
    a.block_stride = Hkv * bs * row;
    a.head_stride = bs * row;
    a.row = int(row);
    a.bs = int(bs); a.D = int(D); a.Dp = Dp; a.NC = Dp / kChunk; a.G = G; a.Hq = int(Hq);
    a.bt = bt; a.bt_stride = max_blocks; a.cu = cu; a.lens = lens;
    a.q = static_cast<const char*>(q.data_ptr());
    a.qdt = q.scalar_type();
    a.qs0 = q.stride(0) * q.element_size();
    a.qs1 = q.stride(1) * q.element_size();
    a.out = static_cast<char*>(out.data_ptr());
    a.qscale = float(scale) * kLog2e;
    a.window = window;
    a.cap2 = float(softcap) * kLog2e;
    const int64_t n = int64_t(items.size());
    // bf16 q: vdpbf16ps on the keys as stored (bf16) or converted to bf16 per tile (int8, exact)
    const bool dot = kHaveDot && !std::is_same_v<T, float> && a.qdt == at::kBFloat16;
    // Dynamic schedule with one item of lookahead: a thread claims its next item before running the
    // current one, so run_item can prefetch the next item's first tiles (omp for hides the next index).
    std::atomic<int64_t> counter{0};
#pragma omp parallel num_threads(nthreads)
    {
      Scratch w(Rmax, Dp);
      int64_t cur = counter.fetch_add(1);
      bool first = true;
      while (cur < n) {
        const int64_t nxt = counter.fetch_add(1);
        const Item* next = nxt < n ? &items[nxt] : nullptr;
#ifdef TDPIPE_BF16_DOT
        if constexpr (!std::is_same_v<T, float>) {
          if (dot) run_item<T, true>(a, items[cur], next, first, w);
        }
#endif
        if (!dot) run_item<T, false>(a, items[cur], next, first, w);
        cur = nxt;
        first = false;
      }
    }
  };
  if (k_cache.scalar_type() == at::kBFloat16) launch(bf16{});
  else if (int8_cache) launch(int8_t{});
  else launch(float{});
  return out;
}

// One row of D floats (or bf16) -> D int8 values round(x * 127 / max|x|), zero padding, float32 scale
// max|x| / 127 (tdpipe/model/kv_quant.py's quantize_rows; an all-zero row gets zeros and scale 0).
#ifdef TDPIPE_AVX512
inline vf load16(const float* p) { return _mm512_loadu_ps(p); }
inline vf load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif
template <typename S>
void quantize_row(const S* x, int D, int row, int8_t* dst) {
#ifdef TDPIPE_AVX512
  if (D % kLanes == 0 && D <= kChunk * kMaxChunks) {  // the same arithmetic, 16 lanes at a time
    vf xs[kChunk * kMaxChunks / kLanes];
    const int n = D / kLanes;
    vf m = vzero();
    for (int j = 0; j < n; ++j) {
      xs[j] = load16(x + j * kLanes);
      m = vmax(m, _mm512_abs_ps(xs[j]));
    }
    const float amax = vhmax(m);
    const vf inv = vset1(amax > 0.f ? 127.0f / amax : 0.f);
    for (int j = 0; j < n; ++j)  // cvtps rounds half to even, as nearbyint; |x * inv| <= 127
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * kLanes),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(vmul(xs[j], inv))));
    std::memset(dst + D, 0, size_t(row - kScaleBytes - D));
    const float scale = amax / 127.0f;
    std::memcpy(dst + row - kScaleBytes, &scale, sizeof(float));
    return;
  }
#endif
  float amax = 0.f;
  for (int e = 0; e < D; ++e) amax = std::max(amax, std::fabs(static_cast<float>(x[e])));
  const float inv = amax > 0.f ? 127.0f / amax : 0.f;
  for (int e = 0; e < D; ++e) {
    const float q = std::nearbyint(static_cast<float>(x[e]) * inv);
    dst[e] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memset(dst + D, 0, size_t(row - kScaleBytes - D));
  const float scale = amax / 127.0f;
  std::memcpy(dst + row - kScaleBytes, &scale, sizeof(float));
}

// A hint that the bytes [p, p + n) are about to be written: their lines fetched for ownership.
inline void prefetch_for_write(const char* p, size_t n) {
  for (size_t i = 0; i < n; i += 64) __builtin_prefetch(p + i, 1, 3);
}

// Calls write(t, h, r) for every token t with a slot (slot -1: padding, skipped) and kv head h, r being the
// index of the cache row [block, h, offset] it goes to: the scatter of store_kv, whatever a row holds (`row`
// bytes in each of the caches at kc and vc). The rows of the token kStoreAhead places later are fetched for
// writing first. Why: a decode step's rows land in lines no one has touched since the step before (one new
// position per sequence, 2 KB apart per head), so each store waits for its line to be fetched, and x86 commits
// stores in order: one thread scattering 256 tokens' K and V for SmolLM2 took ~220 us in a running engine
// (about 3% of a W8A8 decode step), one miss at a time. Fetching a few tokens ahead keeps several misses in
// flight.
constexpr int64_t kStoreAhead = 4;
template <typename F>
void for_each_slot_row(int64_t T, int64_t Hkv, int64_t bs, const int64_t* slots, int nthreads, const char* kc,
                       const char* vc, size_t row, F write) {
  auto cache_row = [&](int64_t slot, int64_t h) { return ((slot / bs) * Hkv + h) * bs + slot % bs; };
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    if (t + kStoreAhead < T && slots[t + kStoreAhead] >= 0) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t r = cache_row(slots[t + kStoreAhead], h);
        prefetch_for_write(kc + r * int64_t(row), row);
        prefetch_for_write(vc + r * int64_t(row), row);
      }
    }
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < Hkv; ++h) write(t, h, cache_row(slots[t], h));
  }
}

// store_kv into an int8 cache: every (token, kv head) row of k and v quantised on its own.
void store_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                   const int64_t* slots) {
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2), bs = k_cache.size(2);
  const int row = int8_row(int(D));
  TORCH_CHECK(k_cache.size(3) == row, "an int8 cache row must be head_dim padded to 4 bytes + 4 (its scale)");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "k / v for an int8 cache must both be float32 or bfloat16");
  int8_t* kc = k_cache.data_ptr<int8_t>();
  int8_t* vc = v_cache.data_ptr<int8_t>();
  const int nthreads = T * Hkv * D >= (1 << 14) ? at::get_num_threads() : 1;
  auto run = [&](auto tag) {
    using S = decltype(tag);
    const S* kp = static_cast<const S*>(k.data_ptr());
    const S* vp = static_cast<const S*>(v.data_ptr());
    const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
    for_each_slot_row(T, Hkv, bs, slots, nthreads, reinterpret_cast<const char*>(kc),
                      reinterpret_cast<const char*>(vc), size_t(row), [&](int64_t t, int64_t h, int64_t r) {
      quantize_row(kp + t * ks0 + h * ks1, int(D), row, kc + r * row);
      quantize_row(vp + t * vs0 + h * vs1, int(D), row, vc + r * row);
    });
  };
  if (k.scalar_type() == at::kBFloat16) run(bf16{});
  else run(float{});
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must both be [T, Hkv, D]");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "k / v must be on CPU");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8_cache || (k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type()),
              "k / v dtype must match the cache dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k / v last dimension must be contiguous");
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 CPU tensor");
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  TORCH_CHECK(slot_mapping.size(0) == T, "slot_mapping length must equal the token count");
  const int64_t nblocks = k_cache.size(0), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.size(1) == Hkv && (int8_cache || k_cache.size(3) == D), "k / v shape does not match the cache");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < nblocks * bs, "slot ", slots[t], " out of range");
  if (int8_cache) {
    store_kv_int8(k, v, k_cache, v_cache, slots);
    return;
  }

  const int64_t esz = k.element_size();
  const size_t row = size_t(D * esz);
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks0 = k.stride(0) * esz, ks1 = k.stride(1) * esz;
  const int64_t vs0 = v.stride(0) * esz, vs1 = v.stride(1) * esz;
  // Threads from a decode batch of ~64 sequences on (each thread's misses overlap the other's); fewer rows
  // are not worth a fork.
  const int nthreads = T * Hkv * D >= (1 << 14) ? at::get_num_threads() : 1;
  for_each_slot_row(T, Hkv, bs, slots, nthreads, kc, vc, row, [&](int64_t t, int64_t h, int64_t r) {
    std::memcpy(kc + r * int64_t(row), kp + t * ks0 + h * ks1, row);
    std::memcpy(vc + r * int64_t(row), vp + t * vs0 + h * vs1, row);
  });
}

std::string kernel_info() {
  std::string isa = kIsa;
#ifdef TDPIPE_BF16_DOT
  isa += "+bf16dot";
#endif
  return isa + ", " + std::to_string(at::get_num_threads()) + " threads";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_attention", &paged_attention, "Causal attention over a paged KV cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("cu_seqlens_q"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0,
        py::arg("softcap") = 0.0, py::call_guard<py::gil_scoped_release>());
  m.def("store_kv", &store_kv, "Scatter K/V rows into the paged cache", py::arg("k"), py::arg("v"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::call_guard<py::gil_scoped_release>());
  m.def("kernel_info", &kernel_info, "ISA path and thread count");
}
