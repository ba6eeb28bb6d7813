// Small AVX-512 helpers shared by lmserve's kernels: bf16 conversion, 16-lane loads, exp; and
// for_each_row, an OpenMP loop that may stay on the calling thread.
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

namespace lm {

// fn(i) for i in [0, n): split over the threads if `parallel`, else on the calling thread with no
// parallel region at all. Not `omp parallel for if (...)`: libgomp runs that as a one-thread
// region, after which the next region of two threads pays for waking the other again (a
// one-row int8 matmul after one took 20% longer: benchmarks/kernel_ab.py int8_gemm --rows 1).
template <typename Fn>
inline void for_each_row(int64_t n, bool parallel, Fn fn) {
  if (parallel) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) fn(i);
  } else {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
}

inline float bf16_to_f32(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

// 16 lanes of a row in bf16 or fp32 widened to fp32.
inline __m512 load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// The lanes of `lanes` only (the others zero, their memory not read).
inline __m512 load16_masked(const uint16_t* p, __mmask16 lanes) {
  __m256i h = _mm256_maskz_loadu_epi16(lanes, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16_masked(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }

// Asks for the cache line at p in L2. Inline assembly: GCC 12 at -O3 dropped the _mm_prefetch
// calls of paged_attention.cpp's attend_direct (none were left in the disassembly); a volatile
// asm statement stays.
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*(const char*)p)); }

// A float passed in a 64-bit argument word of a packed call (its bits in the low half).
inline float word_to_f32(int64_t w) {
  const uint32_t u = (uint32_t)w;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline float to_f32(uint16_t x) { return bf16_to_f32(x); }
inline float to_f32(float x) { return x; }
inline void store_elem(uint16_t* p, float f) { *p = f32_to_bf16(f); }
inline void store_elem(float* p, float f) { *p = f; }

// exp(x) for 16 lanes: Cody-Waite range reduction and a degree-6 polynomial (rel. error ~2e-7).
// Lanes at -inf give 0.
inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The sum of 16 lanes in one fixed order (halves, quarters, pairs: the order GCC's
// _mm512_reduce_add_ps uses), written out so reduce16x16 can match it bit for bit.
inline float reduce16(__m512 v) {
  const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

// reduce16 of 16 vectors at once (out[n] = reduce16(v[n]), same additions in the same order),
// by pairing vectors at each level of the tree instead of reducing each one alone.
inline __m512 reduce16x16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)  // lanes: v[2j] i and i+8 summed | v[2j+1] likewise
    t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit lane L: vector 4j+L, i and i+4 summed
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)  // i and i+2 summed
    w[j] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // z[4L + e] is the sum of v[4e + L]; put it at position 4e + L.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

}  // namespace lm
