// Matrix multiply of int8-quantized activations with weights in blocks of 32 (4-bit or 8-bit
// unsigned codes, w = code * scale + zero): C (M, N) = A (M, K) @ W (N, K)^T, with AVX-512 VNNI
// integer dot products (vpdpbusd: 64 multiply-adds an instruction, twice vdpbf16ps's 32).
//
// A is quantized per row and block of 32 as llama.cpp's Q8 does: a' = d * q, q in [-127, 127],
// d = max|a| / 127. With DIGITS = 2 the rounding error is quantized again in steps of d / 256,
// a' = d * q + d / 256 * q2: about 15 bits of each block at twice the dot products. A block's
// contribution to C[m, n] is then exactly (up to float32 rounding) that of the weights times a':
//     scale[n] * d[m] * (sum(code * q) [* 256 + sum(code * q2)] [/ 256])  +  zero[n] * sum(a')
// where the sums of products are exact integer arithmetic. Each vector lane is one output column (16 weight rows at a
// time), so no horizontal reduction is needed, and every C[m, n] adds its blocks in the same
// order with the same float operations whatever M is or which tile computes it: rows are
// batch-invariant.
//
// Weight layout, rows in groups of 16 (N padded to a multiple of 16):
//   codes  (N/16, K/32, V, 16, 4) bytes, V = 4 for 4-bit: vector v holds, for each of the 16
//          rows, block elements 4v..4v+3 in the low nibbles and 16+4v..16+4v+3 in the high ones
//          (GGUF's Q4 byte order, regrouped); V = 8 for 8-bit: elements 4v..4v+3 as bytes.
//   consts (N/16, K/32, 2, 16) the 16 rows' scales, then their zeros: float16 when every one of
//          them is a float16 value (GGUF stores them so; a sixth less to stream), else float32.
#include <omp.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace lm;

struct Args {
  const int8_t* q;        // (M, K) quantized activations
  const int8_t* q2;       // (M, K) their second digits, or null
  const float* a_scale;   // (M, K/32): d, or d / 256 with two digits
  const float* a_sum;     // (M, K/32): sum of each block's quantized values
  const uint8_t* codes;
  const void* consts;
  bool half_consts;       // consts are float16, not float32
  void* c;
  bool out_bf16;
  int M, N, K;
};

// Round to the nearest integer, ties to even, whatever the thread's MXCSR rounding mode says.
inline __m512i round_to_int(__m512 x) {
  return _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// 16 activations to int8 digits: q = round(x * inv) and, if q2, the remainder in 256ths of
// d = 1 / inv. Returns the stored digits' sum per lane, q * 256 + q2 with two digits.
inline __m512i quantize16(__m512 x, __m512 inv, __m512 d, int8_t* q, int8_t* q2) {
  const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
  __m512i qi = round_to_int(_mm512_mul_ps(x, inv));  // |x * inv| <= 127 by construction
  __m512i ri = _mm512_setzero_si512();
  if (q2) {
    const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qi), d, x);  // about [-d/2, d/2]
    ri = round_to_int(_mm512_mul_ps(_mm512_mul_ps(rest, inv), _mm512_set1_ps(256.0f)));
    // A remainder that rounds to +-128 carries into the first digit, so q2 fits in int8.
    const __mmask16 up = _mm512_cmpgt_epi32_mask(ri, hi), down = _mm512_cmplt_epi32_mask(ri, lo);
    qi = _mm512_mask_sub_epi32(_mm512_mask_add_epi32(qi, up, qi, _mm512_set1_epi32(1)), down, qi,
                               _mm512_set1_epi32(1));
    ri = _mm512_mask_add_epi32(_mm512_mask_sub_epi32(ri, up, ri, _mm512_set1_epi32(256)), down, ri,
                               _mm512_set1_epi32(256));
    ri = _mm512_max_epi32(_mm512_min_epi32(ri, hi), lo);
    _mm_storeu_si128((__m128i*)q2, _mm512_cvtepi32_epi8(ri));
  }
  qi = _mm512_max_epi32(_mm512_min_epi32(qi, hi), lo);  // sums are of the stored digits
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(qi));
  return q2 ? _mm512_add_epi32(_mm512_slli_epi32(qi, 8), ri) : qi;
}

