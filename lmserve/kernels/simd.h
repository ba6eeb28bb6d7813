// What lmserve's kernels share: scalar helpers, and vectors of 16 lanes over the instruction set
// a kernel is compiled for (kernels/build.py picks it at run time: one AVX-512 register, two
// AVX2 registers, or four NEON registers a vector). Kernels written against F16 / I16 / B64 run
// on each (their sources say so in their `lmserve-isa:` line).
//
// The vector operations do the same arithmetic on every ISA, lane by lane and in the same order
// (reductions included), so a kernel's integer paths give the same bits everywhere, and its
// float paths the same bits wherever the ISA has the instruction the AVX-512 code uses.
#pragma once
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LM_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define LM_NEON 1
#else
#error "lmserve's kernels need AVX-512, AVX2 with FMA and F16C, or Arm64 NEON with dotprod"
#endif

namespace lm {

// ---------------------------------------------------------------------------------------------
// Scalar helpers

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

// A matmul's output split for the threads: fn(m0, m_end, n0, width) for every chunk of `chunk`
// rows [m0, m_end) and strip of NR columns from n0 (the last strip `width` < NR wide when NR
// does not divide N), statically over the threads. No output element is split, so the split
// never changes an element's arithmetic.
template <int NR, typename Fn>
inline void for_each_strip(int M, int N, int chunk, Fn fn) {
  const int strips = (N + NR - 1) / NR;
  const int chunks = (M + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) schedule(static)
  for (int c = 0; c < chunks; ++c)
    for (int s = 0; s < strips; ++s) {
      const int n0 = s * NR, m0 = c * chunk;
      fn(m0, m0 + chunk < M ? m0 + chunk : M, n0, N - n0 < NR ? N - n0 : NR);
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

// Asks for the cache line at p in L2. Inline assembly on x86: GCC 12 at -O3 dropped the
// _mm_prefetch calls of paged_attention.cpp's attend_direct (none were left in the
// disassembly); a volatile asm statement stays.
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*(const char*)p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// A spin-wait hint to the core.
inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  asm volatile("yield");
#endif
}

// ---------------------------------------------------------------------------------------------
// 16-lane vectors. F16: float32 lanes; I16: int32 lanes; B64: 64 bytes, lane i owning bytes
// 4i..4i+3 (as VNNI's dot products group them), or 32 bf16 values, lane i owning 2i and 2i+1.

#if LM_AVX512

using F16 = __m512;
using I16 = __m512i;
using B64 = __m512i;

inline F16 fzero() { return _mm512_setzero_ps(); }
inline F16 fset(float x) { return _mm512_set1_ps(x); }
inline F16 fload(const float* p) { return _mm512_loadu_ps(p); }
inline F16 fload(const uint16_t* p) {  // bf16, widened
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline F16 fload_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline F16 fload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// The first n lanes of p (the others zero, their memory not read).
inline F16 fload_first(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline F16 fload_first(const uint16_t* p, int n) {
  const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Lanes in `mask` (bit i: lane i) from a, the others from b.
inline F16 fselect(uint16_t mask, F16 a, F16 b) { return _mm512_mask_mov_ps(b, (__mmask16)mask, a); }
// The first n <= 16 32-bit words of src to dst.
inline void copy_words(void* dst, const void* src, int n) {
  const __mmask16 lanes = (__mmask16)((1u << n) - 1);
  _mm512_mask_storeu_epi32(dst, lanes, _mm512_maskz_loadu_epi32(lanes, src));
}
inline F16 fload_u4(const uint8_t* p, int shift) {  // (p[i] >> shift) & 15, i < 16
  const __m128i b = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i*)p), shift), _mm_set1_epi8(0x0f));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}
inline void fstore(float* p, F16 v) { _mm512_storeu_ps(p, v); }
inline __m256i to_bf16(F16 v);
inline void fstore(uint16_t* p, F16 v) { _mm256_storeu_si256((__m256i*)p, to_bf16(v)); }
inline void fstore_first(float* p, F16 v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
inline void fstore_first(uint16_t* p, F16 v, int n) {
  _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), to_bf16(v));
}
inline F16 fadd(F16 a, F16 b) { return _mm512_add_ps(a, b); }
inline F16 fsub(F16 a, F16 b) { return _mm512_sub_ps(a, b); }
inline F16 fmul(F16 a, F16 b) { return _mm512_mul_ps(a, b); }
inline F16 fdiv(F16 a, F16 b) { return _mm512_div_ps(a, b); }
inline F16 fmadd(F16 a, F16 b, F16 c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline F16 fnmadd(F16 a, F16 b, F16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline F16 fmax(F16 a, F16 b) { return _mm512_max_ps(a, b); }
inline F16 fmin(F16 a, F16 b) { return _mm512_min_ps(a, b); }
inline F16 fabs16(F16 a) { return _mm512_abs_ps(a); }
inline float hmax(F16 v) { return _mm512_reduce_max_ps(v); }
inline bool any_nan(F16 v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
inline bool any_not_below(F16 v, float x) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_NLT_UQ) != 0; }
inline F16 fround(F16 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F16 fscale2(F16 x, F16 n) { return _mm512_scalef_ps(x, n); }  // x * 2^n, n integral
inline F16 to_float(I16 v) { return _mm512_cvtepi32_ps(v); }
inline I16 round_to_int(F16 x) {  // nearest, ties to even, whatever MXCSR says
  return _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline I16 izero() { return _mm512_setzero_si512(); }
inline I16 iload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline I16 iset(int32_t x) { return _mm512_set1_epi32(x); }
inline I16 iadd(I16 a, I16 b) { return _mm512_add_epi32(a, b); }
inline I16 isub(I16 a, I16 b) { return _mm512_sub_epi32(a, b); }
template <int N> inline I16 ishl(I16 a) { return _mm512_slli_epi32(a, N); }
template <int N> inline I16 ishr(I16 a) { return _mm512_srli_epi32(a, N); }  // logical
inline I16 imin(I16 a, I16 b) { return _mm512_min_epi32(a, b); }
inline I16 imin_u(I16 a, I16 b) { return _mm512_min_epu32(a, b); }  // unsigned
inline I16 imax(I16 a, I16 b) { return _mm512_max_epi32(a, b); }
inline I16 igt(I16 a, I16 b) { return _mm512_movm_epi32(_mm512_cmpgt_epi32_mask(a, b)); }  // -1 / 0
inline int32_t ihsum(I16 v) { return _mm512_reduce_add_epi32(v); }
inline void store_i8(int8_t* p, I16 v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(v)); }  // truncating
inline void store_i8_sat(int8_t* p, I16 v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(v)); }  // saturating

inline B64 bload(const void* p) { return _mm512_loadu_si512(p); }
inline void bstore(void* p, B64 v) { _mm512_storeu_si512(p, v); }
inline B64 bset8(uint8_t x) { return _mm512_set1_epi8((char)x); }
inline B64 band(B64 a, B64 b) { return _mm512_and_si512(a, b); }
inline B64 bshr4(B64 a) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0f)); }  // high nibbles
inline B64 broadcast4(const int8_t* p) {  // 4 bytes to every lane
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
// acc[i] += the dot product of lane i's 4 unsigned bytes of u with its 4 signed bytes of s;
// dpbusd_small where every byte of u is below 128 (cheaper where it has to be emulated: without
// AVX512-VNNI, vpmaddubsw pairs, a full byte split into nibbles so no pair saturates).
#if defined(__AVX512VNNI__)
inline I16 dpbusd(I16 acc, B64 u, B64 s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline I16 dpbusd_small(I16 acc, B64 u, B64 s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
inline I16 dpbusd_small(I16 acc, B64 u, B64 s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
inline I16 dpbusd(I16 acc, B64 u, B64 s) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i hi = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(u, 4), nib), s),
                                       _mm512_set1_epi16(16));
  return _mm512_add_epi32(dpbusd_small(acc, _mm512_and_si512(u, nib), s), hi);
}
#endif
// Dot products of nibble codes (u < 16) with signed bytes, a register at a time (see kRegs
// below): where dpbusd is emulated, vpmaddubsw's 16-bit pair sums (at most 2 * 15 * 128 = 3840)
// add up in 16 bits, up to 8 of them (16 products), and one vpmaddwd widens them to 32; where
// it is an instruction, the accumulator holds 32-bit sums throughout. The same integers either
// way.
#if defined(__AVX512VNNI__)
constexpr bool kSums16 = false;  // whether ir_dot_nibbles sums in 16 bits
inline I16 ir_dot_nibbles(I16 acc, B64 u, B64 s) { return dpbusd(acc, u, s); }
inline I16 ir_widen(I16 acc) { return acc; }
#else
constexpr bool kSums16 = true;
inline I16 ir_dot_nibbles(I16 acc, B64 u, B64 s) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s)); }
inline I16 ir_widen(I16 acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
#endif
// A register of a vector and its operations, under the names the other ISAs' sections give
// theirs: kernels that keep many accumulators work on one register of their vectors at a time
// (kRegs of them, kLanes lanes each), so the accumulators fit the register file. Here a vector
// is one register.
constexpr int kRegs = 1;
constexpr int kLanes = 16;
using IR = I16;
using FR = F16;
inline FR& reg(F16& v, int) { return v; }
inline IR ir_set(int32_t x) { return iset(x); }
inline IR ir_set8(uint8_t x) { return bset8(x); }
inline IR ir_load(const void* p) { return bload(p); }
inline IR ir_and(IR a, IR b) { return band(a, b); }
inline IR ir_shr16_4(IR a) { return _mm512_srli_epi16(a, 4); }
inline IR ir_add(IR a, IR b) { return iadd(a, b); }
template <int N> inline IR ir_shl(IR a) { return ishl<N>(a); }
inline IR ir_dpbusd(IR acc, IR u, IR s, bool full) { return full ? dpbusd(acc, u, s) : dpbusd_small(acc, u, s); }
inline FR fr_set(float x) { return fset(x); }
inline FR fr_load(const float* p) { return fload(p); }
inline FR fr_load_f16(const uint16_t* p) { return fload_f16(p); }
inline FR fr_from_int(IR v) { return to_float(v); }
inline FR fr_mul(FR a, FR b) { return fmul(a, b); }
inline FR fr_fmadd(FR a, FR b, FR c) { return fmadd(a, b, c); }
// acc[i] += x[2i+1] * w[2i+1], then += x[2i] * w[2i]: bf16 pairs, as vdpbf16ps (without
// AVX512-BF16, its arithmetic in two FMAs: a product of two bf16 values is exact in float32).
// pack_bf16: 32 floats (lo: elements 0..15, hi: 16..31) rounded to bf16, nearest even.
#if defined(__AVX512BF16__)
inline F16 dpbf16(F16 acc, B64 x, B64 w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
inline B64 pack_bf16(F16 lo, F16 hi) { return (B64)_mm512_cvtne2ps_pbh(hi, lo); }
inline __m256i to_bf16(F16 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
inline F16 dpbf16(F16 acc, B64 x, B64 w) {
  const __m512i hi_mask = _mm512_set1_epi32((int32_t)0xffff0000u);
  const F16 x_odd = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
  const F16 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));
  const F16 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  const F16 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  return _mm512_fmadd_ps(x_even, w_even, _mm512_fmadd_ps(x_odd, w_odd, acc));
}
inline __m256i to_bf16(F16 v) {  // nearest even, NaNs kept quiet
  const __m512i u = _mm512_castps_si512(v);
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  const __m512i r = _mm512_mask_mov_epi32(up, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                          _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
inline B64 pack_bf16(F16 lo, F16 hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(lo)), to_bf16(hi), 1); }
#endif

// The sum of 16 lanes in one fixed order (halves, quarters, pairs: the order GCC's
// _mm512_reduce_add_ps uses), written out so hsum16x16 can match it bit for bit.
inline float hsum(F16 v) {
  const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

// hsum of 16 vectors at once (lane n = hsum(v[n]), same additions in the same order), by
// pairing vectors at each level of the tree instead of reducing each one alone.
inline F16 hsum16x16(const F16* v) {
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

#else  // AVX2 or NEON: a vector is several registers, each op applied to each in turn

#if LM_AVX2
constexpr int kRegs = 2;  // registers a vector
using FR = __m256;
using IR = __m256i;
#else
constexpr int kRegs = 4;
using FR = float32x4_t;
using IR = int32x4_t;
#endif
constexpr int kLanes = 16 / kRegs;  // lanes a register

struct F16 { FR r[kRegs]; };
struct I16 { IR r[kRegs]; };
struct B64 { IR r[kRegs]; };

template <typename V, typename Fn>
inline V each(Fn fn) {
  V out;
  for (int k = 0; k < kRegs; ++k) out.r[k] = fn(k);
  return out;
}

#if LM_AVX2
inline FR fr_set(float x) { return _mm256_set1_ps(x); }
inline FR fr_load(const float* p) { return _mm256_loadu_ps(p); }
inline FR fr_load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline FR fr_load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline FR fr_load_i8(const int8_t* p) {
  int64_t v;
  memcpy(&v, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v)));
}
inline FR fr_load_u4(const uint8_t* p, int shift) {
  int64_t v;
  memcpy(&v, p, 8);
  const __m128i b = _mm_and_si128(_mm_srli_epi16(_mm_cvtsi64_si128(v), shift), _mm_set1_epi8(0x0f));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}
// Two registers of floats as 16 bf16 (a's lanes, then b's), nearest even, NaNs kept quiet.
inline IR fr_pack_bf16(FR a, FR b) {
  auto round = [](FR x) {
    const IR u = _mm256_castps_si256(x);
    const IR up = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const IR nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_srli_epi32(_mm256_blendv_epi8(up, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan), 16);
  };
  // packus interleaves 128-bit halves: a0-3 b0-3 a4-7 b4-7; put them back in order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(round(a), round(b)), 0xD8);
}
inline void fr_store(float* p, FR v) { _mm256_storeu_ps(p, v); }
inline FR fr_add(FR a, FR b) { return _mm256_add_ps(a, b); }
inline FR fr_sub(FR a, FR b) { return _mm256_sub_ps(a, b); }
inline FR fr_mul(FR a, FR b) { return _mm256_mul_ps(a, b); }
inline FR fr_div(FR a, FR b) { return _mm256_div_ps(a, b); }
inline FR fr_fmadd(FR a, FR b, FR c) { return _mm256_fmadd_ps(a, b, c); }
inline FR fr_fnmadd(FR a, FR b, FR c) { return _mm256_fnmadd_ps(a, b, c); }
inline FR fr_max(FR a, FR b) { return _mm256_max_ps(a, b); }
inline FR fr_min(FR a, FR b) { return _mm256_min_ps(a, b); }
inline FR fr_abs(FR a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline bool fr_any_nan(FR v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
inline bool fr_any_not_below(FR v, float x) { return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_NLT_UQ)) != 0; }
inline FR fr_round(FR x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline FR fr_from_int(IR v) { return _mm256_cvtepi32_ps(v); }
inline IR fr_to_int(FR x) { return _mm256_cvtps_epi32(fr_round(x)); }  // exact once rounded
inline FR fr_bits(IR v) { return _mm256_castsi256_ps(v); }
inline IR fr_as_int(FR v) { return _mm256_castps_si256(v); }
inline IR ir_set(int32_t x) { return _mm256_set1_epi32(x); }
inline IR ir_load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline void ir_store(void* p, IR v) { _mm256_storeu_si256((__m256i*)p, v); }
inline IR ir_add(IR a, IR b) { return _mm256_add_epi32(a, b); }
inline IR ir_sub(IR a, IR b) { return _mm256_sub_epi32(a, b); }
template <int N> inline IR ir_shl(IR a) { return _mm256_slli_epi32(a, N); }
template <int N> inline IR ir_shr(IR a) { return _mm256_srli_epi32(a, N); }
inline IR ir_min(IR a, IR b) { return _mm256_min_epi32(a, b); }
inline IR ir_min_u(IR a, IR b) { return _mm256_min_epu32(a, b); }
inline IR ir_max(IR a, IR b) { return _mm256_max_epi32(a, b); }
inline IR ir_gt(IR a, IR b) { return _mm256_cmpgt_epi32(a, b); }
inline IR ir_and(IR a, IR b) { return _mm256_and_si256(a, b); }
inline IR ir_set8(uint8_t x) { return _mm256_set1_epi8((char)x); }
inline IR ir_shr16_4(IR a) { return _mm256_srli_epi16(a, 4); }
// Lane-wise 4-byte dot products, unsigned u (every byte < 128 unless `full`) by signed s.
inline IR ir_dpbusd(IR acc, IR u, IR s, bool full) {
#if defined(__AVXVNNI__)
  (void)full;
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  // vpmaddubsw saturates pairs at 16 bits: exact for bytes below 128; a full byte is split
  // into nibbles (each pair then at most 15 * 128 * 2) and the high half weighted by 16.
  const IR ones = _mm256_set1_epi16(1);
  if (!full) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
  const IR nib = _mm256_set1_epi8(0x0f);
  const IR lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(u, nib), s), ones);
  const IR hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u, 4), nib), s),
                                  _mm256_set1_epi16(16));
  return _mm256_add_epi32(acc, _mm256_add_epi32(lo, hi));
