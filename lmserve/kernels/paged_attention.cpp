// Paged attention for CPUs with AVX-512: rotary embedding, KV-cache store and causal attention of
// a flat batch of tokens in one call per layer.
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
//   page_off   (T,)                   int64 index into `pages` where the token's page list starts
//   ctx        (T,)                   int32 keys the token sees (its position + 1)
//   out        (T, H, D)              bf16 or fp32
#include <omp.h>
#include <string.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace lm;

constexpr int kMaxD = 256;      // head_dim limit (multiple of 16)

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

template <typename QKV, typename Cache>
void rope_and_store(const QKV* qkv, const float* cos, const float* sin, const int64_t* slots,
                    float* q_out, Cache* kc, Cache* vc, int T, int H, int KVH, int D,
                    int page_size) {
  const int64_t row = (int64_t)(H + 2 * KVH) * D;
#pragma omp parallel for schedule(static)
  for (int t = 0; t < T; ++t) {
    const QKV* src = qkv + t * row;
    const float* c = cos + (int64_t)t * D;
    const float* s = sin + (int64_t)t * D;
    for (int h = 0; h < H; ++h) rotate_head(src + h * D, c, s, q_out + ((int64_t)t * H + h) * D, D);
    const int64_t page = slots[t] / page_size, offset = slots[t] % page_size;
    Cache* kdst = kc + page * KVH * D * page_size + offset;  // dimension d of head h at
    Cache* vdst = vc + slots[t] * KVH * D;                    // kdst[(h * D + d) * page_size]
    for (int h = 0; h < KVH; ++h) {
      rotate_head(src + (H + h) * D, c, s, kdst + (int64_t)h * D * page_size, D, page_size);
      const QKV* v = src + (H + KVH + h) * D;
      for (int i = 0; i < D; ++i) store_elem(vdst + h * D + i, to_f32(v[i]));
    }
  }
}

constexpr int kMaxRows = 16;  // query rows (tokens x heads of one KV head) sharing a key block;
                              // so at most 16 query heads per KV head (checked in cpu_paged.py)