// Quantize rows of A per block of 32 to one or two int8 digits; `a` is float32 or bf16.
// scale: the value of one unit of the last digit; sum: the block's sum of quantized values.
// A block holding a NaN or an infinity gets a NaN scale, so its outputs are NaN rather than
// finite nonsense; a block too small for 127 / max|a| to be finite is quantized as zero.
// A worksharing loop: every thread of lm_int8_gemm's parallel region calls it, as gemm_tiles.
template <typename T>
void quantize(const T* a, int8_t* q, int8_t* q2, float* scale, float* sum, int M, int K) {
  const int G = K / 32;
#pragma omp for schedule(static)
  for (int64_t b = 0; b < (int64_t)M * G; ++b) {
    const __m512 x0 = load16(a + b * 32), x1 = load16(a + b * 32 + 16);
    const bool nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const bool bad = nan || std::isinf(amax);
    float inv = amax > 0 ? 127.0f / amax : 0.0f;
    if (bad || !std::isfinite(inv)) inv = 0.0f;
    const float d = inv > 0 ? amax / 127.0f : 0.0f;
    const __m512i s0 = quantize16(x0, _mm512_set1_ps(inv), _mm512_set1_ps(d), q + b * 32,
                                  q2 ? q2 + b * 32 : nullptr);
    const __m512i s1 = quantize16(x1, _mm512_set1_ps(inv), _mm512_set1_ps(d), q + b * 32 + 16,
                                  q2 ? q2 + b * 32 + 16 : nullptr);
    scale[b] = bad ? NAN : q2 ? d / 256.0f : d;
    sum[b] = scale[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));  // exact integer
  }
}

inline __m512 load_consts(const Args& p, int64_t at) {  // 16 scales or zeros as float32
  if (p.half_consts)
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p.consts + at)));
  return _mm512_loadu_ps((const float*)p.consts + at);
}

inline __m512i broadcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Asks for weight group j's block g (codes, then scales and zeros) in L2.
template <int BITS>
inline void prefetch_block(const Args& p, int64_t j, int g) {
  constexpr int V = BITS == 4 ? 4 : 8;
  const int G = p.K / 32;
  const uint8_t* codes = p.codes + (j * G + g) * V * 64;
  for (int x = 0; x < V * 64; x += 64) prefetch_l2(codes + x);
  const int64_t k = (j * G + g) * 32;
  if (p.half_consts) {
    prefetch_l2((const uint16_t*)p.consts + k);
  } else {
    prefetch_l2((const float*)p.consts + k);
    prefetch_l2((const float*)p.consts + k + 16);
  }
}

