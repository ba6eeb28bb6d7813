// lmserve-isa: avx512 avx2 neon
// Paged attention on the CPU: rotary embedding, KV-cache store and causal attention of a flat
// batch of tokens in one call per layer, on simd.h's 16-lane vectors (the same bits on every ISA).
//
// Every query row is computed the same way whatever else is in the batch: its keys are visited
// in blocks aligned to absolute positions (one KV page each), every dot product and every
// softmax update has a fixed order, and no work is split across threads within a row. So a
// token gets bit-identical attention output whether it is decoded alone, decoded beside 63
// others, or recomputed inside a prefill chunk; this is what keeps greedy output independent of
// batching, chunking, prefix caching and preemption.
//
// Layouts (all contiguous, row-major):
//   qkv        (T, (H + 2*KVH) * D)   bf16 or fp32, the fused q/k/v projection output
//   cos, sin   (T, D)                 fp32, rotate-half layout (both halves repeated)
//   slots      (T,)                   int64 cache slot each token's k/v is stored in
//   k cache    (num_pages, KVH, D, page_size)  bf16 or fp32: each page's keys transposed per KV
//                                    head, so 16 keys' values of one dimension are contiguous
//   v cache    (num_slots, KVH, D)    bf16 or fp32; slot = page * page_size + offset
//   int8 caches (value = code * scale, a float32 scale per token and head), page_size a
//              multiple of 4, both (num_pages, KVH, D + extra, page_size) bytes:
//              k: per page and head rows of 4 * page_size bytes: D/4 rows of each key's codes
//                 for 4 dimensions in turn, then the keys' float scales, then the sums of their codes
//              v: per page and head page_size/4 rows of D words, one row per 4 keys (word d holds
//                 the 4 keys' codes of dimension d), then the values' float scales (extra = 4)
//   page_off   (T,)                   int64 index into `pages` where the token's page list starts
//   ctx        (T,)                   int32 keys the token sees (its position + 1)
//   tree_start (T,) or null           int32 for a draft tree's token, the cache position of the
//                                    tree's root (its step's first token); -1 for other tokens
//   tree_bits  (T,) or null           uint64 the tree tokens the token attends, in cache order
//                                    (bit j: the key at tree_start + j; its ancestors and itself)
//
// A draft tree's token at depth d sees the keys before its tree, then its ancestors and itself:
// key positions tree_start + d' for d' <= d as the chain of those tokens would have them (ctx =
// tree_start + d + 1), read from where the tree put them. Every operation of its row is then the
// one its chain's row does, so a verified draft's output is bit-identical to decoding it.
//   out        (T, H, D)              bf16 or fp32
//
// Sliding windows (window > 0, the call's layer is windowed): token t sees the keys
// [ctx - window, ctx) and the first `sinks` keys (attention/window.py). It scores the sinks with
// its query rotated by sink_cos/sink_sin (kept in q_sink) where those are given, else with its
// query. page_skip (T,) or null: the token's page table lacks the pages between the sinks' and
// its window's, entries from ceil(sinks / page_size) on are stored page_skip places earlier.
#include <omp.h>
#include <string.h>

#include "simd.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <vector>