#endif
}
// Lanes of register k of a vector: for the reductions, which walk them in the AVX-512 order.
inline void fr_spill(float* out, FR v) { _mm256_storeu_ps(out, v); }
inline void ir_spill(int32_t* out, IR v) { _mm256_storeu_si256((__m256i*)out, v); }
#else  // NEON
inline FR fr_set(float x) { return vdupq_n_f32(x); }
inline FR fr_load(const float* p) { return vld1q_f32(p); }
inline FR fr_load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline FR fr_load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
inline FR fr_load_i8(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  const int16x8_t w = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(v)));
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
}
inline FR fr_load_u4(const uint8_t* p, int shift) {
  const uint8_t b[4] = {(uint8_t)((p[0] >> shift) & 15), (uint8_t)((p[1] >> shift) & 15),
                        (uint8_t)((p[2] >> shift) & 15), (uint8_t)((p[3] >> shift) & 15)};
  uint32_t v;
  memcpy(&v, b, 4);
  return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(v))))));
}
inline void fr_store(float* p, FR v) { vst1q_f32(p, v); }
inline FR fr_add(FR a, FR b) { return vaddq_f32(a, b); }
inline FR fr_sub(FR a, FR b) { return vsubq_f32(a, b); }
inline FR fr_mul(FR a, FR b) { return vmulq_f32(a, b); }
inline FR fr_div(FR a, FR b) { return vdivq_f32(a, b); }
inline FR fr_fmadd(FR a, FR b, FR c) { return vfmaq_f32(c, a, b); }
inline FR fr_fnmadd(FR a, FR b, FR c) { return vfmsq_f32(c, a, b); }
inline FR fr_max(FR a, FR b) { return vmaxq_f32(a, b); }
inline FR fr_min(FR a, FR b) { return vminq_f32(a, b); }
inline FR fr_abs(FR a) { return vabsq_f32(a); }
inline bool fr_any_nan(FR v) { return vminvq_u32(vceqq_f32(v, v)) == 0; }
inline bool fr_any_not_below(FR v, float x) { return vminvq_u32(vcltq_f32(v, vdupq_n_f32(x))) == 0; }
inline FR fr_round(FR x) { return vrndnq_f32(x); }
inline FR fr_from_int(IR v) { return vcvtq_f32_s32(v); }
inline IR fr_to_int(FR x) { return vcvtnq_s32_f32(x); }
inline FR fr_bits(IR v) { return vreinterpretq_f32_s32(v); }
inline IR fr_as_int(FR v) { return vreinterpretq_s32_f32(v); }
inline IR ir_set(int32_t x) { return vdupq_n_s32(x); }
inline IR ir_load(const void* p) { return vreinterpretq_s32_u8(vld1q_u8((const uint8_t*)p)); }
inline void ir_store(void* p, IR v) { vst1q_u8((uint8_t*)p, vreinterpretq_u8_s32(v)); }
inline IR ir_add(IR a, IR b) { return vaddq_s32(a, b); }
inline IR ir_sub(IR a, IR b) { return vsubq_s32(a, b); }
template <int N> inline IR ir_shl(IR a) { return vshlq_n_s32(a, N); }
template <int N> inline IR ir_shr(IR a) { return vreinterpretq_s32_u32(vshrq_n_u32(vreinterpretq_u32_s32(a), N)); }
inline IR ir_min(IR a, IR b) { return vminq_s32(a, b); }
inline IR ir_min_u(IR a, IR b) { return vreinterpretq_s32_u32(vminq_u32(vreinterpretq_u32_s32(a), vreinterpretq_u32_s32(b))); }
inline IR ir_max(IR a, IR b) { return vmaxq_s32(a, b); }
inline IR ir_gt(IR a, IR b) { return vreinterpretq_s32_u32(vcgtq_s32(a, b)); }
inline IR ir_and(IR a, IR b) { return vandq_s32(a, b); }
inline IR ir_set8(uint8_t x) { return vreinterpretq_s32_u8(vdupq_n_u8(x)); }
inline IR ir_shr16_4(IR a) { return vreinterpretq_s32_u16(vshrq_n_u16(vreinterpretq_u16_s32(a), 4)); }
inline IR ir_dpbusd(IR acc, IR u, IR s, bool full) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
  (void)full;
  return vusdotq_s32(acc, vreinterpretq_u8_s32(u), vreinterpretq_s8_s32(s));
