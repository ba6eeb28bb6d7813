// lmserve-isa: avx512 avx2 neon
// A chain of greedy one-token decode passes of one sequence from one call: a draft model's drafts
// (spec/draft_chain.py). A pass is a call list (call_list.cpp's rows): the token's embedding
// (lm_embed_row_packed), the decoder layers, the final norm, the head, and lm_greedy_pick_packed,
// which writes the best token where the next pass's embedding reads it. Between passes the driver
// moves the arguments that walk along the chain (the token, its cache slot, context length and
// rotary angles: rows of a step's metadata prepared for all the passes at once) on by their
// strides, and it stops after a pass whose pick raised the stop flag. Each pass is the same
// kernels on the same inputs as a one-token step from Python, so the same bits.
#include <stdint.h>
#include <string.h>

#include <cmath>

#include "simd.h"

namespace {

using namespace lm;

// The best value (the first index holding it) and the best of the rest, of x[0 : n].
template <typename T>
void top2(const T* x, int64_t n, int64_t* index, float* best, float* second) {
  constexpr int L = 16;  // lanes of running maxima, so the loop vectorizes
  float m1[L], m2[L];
  for (int l = 0; l < L; ++l) m1[l] = m2[l] = -INFINITY;
  const int64_t whole = n / L * L;
  for (int64_t i = 0; i < whole; i += L)
    for (int l = 0; l < L; ++l) {
      const float v = to_f32(x[i + l]);
      const float lower = v < m1[l] ? v : m1[l];
      m2[l] = lower > m2[l] ? lower : m2[l];
      m1[l] = v > m1[l] ? v : m1[l];
    }
  for (int64_t i = whole; i < n; ++i) {
    const int l = (int)(i - whole);
    const float v = to_f32(x[i]);
    const float lower = v < m1[l] ? v : m1[l];
    m2[l] = lower > m2[l] ? lower : m2[l];
    m1[l] = v > m1[l] ? v : m1[l];
  }
  int top = 0;
  for (int l = 1; l < L; ++l)
    if (m1[l] > m1[top]) top = l;
  float rest = m2[top];
  for (int l = 0; l < L; ++l)
    if (l != top && m1[l] > rest) rest = m1[l];
  *best = m1[top];
  *second = rest;
  *index = 0;  // (a row of NaNs: token 0)
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
// (a float32 word) or the token is one of the a[5] stop ids at a[4].
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
  bool stop = lead < word_to_f32(a[3]);
  const int64_t* stops = (const int64_t*)a[4];
  for (int64_t i = 0; i < a[5]; ++i) stop = stop || stops[i] == token;
  if (stop) *(int32_t*)a[8] = 1;
}

// Runs the call list `calls` (n rows of `stride` words, as lm_run_calls) up to `passes` times,
// adding strides[j] to word moving[j] (a flat index into calls) before every pass but the first;
// returns the passes run: it stops after one that sets *stop.
int lm_run_call_passes(int64_t* calls, int n, int stride, int passes, const int64_t* moving,
                       const int64_t* strides, int n_moving, const int32_t* stop) {
  for (int p = 0; p < passes; ++p) {
    if (p)
      for (int j = 0; j < n_moving; ++j) calls[moving[j]] += strides[j];
    for (int i = 0; i < n; ++i) {
      const int64_t* row = calls + (int64_t)i * stride;
      reinterpret_cast<void (*)(const int64_t*)>(row[0])(row + 1);
    }
    if (*stop) return p + 1;
  }
  return passes;
}
}
