// lmserve-isa: amx avx512 avx2 neon
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
// batch-invariant. On AMX (the "amx" build) whole groups of 16 rows take their integer sums
// from tile instructions instead: the same integers, then the same float steps, so the same bits.
//
// Weight layout, rows in groups of 16 (N padded to a multiple of 16):
//   codes  (N/16, K/32, V, 16, 4) bytes, V = 4 for 4-bit: vector v holds, for each of the 16
//          rows, block elements 4v..4v+3 in the low nibbles and 16+4v..16+4v+3 in the high ones
//          (GGUF's Q4 byte order, regrouped); V = 8 for 8-bit: elements 4v..4v+3 as bytes.
//   consts (N/16, K/32, 2, 16) the 16 rows' scales, then their zeros: float16 when every one of
//          them is a float16 value (GGUF stores them so; a sixth less to stream), else float32.
#include <omp.h>

#include "amx.h"
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
  bool amx;               // groups of 16 rows on AMX tiles
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

// Lanes at..at+kLanes-1 of the scales or zeros, as float32.
inline FR load_consts(const Args& p, int64_t at) {
  if (p.half_consts) return fr_load_f16((const uint16_t*)p.consts + at);
  return fr_load((const float*)p.consts + at);
}

// Block g's contribution to row m's outputs in a register of a weight group: the float steps
// every path takes on the block's integer sums (`sum`, as q * 256 + q2 with two digits).
inline FR add_block(const Args& p, FR acc, IR sum, FR scale, FR zero, int m, int g) {
  const int64_t at = (int64_t)m * (p.K / 32) + g;
  acc = fr_fmadd(fr_from_int(sum), fr_mul(scale, fr_set(p.a_scale[at])), acc);
  return fr_fmadd(zero, fr_set(p.a_sum[at]), acc);
}