// C[m0 : m0+MR, 16 * j0 : 16 * (j0+NR)]; with kAsk it also asks for the weights of groups
// next_j .. next_j+NR-1 in L2, a block per block it computes (a compile-time choice: a test in
// the block loop cost tiles that do not ask 3%).
template <int BITS, int DIGITS, int MR, int NR, bool kAsk>
void tile(const Args& p, int m0, int j0, int next_j) {
  const int G = p.K / 32;
  constexpr int V = BITS == 4 ? 4 : 8;  // weight vectors per block and 16 rows
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    // Two integer accumulators per output vector: the two digits, or with one digit its even
    // and odd dot products (independent chains), combined exactly at the end of the block.
    __m512i s0[MR][NR], s1[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) s0[i][r] = s1[i][r] = _mm512_setzero_si512();
    // One step: weight vectors wa, wb (NR each) against activation words at offsets oa, ob.
    auto step = [&](const __m512i* wa, const __m512i* wb, int oa, int ob) {
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (int64_t)(m0 + i) * p.K + g * 32;
        const __m512i qa = broadcast4(p.q + at + oa), qb = broadcast4(p.q + at + ob);
        if constexpr (DIGITS == 1) {
          for (int r = 0; r < NR; ++r) {
            s0[i][r] = _mm512_dpbusd_epi32(s0[i][r], wa[r], qa);
            s1[i][r] = _mm512_dpbusd_epi32(s1[i][r], wb[r], qb);
          }
        } else {
          const __m512i ra = broadcast4(p.q2 + at + oa), rb = broadcast4(p.q2 + at + ob);
          for (int r = 0; r < NR; ++r) {
            s0[i][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s0[i][r], wa[r], qa), wb[r], qb);
            s1[i][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s1[i][r], wa[r], ra), wb[r], rb);
          }
        }
      }
    };
    const uint8_t* w[NR];
    for (int r = 0; r < NR; ++r) w[r] = p.codes + ((int64_t)(j0 + r) * G + g) * V * 64;
    if constexpr (kAsk)
      for (int r = 0; r < NR; ++r) prefetch_block<BITS>(p, next_j + r, g);
    for (int v = 0; v < 4; ++v) {
      __m512i wa[NR], wb[NR];
      if constexpr (BITS == 4) {  // low nibbles: elements 4v.., high nibbles: 16+4v..
        const __m512i nib = _mm512_set1_epi8(0x0f);
        for (int r = 0; r < NR; ++r) {
          const __m512i raw = _mm512_loadu_si512(w[r] + v * 64);
          wa[r] = _mm512_and_si512(raw, nib);
          wb[r] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
        }
        step(wa, wb, 4 * v, 16 + 4 * v);
      } else {  // vectors 2v and 2v+1: elements 8v.. and 8v+4..
        for (int r = 0; r < NR; ++r) {
          wa[r] = _mm512_loadu_si512(w[r] + v * 128);
          wb[r] = _mm512_loadu_si512(w[r] + v * 128 + 64);
        }
        step(wa, wb, 8 * v, 8 * v + 4);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const int64_t k = ((int64_t)(j0 + r) * G + g) * 32;
      const __m512 scale = load_consts(p, k), zero = load_consts(p, k + 16);
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (int64_t)(m0 + i) * G + g;
        const __m512i dot = DIGITS == 1 ? _mm512_add_epi32(s0[i][r], s1[i][r])
                                        : _mm512_add_epi32(_mm512_slli_epi32(s0[i][r], 8), s1[i][r]);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(p.a_scale[at])),
                                    acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(p.a_sum[at]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) {
      const int n0 = (j0 + r) * 16;
      const __mmask16 keep = p.N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (p.N - n0)) - 1);
      const int64_t at = (int64_t)(m0 + i) * p.N + n0;
      if (p.out_bf16)
        _mm256_mask_storeu_epi16((uint16_t*)p.c + at, keep, (__m256i)_mm512_cvtneps_pbh(acc[i][r]));
      else
        _mm512_mask_storeu_ps((float*)p.c + at, keep, acc[i][r]);
    }
}

constexpr int kMC = 64;  // rows of A kept in cache while every weight strip passes over them

// A tile that asks for the strip at next_j if it is >= 0.
template <int BITS, int DIGITS, int MR, int NR>
void tile_asking(const Args& p, int m0, int j0, int next_j) {
  if (next_j >= 0)
    tile<BITS, DIGITS, MR, NR, true>(p, m0, j0, next_j);
  else
    tile<BITS, DIGITS, MR, NR, false>(p, m0, j0, next_j);
}

// Rows m0 .. m_end of the strip at group j0; the first tile asks for the strip at next_j (if >= 0).
template <int BITS, int DIGITS, int MR, int NR>
void rows(const Args& p, int m0, int m_end, int j0, int next_j = -1) {
  for (; m0 + MR <= m_end; m0 += MR, next_j = -1) tile_asking<BITS, DIGITS, MR, NR>(p, m0, j0, next_j);
  switch (m_end - m0) {  // the last rows, fewer than MR
    case 3: if constexpr (MR > 3) tile_asking<BITS, DIGITS, 3, NR>(p, m0, j0, next_j); break;
    case 2: if constexpr (MR > 2) tile_asking<BITS, DIGITS, 2, NR>(p, m0, j0, next_j); break;
    case 1: if constexpr (MR > 1) tile_asking<BITS, DIGITS, 1, NR>(p, m0, j0, next_j); break;
    default: break;
  }
}