// Attention of the rows of `tokens` consecutive tokens of one sequence (token i sees keys
// [0, ctx[i])) and the G query heads sharing KV head `kvh`, key block by key block; a row's
// arithmetic is the same as if it were alone.
template <int kDV, typename Cache, typename Out>
void attend_group(const float* q, const Cache* kc, const Cache* vc, const int32_t* pages,
                  const int32_t* ctx, int tokens, int kvh, int G, int H, int KVH, int D,
                  int page_size, float scale, Out* out) {
  const int R = tokens * G;  // rows: token-major, then head
  float m[kMaxRows], l[kMaxRows];
  alignas(64) float acc[kMaxRows][kMaxD];
  alignas(64) float kt[kMaxD][16], vf[16][kMaxD];  // a block's keys transposed, its values
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    memset(acc[r], 0, sizeof(float) * D);
  }
  const int DV = kDV ? kDV : D / 16;  // compile-time for common head sizes: registers, unrolled
  const int n_keys = ctx[tokens - 1];  // the last token sees the most keys
  // The keys [start, start + n) as runs within one page: fn(j, run, page id, offset in page).
  // A block is one run when pages hold a multiple of 16 keys (blocks are aligned to 16).
  auto for_each_run = [&](int start, int n, auto fn) {
    int page = start / page_size, offset = start % page_size;
    for (int j = 0; j < n;) {
      const int run = std::min(n - j, page_size - offset);
      fn(j, run, (int64_t)pages[page], offset);
      j += run;
      offset += run;
      if (offset == page_size) offset = 0, ++page;
    }
  };
  // Where dimension d of a page's keys for this head starts (page_size keys follow).
  auto key_dims = [&](int64_t page_id, int offset) {
    return kc + (page_id * KVH + kvh) * D * page_size + offset;
  };
  // The block of keys from `start` for every row: key_dim(d) gives the 16 keys' dimension d,
  // value(j, d) the j-th key's values d*16 .. d*16+15.
  auto passes = [&](int start, auto key_dim, auto value) {
    // Three passes over the rows (scores, softmax update, weighted values) rather than one row
    // at a time: the rows are independent, so each pass's long-latency chains (the reductions,
    // exp) overlap across rows. A row's own operations and their order are unchanged.
    alignas(64) float pj[kMaxRows][16];
    float alpha[kMaxRows];
    int n_row[kMaxRows];
    for (int r = 0; r < R; ++r) n_row[r] = std::min(16, ctx[r / G] - start);  // keys it sees
    // The 16 keys' scores in the lanes of one vector: q[d] times the keys' dimension d, summed
    // over d in four interleaved chains (d mod 4) added at the end: a row's order is fixed.
    // Rows go four at a time so that each load of a key dimension serves four rows (a short
    // last group repeats its last row).
    for (int r0 = 0; r0 < R; r0 += 4) {
      const float* qr[4];
      for (int i = 0; i < 4; ++i) {
        const int r = std::min(r0 + i, R - 1);
        qr[i] = q + ((int64_t)(r / G) * H + r % G) * D;
      }
      __m512 part[4][4];
      for (int i = 0; i < 4; ++i)
        for (int u = 0; u < 4; ++u) part[i][u] = _mm512_setzero_ps();
      for (int d = 0; d < 16 * DV; d += 4)
        for (int u = 0; u < 4; ++u) {
          const __m512 k = key_dim(d + u);
          for (int i = 0; i < 4; ++i)
            part[i][u] = _mm512_fmadd_ps(_mm512_set1_ps(qr[i][d + u]), k, part[i][u]);
        }
      for (int i = 0; i < 4 && r0 + i < R; ++i) {
        const __m512 dots = _mm512_add_ps(_mm512_add_ps(part[i][0], part[i][1]),
                                          _mm512_add_ps(part[i][2], part[i][3]));
        _mm512_store_ps(pj[r0 + i], _mm512_mul_ps(dots, _mm512_set1_ps(scale)));
      }
    }
    for (int r = 0; r < R; ++r) {
      if (n_row[r] <= 0) continue;
      const __mmask16 live = (__mmask16)((1u << n_row[r]) - 1);
      const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_load_ps(pj[r]));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(sv));
      const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
      alpha[r] = m[r] == -INFINITY ? 0.f : std::exp(m[r] - m_new);
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(p);
      m[r] = m_new;
      _mm512_store_ps(pj[r], p);
    }
    // Keys outer, head-dim chunks inner: the DV accumulators are independent FMA chains that
    // overlap (one chain per chunk would wait on the FMA latency at every key). Each element
    // still sums its keys in key order, so the result is the same.
    for (int r = 0; r < R; ++r) {
      if (n_row[r] <= 0) continue;
      __m512 a[kMaxD / 16];
      for (int d = 0; d < DV; ++d)
        a[d] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * d), _mm512_set1_ps(alpha[r]));
      for (int j = 0; j < n_row[r]; ++j) {
        const __m512 p = _mm512_set1_ps(pj[r][j]);
        for (int d = 0; d < DV; ++d) a[d] = _mm512_fmadd_ps(p, value(j, d), a[d]);
      }
      for (int d = 0; d < DV; ++d) _mm512_store_ps(acc[r] + 16 * d, a[d]);
    }
  };
  // A few rows (one decoded token's heads) read the block straight from the cache, converting
  // as they go, when every block lies in one page (pages of a multiple of 16 keys); more rows
  // share a float32 copy. Widening is exact, so both give the same bits; keys past the end are
  // masked out of the softmax either way.
  const bool direct = R <= 4 && page_size % 16 == 0;
  // Blocks are aligned to absolute key positions, so the order of every floating-point
  // operation of a row depends only on that row's context length.
  for (int start = 0; start < n_keys; start += 16) {
    const int n = std::min(16, n_keys - start);
    if (!direct) {
      for_each_run(start, n, [&](int j, int run, int64_t page_id, int offset) {
        const Cache* k = key_dims(page_id, offset);
        if (run == 16) {
          for (int d = 0; d < D; ++d) _mm512_store_ps(kt[d], load16(k + (int64_t)d * page_size));
        } else {
          const __mmask16 lanes = (__mmask16)((1u << run) - 1);
          for (int d = 0; d < D; ++d)
            _mm512_mask_storeu_ps(kt[d] + j, lanes, load16_masked(k + (int64_t)d * page_size, lanes));
        }
        for (int i = 0; i < run; ++i) {
          const Cache* v = vc + ((page_id * page_size + offset + i) * KVH + kvh) * D;
          for (int d = 0; d < DV; ++d) _mm512_store_ps(vf[j + i] + 16 * d, load16(v + 16 * d));
        }
      });
      if (n < 16)  // keys past the end score zero (then masked), never garbage
        for (int d = 0; d < D; ++d) _mm512_mask_storeu_ps(kt[d], (__mmask16)(0xffffu << n), _mm512_setzero_ps());
      passes(start, [&](int d) { return _mm512_load_ps(kt[d]); },
             [&](int j, int d) { return _mm512_load_ps(vf[j] + 16 * d); });
    } else {
      const int64_t page_id = pages[start / page_size];
      const int offset = start % page_size;
      const Cache* k = key_dims(page_id, offset);
      const Cache* v = vc + ((page_id * page_size + offset) * KVH + kvh) * D;
      passes(start, [&](int d) { return load16(k + (int64_t)d * page_size); },
             [&](int j, int d) { return load16(v + (int64_t)j * KVH * D + 16 * d); });
    }
  }
  for (int r = 0; r < R; ++r) {
    const float inv = 1.f / l[r];
    Out* o = out + ((int64_t)(r / G) * H + r % G) * D;
    for (int i = 0; i < D; ++i) store_elem(o + i, acc[r][i] * inv);
  }
}

