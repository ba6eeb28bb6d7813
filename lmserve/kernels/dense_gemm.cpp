// lmserve-isa: avx512 avx2 neon
// Float32 matrix multiply with dense float32 weights, the full-precision level's (O0) matmul:
// C (M, N) = A (M, K) @ W (N, K)^T, W row-major as the model holds it (no repacking, so a model
// library's mapped weights serve as they are).
//
// Why not oneDNN or MKL: they pick their arithmetic by the shape, and a row multiplied alone (a
// decode step of one sequence) gets other last bits than the same row among others (a batch, a
// verify step of speculative decoding). Here every output element C[m, n] is 16 float32 lanes
// accumulated over K in steps of 16 (lane j: elements j, j+16, ...), with fused multiply-adds in
// K's order, then summed by `hsum`; whatever M is and whichever tile computes it, so a token's
// row is bit-identical alone or in any batch.
//
// Up to 8 rows (decode, a verify step) take each weight vector in one tile as it streams in, at
// the memory's speed, and 9-16 (a long verify step, a draft tree) in a second tile from the L1
// cache; more rows reuse each strip of weights from L1 across tiles of 4 rows (prefill), while
// the next strip comes in.
#include <omp.h>

#include "simd.h"

namespace {

using namespace lm;

struct Args {
  const float* a;
  const float* w;
  float* c;
  int M, N, K;
};

// `v`, kept in a register: GCC otherwise folds the loads of one operand into the FMAs, loading
// it once per use (20 loads to 16 FMAs a step of a 4x4 tile, where 8 do: load-bound).
inline F16 in_register(F16 v) {
#if LM_AVX512
  asm("" : "+v"(v));
#endif
  return v;
}

#if LM_AVX512
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

// Whether a tile of `rows` rows against `cols` weight rows (a decode step's one tile) asks for
// the weights kAhead floats ahead at each step of K, instead of its strip asking for the next
// strip's all at once. With up to 4 rows the tile computes faster than the memory streams, and
// a steady trickle of requests keeps it busier than a burst that fills the miss queue: over a
// whole model's weights (Zen 4, interleaved A/B) 2-4 rows took 7-19% less time, one row 2-5%;
// with 5-8 rows it took 7-28% more (their FMAs then share the load ports with the requests).
constexpr bool streams(int rows, int cols) { return kAvx512 && cols == 2 && rows <= 4; }
constexpr int64_t kAhead = 8192 / sizeof(float);

// Asks for the cache lines [from, to) of the weights at `w` (16 floats a line) in L2.
inline void ask_l2(const float* w, int64_t from, int64_t to) {
  for (int64_t l = from; l < to; ++l) prefetch_l2(w + l * 16);
}

// The cache lines of a strip of `rows` weight rows of K floats.
inline int64_t strip_lines(int rows, int K) { return ((int64_t)rows * K + 15) / 16; }

// C[m0 : m0+MR, n0 : n0+NR]. With `next` (the next strip's weights), K runs in kParts parts,
// each first asking for its share of the next strip in L2 (see `strip`).
template <int MR, int NR, int kParts = 1, bool kInL1 = false>
void tile(const Args& p, int m0, int n0, const float* next = nullptr) {
  F16 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = fzero();
  const float* w = p.w + (int64_t)n0 * p.K;
  const float* a = p.a + (int64_t)m0 * p.K;
  const int whole = p.K / 16 * 16;
  const int64_t lines = strip_lines(NR, p.K);
  for (int part = 0; part < kParts; ++part) {
    if (next) ask_l2(next, lines * part / kParts, lines * (part + 1) / kParts);
    const int k_end = part == kParts - 1 ? whole : whole / 16 * (part + 1) / kParts * 16;
    for (int k = whole / 16 * part / kParts * 16; k < k_end; k += 16) {
      F16 wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = in_register(fload(w + (int64_t)r * p.K + k));
      // (Past the weights' end at the last strip: never faults.)
      if constexpr (!kInL1 && streams(MR, NR))
        for (int r = 0; r < NR; ++r) prefetch_l2(w + (int64_t)r * p.K + k + kAhead);
      for (int i = 0; i < MR; ++i) {
        const F16 x = in_register(fload(a + (int64_t)i * p.K + k));
        for (int r = 0; r < NR; ++r) acc[i][r] = fmadd(x, wv[r], acc[i][r]);
      }
    }
  }
  if (whole < p.K) {  // the last K % 16 elements in the first lanes, zeros in the others
    const int rest = p.K - whole;
    F16 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = fload_first(w + (int64_t)r * p.K + whole, rest);
    for (int i = 0; i < MR; ++i) {
      const F16 x = fload_first(a + (int64_t)i * p.K + whole, rest);
      for (int r = 0; r < NR; ++r) acc[i][r] = fmadd(x, wv[r], acc[i][r]);
    }
  }
  float* c = p.c + (int64_t)m0 * p.N + n0;
  // All of a tile's sums at once, padded with zeros (the same additions as `hsum`'s, so the
  // same bits): against one `hsum` each, over a whole model's weights, 3-7 rows took 7-14% less
  // time (Zen 4; their reductions were a tenth of a strip's instructions at K = 576). Not on
  // AVX2 or NEON, where hsum16x16 is 16 hsums; nor past 16 sums (tails of the 4x4 strips,
  // instantiated but never run).
  if constexpr (kAvx512 && MR * NR <= 16) {
    alignas(64) float sums[16];
    if constexpr (MR * NR == 16) {
      fstore(sums, hsum16x16(&acc[0][0]));
    } else {
      F16 all[16];
      for (int j = 0; j < 16; ++j) all[j] = j < MR * NR ? acc[j / NR][j % NR] : fzero();
      fstore(sums, hsum16x16(all));
    }
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) c[(int64_t)i * p.N + r] = sums[i * NR + r];
  } else {
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) c[(int64_t)i * p.N + r] = hsum(acc[i][r]);
  }
}

