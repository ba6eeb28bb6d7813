// lmserve-isa: avx512 avx2 neon
// One decode token each of a batch of sequences through a Mamba / Mamba2 mixer's recurrent
// parts, reading and writing each sequence's state in place in its slot (the torch path gathers
// the states, updates the copies and scatters them back: three passes over state that is the
// largest thing a decode step of a recurrent model touches):
//   lm_conv_step:    depthwise causal convolution of the newest input with the slot's last
//                    K - 1 inputs, then SiLU; the inputs shift by one
//   lm_scan_step_v1: Mamba's selective scan, a state per channel and state index
//   lm_scan_step_v2: Mamba2's, a state per head, head dim and state index, one decay per head
// The scan outputs y = C . state, before the D skip and the gate (added in torch for every row).
#include <omp.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

using namespace lm;

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

}  // namespace

extern "C" {

// conv: (slots, C, K - 1); x: (batch, C) rows x_stride apart; w: (C, K); u: (batch, C).
void lm_conv_step(float* conv, const int64_t* slots, int batch, const float* x, int64_t x_stride,
                  const float* w, const float* bias, float* u, int channels, int kernel, int threads) {
  const int past = kernel - 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (batch * channels >= 8192)
  for (int b = 0; b < batch; ++b) {
    float* state = conv + slots[b] * (int64_t)channels * past;
    const float* xb = x + b * x_stride;
    float* ub = u + (int64_t)b * channels;
    for (int c = 0; c < channels; ++c) {
      float* s = state + (int64_t)c * past;
      const float* wc = w + (int64_t)c * kernel;
      float acc = bias[c];
      for (int k = 0; k < past; ++k) acc += wc[k] * s[k];
      acc += wc[past] * xb[c];
      for (int k = 0; k + 1 < past; ++k) s[k] = s[k + 1];
      if (past) s[past - 1] = xb[c];
      ub[c] = acc / (1.f + std::exp(-acc));
    }
  }
}

// ssm: (slots, I, N); u, dt: (batch, I); A: (I, N); bc: (batch, ...) rows bc_stride apart with
// B at 0 and C at N; y: (batch, I).
void lm_scan_step_v1(float* ssm, const int64_t* slots, int batch, const float* u, const float* dt,
                     const float* A, const float* bc, int64_t bc_stride, float* y, int inner,
                     int state_size, int threads) {
  const int N = state_size;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (batch * inner >= 256)
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < inner; ++i) {
      float* s = ssm + (slots[b] * (int64_t)inner + i) * N;
      const float* Bv = bc + b * bc_stride;
      const float* Cv = Bv + N;
      const float d = dt[(int64_t)b * inner + i], dx = d * u[(int64_t)b * inner + i];
      const float* a = A + (int64_t)i * N;
      float acc = 0.f;
      for (int n = 0; n < N; ++n) {
        s[n] = s[n] * std::exp(d * a[n]) + dx * Bv[n];
        acc += s[n] * Cv[n];
      }
      y[(int64_t)b * inner + i] = acc;
    }
  }
}

// ssm: (slots, H, P, N); u: (batch, ...) rows u_stride apart: x (H * P), B (G * N), C (G * N);
// dt_raw: (batch, ...) rows dt_stride apart, H values before the bias and softplus; y: (batch, H * P).
void lm_scan_step_v2(float* ssm, const int64_t* slots, int batch, const float* u, int64_t u_stride,
                     const float* dt_raw, int64_t dt_stride, const float* dt_bias, const float* A,
                     float* y, int heads, int head_dim, int groups,
                     int state_size, int threads) {
  const int P = head_dim, N = state_size, inner = heads * head_dim;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (batch * heads >= 8)
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const float* ub = u + b * u_stride;
      const int g = h / (heads / groups);
      const float* Bv = ub + inner + (int64_t)g * N;
      const float* Cv = ub + inner + (int64_t)groups * N + (int64_t)g * N;
      const float d = softplus(dt_raw[b * dt_stride + h] + dt_bias[h]);
      const float decay = std::exp(d * A[h]);
      float* s = ssm + (slots[b] * (int64_t)heads + h) * P * N;
      for (int p = 0; p < P; ++p) {
        const float dx = d * ub[h * P + p];
        float* sp = s + (int64_t)p * N;
        float acc = 0.f;
        for (int n = 0; n < N; ++n) {
          sp[n] = sp[n] * decay + dx * Bv[n];
          acc += sp[n] * Cv[n];
        }
        y[(int64_t)b * inner + h * P + p] = acc;
      }
    }
  }
}

}  // extern "C"