namespace {

using namespace lm;

constexpr int kMaxD = 256;      // head_dim limit (multiple of 16)

// A token's page table: entry i holds the page of keys [i * page_size, (i + 1) * page_size).
struct PageTable {
  const int32_t* p;
  int sink_pages = 0;  // entries before the gap a sliding window leaves (see page_skip)
  int skip = 0;
  int64_t operator[](int i) const { return p[i < sink_pages ? i : i - skip]; }
};

// Cache elements after a head's D that an int8 cache adds (other caches hold the values
// themselves): a key's float scale and int32 code sum, a value's float scale (rows of page_size).
template <typename Cache>
constexpr int kKeyExtra = 0;
template <>
constexpr int kKeyExtra<int8_t> = 8;
template <typename Cache>
constexpr int kValueExtra = 0;
template <>
constexpr int kValueExtra<int8_t> = 4;

// A head's D values to int8 codes in dst (code = round(x / scale), scale = max|x| / 127); returns
// the scale: NaN if x holds a NaN or an infinity (the key's or value's rows then come out NaN,
// as with a float cache: softmax_update), and codes 0 for x all zero or too small for
// 127 / max|x| to be finite.
inline float quantize_head(const float* x, int8_t* dst, int D) {
  F16 amax = fzero();
  bool bad = false;  // met a NaN or an infinity
  for (int i = 0; i < D; i += 16) {
    const F16 v = fload(x + i);
    bad |= any_nan(fsub(v, v));  // inf - inf, NaN
    amax = fmax(amax, fabs16(v));
  }
  const float m = hmax(amax);
  const float r = m > 0.f && !bad ? 127.f / m : 0.f;
  const F16 inv = fset(std::isfinite(r) ? r : 0.f);
  for (int i = 0; i < D; i += 16)  // |x * inv| <= 127: round to nearest even, then narrow
    store_i8_sat(dst + i, round_to_int(fmul(fload(x + i), inv)));
  return bad ? NAN : m / 127.f;
}

// Rotate one head (rotate-half layout) and write it to dst, element i at dst[i * stride].
template <typename Src, typename Dst>
inline void rotate_head(const Src* x, const float* cos, const float* sin, Dst* dst, int D,
                        int64_t stride = 1) {
  const int half = D / 2;
  for (int i = 0; i < half; ++i) {
    float a = to_f32(x[i]), b = to_f32(x[i + half]);
    store_elem(dst + i * stride, a * cos[i] - b * sin[i]);
    store_elem(dst + (i + half) * stride, b * cos[i + half] + a * sin[i + half]);
  }
}

// rope_and_store and attention are worksharing loops: every thread of run()'s region calls them.
template <typename QKV, typename Cache>
void rope_and_store(const QKV* qkv, const float* cos, const float* sin, const int64_t* slots,
                    float* q_out, Cache* kc, Cache* vc, int T, int H, int KVH, int D,
                    int page_size, const float* sink_cos, const float* sink_sin, float* q_sink) {
  const int64_t row = (int64_t)(H + 2 * KVH) * D;
#pragma omp for schedule(static)
  for (int t = 0; t < T; ++t) {
    const QKV* src = qkv + t * row;
    const float* c = cos + (int64_t)t * D;
    const float* s = sin + (int64_t)t * D;
    for (int h = 0; h < H; ++h) rotate_head(src + h * D, c, s, q_out + ((int64_t)t * H + h) * D, D);
    if (q_sink)
      for (int h = 0; h < H; ++h)
        rotate_head(src + h * D, sink_cos + (int64_t)t * D, sink_sin + (int64_t)t * D,
                    q_sink + ((int64_t)t * H + h) * D, D);
    const int64_t page = slots[t] / page_size, offset = slots[t] % page_size;
    for (int h = 0; h < KVH; ++h) {
      Cache* kh = kc + (page * KVH + h) * (D + kKeyExtra<Cache>) * page_size;
      const QKV* v = src + (H + KVH + h) * D;
      if constexpr (kKeyExtra<Cache> > 0) {
        alignas(64) float x[kMaxD];
        alignas(64) int8_t codes[kMaxD];
        rotate_head(src + (H + h) * D, c, s, x, D);
        const float k_scale = quantize_head(x, codes, D);
        int32_t sum = 0;
        for (int e = 0; e < D / 4; ++e) {  // dimensions 4e..4e+3 of this key
          memcpy(kh + ((int64_t)e * page_size + offset) * 4, codes + 4 * e, 4);
          sum += codes[4 * e] + codes[4 * e + 1] + codes[4 * e + 2] + codes[4 * e + 3];
        }
        ((float*)(kh + D * page_size))[offset] = k_scale;
        ((int32_t*)(kh + D * page_size + 4 * page_size))[offset] = sum;
        for (int i = 0; i < D; ++i) x[i] = to_f32(v[i]);
        Cache* vh = vc + (page * KVH + h) * (D + kValueExtra<Cache>) * page_size;
        const float v_scale = quantize_head(x, codes, D);
        // This key's byte (offset % 4) of each word of its row.
        Cache* row = vh + (offset / 4) * 4 * D;
        for (int i = 0; i < D; ++i) row[4 * i + offset % 4] = codes[i];
        ((float*)(vh + D * page_size))[offset] = v_scale;
      } else {
        rotate_head(src + (H + h) * D, c, s, kh + offset, D, page_size);
        Cache* vh = vc + (slots[t] * KVH + h) * D;
        for (int i = 0; i < D; ++i) store_elem(vh + i, to_f32(v[i]));
      }
    }
  }
}

constexpr int kMaxRows = 16;  // query rows (tokens x heads of one KV head) sharing a key block;
                              // so at most 16 query heads per KV head (checked in cpu_paged.py)

// Both attention paths below compute a row (one token, one query head) with the same operations
// in the same order (block_scores, or block_scores_q8 on an int8 cache; softmax_update; the
// weighted values acc = acc * alpha + p[j] * value j over the keys in order, as per-element FMA
// chains, or on an int8 cache value_dots' exact integer sums of a block then add_value_dots;
// store_row), so its output does not depend on which path ran it.

// Scores of kRows rows against a block of 16 keys, times `scale`, into out[0 .. rows): the
// 16 keys' scores in the lanes of one vector, q[d] times the keys' dimension d (key_dim(d)),
// summed over d in four interleaved chains (d mod 4) added at the end. Each key load serves
// every row (qr may repeat a row to fill kRows).
template <int kRows = 4, typename KeyDim>
inline void block_scores(const float* const* qr, int DV, float scale, KeyDim key_dim,
                         float (*out)[16], int rows) {
  F16 part[kRows][4];
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < 4; ++u) part[i][u] = fzero();
  for (int d = 0; d < 16 * DV; d += 4)
    for (int u = 0; u < 4; ++u) {
      const F16 k = key_dim(d + u);
      for (int i = 0; i < kRows; ++i) part[i][u] = fmadd(fset(qr[i][d + u]), k, part[i][u]);
    }
  for (int i = 0; i < rows; ++i) {
    const F16 dots = fadd(fadd(part[i][0], part[i][1]), fadd(part[i][2], part[i][3]));
    fstore(out[i], fmul(dots, fset(scale)));
  }
}

// The query of a row against an int8 cache: its codes (as quantize_head) plus 128, four to a
// word (dpbusd multiplies unsigned bytes with signed ones); returns its scale.
inline float query_words(const float* q, uint32_t* words, int D) {
  alignas(64) int8_t codes[kMaxD];
  const float scale = quantize_head(q, codes, D);
  for (int i = 0; i < D; ++i) ((uint8_t*)words)[i] = (uint8_t)(codes[i] + 128);
  return scale;
}

// block_scores against an int8 cache: key_quad(e) holds the 16 keys' codes of dimensions
// 4e..4e+3, multiplied with the rows' query words by vpdpbusd (exact integer sums, two chains
// for e even and odd); 128 * each key's code sum is taken back for the query's offset, and the
// integer score times q_scale[i], the key's scale and `scale` is the row's score.
template <int kRows = 4, typename KeyQuad>
inline void block_scores_q8(const uint32_t* const* qw, const float* q_scale, int D, float scale,
                            const float* key_scales, const int32_t* key_sums, KeyQuad key_quad,
                            float (*out)[16], int rows) {
  I16 part[kRows][2];
  for (int i = 0; i < kRows; ++i) part[i][0] = part[i][1] = izero();
  for (int e = 0; e < D / 4; e += 2)
    for (int u = 0; u < 2; ++u) {
      const B64 k = key_quad(e + u);
      for (int i = 0; i < kRows; ++i)
        part[i][u] = dpbusd(part[i][u], broadcast4((const int8_t*)&qw[i][e + u]), k);
    }
  const I16 offset = ishl<7>(iload(key_sums));  // 128 * sum
  const F16 ks = fload(key_scales);
  for (int i = 0; i < rows; ++i) {
    const I16 dots = isub(iadd(part[i][0], part[i][1]), offset);
    const F16 f = fmul(ks, fset(q_scale[i] * scale));
    fstore(out[i], fmul(to_float(dots), f));
  }
}