constexpr int kMC = 64;  // rows of A kept in cache while every weight strip passes over them

// A tile of 1-8 rows (8 only against 2 weight rows: 8x4 accumulators would not fit in
// registers); `kInL1`: the strip's weights are in L1 already, so it asks for nothing ahead.
template <int NR, int kParts = 1, bool kInL1 = false>
void tail(const Args& p, int m0, int rows, int n0, const float* next = nullptr) {
  switch (rows) {
    case 8:
      if constexpr (NR <= 2) tile<8, NR, kParts, kInL1>(p, m0, n0, next);
      break;
    case 7: tile<7, NR, kParts, kInL1>(p, m0, n0, next); break;
    case 6: tile<6, NR, kParts, kInL1>(p, m0, n0, next); break;
    case 5: tile<5, NR, kParts, kInL1>(p, m0, n0, next); break;
    case 4: tile<4, NR, kParts, kInL1>(p, m0, n0, next); break;
    case 3: tile<3, NR, kParts, kInL1>(p, m0, n0, next); break;
    case 2: tile<2, NR, kParts, kInL1>(p, m0, n0, next); break;
    case 1: tile<1, NR, kParts, kInL1>(p, m0, n0, next); break;
    default: break;
  }
}

// Rows [m0, m_end) of the NR columns at n0: tiles of MR rows, then one of the rest. Unless the
// tile streams (above), the next strip's weights are asked for in L2 first, to come in while
// this one computes: a tile of one row is bound by their latency, and the later tiles of more
// rows compute from L1 while the memory would idle (one-row decode 9-18% faster in the engine,
// 8-16 rows of the head 1.1-1.3x). One tile of 5-8 rows asks for them a quarter at a time, at
// each quarter of K: the whole strip's requests at once left the memory idle while the FMAs
// ran, and in quarters over a whole model's weights 5-8 rows took 11-21% less time (Zen 4).
// It asks for the strip after next (the next was asked for by the strip before; a thread's
// first strips are the hardware prefetcher's): the memory's latency is then hidden by two
// strips' work instead of one's, and 5-8 and 12 rows took 4-8% less time again, 9 rows 1-4%
// (kernel_ab.py dense_gemm --base 14657f8, Zen 4, same bits; three strips ahead: the same).
// With 9-16 rows, the rows past the first 8 follow in a second tile over the strip, now in L1.
template <int MR, int NR>
void strip(const Args& p, int m0, int m_end, int n0) {
  const int rows = m_end - m0;
  const float* next = n0 + 2 * NR <= p.N ? p.w + (int64_t)(n0 + NR) * p.K : nullptr;
  if (streams(rows, NR)) next = nullptr;
  if constexpr (MR > 4) {  // (AVX-512's one tile of up to 8 rows)
    if (next && rows > 4 && rows <= 2 * MR) {
      if (n0 + 3 * NR <= p.N) next += (int64_t)NR * p.K;  // the strip after next
      const int first = rows > MR ? MR : rows;
      tail<NR, 4>(p, m0, first, n0, next);
      tail<NR, 1, true>(p, m0 + first, rows - first, n0);
      return;
    }
  }
  if (next) ask_l2(next, 0, strip_lines(NR, p.K));
  for (; m0 + MR <= m_end; m0 += MR) tile<MR, NR>(p, m0, n0);
  tail<NR>(p, m0, m_end - m0, n0);
}

template <int MR, int NR>
void gemm_tiles(const Args& p) {
  for_each_strip<NR>(p.M, p.N, kMC, [&](int m0, int m_end, int n0, int width) {
    if (width == NR)
      strip<MR, NR>(p, m0, m_end, n0);
    else
      for (int n = n0; n < n0 + width; ++n) strip<MR, 1>(p, m0, m_end, n);
  });
}

// Tile shapes by the row count (a shape never changes an element's arithmetic). Up to 8 rows (a
// decode step, a verify step of speculative decoding) take every row in one tile against 2
// weight rows, so that their FMAs run as the weights stream in. Over a whole model's weights
// (Zen 4) that took 8-12% less time than tiles against 4 weight rows for one row, 12-18% for
// 2-4 rows, and 10-17% less for 5-8 rows than a tile of 4 and one of the rest (the second
// computing while memory idled). 9-16 rows add a second such tile from L1: 0.7-0.8 of the time
// of 4x4 tiles (9 rows 1.10x of 8 rows, was 1.4x); from 17 rows on 4x4 tiles are as fast.
void gemm(const Args& p) {
#if LM_AVX512
  if (p.M <= 16)
    gemm_tiles<8, 2>(p);
  else
    gemm_tiles<4, 4>(p);
#else  // an F16 is 2 (AVX2) or 4 (NEON) registers: tiles of 2x2 keep the accumulators in them
  gemm_tiles<2, 2>(p);
#endif
}

}  // namespace

extern "C" {

// C (M, N) = A (M, K) @ W (N, K)^T, all float32 and contiguous.
void lm_dense_gemm(const float* a, const float* w, float* c, int M, int N, int K, int threads) {
  omp_set_num_threads(threads);
  gemm(Args{a, w, c, M, N, K});
}

// The same with its arguments as 64-bit words, in order, for call lists (call_list.cpp).
void lm_dense_gemm_packed(const int64_t* a) {
  lm_dense_gemm((const float*)a[0], (const float*)a[1], (float*)a[2], (int)a[3], (int)a[4], (int)a[5],
                (int)a[6]);
}
}