inline void store_row(const Args& p, int m, int j, F16 acc) {  // C[m, 16j : 16j+16]
  const int n0 = j * 16, n = std::min(16, p.N - n0);
  const int64_t at = (int64_t)m * p.N + n0;
  if (p.out_bf16)
    fstore_first((uint16_t*)p.c + at, acc, n);
  else
    fstore_first((float*)p.c + at, acc, n);
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

inline IR word(const int8_t* p) {  // 4 activation digits to every 32-bit lane
  int32_t v;
  memcpy(&v, p, 4);
  return ir_set(v);
}

// C[m0 : m0+MR, 16 * j0 : 16 * (j0+NR)]; with kAsk it also asks for the weights of groups
// next_j .. next_j+NR-1 in L2, a block per block it computes (a compile-time choice: a test in
// the block loop cost tiles that do not ask 3%). A block's integer work goes one register of
// the vectors at a time (kRegs: one on AVX-512, AVX2's two halves, NEON's four quarters), with
// one accumulator an output and digit, so a tile's integer accumulators stay in registers (its
// float ones, touched once a block, may not): AVX2 holds a 4 x 3 tile's 12 in its 16, where
// whole vectors (two registers each, two accumulators an output) spilled a 4 x 2 tile's 32.
// With the shapes below, AVX2's layer matmuls take 0.89, 0.78, 0.70 and 0.64 of the time they
// took at 1, 4, 16 and 256 rows with one digit, 0.72, 0.70, 0.80 and 0.86 with two
// (kernel_ab.py int8_gemm --base db07c16, Zen 4, same bits); AVX-512 is unchanged (0.95-1.02).
template <int BITS, int DIGITS, int MR, int NR, bool kAsk>
void tile(const Args& p, int m0, int j0, int next_j) {
  const int G = p.K / 32;
  constexpr int V = BITS == 4 ? 4 : 8;  // weight vectors per block and 16 rows
  F16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = fzero();
  // 4-bit codes are nibbles, whose products may add up in 16 bits until a pass's end (8 of them
  // an accumulator: ir_dot_nibbles). 8-bit codes are full bytes where vpdpbusd is an
  // instruction; where it is emulated (kSums16) they go as nibbles too, in two passes over the
  // block, low nibbles then high ones, whose sums add as low + 16 * high: the same integers with
  // fewer emulated instructions than a full byte's products (AVX2 8-bit layers, `kernel_ab.py
  // int8_gemm --bits 8`: 0.90-0.95 of the time at 4 rows, 0.88-0.97 at 16, 0.89 at 256, 1 row
  // unchanged).
  constexpr bool kNibbles = BITS == 4 || kSums16;
  constexpr int kPasses = BITS == 8 && kNibbles ? 2 : 1;
  auto dot = [](IR s, IR w, IR q) {
    if constexpr (kNibbles) return ir_dot_nibbles(s, w, q);
    else return ir_dpbusd(s, w, q, true);
  };
  const IR nib = ir_set8(0x0f);
  auto nibble = [&](IR x, int high) { return ir_and(high ? ir_shr16_4(x) : x, nib); };
  for (int g = 0; g < G; ++g) {
    const uint8_t* w[NR];
    for (int r = 0; r < NR; ++r) w[r] = p.codes + ((int64_t)(j0 + r) * G + g) * V * 64;
    if constexpr (kAsk)
      for (int r = 0; r < NR; ++r) prefetch_block<BITS>(p, next_j + r, g);
    for (int k = 0; k < kRegs; ++k) {
      const int lane_byte = k * 4 * kLanes;  // the register's bytes within a 64-byte vector
      IR sums[DIGITS][MR][NR];  // each digit's integer sums of the block
      for (int pass = 0; pass < kPasses; ++pass) {
        IR s[DIGITS][MR][NR];
        for (int d = 0; d < DIGITS; ++d)
          for (int i = 0; i < MR; ++i)
            for (int r = 0; r < NR; ++r) s[d][i][r] = ir_set(0);
        for (int v = 0; v < 4; ++v) {
          // Weight registers wa, wb (NR each) against the activation words at offsets oa, ob.
          IR wa[NR], wb[NR];
          int oa, ob;
          if constexpr (BITS == 4) {  // low nibbles: elements 4v.., high nibbles: 16+4v..
            for (int r = 0; r < NR; ++r) {
              const IR raw = ir_load(w[r] + v * 64 + lane_byte);
              wa[r] = nibble(raw, 0);
              wb[r] = nibble(raw, 1);
            }
            oa = 4 * v, ob = 16 + 4 * v;
          } else {  // vectors 2v and 2v+1: elements 8v.. and 8v+4..
            for (int r = 0; r < NR; ++r) {
              wa[r] = ir_load(w[r] + v * 128 + lane_byte);
              wb[r] = ir_load(w[r] + v * 128 + 64 + lane_byte);
              if constexpr (kNibbles) wa[r] = nibble(wa[r], pass), wb[r] = nibble(wb[r], pass);
            }
            oa = 8 * v, ob = 8 * v + 4;
          }
          for (int i = 0; i < MR; ++i)
            for (int d = 0; d < DIGITS; ++d) {
              const int8_t* q = (d == 0 ? p.q : p.q2) + (int64_t)(m0 + i) * p.K + g * 32;
              const IR qa = word(q + oa), qb = word(q + ob);
              for (int r = 0; r < NR; ++r) s[d][i][r] = dot(dot(s[d][i][r], wa[r], qa), wb[r], qb);
            }
        }
        for (int d = 0; d < DIGITS; ++d)
          for (int i = 0; i < MR; ++i)
            for (int r = 0; r < NR; ++r) {
              const IR part = kNibbles ? ir_widen(s[d][i][r]) : s[d][i][r];
              sums[d][i][r] = pass == 0 ? part : ir_add(sums[d][i][r], ir_shl<4>(part));
            }
      }
      for (int r = 0; r < NR; ++r) {
        const int64_t at = ((int64_t)(j0 + r) * G + g) * 32 + k * kLanes;
        const FR scale = load_consts(p, at), zero = load_consts(p, at + 16);
        for (int i = 0; i < MR; ++i) {
          const IR first = sums[0][i][r];
          const IR sum = DIGITS == 1 ? first : ir_add(ir_shl<8>(first), sums[DIGITS - 1][i][r]);
          reg(acc[i][r], k) = add_block(p, reg(acc[i][r], k), sum, scale, zero, m0 + i, g);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) store_row(p, m0 + i, j0 + r, acc[i][r]);
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

#if LM_AMX
// Tiles: 0, 1: one block's first-digit sums for groups j0 and j0+1 (16 x 16 int32); 2, 3: its
// second-digit sums; 4, 5: 16 rows' first and second digits of the block (16 x 32 bytes); 6, 7:
// the two groups' codes of the block, 8 rows of 16 x 4 bytes: the layout's vectors as they are
// for 8-bit codes, split into low and high nibbles for 4-bit ones (elements 0..15, then 16..31).
constexpr TileShape kTiles[8] = {{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 32}, {16, 32}, {8, 64}, {8, 64}};
constexpr int kTileBytes = 512;  // a block of 16 rows' codes as tile rows
constexpr int kRun = 8;          // blocks whose sums wait in L1 for their float steps

// The blocks of groups j0 .. j0+NC-1 as tile rows, group after group: the weights themselves
// for 8-bit codes, else unpacked into `buffer`.
template <int BITS, int NC>
const uint8_t* tile_codes(const Args& p, int j0, std::vector<uint8_t>& buffer) {
  const int G = p.K / 32;
  const uint8_t* codes = p.codes + (int64_t)j0 * G * kTileBytes / (BITS == 4 ? 2 : 1);
  if constexpr (BITS == 8) return codes;
  buffer.resize((size_t)NC * G * kTileBytes);
  const B64 nib = bset8(0x0f);
  for (int b = 0; b < NC * G; ++b)
    for (int v = 0; v < 4; ++v) {
      const B64 raw = bload(codes + (b * 4 + v) * 64);
      bstore(buffer.data() + b * kTileBytes + v * 64, band(raw, nib));
      bstore(buffer.data() + b * kTileBytes + (4 + v) * 64, bshr4(raw));
    }
  return buffer.data();
}

// One digit's sums for both groups: tiles C0 and C1 from digit tile A and code tiles 6 and 7.
// A macro: GCC's tile intrinsics paste their tile numbers into the assembly.
#define LM_DIGIT_SUMS(C0, C1, A, digits, out)                          \
  _tile_zero(C0);                                                      \
  _tile_loadd(A, digits, p.K);                                         \
  _tile_dpbsud(C0, A, 6);                                              \
  _tile_stored(C0, out[0], 64);                                        \
  if constexpr (NC == 2) {                                             \
    _tile_zero(C1);                                                    \
    _tile_dpbsud(C1, A, 7);                                            \
    _tile_stored(C1, out[NC - 1], 64);                                 \
  }

// Block g's integer sums of rows m0 .. m0+15 against the NC groups' codes (TDPBSUD: signed
// activation digits times unsigned codes) into out[digit][group].
template <int DIGITS, int NC>
inline void tile_sums(const Args& p, const uint8_t* codes, int m0, int g, int32_t (*out)[NC][16][16]) {
  const int G = p.K / 32;
  const int64_t at = (int64_t)m0 * p.K + g * 32;
  _tile_loadd(6, codes + (int64_t)g * kTileBytes, 64);
  if constexpr (NC == 2) _tile_loadd(7, codes + (int64_t)(G + g) * kTileBytes, 64);
  LM_DIGIT_SUMS(0, 1, 4, p.q + at, out[0]);
  if constexpr (DIGITS == 2) {
    LM_DIGIT_SUMS(2, 3, 5, p.q2 + at, out[DIGITS - 1]);
  }
}
#undef LM_DIGIT_SUMS

// Rows m0 .. of groups j0 .. j0+NC-1 in whole groups of 16 on the tiles; returns the first row
// left (fewer than 16 remain). The sums of a run of blocks come from the tiles first, then take
// tile()'s float steps, in its order, with the 16 rows' accumulators in registers. With next_j
// >= 0 it asks for that strip's weights in L2 as it goes, as tile() does.
template <int BITS, int DIGITS, int NC>
int amx_rows(const Args& p, int m0, int m_end, int j0, int next_j) {
  if (m_end - m0 < 16) return m0;
  const int G = p.K / 32;
  thread_local std::vector<uint8_t> buffer;
  const uint8_t* codes = tile_codes<BITS, NC>(p, j0, buffer);
  asm volatile("" ::: "memory");  // the unpacked codes are in memory before the tiles read them
  alignas(64) int32_t sums[kRun][DIGITS][NC][16][16];
  alignas(64) float acc[NC][16][16];
  for (; m0 + 16 <= m_end; m0 += 16, next_j = -1) {
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < 16; ++i) fstore(acc[c][i], fzero());
    for (int g0 = 0; g0 < G; g0 += kRun) {
      const int run = std::min(kRun, G - g0);
      for (int b = 0; b < run; ++b) {
        if (next_j >= 0)
          for (int c = 0; c < NC; ++c) prefetch_block<BITS>(p, next_j + c, g0 + b);
        tile_sums<DIGITS, NC>(p, codes, m0, g0 + b, sums[b]);
      }
      for (int c = 0; c < NC; ++c) {
        F16 a[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) a[i] = fload(acc[c][i]);
        for (int b = 0; b < run; ++b) {
          const int g = g0 + b;
          const int64_t k = ((int64_t)(j0 + c) * G + g) * 32;
          const F16 scale = load_consts(p, k), zero = load_consts(p, k + 16);
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            const I16 first = iload(sums[b][0][c][i]);
            const I16 sum = DIGITS == 1 ? first : iadd(ishl<8>(first), iload(sums[b][DIGITS - 1][c][i]));
            a[i] = add_block(p, a[i], sum, scale, zero, m0 + i, g);
          }
        }
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) fstore(acc[c][i], a[i]);
      }
    }
    for (int i = 0; i < 16; ++i)
      for (int c = 0; c < NC; ++c) store_row(p, m0 + i, j0 + c, fload(acc[c][i]));
  }
  return m0;
}
#endif

// Rows m0 .. m_end of groups j0 .. j0+NR-1: groups of 16 on AMX tiles where the build and the
// call have them, the rest in vector tiles.
template <int BITS, int DIGITS, int MR, int NR>
void strip_rows(const Args& p, int m0, int m_end, int j0, int next_j) {
#if LM_AMX
  if (p.amx) {
    const int first = amx_rows<BITS, DIGITS, NR>(p, m0, m_end, j0, next_j);
    if (first != m0) next_j = -1;  // asked for already
    m0 = first;
  }
#endif
  rows<BITS, DIGITS, MR, NR>(p, m0, m_end, j0, next_j);
}

// Tiles of MR rows x NR groups of 16 columns. The tile shape never changes the arithmetic of an
// output element, so choosing it by M keeps rows batch-invariant. With one chunk of rows (decode)
// each strip asks for the next one's weights in L2 as it goes: a strip of few rows is done before
// the hardware prefetcher, which stops at every 4 KiB page, has brought the next from memory
// (benchmarks/kernel_ab.py int8_gemm, Zen 4: a layer's matmuls over 1, 4 and 16 rows take 15%,
// 22-25% and 10% less time than asking for nothing, one digit or two; asking for the strip after
// next instead is 0-5% slower than this; with more chunks the prefetcher keeps up, or later
// chunks find the weights in L2, and asking would cost 2-4%).
template <int BITS, int DIGITS, int MR, int NR>
void gemm_tiles(const Args& p) {
  const int groups = (p.N + 15) / 16, strips = (groups + NR - 1) / NR;
  const int chunks = (p.M + kMC - 1) / kMC;
#pragma omp for collapse(2) schedule(static) nowait  // the region's end waits for all
  for (int c = 0; c < chunks; ++c)
    for (int s = 0; s < strips; ++s) {
      const int j0 = s * NR, m0 = c * kMC, m_end = std::min(p.M, m0 + kMC);
      if (j0 + NR <= groups)
        strip_rows<BITS, DIGITS, MR, NR>(p, m0, m_end, j0, chunks == 1 && j0 + 2 * NR <= groups ? j0 + NR : -1);
      else
        for (int j = j0; j < groups; ++j) strip_rows<BITS, DIGITS, MR, 1>(p, m0, m_end, j, -1);
    }
}

// Tile shapes, rows x groups of 16 columns: one row 1 x 2; more rows 4 x NR with one digit and
// 3 x NR with two (twice the accumulators). NR is 2 where a vector is one register (AVX-512), 3
// where the tile works a register at a time (AVX2 at 16 rows: 4 x 3 0.94 of 4 x 2's time, 3 x 3
// 0.96 of 3 x 2's; 2 x 4 and 4 x 4 slower).
template <int BITS, int DIGITS>
void gemm(const Args& p) {
  constexpr int NR = kRegs == 1 ? 2 : 3;
  if (p.M == 1)
    gemm_tiles<BITS, DIGITS, 1, 2>(p);
  else if constexpr (DIGITS == 2)
    gemm_tiles<BITS, DIGITS, 3, NR>(p);
  else
    gemm_tiles<BITS, DIGITS, 4, NR>(p);
}

// The quantized activations of a call: this thread's own, reused, when they are decode-sized,
// else `local`'s, allocated for the call and freed after it. (A zeroed allocation per call, with
// a second barrier at the tile loop's end, cost a layer's matmuls 1-6% at 1-16 rows:
// benchmarks/kernel_ab.py int8_gemm --base 678c457 --new c3e56fc, docs/performance.md.)
struct Scratch {
  std::vector<int8_t> q;  // (digits, M, K)
  std::vector<float> scale, sum;  // (M, K/32)
};
constexpr size_t kReusedBytes = 1 << 20;

Scratch& scratch(size_t q_bytes, size_t blocks, Scratch& local) {
  thread_local Scratch reused;
  Scratch& s = q_bytes <= kReusedBytes ? reused : local;
  if (s.q.size() < q_bytes) s.q.resize(q_bytes);
  if (s.scale.size() < blocks) s.scale.resize(blocks), s.sum.resize(blocks);
  return s;
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
  Scratch local;
  Scratch& buffers = scratch((size_t)M * K * digits, (size_t)M * G, local);
  // (Pointers, not the buffers: inside the parallel region a thread_local names each thread's own.)
  int8_t* const q = buffers.q.data();
  float* const scale = buffers.scale.data();
  float* const sum = buffers.sum.data();
  int8_t* q2 = digits == 2 ? q + (size_t)M * K : nullptr;
#if LM_AMX
  const bool amx = M >= 16 && amx_ready();
#else
  const bool amx = false;
#endif
  const Args p{q, q2, scale, sum, codes, consts, half_consts != 0,
               c, out_bf16 != 0, M, N, K, amx};
#pragma omp parallel
  {
#if LM_AMX
    if (amx) amx_configure(kTiles);
#endif
    if (a_f32)
      quantize((const float*)a, q, q2, scale, sum, M, K);
    else
      quantize((const uint16_t*)a, q, q2, scale, sum, M, K);
    if (bits == 4)
      digits == 2 ? gemm<4, 2>(p) : gemm<4, 1>(p);
    else
      digits == 2 ? gemm<8, 2>(p) : gemm<8, 1>(p);
#if LM_AMX
    if (amx) _tile_release();
#endif
  }
}

// Whether this build multiplies groups of 16 rows on AMX tiles in this process (an "amx" build
// that Linux granted the tile state).
int lm_int8_gemm_tiles() {
#if LM_AMX
  return amx_ready();
#else
  return 0;
#endif
}

// The same with its arguments as 64-bit words, in order, for call lists (call_list.cpp).
void lm_int8_gemm_packed(const int64_t* a) {
  lm_int8_gemm((const void*)a[0], (int)a[1], (const uint8_t*)a[2], (const void*)a[3], (void*)a[4],
               (int)a[5], (int)a[6], (int)a[7], (int)a[8], (int)a[9], (int)a[10], (int)a[11],
               (int)a[12]);
}
}