// A row's online-softmax update for one block: the scores s (those in `live`, at least one)
// become the weights p in place; m (running max) and l (running sum) are updated. Returns the
// factor the row's earlier weighted values are scaled by. A live score of NaN or +infinity (a
// NaN or infinite query or key) makes the row NaN from here on, as torch's softmax would: the
// max of 16 lanes with a NaN depends on its lane, which once let such a key zero parts of rows.
inline float softmax_update(float* s, uint16_t live, float& m, float& l) {
  const F16 sv = fselect(live, fload(s), fset(-INFINITY));
  if (any_not_below(sv, INFINITY) || std::isnan(m)) {
    m = l = NAN;
    fstore(s, fset(NAN));
    return NAN;
  }
  const float m_new = std::max(m, hmax(sv));
  const F16 p = fselect(live, exp16(fsub(sv, fset(m_new))), fzero());
  const float alpha = m == -INFINITY ? 0.f : std::exp(m - m_new);
  l = std::fma(l, alpha, hsum(p));  // fused at every inlined site alike
  m = m_new;
  fstore(s, p);
  return alpha;
}

// With an int8 cache a row's weights (those live) are multiplied by their keys' value
// scales before they weight the value codes, the rest set to 0 (a later key's NaN scale must not
// reach the row); l keeps the plain weights.
inline void scale_weights(float* p, uint16_t live, const float* value_scales) {
  fstore(p, fselect(live, fmul(fload(p), fload(value_scales)), fzero()));
}

// A row's weights of one block on an int8 cache (scale_weights done; zero past its keys) as
// 16-bit codes in 65535ths of the largest, for dpbusd (unsigned bytes) against the value codes:
// words[g] holds the high bytes of keys 4g..4g+3, words[4 + g] their low bytes. (One byte in
// 255ths rounded the small weights of long contexts coarsely: O3's perplexity +0.73% against
// +0.45%.) Returns the weight of one step: NaN if a weight is (a NaN value scale or softmax), so
// the row's output is; the codes are all 0, so the block adds nothing, if every weight is 0 or
// too small for 65535 / max to be finite.
inline float weight_words(const float* p, uint32_t* words) {
  const F16 w = fload(p);
  const bool nan = any_nan(w);
  const float w_max = hmax(w);
  const float r = !nan && w_max > 0.f ? 65535.f / w_max : 0.f;
  const I16 codes = round_to_int(fmul(w, fset(std::isfinite(r) ? r : 0.f)));
  const I16 c = imin_u(codes, iset(65535));  // w <= w_max: a no-op (NaN: step is NaN)
  store_i8((int8_t*)words, ishr<8>(c));
  store_i8((int8_t*)(words + 4), c);
  return nan ? NAN : w_max / 65535.f;
}

// A row's weighted values over one block on an int8 cache: acc[16 d ..] = acc * alpha + (the
// exact integer sums of the weight words times the value quads) * step, for the dn vectors of 16
// dimensions from d0 (dots[d] holds the integer sums of vector d0 + d).
inline void add_value_dots(float* acc, float alpha, float step, const I16* dots, int d0, int dn) {
  for (int d = 0; d < dn; ++d) {
    float* a = acc + 16 * (d0 + d);
    fstore(a, fmadd(to_float(dots[d]), fset(step), fmul(fload(a), fset(alpha))));
  }
}

// Exact integer sums, for up to 4 rows (those live) over one block on an int8 cache, of the
// rows' weight codes (weight_words) times the value codes: dots[r][d] for the dn <= 4 vectors of
// 16 dimensions from d0. value_row(g) points at the D words of keys 4g..4g+3; only the first
// `quads` are read (the rows' weights past them are 0). A value vector is loaded once for all
// rows, whose 4 x dn accumulators are independent chains.
template <typename ValueRow>
inline void value_dots(const uint32_t (*w)[8], const bool* live, int quads, ValueRow value_row,
                       int d0, int dn, I16 (*dots)[4]) {
  for (int r = 0; r < 4; ++r)
    for (int d = 0; d < dn; ++d) dots[r][d] = izero();
  for (int byte = 0; byte < 2; ++byte) {  // high bytes, times 256, then low bytes
    for (int r = 0; r < 4; ++r)
      for (int d = 0; d < dn; ++d) dots[r][d] = ishl<8>(dots[r][d]);
    for (int g = 0; g < quads; ++g) {
      B64 v[4];
      for (int d = 0; d < dn; ++d) v[d] = bload(value_row(g) + 16 * (d0 + d));
      // Rows loop to 4 (guarded) so that the compiler unrolls them: dots stays in registers.
      for (int r = 0; r < 4; ++r) {
        if (!live[r]) continue;
        const B64 p = broadcast4((const int8_t*)&w[r][4 * byte + g]);
        for (int d = 0; d < dn; ++d) dots[r][d] = dpbusd(dots[r][d], p, v[d]);
      }
    }
  }
}

// A row's output: its weighted values over the softmax sum.
template <typename Out>
inline void store_row(const float* acc, float l, Out* out, int D) {
  const float inv = 1.f / l;
  for (int i = 0; i < D; ++i) store_elem(out + i, acc[i] * inv);
}

// Asks for the keys of KV head kvh in the block of 16 from key `start` in L2 (none past n_keys).
// attend_direct asks one chunk ahead: a sequence's pages are scattered, so the hardware
// prefetcher cannot know them (20-25% on decode over 16 streams; into L1, or two chunks ahead,
// was slower). It asks a block at a time, keys while it scores and values while it weights:
// asking for a whole chunk's lines at once stalled on the core's outstanding misses
// (kernel_ab.py paged_attention --kv bf16 / int8: decode over 16 streams 7-11% / 0-6% faster).
template <typename Cache>
void prefetch_keys(const Cache* kc, PageTable pages, int start, int n_keys, int kvh, int KVH, int D,
                   int page_size) {
  if (start >= n_keys) return;
  const int64_t page_id = pages[start / page_size];
  const int offset = start % page_size;
  const Cache* kh = kc + (page_id * KVH + kvh) * (D + kKeyExtra<Cache>) * page_size;
  if constexpr (kKeyExtra<Cache> > 0) {  // rows of 4 * page_size bytes: D / 4 of codes, scales, sums
    for (int e = 0; e < D / 4 + 2; ++e) {
      prefetch_l2(kh + ((int64_t)e * page_size + offset) * 4);
      prefetch_l2(kh + ((int64_t)e * page_size + offset) * 4 + 63);
    }
  } else {
    // A float cache's block of keys is D runs of 16, page_size apart: one line holds one run, or
    // several when pages hold 16 keys.
    const int dims_a_line = std::max(1, 64 / (page_size * (int)sizeof(Cache)));
    for (int d = 0; d < D; d += dims_a_line) prefetch_l2(kh + (int64_t)d * page_size + offset);
  }
}

