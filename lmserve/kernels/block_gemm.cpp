// Matrix multiply with weights kept in GGUF-style blocks of 32 (4-bit or 8-bit codes with a
// float32 scale and zero per block): C (M, N) = A (M, K) @ W (N, K)^T, A in bf16.
//
// Each block of 32 weights is expanded in registers to bf16 (w = code * scale + zero, one
// rounding) and multiplied with AVX-512 BF16 dot products (vdpbf16ps) into 16 float32 lanes,
// then summed once at the end. Memory traffic is the packed codes (0.5 or 1 byte a weight), which
// is what decode is bound by; prefill reuses each expanded block across up to 8 rows of A.
//
// Every output element C[m, n] is accumulated over the K blocks in the same order and reduced
// the same way whatever M is and whichever tile shape computes it, so a token's row is
// bit-identical alone or in a batch of any size (greedy output must not depend on batch company).
//
// Layouts: codes (N, K/32, 16) uint8 for 4-bit (byte i: low nibble = weight i, high = weight
// i+16, as GGUF Q4_0/Q4_1 store them) or (N, K/32, 32) int8 for 8-bit (as GGUF Q8_0);
// scale and zero (N, K/32) float32 (zero may be null: no offset).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

namespace {

template <int BITS>
inline __m512bh expand(const uint8_t* codes, float scale, float zero) {
  const __m512 s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero);
  if constexpr (BITS == 4) {
    // The 16 possible weights of the block, rounded to bf16 once, then looked up per code.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(iota, s, z)));
    const __m128i b = _mm_loadu_si128((const __m128i*)codes);
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m256i idx8 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), nib), _mm_and_si128(b, nib));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx8), table);
  } else {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)codes)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s, z), _mm512_fmadd_ps(lo, s, z));
  }
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

struct Args {
  const uint16_t* a;
  const uint8_t* codes;
  const float* scale;
  const float* zero;
  void* c;
  bool out_bf16;
  int M, N, K;
};

// C[m0 : m0+MR, n0 : n0+NR]
template <int BITS, int MR, int NR>
void tile(const Args& p, int m0, int n0) {
  constexpr int BYTES = BITS * 4;  // bytes of codes per block of 32
  const int G = p.K / 32;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  const uint8_t* codes = p.codes + (int64_t)n0 * G * BYTES;
  const float* scale = p.scale + (int64_t)n0 * G;
  const float* zero = p.zero ? p.zero + (int64_t)n0 * G : nullptr;
  const uint16_t* a = p.a + (int64_t)m0 * p.K;
  for (int g = 0; g < G; ++g) {
    __m512bh w[NR];
    for (int r = 0; r < NR; ++r)
      w[r] = expand<BITS>(codes + ((int64_t)r * G + g) * BYTES, scale[r * G + g],
                          zero ? zero[r * G + g] : 0.f);
    for (int i = 0; i < MR; ++i) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(a + (int64_t)i * p.K + g * 32);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], x, w[r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) {
      const float v = _mm512_reduce_add_ps(acc[i][r]);
      const int64_t at = (int64_t)(m0 + i) * p.N + n0 + r;
      if (p.out_bf16)
        ((uint16_t*)p.c)[at] = f32_to_bf16(v);
      else
        ((float*)p.c)[at] = v;
    }
}

constexpr int kMR = 8;  // rows of A sharing one expansion of a weight block

constexpr int kMC = 64;  // rows of A kept in cache while every weight strip passes over them

// Rows [m0, m_end) of the NR columns starting at n0.
template <int BITS, int NR>
void strip(const Args& p, int m0, int m_end, int n0) {
  for (; m0 + kMR <= m_end; m0 += kMR) tile<BITS, kMR, NR>(p, m0, n0);
  switch (m_end - m0) {
    case 7: tile<BITS, 7, NR>(p, m0, n0); break;
    case 6: tile<BITS, 6, NR>(p, m0, n0); break;
    case 5: tile<BITS, 5, NR>(p, m0, n0); break;
    case 4: tile<BITS, 4, NR>(p, m0, n0); break;
    case 3: tile<BITS, 3, NR>(p, m0, n0); break;
    case 2: tile<BITS, 2, NR>(p, m0, n0); break;
    case 1: tile<BITS, 1, NR>(p, m0, n0); break;
    default: break;
  }
}

// NR weight rows are expanded together: more independent work per block when few rows of A
// share it (decode), fewer accumulators when many do. NR never changes the arithmetic of an
// output element, so choosing it by M keeps rows batch-invariant.
template <int BITS, int kNR>
void gemm_nr(const Args& p) {
  const int strips = (p.N + kNR - 1) / kNR;
  const int chunks = (p.M + kMC - 1) / kMC;
#pragma omp parallel for collapse(2) schedule(static)
  for (int c = 0; c < chunks; ++c)
    for (int s = 0; s < strips; ++s) {
      const int n0 = s * kNR, m0 = c * kMC, m_end = std::min(p.M, m0 + kMC);
      if (n0 + kNR <= p.N)
        strip<BITS, kNR>(p, m0, m_end, n0);
      else
        for (int n = n0; n < p.N; ++n) strip<BITS, 1>(p, m0, m_end, n);
    }
}

template <int BITS>
void gemm(const Args& p) {
  if (p.M <= 4)
    gemm_nr<BITS, 4>(p);
  else
    gemm_nr<BITS, 2>(p);
}

}  // namespace

extern "C" {

// bits: 4 or 8. K must be a multiple of 32.
void lm_block_gemm(const uint16_t* a, const uint8_t* codes, const float* scale, const float* zero,
                   void* c, int out_bf16, int M, int N, int K, int bits, int threads) {
  omp_set_num_threads(threads);
  const Args p{a, codes, scale, zero, c, out_bf16 != 0, M, N, K};
  if (bits == 4)
    gemm<4>(p);
  else
    gemm<8>(p);
}
}
