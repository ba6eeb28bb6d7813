// lmserve-isa: avx512 avx2 neon
// Element-wise steps of a decoder layer fused into one pass each, so a decode step does not pay
// a handful of torch dispatches per layer for a few thousand numbers:
//   lm_add_rms_norm: x += delta (the previous sublayer's output); out = rms_norm(x) * weight
//   lm_silu_mul:     out = silu(gate) * up for the fused gate/up projection output
// Rows are independent and computed the same way whatever the number of rows.
#include <omp.h>

#include <cmath>

#include "simd.h"

namespace {

using namespace lm;

// Elements from which a call splits its rows over the threads: a decode batch of 16 (SiLU 10.5
// -> 6.9 us a call, the norm 3.9 -> 3.4: benchmarks/kernel_ab.py fused_ops), not one stream,
// where waking the other thread costs more than the work.
constexpr int64_t kParallelFrom = 8192;

template <typename In, typename Out>
void add_rms_norm(float* x, const In* delta, const float* weight, float eps, Out* out, int T, int D) {
  for_each_row(T, (int64_t)T * D >= kParallelFrom, [&](int64_t t) {
    float* row = x + t * D;
    if (delta) {
      const In* d = delta + (int64_t)t * D;
      for (int i = 0; i < D; ++i) row[i] += to_f32(d[i]);
    }
    F16 sq = fzero();
    int i = 0;
    for (; i + 16 <= D; i += 16) {
      const F16 v = fload(row + i);
      sq = fmadd(v, v, sq);
    }
    float sum = hsum(sq);
    for (; i < D; ++i) sum += row[i] * row[i];
    const float r = 1.0f / std::sqrt(sum / D + eps);
    Out* o = out + t * D;
    for (int j = 0; j < D; ++j) store_elem(o + j, weight[j] * (row[j] * r));
  });
}

template <typename In, typename Out>
void silu_mul(const In* gate_up, Out* out, int T, int F) {
  for_each_row(T, (int64_t)T * F >= kParallelFrom, [&](int64_t t) {
    const In* g = gate_up + t * 2 * F;
    const In* u = g + F;
    Out* o = out + t * F;
    int i = 0;
    for (; i + 16 <= F; i += 16) {
      const F16 gv = fload(g + i);
      const F16 s = fdiv(gv, fadd(fset(1.f), exp16(fsub(fzero(), gv))));
      float r[16];
      fstore(r, fmul(s, fload(u + i)));
      for (int j = 0; j < 16; ++j) store_elem(o + i + j, r[j]);
    }
    for (; i < F; ++i) {
      const float gv = to_f32(g[i]);
      store_elem(o + i, gv / (1.f + std::exp(-gv)) * to_f32(u[i]));
    }
  });
}

}  // namespace

extern "C" {

// delta may be null; delta_bf16 / out_bf16 pick bf16 (1) or float32 (0).
void lm_add_rms_norm(float* x, const void* delta, int delta_bf16, const float* weight, float eps,
                     void* out, int out_bf16, int T, int D, int threads) {
  omp_set_num_threads(threads);
  if (delta_bf16) {
    if (out_bf16) add_rms_norm(x, (const uint16_t*)delta, weight, eps, (uint16_t*)out, T, D);
    else add_rms_norm(x, (const uint16_t*)delta, weight, eps, (float*)out, T, D);
  } else {
    if (out_bf16) add_rms_norm(x, (const float*)delta, weight, eps, (uint16_t*)out, T, D);
    else add_rms_norm(x, (const float*)delta, weight, eps, (float*)out, T, D);
  }
}

// gate_up (T, 2F) -> out (T, F), same dtype (bf16 when bf16 = 1, else float32).
void lm_silu_mul(const void* gate_up, void* out, int bf16, int T, int F, int threads) {
  omp_set_num_threads(threads);
  if (bf16) silu_mul((const uint16_t*)gate_up, (uint16_t*)out, T, F);
  else silu_mul((const float*)gate_up, (float*)out, T, F);
}

// Both with their arguments as 64-bit words, in order, for call lists (call_list.cpp).
void lm_add_rms_norm_packed(const int64_t* a) {
  lm_add_rms_norm((float*)a[0], (const void*)a[1], (int)a[2], (const float*)a[3], word_to_f32(a[4]),
                  (void*)a[5], (int)a[6], (int)a[7], (int)a[8], (int)a[9]);
}
void lm_silu_mul_packed(const int64_t* a) {
  lm_silu_mul((const void*)a[0], (void*)a[1], (int)a[2], (int)a[3], (int)a[4], (int)a[5]);
}
}
