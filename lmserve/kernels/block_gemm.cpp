// lmserve-isa: amx avx512 avx2 neon
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
//
// The "amx" build multiplies on AMX tiles instead (below), with other last bits.
#include <omp.h>

#include "amx.h"
#include "simd.h"

#include <algorithm>
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

#if LM_AMX
// AMX tiles (the "amx" build, where Linux grants them): TDPBF16PS multiplies 16 rows by 16
// weight rows over a block of 32 in one instruction, for every row count. Its sums are not
// vdpbf16ps's: an instruction sums the block's even and odd products apart, from zero, then adds
// the two and that to the output (Intel SDM), where the vector path adds each pair of products
// to one of 16 running lanes. A row therefore gets other last bits here than in the vector path,
// but the same alone as in any batch (each output's arithmetic depends on its row and column
// only), which is why the tiles take every row count, decode's single row too.
//
// Tiles: 0-3 the sums of 2 x 2 groups of 16 rows and 16 columns; 4, 5 a block of 32 activations
// of two row groups (or of one group's two bf16 halves, for float32 activations); 6, 7 a block
// of two column groups' weights as the instruction takes them: row j holds each column's pair j
// (elements 2j and 2j + 1), so a block of 16 weight rows is a 16 x 16 transpose of 32-bit pairs.
// Fewer than 16 rows in all (decode) configure the sum and activation tiles with that many rows:
// each output's arithmetic is the same in a tile of any height.
constexpr int kGroup = 16;                // rows or columns a tile holds
constexpr int kTileElems = kGroup * 32;   // bf16 elements of a tile (1 KiB)
bool use_tiles = true;

// Transposes the 16 x 16 32-bit elements of r (row i: r[i]).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// The weights of `groups` column groups from n0 in tile layout, (groups, K/32) tiles; rows past
// the layout's (N rounded up to kPack) are zeros.
template <int BITS>
void tile_weights(const Args& p, int n0, int groups, uint16_t* out) {
  const int G = p.K / 32, rows = (p.N + kPack - 1) / kPack * kPack;
  for (int c = 0; c < groups; ++c)
    for (int g = 0; g < G; ++g) {
      __m512i r[kGroup];
      for (int i = 0; i < kGroup; ++i) {
        const int n = n0 + c * kGroup + i;
        r[i] = n < rows ? block<BITS>(p, n, g) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int j = 0; j < kGroup; ++j) _mm512_storeu_si512(out + ((int64_t)c * G + g) * kTileElems + j * 32, r[j]);
    }
}

// Rows m0 .. m0+15 of the activations (all of them when fewer than 16: the tiles are that
// high): in place when all exist, else the zero-padded copy of the last rows, `tail` (16 rows of
// high halves, then 16 of low ones for float32 activations).
struct RowGroup {
  const uint16_t* hi;
  const uint16_t* lo;
};

inline RowGroup row_group(const Args& p, int m0, const uint16_t* tail) {
  const int64_t at = (int64_t)m0 * p.K;
  if (m0 + kGroup <= p.M || p.M < kGroup) return {p.a + at, p.a_lo ? p.a_lo + at : nullptr};
  return {tail, tail + kGroup * p.K};
}

// Writes tile `t`'s sums, rows m0 .. and columns n0 .., where the output has them.
#define LM_STORE_SUMS(t, m0, n0)                                                  \
  do {                                                                            \
    alignas(64) float sums[kGroup][kGroup];                                       \
    _tile_stored(t, sums, 64);                                                    \
    for (int i = 0; i < kGroup && (m0) + i < p.M; ++i)                            \
      for (int j = 0; j < kGroup && (n0) + j < p.N; ++j) store(p, (m0) + i, (n0) + j, sums[i][j]); \
  } while (0)

