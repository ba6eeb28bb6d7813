// lmserve-isa: avx512 avx2 neon
// The two calls a chain of greedy one-token decode passes adds to a call list around the decoder
// layers (greedy_chain.py: a draft model's drafts, a lone sequence's tokens): the token's
// embedding first (lm_embed_row_packed), and after the final norm and the head
// lm_greedy_pick_packed, which writes the best token where the next pass's embedding reads it and
// raises the stop flag that call_list.cpp's lm_run_call_passes checks between passes.
#include <stdint.h>
#include <string.h>

#include <cmath>

#include "simd.h"

namespace {

using namespace lm;

// The best value (the first index holding it) and the best of the rest, of x[0 : n]; as
// torch.argmax, a NaN counts as the best (the first NaN's index, best and second NaN).
template <typename T>
void top2(const T* x, int64_t n, int64_t* index, float* best, float* second) {
  constexpr int L = 16;  // lanes of running maxima, so the loop vectorizes
  float m1[L], m2[L];
  int nan[L] = {};
  for (int l = 0; l < L; ++l) m1[l] = m2[l] = -INFINITY;
  const int64_t whole = n / L * L;
  for (int64_t i = 0; i < whole; i += L)
    for (int l = 0; l < L; ++l) {
      const float v = to_f32(x[i + l]);
      const float lower = v < m1[l] ? v : m1[l];
      m2[l] = lower > m2[l] ? lower : m2[l];
      m1[l] = v > m1[l] ? v : m1[l];
      nan[l] |= v != v;
    }
  for (int64_t i = whole; i < n; ++i) {
    const int l = (int)(i - whole);
    const float v = to_f32(x[i]);
    const float lower = v < m1[l] ? v : m1[l];
    m2[l] = lower > m2[l] ? lower : m2[l];
    m1[l] = v > m1[l] ? v : m1[l];
    nan[l] |= v != v;
  }
  for (int l = 0; l < L; ++l)
    if (nan[l]) {
      *index = 0;
      while (to_f32(x[*index]) == to_f32(x[*index])) ++*index;
      *best = *second = NAN;
      return;
    }
  int top = 0;
  for (int l = 1; l < L; ++l)
    if (m1[l] > m1[top]) top = l;
  float rest = m2[top];
  for (int l = 0; l < L; ++l)
    if (l != top && m1[l] > rest) rest = m1[l];
  *best = m1[top];
  *second = rest;
  *index = 0;
  for (int64_t i = 0; i < n; ++i)
    if (to_f32(x[i]) == m1[top]) {
      *index = i;
      break;
    }
}

}  // namespace

extern "C" {

// out (dim,) float32 = row *token of table (V, dim), float32 or bf16 (table_bf16 = 1).
void lm_embed_row_packed(const int64_t* a) {
  const int64_t dim = a[2], token = *(const int64_t*)a[3];
  float* out = (float*)a[4];
  if (a[1]) {
    const uint16_t* row = (const uint16_t*)a[0] + token * dim;
    for (int64_t i = 0; i < dim; ++i) out[i] = bf16_to_f32(row[i]);
  } else {
    memcpy(out, (const float*)a[0] + token * dim, dim * sizeof(float));
  }
}

// The greedy token of one row of logits (vocab,), float32 or bf16 (a[1] = 1), into *a[6], and
// its lead over the second best into *a[7]; raises *a[8] when the lead is under the margin a[3]
// (a float32 word) or NaN, or the token is one of the a[5] stop ids at a[4].
void lm_greedy_pick_packed(const int64_t* a) {
  int64_t token;
  float best, second;
  if (a[1])
    top2((const uint16_t*)a[0], a[2], &token, &best, &second);
  else
    top2((const float*)a[0], a[2], &token, &best, &second);
  const float lead = best - second;
  *(int64_t*)a[6] = token;
  *(float*)a[7] = lead;
  bool stop = lead < word_to_f32(a[3]) || lead != lead;  // (a NaN: nothing to go on from)
  const int64_t* stops = (const int64_t*)a[4];
  for (int64_t i = 0; i < a[5]; ++i) stop = stop || stops[i] == token;
  if (stop) *(int32_t*)a[8] = 1;
}
}