// The same for the block's values.
template <typename Cache>
void prefetch_values(const Cache* vc, PageTable pages, int start, int n_keys, int kvh, int KVH,
                     int D, int page_size) {
  if (start >= n_keys) return;
  const int64_t page_id = pages[start / page_size];
  const int offset = start % page_size;
  if constexpr (kValueExtra<Cache> > 0) {  // the block's 4 rows of D words, its 16 scales
    const Cache* vh = vc + (page_id * KVH + kvh) * (D + kValueExtra<Cache>) * page_size;
    for (int x = 0; x < 16 * D; x += 64) prefetch_l2(vh + (int64_t)offset * D + x);
    prefetch_l2(vh + (int64_t)D * page_size + 4 * offset);
  } else {
    const Cache* v = vc + ((page_id * page_size + offset) * KVH + kvh) * D;
    for (int j = 0; j < 16; ++j)
      for (int x = 0; x < D * (int)sizeof(Cache); x += 64)
        prefetch_l2((const char*)(v + (int64_t)j * KVH * D) + x);
  }
}

// fn(std::integral_constant<int, R>{}) for R rows, 1 to 4: a row count known at compile time, so
// the score functions keep no repeated row (a 3-head group's 4th would cost a quarter of the work).
template <typename Fn>
inline void with_rows(int R, Fn fn) {
  switch (R) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{});
  }
}

// The query position of row r (token-major, then head) in q and out.
inline int64_t row_at(int r, int G, int H, int D) { return ((int64_t)(r / G) * H + r % G) * D; }

// Attention of the rows of `tokens` consecutive tokens of one sequence (token i sees keys
// [0, ctx[i]), or under a window those of Window::visible) and the G query heads sharing KV
// head `kvh`, key block by key block, through copies of each block's keys and values shared by
// up to 16 rows (widened to float32, or an int8 cache's codes as the integer dot products read
// them).
//
// A draft tree's token comes alone (tokens = 1) with its tree's start (else -1) and bits: its key
// positions from tree_start on are read from its ancestors' cache positions.
struct Window {
  int size = 0;   // 0: none
  int sinks = 0;
  const float* q_sink = nullptr;  // the rows' queries for the sinks (laid out as q), or null
  // Token i's oldest window key, and its keys below which are sinks (scored with q_sink).
  int lowest(int ctx) const { return size ? std::max(0, ctx - size) : 0; }
  int sink_end(int ctx) const { return std::min(sinks, lowest(ctx)); }
  // The lanes of the block of 16 keys from `start` a token with `ctx` keys sees.
  uint16_t visible(int start, int ctx) const {
    auto lanes = [&](int lo, int hi) {  // keys [lo, hi) of the block as lanes
      lo = std::max(lo, start) - start, hi = std::min(hi, start + 16) - start;
      return hi > lo ? (uint32_t)(((1ull << hi) - 1) & ~((1ull << lo) - 1)) : 0u;
    };
    return (uint16_t)(lanes(0, sink_end(ctx)) | lanes(lowest(ctx), ctx));
  }
};