template <typename Cache, typename Out>
void attention(const float* q, const Cache* kc, const Cache* vc, const int32_t* pages,
               const int64_t* page_off, const int32_t* ctx, Out* out, int T, int H, int KVH, int D,
               int page_size, float scale) {
  const int G = H / KVH;
  const int max_tokens = std::max(1, kMaxRows / G);
  // Groups of consecutive tokens of one sequence (a prefill chunk), each token one more key.
  std::vector<int> group_start;
  for (int t = 0; t < T; ++t) {
    const int s = group_start.empty() ? -1 : group_start.back();
    if (s < 0 || t - s >= max_tokens || page_off[t] != page_off[s] || ctx[t] != ctx[t - 1] + 1)
      group_start.push_back(t);
  }
  const int groups = (int)group_start.size();
  group_start.push_back(T);
  auto* group = D == 64 ? attend_group<4, Cache, Out>
              : D == 128 ? attend_group<8, Cache, Out> : attend_group<0, Cache, Out>;
  auto attend = [&](int i, int kvh) {
    const int t = group_start[i];
    group(q + ((int64_t)t * H + kvh * G) * D, kc, vc, pages + page_off[t], ctx + t,
          group_start[i + 1] - t, kvh, G, H, KVH, D, page_size, scale,
          out + ((int64_t)t * H + kvh * G) * D);
  };
  // Rows are independent, so how they are grouped or spread over threads cannot change them.
  // With enough groups a thread takes all KV heads of one: it then reads each page's keys and
  // values whole (decode over 16 streams: 3-17% faster than a head per thread, measured in
  // alternating runs); with few
  // (one decode stream) the heads are spread over the threads instead.
  if (groups >= 2 * omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < groups; ++i)
      for (int kvh = 0; kvh < KVH; ++kvh) attend(i, kvh);
  } else {
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int i = 0; i < groups; ++i)
      for (int kvh = 0; kvh < KVH; ++kvh) attend(i, kvh);
  }
}

template <typename QKV, typename Cache, typename Out>
void run(const void* qkv, const float* cos, const float* sin, const int64_t* slots, float* q_buf,
         void* kc, void* vc, const int32_t* pages, const int64_t* page_off, const int32_t* ctx,
         void* out, int T, int H, int KVH, int D, int page_size, float scale) {
  rope_and_store((const QKV*)qkv, cos, sin, slots, q_buf, (Cache*)kc, (Cache*)vc, T, H, KVH, D,
                 page_size);
  attention(q_buf, (const Cache*)kc, (const Cache*)vc, pages, page_off, ctx, (Out*)out, T, H, KVH,
            D, page_size, scale);
}

}  // namespace

extern "C" {

// bf16: bit 0 = qkv is bf16, bit 1 = caches are bf16, bit 2 = out is bf16 (else fp32).
void lm_paged_attention(const void* qkv, const float* cos, const float* sin, const int64_t* slots,
                        float* q_buf, void* kc, void* vc, const int32_t* pages,
                        const int64_t* page_off, const int32_t* ctx, void* out, int T, int H,
                        int KVH, int D, int page_size, float scale, int bf16, int threads) {
  omp_set_num_threads(threads);
#define LM_CASE(bits, A, B, C)                                                                   \
  case bits:                                                                                     \
    run<A, B, C>(qkv, cos, sin, slots, q_buf, kc, vc, pages, page_off, ctx, out, T, H, KVH, D, \
                 page_size, scale);                                                              \
    break;
  switch (bf16) {
    LM_CASE(0, float, float, float)
    LM_CASE(1, uint16_t, float, float)
    LM_CASE(2, float, uint16_t, float)
    LM_CASE(3, uint16_t, uint16_t, float)
    LM_CASE(4, float, float, uint16_t)
    LM_CASE(5, uint16_t, float, uint16_t)
    LM_CASE(6, float, uint16_t, uint16_t)
    LM_CASE(7, uint16_t, uint16_t, uint16_t)
  }
#undef LM_CASE
}

// The same with its arguments as 64-bit words, in order, for call lists (call_list.cpp).
void lm_paged_attention_packed(const int64_t* a) {
  lm_paged_attention((const void*)a[0], (const float*)a[1], (const float*)a[2], (const int64_t*)a[3],
                     (float*)a[4], (void*)a[5], (void*)a[6], (const int32_t*)a[7],
                     (const int64_t*)a[8], (const int32_t*)a[9], (void*)a[10], (int)a[11],
                     (int)a[12], (int)a[13], (int)a[14], (int)a[15], word_to_f32(a[16]), (int)a[17],
                     (int)a[18]);
}
}
