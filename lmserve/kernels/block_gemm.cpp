// lmserve-isa: avx512 avx2 neon
// Matrix multiply with weights kept in GGUF-style blocks of 32 (4-bit or 8-bit codes with a
// float32 scale and zero per block, or plain bf16): C (M, N) = A (M, K) @ W (N, K)^T.
//
// Each block of 32 weights is expanded in registers to bf16 (w = code * scale + zero, one
// rounding) and multiplied with bf16 pair dot products (AVX-512 BF16's vdpbf16ps, or its
// arithmetic in FMAs elsewhere) into 16 float32 lanes, then summed once at the end. Memory traffic is the packed codes (0.5 or 1 byte a weight), which
// is what decode is bound by; prefill expands a strip of blocks once and reuses it in tiles.
//
// Every output element C[m, n] is accumulated over the K blocks in the same order and reduced
// the same way whatever M is and whichever tile shape computes it, so a token's row is
// bit-identical alone or in a batch of any size (greedy output must not depend on batch company).
//
// Layouts: weight rows are interleaved in groups of 4 (N padded to a multiple of 4), so a strip
// of 4 rows streams through one contiguous run of memory:
//   codes   (N/4, K/32, 4, 16) uint8 for 4-bit (byte i: low nibble = weight i, high = weight
//           i+16, as GGUF Q4_0/Q4_1 store a block), (N/4, K/32, 4, 32) int8 for 8-bit (Q8_0),
//           or (N/4, K/32, 4, 64) bytes of bf16 weights (scale and zero unused)
//   consts  (N/4, K/32, 2, 4) float32: the 4 rows' scales, then their zeros.
#include <omp.h>

#include "simd.h"

#include <vector>

namespace {

using namespace lm;

// A block's 32 weights as bf16: round(code * scale + zero).
template <int BITS>
inline B64 expand(const uint8_t* codes, float scale, float zero) {
  const F16 s = fset(scale), z = fset(zero);
  if constexpr (BITS == 4) {
#if LM_AVX512
    // The 16 possible weights of the block, rounded to bf16 once, then looked up per code.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i table = _mm512_castsi256_si512(to_bf16(fmadd(iota, s, z)));
    const __m128i b = _mm_loadu_si128((const __m128i*)codes);
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m256i idx8 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), nib), _mm_and_si128(b, nib));
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx8), table);
#else  // weights 0..15 in the low nibbles, 16..31 in the high ones
    return pack_bf16(fmadd(fload_u4(codes, 0), s, z), fmadd(fload_u4(codes, 4), s, z));
#endif
  } else if constexpr (BITS == 16) {  // plain bf16 weights: nothing to expand
    return bload(codes);
  } else {
    const int8_t* q = (const int8_t*)codes;
    return pack_bf16(fmadd(fload_i8(q), s, z), fmadd(fload_i8(q + 16), s, z));
  }
}

struct Args {
  const uint16_t* a;
  const uint16_t* a_lo;  // null, or the bf16 remainder a_f32 - a of float32 activations
  const uint8_t* codes;
  const float* consts;
  void* c;
  bool out_bf16;
  int M, N, K;
};

constexpr int kPack = 4;  // weight rows interleaved in memory

// Expanded block g of weight row n.
template <int BITS>
inline B64 block(const Args& p, int n, int g) {
  const int64_t at = ((int64_t)(n / kPack) * (p.K / 32) + g);
  const float* c = p.consts + at * 2 * kPack + n % kPack;
  return expand<BITS>(p.codes + (at * kPack + n % kPack) * (BITS * 4), c[0], c[kPack]);
}

inline void store(const Args& p, int m, int n, float v) {
  const int64_t at = (int64_t)m * p.N + n;
  if (p.out_bf16)
    ((uint16_t*)p.c)[at] = f32_to_bf16(v);
  else
    ((float*)p.c)[at] = v;
}

// C[m0 : m0+MR, n0 : n0+NR]. Weight blocks come from `expanded` (NR x G, already bf16) when
// given, else are expanded here; either way they are the same bf16 values.
template <int BITS, int MR, int NR>
void tile(const Args& p, int m0, int n0, const uint16_t* expanded) {
  const int G = p.K / 32;
  F16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = fzero();
  for (int g = 0; g < G; ++g) {
    B64 w[NR];
    for (int r = 0; r < NR; ++r) w[r] = expanded ? bload(expanded + (r * G + g) * 32) : block<BITS>(p, n0 + r, g);
    for (int i = 0; i < MR; ++i) {
      const int64_t at = (int64_t)(m0 + i) * p.K + g * 32;
      const B64 x = bload(p.a + at);
      for (int r = 0; r < NR; ++r) acc[i][r] = dpbf16(acc[i][r], x, w[r]);
      if (p.a_lo) {
        const B64 lo = bload(p.a_lo + at);
        for (int r = 0; r < NR; ++r) acc[i][r] = dpbf16(acc[i][r], lo, w[r]);
      }
    }
  }
  if constexpr (MR * NR == 16) {
    float sums[16];
    fstore(sums, hsum16x16(&acc[0][0]));
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) store(p, m0 + i, n0 + r, sums[i * NR + r]);
  } else {
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) store(p, m0 + i, n0 + r, hsum(acc[i][r]));
  }
}