template <int kDV, typename Cache, typename Out>
void attend_group(const float* q, const Cache* kc, const Cache* vc, PageTable pages,
                  const int32_t* ctx, int tokens, int kvh, int G, int H, int KVH, int D,
                  int page_size, float scale, Out* out, int tree_start, uint64_t tree_bits,
                  Window window) {
  const int R = tokens * G;
  float m[kMaxRows], l[kMaxRows];
  alignas(64) float acc[kMaxRows][kMaxD];
  constexpr bool kInt8 = kKeyExtra<Cache> > 0;
  // A block's keys transposed and its values, or with an int8 cache the keys' codes and the
  // values' rows of words as vpdpbusd reads them, their scales, the keys' code sums, and the
  // rows' quantized queries (then their sink queries).
  alignas(64) float kt[kInt8 ? 1 : kMaxD][16], vf[kInt8 ? 1 : 16][kMaxD];
  alignas(64) uint32_t kq[kInt8 ? kMaxD / 4 : 1][16], vq[kInt8 ? 4 : 1][kInt8 ? kMaxD : 1];
  alignas(64) float k_scales[16], v_scales[16];
  alignas(64) int32_t k_sums[16];
  alignas(64) uint32_t qw[kInt8 ? 2 * kMaxRows : 1][kMaxD / 4];
  float q_scales[2 * kMaxRows];
  const int64_t k_head = (int64_t)(D + kKeyExtra<Cache>) * page_size;
  const int64_t v_head = (int64_t)(D + kValueExtra<Cache>) * page_size;  // an int8 cache's
  const bool sink_rows = window.q_sink != nullptr;
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    memset(acc[r], 0, sizeof(float) * D);
    if constexpr (kInt8) {
      q_scales[r] = query_words(q + row_at(r, G, H, D), qw[r], D);
      if (sink_rows) q_scales[kMaxRows + r] = query_words(window.q_sink + row_at(r, G, H, D), qw[kMaxRows + r], D);
    }
  }
  const int DV = kDV ? kDV : D / 16;  // compile-time for common head sizes: registers, unrolled
  const int n_keys = ctx[tokens - 1];  // the last token sees the most keys
  int ancestor[64];  // a tree token's ancestors (and itself) as offsets from the tree's start
  if (tree_start >= 0)
    for (int i = 0, b = 0; b < 64; ++b)
      if (tree_bits >> b & 1) ancestor[i++] = b;
  // Under a window the keys [gap_lo, gap_hi) are seen by no row (their pages may be gone): the
  // blocks wholly inside are skipped, the lanes of the others read as zeros. Whole pages, so
  // the keys read (sink pages, the pages of the windows) are those the sequence holds.
  const int sink_max = window.sink_end(n_keys), lo_min = window.lowest(ctx[0]);
  const int gap_lo = (sink_max + page_size - 1) / page_size * page_size;
  const int gap_hi = std::max(gap_lo, lo_min / page_size * page_size);
  // Blocks are aligned to absolute key positions, so the order of every floating-point
  // operation of a row depends only on that row's context length (and window).
  for (int start = 0; start < n_keys; start += 16) {
    if (start >= gap_lo && start + 16 <= gap_hi) {  // on to the block holding gap_hi
      start = gap_hi / 16 * 16 - 16;
      continue;
    }
    const int n = std::min(16, n_keys - start);
    // Copy the keys [start, start + n) run by run (a run lies in one page) and widen them; a
    // tree token's keys from its tree's start on are single runs from its ancestors' positions.
    for (int j = 0; j < n;) {
      int64_t at = start + j;  // cache position of key j
      int run;
      if (at >= gap_lo && at < gap_hi) {  // zeros, never another sequence's KV or a gone page
        run = std::min(n - j, (int)(gap_hi - at));
        if constexpr (kInt8) {
          for (int e = 0; e < D / 4; ++e) memset(kq[e] + j, 0, sizeof(uint32_t) * run);
          for (int i = j; i < j + run; ++i) k_scales[i] = v_scales[i] = 0.f, k_sums[i] = 0;
          for (int g = j / 4; g < (j + run) / 4; ++g) memset(vq[g], 0, sizeof(uint32_t) * D);
        } else {
          for (int d = 0; d < D; ++d) fstore_first(kt[d] + j, fzero(), run);
          for (int i = j; i < j + run; ++i) memset(vf[i], 0, sizeof(float) * D);
        }
        j += run;
        continue;
      }
      if (tree_start >= 0 && at >= tree_start) {
        at = tree_start + ancestor[at - tree_start];
        run = 1;
      } else {
        run = std::min(n - j, page_size - (int)(at % page_size));
        if (tree_start >= 0) run = std::min(run, (int)(tree_start - at));
      }
      const int64_t page_id = pages[at / page_size];
      const int offset = (int)(at % page_size);
      const Cache* kh = kc + (page_id * KVH + kvh) * k_head;
      if constexpr (kInt8) {
        // Keys: rows of 4 * page_size bytes, codes by 4 dimensions, then scales, then code sums.
        const uint32_t* rows = (const uint32_t*)kh + offset;
        for (int e = 0; e < D / 4; ++e) copy_words(kq[e] + j, rows + (int64_t)e * page_size, run);
        copy_words(k_scales + j, rows + (int64_t)(D / 4) * page_size, run);
        copy_words(k_sums + j, rows + (int64_t)(D / 4 + 1) * page_size, run);
        // Values: rows of D words (one per 4 keys: a run holds whole rows), then scales.
        const Cache* vh = vc + (page_id * KVH + kvh) * v_head;
        if (!(tree_start >= 0 && start + j >= tree_start)) {  // runs start at a row (4 keys)
          for (int g = 0; g < (run + 3) / 4; ++g)
            memcpy(vq[j / 4 + g], vh + (int64_t)(offset + 4 * g) * D, sizeof(uint32_t) * D);
        } else {  // a tree's key: its byte of its row's words into lane j's byte, one by one
          const Cache* row = vh + (int64_t)(offset / 4) * 4 * D;
          for (int d = 0; d < D; ++d) ((Cache*)vq[j / 4])[4 * d + j % 4] = row[4 * d + offset % 4];
        }
        memcpy(v_scales + j, vh + (int64_t)D * page_size + 4 * offset, sizeof(float) * run);
      } else {
        for (int d = 0; d < D; ++d)
          fstore_first(kt[d] + j, fload_first(kh + (int64_t)d * page_size + offset, run), run);
        for (int i = 0; i < run; ++i) {
          const Cache* v = vc + ((page_id * page_size + offset + i) * KVH + kvh) * D;
          for (int d = 0; d < DV; ++d) fstore(vf[j + i] + 16 * d, fload(v + 16 * d));
        }
      }
      j += run;
    }
    if (n < 16) {  // keys past the end score zero (then masked), never garbage
      if constexpr (kInt8) {
        for (int e = 0; e < D / 4; ++e) memset(kq[e] + n, 0, sizeof(uint32_t) * (16 - n));
        for (int j = n; j < 16; ++j) k_scales[j] = v_scales[j] = 0.f, k_sums[j] = 0;
      } else {
        for (int d = 0; d < D; ++d) fstore_first(kt[d] + n, fzero(), 16 - n);
      }
    }
    // Three passes over the rows (scores, softmax update, weighted values) rather than one row
    // at a time: the rows are independent, so each pass's long-latency chains (the reductions,
    // exp) overlap across rows.
    alignas(64) float pj[kMaxRows][16];
    float alpha[kMaxRows];
    int n_row[kMaxRows];  // keys of the block up to the row's last one seen (0: none)
    uint16_t live[kMaxRows];
    for (int r = 0; r < R; ++r) {
      live[r] = window.visible(start, ctx[r / G]);
      n_row[r] = live[r] ? 32 - __builtin_clz((uint32_t)live[r]) : 0;
    }
    // The rows' scores with their queries, then (a block holding sinks some row scores from
    // its sink position) with their sink queries, taken for the lanes of those sinks.
    for (int pass = 0; pass < (sink_rows && start < sink_max ? 2 : 1); ++pass) {
      alignas(64) float ps[kMaxRows][16];
      float (*dst)[16] = pass ? ps : pj;
      const float* qs = pass ? window.q_sink : q;
      for (int r0 = 0; r0 < R; r0 += 4) {
        if constexpr (kInt8) {
          const uint32_t* qr[4];
          for (int i = 0; i < 4; ++i) qr[i] = qw[pass * kMaxRows + std::min(r0 + i, R - 1)];
          block_scores_q8(qr, q_scales + pass * kMaxRows + r0, D, scale, k_scales, k_sums,
                          [&](int e) { return bload(kq[e]); }, dst + r0, std::min(4, R - r0));
        } else {
          const float* qr[4];
          for (int i = 0; i < 4; ++i) qr[i] = qs + row_at(std::min(r0 + i, R - 1), G, H, D);
          block_scores(qr, DV, scale, [&](int d) { return fload(kt[d]); }, dst + r0,
                       std::min(4, R - r0));
        }
      }
      if (pass)
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < std::min(16, window.sink_end(ctx[r / G]) - start); ++j) pj[r][j] = ps[r][j];
    }
    for (int r = 0; r < R; ++r)
      if (n_row[r] > 0) {
        alpha[r] = softmax_update(pj[r], live[r], m[r], l[r]);
        if constexpr (kInt8) scale_weights(pj[r], live[r], v_scales);
      }
    if constexpr (kInt8) {  // exact integer sums, 4 rows at a time
      alignas(64) uint32_t w[kMaxRows][8];
      float step[kMaxRows];
      bool alive[kMaxRows + 3] = {};
      for (int r = 0; r < R; ++r)
        if ((alive[r] = n_row[r] > 0)) step[r] = weight_words(pj[r], w[r]);
      for (int r0 = 0; r0 < R; r0 += 4)
        for (int d0 = 0; d0 < DV; d0 += 4) {
          const int dn = std::min(4, DV - d0);
          I16 dots[4][4];
          value_dots(w + r0, alive + r0, (n + 3) / 4, [&](int g) { return vq[g]; }, d0, dn, dots);
          for (int r = r0; r < std::min(R, r0 + 4); ++r)
            if (alive[r]) add_value_dots(acc[r], alpha[r], step[r], dots[r - r0], d0, dn);
        }
    } else {
      // Keys outer, head-dim chunks inner: the DV accumulators are independent FMA chains that
      // overlap (one chain per chunk would wait on the FMA latency at every key). A lane the row
      // does not see has weight 0 (softmax_update) against a finite value: it adds nothing.
      for (int r = 0; r < R; ++r) {
        if (n_row[r] <= 0) continue;
        F16 a[kMaxD / 16];
        for (int d = 0; d < DV; ++d) a[d] = fmul(fload(acc[r] + 16 * d), fset(alpha[r]));
        for (int j = 0; j < n_row[r]; ++j) {
          const F16 p = fset(pj[r][j]);
          for (int d = 0; d < DV; ++d) a[d] = fmadd(p, fload(vf[j] + 16 * d), a[d]);
        }
        for (int d = 0; d < DV; ++d) fstore(acc[r] + 16 * d, a[d]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(acc[r], l[r], out + row_at(r, G, H, D), D);
}

// The same for at most 4 rows (a decoded token's query heads of this KV head) when pages hold a
// multiple of 16 keys (a block is then one page run): keys and values are read straight from the
// cache (widened as they are used; an int8 cache's as codes), and the work goes in chunks of
// kChunk blocks: every block's scores first (independent of each other, so several pages' loads
// are in flight at once), then each row's softmax updates block after block, then the weighted
// values with keys outer and rows inner, so a value vector is loaded (and widened) once for all
// rows. 10-20% faster than attend_group on decode over 16 streams (alternating runs). Under a
// window it visits the sink blocks and the window's; a block is a whole page's run, so the keys
// of one that a row does not see are in a page the sequence holds, and are masked.
template <int kDV, typename Cache, typename Out>
void attend_direct(const float* q, const Cache* kc, const Cache* vc, PageTable pages,
                   const int32_t* ctx, int tokens, int kvh, int G, int H, int KVH, int D,
                   int page_size, float scale, Out* out, Window window) {
  constexpr int kChunk = 4;
  const int R = tokens * G;
  const int DV = kDV ? kDV : D / 16;
  constexpr bool kInt8 = kKeyExtra<Cache> > 0;
  const float* qr[4];
  alignas(64) uint32_t qw[kInt8 ? 8 : 1][kMaxD / 4];  // an int8 cache's quantized queries
  const uint32_t* qwr[2][4] = {};  // and then its sink queries
  float q_scales[2][4] = {};
  const float* qsr[4];  // the rows' sink queries (attend_group's second pass)
  const bool sink_rows = window.q_sink != nullptr;
  int row_ctx[4];
  for (int i = 0; i < 4; ++i) {
    const int r = std::min(i, R - 1);
    qr[i] = q + row_at(r, G, H, D);
    qsr[i] = sink_rows ? window.q_sink + row_at(r, G, H, D) : qr[i];
    row_ctx[i] = ctx[r / G];
  }
  float m[4], l[4];
  alignas(64) float acc[4][kMaxD];
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    memset(acc[r], 0, sizeof(float) * D);
    if constexpr (kInt8) {
      q_scales[0][r] = query_words(qr[r], qw[r], D), qwr[0][r] = qw[r];
      if (sink_rows) q_scales[1][r] = query_words(qsr[r], qw[4 + r], D), qwr[1][r] = qw[4 + r];
    }
  }
  const int n_keys = ctx[tokens - 1];
  // The blocks read: under a window the sink blocks, then those from the one holding the first
  // token's oldest key (a block lies in one page: pages hold a multiple of 16 keys), as block
  // indices 0 .. n_blocks.
  const int sink_max = window.sink_end(n_keys);
  int sink_blocks = (sink_max + 15) / 16, first = window.lowest(ctx[0]) / 16;
  if (sink_blocks >= first) sink_blocks = first = 0;  // no gap between them
  const int n_blocks = sink_blocks + (n_keys + 15) / 16 - first;
  auto block_start = [&](int i) { return 16 * (i < sink_blocks ? i : i - sink_blocks + first); };
  auto prefetch = [&](int i, bool keys) {
    if (i >= n_blocks) return;
    if (keys) prefetch_keys(kc, pages, block_start(i), n_keys, kvh, KVH, D, page_size);
    else prefetch_values(vc, pages, block_start(i), n_keys, kvh, KVH, D, page_size);
  };
  const int64_t k_head = (int64_t)(D + kKeyExtra<Cache>) * page_size;
  const int64_t v_head = (int64_t)(D + kValueExtra<Cache>) * page_size;  // an int8 cache's
  const int64_t v_stride = (int64_t)KVH * D;  // between slots' values in a float cache
  for (int b = 0; b < kChunk; ++b) prefetch(b, true), prefetch(b, false);  // the first chunk;
  // each block asks for its next chunk's.
  for (int c0 = 0; c0 < n_blocks; c0 += kChunk) {
    const int nb = std::min(kChunk, n_blocks - c0);
    alignas(64) float pj[kChunk][4][16];
    float alpha[kChunk][4];
    int n_row[kChunk][4];
    uint16_t live[kChunk][4];
    const Cache* vb[kChunk];
    alignas(64) float v_scales[kChunk][16];
    for (int b = 0; b < nb; ++b) {
      const int start = block_start(c0 + b);
      prefetch(c0 + b + kChunk, true);
      const int64_t page_id = pages[start / page_size];
      const int offset = start % page_size;
      const Cache* kh = kc + (page_id * KVH + kvh) * k_head;
      for (int r = 0; r < R; ++r) {
        live[b][r] = window.visible(start, row_ctx[r]);
        n_row[b][r] = live[b][r] ? 32 - __builtin_clz((uint32_t)live[b][r]) : 0;
      }
      // The rows' scores, then (a block of sinks scored from a moved position) their sink
      // queries' for the sink lanes, as attend_group. Keys a row does not see (past the end,
      // before its window) are masked out of the softmax.
      const bool sink_pass = sink_rows && start < sink_max;
      alignas(64) float ps[4][16];
      if constexpr (kInt8) {
        const Cache* vh = vc + (page_id * KVH + kvh) * v_head;
        vb[b] = vh + (int64_t)offset * D;  // 4 rows of D words
        for (int j = 0; j < 16; ++j) v_scales[b][j] = 0.f;
        memcpy(v_scales[b], vh + (int64_t)D * page_size + 4 * offset, sizeof(float) * std::min(16, n_keys - start));
        const uint32_t* rows = (const uint32_t*)kh + offset;  // codes by 4 dimensions, scales, sums
        const float* ks = (const float*)(rows + (int64_t)(D / 4) * page_size);
        const int32_t* sums = (const int32_t*)(rows + (int64_t)(D / 4 + 1) * page_size);
        auto key_quad = [&](int e) { return bload(rows + (int64_t)e * page_size); };
        with_rows(R, [&](auto rows) {
          block_scores_q8<rows>(qwr[0], q_scales[0], D, scale, ks, sums, key_quad, pj[b], R);
          if (sink_pass) block_scores_q8<rows>(qwr[1], q_scales[1], D, scale, ks, sums, key_quad, ps, R);
        });
      } else {
        vb[b] = vc + ((page_id * page_size + offset) * KVH + kvh) * D;
        auto key_dim = [&](int d) { return fload(kh + (int64_t)d * page_size + offset); };
        with_rows(R, [&](auto rows) {
          block_scores<rows>(qr, DV, scale, key_dim, pj[b], R);
          if (sink_pass) block_scores<rows>(qsr, DV, scale, key_dim, ps, R);
        });
      }
      if (sink_pass)
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < std::min(16, window.sink_end(row_ctx[r]) - start); ++j) pj[b][r][j] = ps[r][j];
    }
    for (int b = 0; b < nb; ++b)
      for (int r = 0; r < R; ++r)
        if (n_row[b][r] > 0) {
          alpha[b][r] = softmax_update(pj[b][r], live[b][r], m[r], l[r]);
          if constexpr (kInt8) scale_weights(pj[b][r], live[b][r], v_scales[b]);
        }
    if constexpr (kInt8) {  // each row's weights as words of 4 keys against the value rows
      alignas(64) uint32_t w[kChunk][4][8];
      float step[kChunk][4];
      bool live[kChunk][4];
      int quads[kChunk];
      for (int b = 0; b < nb; ++b) {
        int n_max = 0;
        for (int r = 0; r < 4; ++r) {
          live[b][r] = r < R && n_row[b][r] > 0;
          if (live[b][r]) step[b][r] = weight_words(pj[b][r], w[b][r]), n_max = std::max(n_max, n_row[b][r]);
        }
        quads[b] = (n_max + 3) / 4;  // words past every row's keys are 0
      }
      for (int d0 = 0; d0 < DV; d0 += 4)  // 64 dimensions at a time: 16 integer accumulators
        for (int b = 0; b < nb; ++b) {
          if (d0 == 0) prefetch(c0 + b + kChunk, false);
          const int dn = std::min(4, DV - d0);
          I16 dots[4][4];
          const uint32_t* rows = (const uint32_t*)vb[b];
          value_dots(w[b], live[b], quads[b], [&](int g) { return rows + (int64_t)g * D; }, d0, dn, dots);
          for (int r = 0; r < R; ++r)
            if (live[b][r]) add_value_dots(acc[r], alpha[b][r], step[b][r], dots[r], d0, dn);
        }
    } else {
      for (int d0 = 0; d0 < DV; d0 += 4) {  // 64 dimensions at a time: 16 accumulators
        const int dn = std::min(4, DV - d0);
        for (int b = 0; b < nb; ++b) {
          if (d0 == 0) prefetch(c0 + b + kChunk, false);
          F16 a[4][4];
          int n_max = 0;
          // Rows loop to 4 (guarded) so that the compiler unrolls them: a[][] stays in registers.
          for (int r = 0; r < 4; ++r) {
            if (r >= R || n_row[b][r] <= 0) continue;
            n_max = std::max(n_max, n_row[b][r]);
            for (int d = 0; d < dn; ++d)
              a[r][d] = fmul(fload(acc[r] + 16 * (d0 + d)), fset(alpha[b][r]));
          }
          for (int j = 0; j < n_max; ++j) {
            F16 v[4];
            for (int d = 0; d < dn; ++d) v[d] = fload(vb[b] + j * v_stride + 16 * (d0 + d));
            for (int r = 0; r < 4; ++r) {
              if (r >= R || j >= n_row[b][r]) continue;
              const F16 p = fset(pj[b][r][j]);
              for (int d = 0; d < dn; ++d) a[r][d] = fmadd(p, v[d], a[r][d]);
            }
          }
          for (int r = 0; r < 4; ++r)
            if (r < R && n_row[b][r] > 0)
              for (int d = 0; d < dn; ++d) fstore(acc[r] + 16 * (d0 + d), a[r][d]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(acc[r], l[r], out + row_at(r, G, H, D), D);
}

template <typename Cache, typename Out>
void attention(const float* q, const Cache* kc, const Cache* vc, const int32_t* pages,
               const int64_t* page_off, const int32_t* page_skip, const int32_t* ctx,
               const int32_t* tree_start, const uint64_t* tree_bits, Out* out, int T, int H,
               int KVH, int D, int page_size, float scale, Window window) {
  const int G = H / KVH;
  const int max_tokens = std::max(1, kMaxRows / G);
  auto in_tree = [&](int t) { return tree_start && tree_start[t] >= 0; };
  // Groups of consecutive tokens of one sequence (a prefill chunk), each token one more key; a
  // draft tree's token alone.
  std::vector<int> group_start;
  for (int t = 0; t < T; ++t) {
    const int s = group_start.empty() ? -1 : group_start.back();
    if (s < 0 || t - s >= max_tokens || page_off[t] != page_off[s] || ctx[t] != ctx[t - 1] + 1 ||
        in_tree(t) || in_tree(s))
      group_start.push_back(t);
  }
  const int groups = (int)group_start.size();
  group_start.push_back(T);
  auto* group = D == 64 ? attend_group<4, Cache, Out>
              : D == 128 ? attend_group<8, Cache, Out> : attend_group<0, Cache, Out>;
  auto* direct = D == 64 ? attend_direct<4, Cache, Out>
               : D == 128 ? attend_direct<8, Cache, Out> : attend_direct<0, Cache, Out>;
  const int sink_pages = (window.sinks + page_size - 1) / page_size;
  auto attend = [&](int i, int kvh) {
    const int t = group_start[i], n = group_start[i + 1] - t;
    const int64_t row = ((int64_t)t * H + kvh * G) * D;
    Out* ot = out + row;
    const PageTable table{pages + page_off[t], sink_pages, page_skip ? page_skip[t] : 0};
    Window w = window;
    if (w.q_sink) w.q_sink += row;
    if (in_tree(t))
      group(q + row, kc, vc, table, ctx + t, n, kvh, G, H, KVH, D, page_size, scale, ot,
            tree_start[t], tree_bits[t], w);
    else if (n * G <= 4 && page_size % 16 == 0)
      direct(q + row, kc, vc, table, ctx + t, n, kvh, G, H, KVH, D, page_size, scale, ot, w);
    else
      group(q + row, kc, vc, table, ctx + t, n, kvh, G, H, KVH, D, page_size, scale, ot, -1, 0, w);
  };
  // Rows are independent, so how they are grouped or spread over threads cannot change them.
  // With enough groups a thread takes all KV heads of one: it then reads each page's keys and
  // values whole (decode over 16 streams: 3-17% faster than a head per thread, measured in
  // alternating runs); with few (one decode stream) the heads are spread over the threads.
  if (groups >= 2 * omp_get_num_threads()) {
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < groups; ++i)
      for (int kvh = 0; kvh < KVH; ++kvh) attend(i, kvh);
  } else {
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int i = 0; i < groups; ++i)
      for (int kvh = 0; kvh < KVH; ++kvh) attend(i, kvh);
  }
}

template <typename QKV, typename Cache, typename Out>
void run(const void* qkv, const float* cos, const float* sin, const int64_t* slots, float* q_buf,
         void* kc, void* vc, const int32_t* pages, const int64_t* page_off, const int32_t* ctx,
         const int32_t* tree_start, const uint64_t* tree_bits, void* out, int T, int H, int KVH,
         int D, int page_size, float scale, const float* sink_cos, const float* sink_sin,
         float* q_sink, const int32_t* page_skip, Window window) {
  // One parallel region for both (each thread finds the same groups): a region's start and end
  // cost more than the barrier between its loops.
#pragma omp parallel
  {
    rope_and_store((const QKV*)qkv, cos, sin, slots, q_buf, (Cache*)kc, (Cache*)vc, T, H, KVH, D,
                   page_size, sink_cos, sink_sin, q_sink);
    attention(q_buf, (const Cache*)kc, (const Cache*)vc, pages, page_off, page_skip, ctx,
              tree_start, tree_bits, (Out*)out, T, H, KVH, D, page_size, scale, window);
  }
}

}  // namespace

extern "C" {

// flags: bit 0 = qkv is bf16, bit 1 = caches are bf16, bit 2 = out is bf16 (else fp32), bit 4 =
// caches are int8 (with scales; bit 1 clear).
// tree_start and tree_bits: null when no token of the step belongs to a draft tree.
// window 0: no sliding window (this layer attends densely); sink_cos, sink_sin: null when no
// query scores its sinks from another position (q_sink, (T, H, D) float32 scratch, unused then).
void lm_paged_attention(const void* qkv, const float* cos, const float* sin, const int64_t* slots,
                        float* q_buf, void* kc, void* vc, const int32_t* pages,
                        const int64_t* page_off, const int32_t* ctx, const int32_t* tree_start,
                        const uint64_t* tree_bits, void* out, int T, int H, int KVH, int D,
                        int page_size, float scale, int flags, int threads,
                        const float* sink_cos, const float* sink_sin, float* q_sink,
                        const int32_t* page_skip, int window, int sinks) {
  omp_set_num_threads(threads);
  if (!window || !sink_cos) q_sink = nullptr;
  const Window w{window, window ? sinks : 0, q_sink};
#define LM_CASE(bits, A, B, C)                                                                  \
  case bits:                                                                                    \
    run<A, B, C>(qkv, cos, sin, slots, q_buf, kc, vc, pages, page_off, ctx, tree_start,         \
                 tree_bits, out, T, H, KVH, D, page_size, scale, w.q_sink ? sink_cos : nullptr, \
                 sink_sin, q_sink, page_skip, w);                                               \
    break;
  switch (flags) {
    LM_CASE(0, float, float, float)
    LM_CASE(1, uint16_t, float, float)
    LM_CASE(2, float, uint16_t, float)
    LM_CASE(3, uint16_t, uint16_t, float)
    LM_CASE(4, float, float, uint16_t)
    LM_CASE(5, uint16_t, float, uint16_t)
    LM_CASE(6, float, uint16_t, uint16_t)
    LM_CASE(7, uint16_t, uint16_t, uint16_t)
    LM_CASE(16, float, int8_t, float)  // int8 caches: integer scores and values (dpbusd)
    LM_CASE(17, uint16_t, int8_t, float)
    LM_CASE(20, float, int8_t, uint16_t)
    LM_CASE(21, uint16_t, int8_t, uint16_t)
  }
#undef LM_CASE
}

// The same with its arguments as 64-bit words, in order, for call lists (call_list.cpp).
void lm_paged_attention_packed(const int64_t* a) {
  lm_paged_attention((const void*)a[0], (const float*)a[1], (const float*)a[2], (const int64_t*)a[3],
                     (float*)a[4], (void*)a[5], (void*)a[6], (const int32_t*)a[7],
                     (const int64_t*)a[8], (const int32_t*)a[9], (const int32_t*)a[10],
                     (const uint64_t*)a[11], (void*)a[12], (int)a[13], (int)a[14], (int)a[15],
                     (int)a[16], (int)a[17], word_to_f32(a[18]), (int)a[19], (int)a[20],
                     (const float*)a[21], (const float*)a[22], (float*)a[23], (const int32_t*)a[24],
                     (int)a[25], (int)a[26]);
}
}