// Tiles of MR rows x NR groups of 16 columns. The tile shape never changes the arithmetic of an
// output element, so choosing it by M keeps rows batch-invariant. With one chunk of rows (decode)
// each strip asks for the next one's weights in L2 as it goes: a strip of few rows is done before
// the hardware prefetcher, which stops at every 4 KiB page, has brought the next from memory
// (benchmarks/kernel_ab.py int8_gemm: a layer's matmuls over 16 rows take 19% less time, 14%
// with two digits, over 1 row 22%; with more chunks the prefetcher keeps up, or later chunks find
// the weights in L2, and asking would cost 2-4%).
template <int BITS, int DIGITS, int MR, int NR>
void gemm_tiles(const Args& p) {
  const int groups = (p.N + 15) / 16, strips = (groups + NR - 1) / NR;
  const int chunks = (p.M + kMC - 1) / kMC;
#pragma omp for collapse(2) schedule(static)
  for (int c = 0; c < chunks; ++c)
    for (int s = 0; s < strips; ++s) {
      const int j0 = s * NR, m0 = c * kMC, m_end = std::min(p.M, m0 + kMC);
      if (j0 + NR <= groups)
        rows<BITS, DIGITS, MR, NR>(p, m0, m_end, j0, chunks == 1 && j0 + 2 * NR <= groups ? j0 + NR : -1);
      else
        for (int j = j0; j < groups; ++j) rows<BITS, DIGITS, MR, 1>(p, m0, m_end, j);
    }
}

template <int BITS, int DIGITS>
void gemm(const Args& p) {
  if (p.M == 1)
    gemm_tiles<BITS, DIGITS, 1, 2>(p);
  else if constexpr (DIGITS == 2)  // twice the integer accumulators: 3 rows fit the registers
    gemm_tiles<BITS, DIGITS, 3, 2>(p);
  else
    gemm_tiles<BITS, DIGITS, 4, 2>(p);
}

}  // namespace

extern "C" {

// C (M, N) = A (M, K) @ W^T for W in blocks of `bits` (4 or 8), A float32 (a_f32 = 1) or bf16,
// quantized here per row and block of 32 to `digits` (1 or 2) int8 digits; K a multiple of 32;
// consts float16 (half_consts = 1) or float32.
void lm_int8_gemm(const void* a, int a_f32, const uint8_t* codes, const void* consts, void* c,
                  int out_bf16, int M, int N, int K, int bits, int digits, int half_consts,
                  int threads) {
  omp_set_num_threads(threads);
  const int G = K / 32;
  std::vector<int8_t> q((size_t)M * K * digits);
  std::vector<float> scale((size_t)M * G), sum((size_t)M * G);
  int8_t* q2 = digits == 2 ? q.data() + (size_t)M * K : nullptr;
  const Args p{q.data(), q2, scale.data(), sum.data(), codes, consts, half_consts != 0,
               c, out_bf16 != 0, M, N, K};
#pragma omp parallel
  {
    if (a_f32)
      quantize((const float*)a, q.data(), q2, scale.data(), sum.data(), M, K);
    else
      quantize((const uint16_t*)a, q.data(), q2, scale.data(), sum.data(), M, K);
    if (bits == 4)
      digits == 2 ? gemm<4, 2>(p) : gemm<4, 1>(p);
    else
      digits == 2 ? gemm<8, 2>(p) : gemm<8, 1>(p);
  }
}

// The same with its arguments as 64-bit words, in order, for call lists (call_list.cpp).
void lm_int8_gemm_packed(const int64_t* a) {
  lm_int8_gemm((const void*)a[0], (int)a[1], (const uint8_t*)a[2], (const void*)a[3], (void*)a[4],
               (int)a[5], (int)a[6], (int)a[7], (int)a[8], (int)a[9], (int)a[10], (int)a[11],
               (int)a[12]);
}
}