constexpr int kMC = 64;  // rows of A kept in cache while every weight strip passes over them

// The last rows < MR of a strip, one tile.
template <int BITS, int NR>
void tail(const Args& p, int m0, int rows, int n0, const uint16_t* expanded) {
  switch (rows) {
    case 7: tile<BITS, 7, NR>(p, m0, n0, expanded); break;
    case 6: tile<BITS, 6, NR>(p, m0, n0, expanded); break;
    case 5: tile<BITS, 5, NR>(p, m0, n0, expanded); break;
    case 4: tile<BITS, 4, NR>(p, m0, n0, expanded); break;
    case 3: tile<BITS, 3, NR>(p, m0, n0, expanded); break;
    case 2: tile<BITS, 2, NR>(p, m0, n0, expanded); break;
    case 1: tile<BITS, 1, NR>(p, m0, n0, expanded); break;
    default: break;
  }
}

// Rows [m0, m_end) of the NR columns starting at n0, in tiles of MR rows. With more than one
// tile of rows, the strip's blocks are expanded once into a buffer that every tile reads.
template <int BITS, int MR, int NR>
void strip(const Args& p, int m0, int m_end, int n0) {
  const uint16_t* expanded = nullptr;
  if (m_end - m0 > MR) {
    const int G = p.K / 32;
    thread_local std::vector<uint16_t> buffer;  // NR x G blocks of 32 bf16
    buffer.resize((size_t)NR * G * 32);
    for (int r = 0; r < NR; ++r)
      for (int g = 0; g < G; ++g)
        bstore(buffer.data() + (r * G + g) * 32, block<BITS>(p, n0 + r, g));
    expanded = buffer.data();
  }
  for (; m0 + MR <= m_end; m0 += MR) tile<BITS, MR, NR>(p, m0, n0, expanded);
  tail<BITS, NR>(p, m0, m_end - m0, n0, expanded);
}

// Tiles of MR x NR outputs. NR weight rows are expanded together: more independent work per
// block when few rows of A share it (decode). Tile shapes never change the arithmetic of an
// output element, so choosing them by M keeps rows batch-invariant.
template <int BITS, int MR, int NR>
void gemm_tiles(const Args& p) {
  for_each_strip<NR>(p.M, p.N, kMC, [&](int m0, int m_end, int n0, int width) {
    if (width == NR)
      strip<BITS, MR, NR>(p, m0, m_end, n0);
    else
      for (int n = n0; n < n0 + width; ++n) strip<BITS, MR, 1>(p, m0, m_end, n);
  });
}

template <int BITS>
void gemm(const Args& p) {
  if (p.M <= 4)
    gemm_tiles<BITS, 4, 4>(p);
  else if (p.a_lo)  // two loads of A per block and row: fewer rows per tile, more columns
    gemm_tiles<BITS, 4, 4>(p);
  else
    gemm_tiles<BITS, 8, 2>(p);
}

}  // namespace

extern "C" {

// C (M, N) = A (M, K) @ W^T for W in blocks of `bits` (4, 8, or 16: bf16); K a multiple of 32.
// A is bf16 (a_f32 = 0), or float32 (a_f32 = 1), multiplied as two bf16 halves (hi + lo), which
// keeps about 16 bits of each activation at twice the dot-product work.
void lm_block_gemm(const void* a, int a_f32, const uint8_t* codes, const float* consts, void* c,
                   int out_bf16, int M, int N, int K, int bits, int threads) {
  omp_set_num_threads(threads);
  std::vector<uint16_t> hi, lo;
  Args p{(const uint16_t*)a, nullptr, codes, consts, c, out_bf16 != 0, M, N, K};
  if (a_f32) {
    const int64_t n = (int64_t)M * K;
    hi.resize(n);
    lo.resize(n);
    const float* x = (const float*)a;
    for_each_row(n, n > 32768, [&](int64_t i) {
      hi[i] = f32_to_bf16(x[i]);
      lo[i] = f32_to_bf16(x[i] - bf16_to_f32(hi[i]));
    });
    p.a = hi.data();
    p.a_lo = lo.data();
  }
  if (bits == 4)
    gemm<4>(p);
  else if (bits == 8)
    gemm<8>(p);
  else
    gemm<16>(p);
}

// The same with its arguments as 64-bit words, in order, for call lists (call_list.cpp).
void lm_block_gemm_packed(const int64_t* a) {
  lm_block_gemm((const void*)a[0], (int)a[1], (const uint8_t*)a[2], (const float*)a[3], (void*)a[4],
                (int)a[5], (int)a[6], (int)a[7], (int)a[8], (int)a[9], (int)a[10]);
}
}
