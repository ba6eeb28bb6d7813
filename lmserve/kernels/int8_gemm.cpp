// lmserve-isa: avx512 avx2 neon
// Matrix multiply of int8-quantized activations with weights in blocks of 32 (4-bit or 8-bit
// unsigned codes, w = code * scale + zero): C (M, N) = A (M, K) @ W (N, K)^T, with integer dot
// products of 4 bytes a lane (AVX-512 VNNI's vpdpbusd: 64 multiply-adds an instruction, twice
// vdpbf16ps's 32; AVX-VNNI's on AVX2, or vpmaddubsw pairs, and sdot/usdot on Arm, elsewhere:
// the same integer sums, so the same bits).
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

// 16 activations to int8 digits: q = round(x * inv) and, if q2, the remainder in 256ths of
// d = 1 / inv. Returns the stored digits' sum per lane, q * 256 + q2 with two digits.
inline I16 quantize16(F16 x, F16 inv, F16 d, int8_t* q, int8_t* q2) {
  const I16 lo = iset(-128), hi = iset(127);
  I16 qi = round_to_int(fmul(x, inv));  // |x * inv| <= 127 by construction
  I16 ri = izero();
  if (q2) {
    const F16 rest = fnmadd(to_float(qi), d, x);  // about [-d/2, d/2]
    ri = round_to_int(fmul(fmul(rest, inv), fset(256.0f)));
    // A remainder that rounds to +-128 carries into the first digit, so q2 fits in int8
    // (the comparisons give -1 where true).
    const I16 up = igt(ri, hi), down = igt(lo, ri);
    qi = iadd(isub(qi, up), down);
    ri = isub(iadd(ri, ishl<8>(up)), ishl<8>(down));
    ri = imax(imin(ri, hi), lo);
    store_i8(q2, ri);
  }
  qi = imax(imin(qi, hi), lo);  // sums are of the stored digits
  store_i8(q, qi);
  return q2 ? iadd(ishl<8>(qi), ri) : qi;
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
    const F16 x0 = fload(a + b * 32), x1 = fload(a + b * 32 + 16);
    const bool nan = any_nan(x0) || any_nan(x1);
    const float amax = hmax(fmax(fabs16(x0), fabs16(x1)));
    const bool bad = nan || std::isinf(amax);
    float inv = amax > 0 ? 127.0f / amax : 0.0f;
    if (bad || !std::isfinite(inv)) inv = 0.0f;
    const float d = inv > 0 ? amax / 127.0f : 0.0f;
    const I16 s0 = quantize16(x0, fset(inv), fset(d), q + b * 32, q2 ? q2 + b * 32 : nullptr);
    const I16 s1 = quantize16(x1, fset(inv), fset(d), q + b * 32 + 16, q2 ? q2 + b * 32 + 16 : nullptr);
    scale[b] = bad ? NAN : q2 ? d / 256.0f : d;
    sum[b] = scale[b] * (float)ihsum(iadd(s0, s1));  // exact integer
  }
}

inline F16 load_consts(const Args& p, int64_t at) {  // 16 scales or zeros as float32
  if (p.half_consts) return fload_f16((const uint16_t*)p.consts + at);
  return fload((const float*)p.consts + at);
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
  F16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = fzero();
  // 4-bit codes are below 128 (cheaper products where they are emulated); 8-bit ones are not.
  auto dot = [](I16 s, B64 w, B64 q) { return BITS == 4 ? dpbusd_small(s, w, q) : dpbusd(s, w, q); };
  for (int g = 0; g < G; ++g) {
    // Two integer accumulators per output vector: the two digits, or with one digit its even
    // and odd dot products (independent chains), combined exactly at the end of the block.
    I16 s0[MR][NR], s1[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) s0[i][r] = s1[i][r] = izero();
    // One step: weight vectors wa, wb (NR each) against activation words at offsets oa, ob.
    auto step = [&](const B64* wa, const B64* wb, int oa, int ob) {
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (int64_t)(m0 + i) * p.K + g * 32;
        const B64 qa = broadcast4(p.q + at + oa), qb = broadcast4(p.q + at + ob);
        if constexpr (DIGITS == 1) {
          for (int r = 0; r < NR; ++r) {
            s0[i][r] = dot(s0[i][r], wa[r], qa);
            s1[i][r] = dot(s1[i][r], wb[r], qb);
          }
        } else {
          const B64 ra = broadcast4(p.q2 + at + oa), rb = broadcast4(p.q2 + at + ob);
          for (int r = 0; r < NR; ++r) {
            s0[i][r] = dot(dot(s0[i][r], wa[r], qa), wb[r], qb);
            s1[i][r] = dot(dot(s1[i][r], wa[r], ra), wb[r], rb);
          }
        }
      }
    };
    const uint8_t* w[NR];
    for (int r = 0; r < NR; ++r) w[r] = p.codes + ((int64_t)(j0 + r) * G + g) * V * 64;
    if constexpr (kAsk)
      for (int r = 0; r < NR; ++r) prefetch_block<BITS>(p, next_j + r, g);
    for (int v = 0; v < 4; ++v) {
      B64 wa[NR], wb[NR];
      if constexpr (BITS == 4) {  // low nibbles: elements 4v.., high nibbles: 16+4v..
        const B64 nib = bset8(0x0f);
        for (int r = 0; r < NR; ++r) {
          const B64 raw = bload(w[r] + v * 64);
          wa[r] = band(raw, nib);
          wb[r] = bshr4(raw);
        }
        step(wa, wb, 4 * v, 16 + 4 * v);
      } else {  // vectors 2v and 2v+1: elements 8v.. and 8v+4..
        for (int r = 0; r < NR; ++r) {
          wa[r] = bload(w[r] + v * 128);
          wb[r] = bload(w[r] + v * 128 + 64);
        }
        step(wa, wb, 8 * v, 8 * v + 4);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const int64_t k = ((int64_t)(j0 + r) * G + g) * 32;
      const F16 scale = load_consts(p, k), zero = load_consts(p, k + 16);
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (int64_t)(m0 + i) * G + g;
        const I16 sum = DIGITS == 1 ? iadd(s0[i][r], s1[i][r]) : iadd(ishl<8>(s0[i][r]), s1[i][r]);
        acc[i][r] = fmadd(to_float(sum), fmul(scale, fset(p.a_scale[at])), acc[i][r]);
        acc[i][r] = fmadd(zero, fset(p.a_sum[at]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) {
      const int n0 = (j0 + r) * 16, n = std::min(16, p.N - n0);
      const int64_t at = (int64_t)(m0 + i) * p.N + n0;
      if (p.out_bf16)
        fstore_first((uint16_t*)p.c + at, acc[i][r], n);
      else
        fstore_first((float*)p.c + at, acc[i][r], n);
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