#else
  // sdot multiplies signed bytes: exact for u below 128; a full byte is split into nibbles.
  const int8x16_t sv = vreinterpretq_s8_s32(s);
  if (!full) return vdotq_s32(acc, vreinterpretq_s8_s32(u), sv);
  const uint8x16_t uv = vreinterpretq_u8_s32(u);
  const int32x4_t lo = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(uv, vdupq_n_u8(0x0f))), sv);
  const int32x4_t hi = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vshrq_n_u8(uv, 4)), sv);
  return vaddq_s32(acc, vaddq_s32(lo, vshlq_n_s32(hi, 4)));
#endif
}
inline void fr_spill(float* out, FR v) { vst1q_f32(out, v); }
inline void ir_spill(int32_t* out, IR v) { vst1q_s32(out, v); }
#endif

inline F16 fzero() { return each<F16>([](int) { return fr_set(0.f); }); }
inline F16 fset(float x) { return each<F16>([&](int) { return fr_set(x); }); }
inline F16 fload(const float* p) { return each<F16>([&](int k) { return fr_load(p + k * kLanes); }); }
inline F16 fload(const uint16_t* p) { return each<F16>([&](int k) { return fr_load_bf16(p + k * kLanes); }); }
inline F16 fload_f16(const uint16_t* p) { return each<F16>([&](int k) { return fr_load_f16(p + k * kLanes); }); }
inline F16 fload_i8(const int8_t* p) { return each<F16>([&](int k) { return fr_load_i8(p + k * kLanes); }); }
inline F16 fload_u4(const uint8_t* p, int shift) {  // (p[i] >> shift) & 15, i < 16
  return each<F16>([&](int k) { return fr_load_u4(p + k * kLanes, shift); });
}
inline void copy_words(void* dst, const void* src, int n) { memcpy(dst, src, 4 * n); }
template <typename T>
inline F16 fload_first(const T* p, int n) {  // the first n lanes of p, the others zero
  if (n == 16) return fload(p);
  T lanes[16] = {};
  memcpy(lanes, p, sizeof(T) * n);
  return fload(lanes);
}
inline void fstore(float* p, F16 v) {
  for (int k = 0; k < kRegs; ++k) fr_store(p + k * kLanes, v.r[k]);
}
inline void fstore(uint16_t* p, F16 v) {
  float lanes[16];
  fstore(lanes, v);
  for (int i = 0; i < 16; ++i) p[i] = f32_to_bf16(lanes[i]);
}
inline void fstore_first(float* p, F16 v, int n) {
  float lanes[16];
  fstore(lanes, v);
  memcpy(p, lanes, 4 * n);
}
inline void fstore_first(uint16_t* p, F16 v, int n) {
  float lanes[16];
  fstore(lanes, v);
  for (int i = 0; i < n; ++i) p[i] = f32_to_bf16(lanes[i]);
}
inline F16 fadd(F16 a, F16 b) { return each<F16>([&](int k) { return fr_add(a.r[k], b.r[k]); }); }
inline F16 fsub(F16 a, F16 b) { return each<F16>([&](int k) { return fr_sub(a.r[k], b.r[k]); }); }
inline F16 fmul(F16 a, F16 b) { return each<F16>([&](int k) { return fr_mul(a.r[k], b.r[k]); }); }
inline F16 fdiv(F16 a, F16 b) { return each<F16>([&](int k) { return fr_div(a.r[k], b.r[k]); }); }
inline F16 fmadd(F16 a, F16 b, F16 c) { return each<F16>([&](int k) { return fr_fmadd(a.r[k], b.r[k], c.r[k]); }); }
inline F16 fnmadd(F16 a, F16 b, F16 c) { return each<F16>([&](int k) { return fr_fnmadd(a.r[k], b.r[k], c.r[k]); }); }
inline F16 fmax(F16 a, F16 b) { return each<F16>([&](int k) { return fr_max(a.r[k], b.r[k]); }); }
inline F16 fmin(F16 a, F16 b) { return each<F16>([&](int k) { return fr_min(a.r[k], b.r[k]); }); }
inline F16 fabs16(F16 a) { return each<F16>([&](int k) { return fr_abs(a.r[k]); }); }
inline F16 fround(F16 x) { return each<F16>([&](int k) { return fr_round(x.r[k]); }); }
inline F16 fselect(uint16_t mask, F16 a, F16 b) {
  float x[16], y[16];
  fstore(x, a);
  fstore(y, b);
  for (int i = 0; i < 16; ++i)
    if (!(mask >> i & 1)) x[i] = y[i];
  return fload(x);
}
inline F16 to_float(I16 v) { return each<F16>([&](int k) { return fr_from_int(v.r[k]); }); }
inline I16 round_to_int(F16 x) { return each<I16>([&](int k) { return fr_to_int(x.r[k]); }); }
inline bool any_nan(F16 v) {
  bool nan = false;
  for (int k = 0; k < kRegs; ++k) nan |= fr_any_nan(v.r[k]);
  return nan;
}
// Whether a lane is >= x or NaN.
inline bool any_not_below(F16 v, float x) {
  bool any = false;
  for (int k = 0; k < kRegs; ++k) any |= fr_any_not_below(v.r[k], x);
  return any;
}
inline float hmax(F16 v) {  // max is exact: any order gives the same value
  float lanes[16];
  fstore(lanes, v);
  float m = lanes[0];
  for (int i = 1; i < 16; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}
// x * 2^n for integral n in [-127, 127] (what exp16 needs): the power of two built in the
// exponent field, applied in two halves so that it never leaves the float range on the way.
inline F16 fscale2(F16 x, F16 n) {
  return each<F16>([&](int k) {
    const IR e = fr_to_int(n.r[k]);
    const IR half = ir_shr<1>(ir_add(e, ir_set(1 << 30)));  // floor(e / 2) + 2^29
    const IR h1 = ir_sub(half, ir_set(1 << 29)), h2 = ir_sub(e, h1);
    const FR p1 = fr_bits(ir_shl<23>(ir_add(h1, ir_set(127)))), p2 = fr_bits(ir_shl<23>(ir_add(h2, ir_set(127))));
    return fr_mul(fr_mul(x.r[k], p1), p2);
  });
}

inline I16 izero() { return each<I16>([](int) { return ir_set(0); }); }
inline I16 iload(const int32_t* p) { return each<I16>([&](int k) { return ir_load(p + k * kLanes); }); }
inline I16 iset(int32_t x) { return each<I16>([&](int) { return ir_set(x); }); }
inline I16 iadd(I16 a, I16 b) { return each<I16>([&](int k) { return ir_add(a.r[k], b.r[k]); }); }
inline I16 isub(I16 a, I16 b) { return each<I16>([&](int k) { return ir_sub(a.r[k], b.r[k]); }); }
template <int N> inline I16 ishl(I16 a) { return each<I16>([&](int k) { return ir_shl<N>(a.r[k]); }); }
template <int N> inline I16 ishr(I16 a) { return each<I16>([&](int k) { return ir_shr<N>(a.r[k]); }); }
inline I16 imin_u(I16 a, I16 b) { return each<I16>([&](int k) { return ir_min_u(a.r[k], b.r[k]); }); }
inline I16 imin(I16 a, I16 b) { return each<I16>([&](int k) { return ir_min(a.r[k], b.r[k]); }); }
inline I16 imax(I16 a, I16 b) { return each<I16>([&](int k) { return ir_max(a.r[k], b.r[k]); }); }
inline I16 igt(I16 a, I16 b) { return each<I16>([&](int k) { return ir_gt(a.r[k], b.r[k]); }); }
inline int32_t ihsum(I16 v) {
  int32_t lanes[16], sum = 0;
  for (int k = 0; k < kRegs; ++k) ir_spill(lanes + k * kLanes, v.r[k]);
  for (int i = 0; i < 16; ++i) sum += lanes[i];
  return sum;
}
inline void store_i8(int8_t* p, I16 v) {  // truncating
  int32_t lanes[16];
  for (int k = 0; k < kRegs; ++k) ir_spill(lanes + k * kLanes, v.r[k]);
  for (int i = 0; i < 16; ++i) p[i] = (int8_t)lanes[i];
}
inline void store_i8_sat(int8_t* p, I16 v) { store_i8(p, imax(imin(v, iset(127)), iset(-128))); }

inline B64 bload(const void* p) {
  return each<B64>([&](int k) { return ir_load((const uint8_t*)p + k * 4 * kLanes); });
}
inline void bstore(void* p, B64 v) {
  for (int k = 0; k < kRegs; ++k) ir_store((uint8_t*)p + k * 4 * kLanes, v.r[k]);
}
inline B64 bset8(uint8_t x) { return each<B64>([&](int) { return ir_set8(x); }); }
inline B64 band(B64 a, B64 b) { return each<B64>([&](int k) { return ir_and(a.r[k], b.r[k]); }); }
inline B64 bshr4(B64 a) { return each<B64>([&](int k) { return ir_and(ir_shr16_4(a.r[k]), ir_set8(0x0f)); }); }
inline B64 broadcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return each<B64>([&](int) { return ir_set(v); });
}
inline I16 dpbusd(I16 acc, B64 u, B64 s) {
  return each<I16>([&](int k) { return ir_dpbusd(acc.r[k], u.r[k], s.r[k], true); });
}
// ir_dot_nibbles and ir_widen: as in the AVX-512 section (vpmaddubsw's pair sums where AVX2 has
// no AVX-VNNI, 32-bit dot products elsewhere).
#if LM_AVX2 && !defined(__AVXVNNI__)
constexpr bool kSums16 = true;
inline IR ir_dot_nibbles(IR acc, IR u, IR s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
inline IR ir_widen(IR acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#else
constexpr bool kSums16 = false;
inline IR ir_dot_nibbles(IR acc, IR u, IR s) { return ir_dpbusd(acc, u, s, false); }
inline IR ir_widen(IR acc) { return acc; }
#endif
inline FR& reg(F16& v, int k) { return v.r[k]; }
// vdpbf16ps's arithmetic: the odd pair's product added first, then the even one's, each
// rounded once (a product of two bf16 values is exact in float32, so an FMA is that step).
inline F16 dpbf16(F16 acc, B64 x, B64 w) {
  return each<F16>([&](int k) {
    const IR hi_mask = ir_set((int32_t)0xffff0000u);
    const FR x_odd = fr_bits(ir_and(x.r[k], hi_mask)), w_odd = fr_bits(ir_and(w.r[k], hi_mask));
    const FR x_even = fr_bits(ir_shl<16>(x.r[k])), w_even = fr_bits(ir_shl<16>(w.r[k]));
    return fr_fmadd(x_even, w_even, fr_fmadd(x_odd, w_odd, acc.r[k]));
  });
}
inline B64 pack_bf16(F16 lo, F16 hi) {
#if LM_AVX2
  return B64{{fr_pack_bf16(lo.r[0], lo.r[1]), fr_pack_bf16(hi.r[0], hi.r[1])}};
#else
  alignas(64) uint16_t out[32];
  fstore(out, lo);
  fstore(out + 16, hi);
  return bload(out);
#endif
}

// The sum of 16 lanes in the AVX-512 build's order: halves, quarters, pairs, then the last two.
inline float hsum(F16 v) {
  float x[16];
  fstore(x, v);
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = x[i] + x[i + 8];
  for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
  const float p0 = q[0] + q[2], p1 = q[1] + q[3];
  return p0 + p1;
}
inline F16 hsum16x16(const F16* v) {
  float sums[16];
  for (int n = 0; n < 16; ++n) sums[n] = hsum(v[n]);
  return fload(sums);
}

#endif

// exp(x) for 16 lanes: Cody-Waite range reduction and a degree-6 polynomial (rel. error ~2e-7).
// Lanes at -inf give 0.
inline F16 exp16(F16 x) {
  x = fmin(fmax(x, fset(-87.0f)), fset(88.0f));
  const F16 n = fround(fmul(x, fset(1.44269504088896341f)));
  F16 r = fnmadd(n, fset(0.693359375f), x);
  r = fnmadd(n, fset(-2.12194440e-4f), r);
  F16 p = fset(1.9875691500e-4f);
  p = fmadd(p, r, fset(1.3981999507e-3f));
  p = fmadd(p, r, fset(8.3334519073e-3f));
  p = fmadd(p, r, fset(4.1665795894e-2f));
  p = fmadd(p, r, fset(1.6666665459e-1f));
  p = fmadd(p, r, fset(5.0000001201e-1f));
  p = fmadd(p, fmul(r, r), fadd(r, fset(1.0f)));
  return fscale2(p, n);
}

}  // namespace lm