// Every strip of 32 columns on this thread's share: its weights put in tile layout once, then
// every row group multiplied against them, block by block. A macro's tile numbers: GCC's tile
// intrinsics paste them into the assembly.
template <int BITS>
void tile_strips(const Args& p, const uint16_t* tail) {
  const int G = p.K / 32, strips = (p.N + 2 * kGroup - 1) / (2 * kGroup);
  const int64_t a_stride = (int64_t)p.K * 2;
  thread_local std::vector<uint16_t> weights;
  weights.resize((size_t)2 * G * kTileElems);
#pragma omp for schedule(static)
  for (int s = 0; s < strips; ++s) {
    const int n0 = s * 2 * kGroup, groups = p.N - n0 > kGroup ? 2 : 1;
    tile_weights<BITS>(p, n0, groups, weights.data());
    asm volatile("" ::: "memory");  // the weights are in memory before the tiles read them
    const uint16_t* w0 = weights.data();
    const uint16_t* w1 = w0 + (int64_t)G * kTileElems;
    // Two row groups at a time with bf16 activations; one with float32's two halves.
    for (int m0 = 0; m0 < p.M; m0 += p.a_lo ? kGroup : 2 * kGroup) {
      const RowGroup r0 = row_group(p, m0, tail);
      const bool two_rows = !p.a_lo && m0 + kGroup < p.M, two_cols = groups == 2;
      const RowGroup r1 = two_rows ? row_group(p, m0 + kGroup, tail) : r0;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int g = 0; g < G; ++g) {
        _tile_loadd(6, w0 + (int64_t)g * kTileElems, 64);
        if (two_cols) _tile_loadd(7, w1 + (int64_t)g * kTileElems, 64);
        _tile_loadd(4, r0.hi + g * 32, a_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) _tile_dpbf16ps(1, 4, 7);
        if (p.a_lo) {
          _tile_loadd(5, r0.lo + g * 32, a_stride);
          _tile_dpbf16ps(0, 5, 6);
          if (two_cols) _tile_dpbf16ps(1, 5, 7);
        } else if (two_rows) {
          _tile_loadd(5, r1.hi + g * 32, a_stride);
          _tile_dpbf16ps(2, 5, 6);
          if (two_cols) _tile_dpbf16ps(3, 5, 7);
        }
      }
      LM_STORE_SUMS(0, m0, n0);
      if (two_cols) LM_STORE_SUMS(1, m0, n0 + kGroup);
      if (two_rows) {
        LM_STORE_SUMS(2, m0 + kGroup, n0);
        if (two_cols) LM_STORE_SUMS(3, m0 + kGroup, n0 + kGroup);
      }
    }
  }
}
#undef LM_STORE_SUMS

void tile_gemm(const Args& p, int bits) {
  std::vector<uint16_t> tail;  // the last rows of 16 or more, zero-padded (see row_group)
  const int whole = p.M / kGroup * kGroup;
  if (whole < p.M && whole > 0) {
    tail.assign((size_t)(p.a_lo ? 2 : 1) * kGroup * p.K, 0);
    const int64_t at = (int64_t)whole * p.K, n = (int64_t)(p.M - whole) * p.K;
    std::copy(p.a + at, p.a + at + n, tail.begin());
    if (p.a_lo) std::copy(p.a_lo + at, p.a_lo + at + n, tail.begin() + kGroup * p.K);
  }
  const uint8_t rows = p.M < kGroup ? p.M : kGroup;
  const TileShape tiles[8] = {{rows, 64}, {rows, 64}, {rows, 64}, {rows, 64}, {rows, 64}, {rows, 64},
                              {kGroup, 64}, {kGroup, 64}};
#pragma omp parallel
  {
    amx_configure(tiles);
    if (bits == 4)
      tile_strips<4>(p, tail.data());
    else if (bits == 8)
      tile_strips<8>(p, tail.data());
    else
      tile_strips<16>(p, tail.data());
    _tile_release();
  }
}
#endif

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
#if LM_AMX
  if (use_tiles && amx_ready()) return tile_gemm(p, bits);
#endif
  if (bits == 4)
    gemm<4>(p);
  else if (bits == 8)
    gemm<8>(p);
  else
    gemm<16>(p);
}

// Whether this build multiplies on AMX tiles in this process (an "amx" build that Linux granted
// the tile state, tiles not turned off).
int lm_block_gemm_tiles() {
#if LM_AMX
  return use_tiles && amx_ready();
#else
  return 0;
#endif
}

// Turns the tiles off (0) or back on in an "amx" build, for comparing them with the vector path
// in one process (tests/native/isa_harness.cpp).
void lm_block_gemm_use_tiles(int on) {
#if LM_AMX
  use_tiles = on != 0;
#else
  (void)on;
#endif
}

// The same with its arguments as 64-bit words, in order, for call lists (call_list.cpp).
void lm_block_gemm_packed(const int64_t* a) {
  lm_block_gemm((const void*)a[0], (int)a[1], (const uint8_t*)a[2], (const float*)a[3], (void*)a[4],
                (int)a[5], (int)a[6], (int)a[7], (int)a[8], (int)a[9], (int)a[10]);
}
}
