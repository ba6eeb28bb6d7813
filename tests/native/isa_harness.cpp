// Runs lmserve's portable kernels (int8_gemm, block_gemm, dense_gemm, fused_ops) on fixed pseudo-random
// inputs, checks each against a plain scalar reference written from the layouts their sources
// document, and writes every output's bytes to stdout, so that builds for different instruction
// sets (AMX, AVX-512, AVX2, Arm64 NEON under qemu-user) can be compared bit for bit
// (tests/test_kernel_isas.py). Exit status 1 and a message on stderr when a check fails.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmath>
#include <vector>

extern "C" {
void lm_int8_gemm(const void* a, int a_f32, const uint8_t* codes, const void* consts, void* c,
                  int out_bf16, int M, int N, int K, int bits, int digits, int half_consts, int threads);
int lm_int8_gemm_tiles();
void lm_block_gemm(const void* a, int a_f32, const uint8_t* codes, const float* consts, void* c,
                   int out_bf16, int M, int N, int K, int bits, int threads);
int lm_block_gemm_tiles();
void lm_block_gemm_use_tiles(int on);
void lm_dense_gemm(const float* a, const float* w, float* c, int M, int N, int K, int threads);
void lm_add_rms_norm(float* x, const void* delta, int delta_bf16, const float* weight, float eps,
                     void* out, int out_bf16, int T, int D, int threads);
void lm_silu_mul(const void* gate_up, void* out, int bf16, int T, int F, int threads);
}

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;
uint32_t next_u32() {  // xorshift64*
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32);
}
float uniform() { return (next_u32() >> 8) * (2.0f / 16777216.0f) - 1.0f; }  // [-1, 1)

float bf16_round(float f) {  // to the nearest bf16, ties to even
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  u &= 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
}

int failures = 0;
void emit(const void* p, size_t bytes) { fwrite(p, 1, bytes, stdout); }

// max |got - ref| <= tol * max |ref| over the outputs.
void check(const char* what, const std::vector<float>& got, const std::vector<double>& ref, double tol) {
  double scale = 0, err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    scale = std::fmax(scale, std::fabs(ref[i]));
    err = std::fmax(err, std::isfinite(got[i]) ? std::fabs(got[i] - ref[i]) : INFINITY);
  }
  if (!(err <= tol * scale)) {
    fprintf(stderr, "%s: max error %g, allowed %g\n", what, err, tol * scale);
    ++failures;
  }
}

// int8_gemm's weight layout: codes (N/16, K/32, V, 16, 4), consts (N/16, K/32, 2, 16) float32.
double int8_weight(const std::vector<uint8_t>& codes, const std::vector<float>& consts, int bits,
                   int K, int n, int k) {
  const int G = K / 32, V = bits == 4 ? 4 : 8, j = n / 16, lane = n % 16, g = k / 32, e = k % 32;
  const int64_t block = (int64_t)j * G + g;
  int code;
  if (bits == 4) {
    const int f = e % 16;
    const uint8_t byte = codes[(block * V + f / 4) * 64 + lane * 4 + f % 4];
    code = e < 16 ? byte & 15 : byte >> 4;
  } else {
    code = codes[(block * V + e / 4) * 64 + lane * 4 + e % 4];
  }
  return code * (double)consts[block * 32 + lane] + consts[block * 32 + 16 + lane];
}

// block_gemm's: codes (N/4, K/32, 4, 16 | 32 | 64 bytes), consts (N/4, K/32, 2, 4) float32;
// the kernel multiplies bf16(code * scale + zero).
double block_weight(const std::vector<uint8_t>& codes, const std::vector<float>& consts, int bits,
                    int K, int n, int k) {
  const int G = K / 32, g = k / 32, e = k % 32, row = n % 4;
  const int64_t block = ((int64_t)(n / 4) * G + g);
  const uint8_t* c = codes.data() + (block * 4 + row) * (bits * 4);
  if (bits == 16) {
    uint16_t h;
    memcpy(&h, c + 2 * e, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  const int code = bits == 4 ? (e < 16 ? c[e] & 15 : c[e - 16] >> 4) : (int8_t)c[e];
  return bf16_round(code * consts[block * 8 + row] + consts[block * 8 + 4 + row]);
}

std::vector<float> random_floats(size_t n, float scale) {
  std::vector<float> v(n);
  for (float& x : v) x = uniform() * scale;
  return v;
}

std::vector<uint8_t> random_bytes(size_t n) {
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = (uint8_t)next_u32();
  return v;
}

// Every row of `c` (M x N, computed by `gemm` over all M rows) the same bits when computed alone.
template <typename Gemm>
void check_rows_alone(const char* what, const std::vector<float>& c, int M, int N, Gemm gemm) {
  for (int m = 0; m < M; ++m) {
    std::vector<float> alone(N);
    gemm(m, alone.data());
    if (memcmp(alone.data(), c.data() + (size_t)m * N, N * 4) != 0) {
      fprintf(stderr, "%s: row %d of %d differs alone\n", what, m, M);
      ++failures;
      return;
    }
  }
}

void int8_cases() {
  const int N = 48, K = 320;  // 3 groups of 16 weight rows; 10 blocks: AMX's runs of 8, then 2
  for (int bits : {4, 8})
    for (int digits : {1, 2})
      for (int M : {1, 5, 37, 100}) {  // 37 and 100: groups of 16 rows on AMX, and the rest
        const std::vector<uint8_t> codes = random_bytes((size_t)N * K * bits / 8);
        std::vector<float> consts = random_floats((size_t)N / 16 * K / 32 * 32, 0.05f);
        std::vector<float> a = random_floats((size_t)M * K, 1.0f);
        a[3] *= 20;  // an outlier
        std::vector<float> c((size_t)M * N);
        lm_int8_gemm(a.data(), 1, codes.data(), consts.data(), c.data(), 0, M, N, K, bits, digits, 0, 2);
        std::vector<double> ref((size_t)M * N);
        for (int m = 0; m < M; ++m)
          for (int n = 0; n < N; ++n)
            for (int k = 0; k < K; ++k) ref[m * N + n] += a[m * K + k] * int8_weight(codes, consts, bits, K, n, k);
        check(digits == 1 ? "int8_gemm, one digit" : "int8_gemm, two digits", c, ref, digits == 1 ? 3e-2 : 3e-4);
        char what[64];
        snprintf(what, sizeof what, "int8_gemm, %d-bit codes, %d digit(s)", bits, digits);
        check_rows_alone(what, c, M, N, [&](int m, float* out) {
          lm_int8_gemm(a.data() + (size_t)m * K, 1, codes.data(), consts.data(), out, 0, 1, N, K, bits, digits, 0, 2);
        });
        emit(c.data(), c.size() * 4);
      }
}

// bf16 products within float32 rounding of the float64 reference, each row alone as in the
// batch. Where the build has tiles they are checked so too, and the vector path's outputs are
// the ones written out (the tiles' sums are other last bits; kernels/block_gemm.cpp).
// N = 40: a strip of two column groups and one of one; M = 16: one whole row group; 20, 37: two
// at a time, the last rows zero-padded (and on vector tiles: 4 x 4 for up to 4 rows, else 8 x 2
// and the rest).
void block_cases() {
  const int N = 40, K = 96;
  for (int bits : {4, 8, 16})
    for (int a_f32 : {0, 1})
      for (int M : {1, 5, 16, 20, 37}) {
        std::vector<uint8_t> codes = random_bytes((size_t)N * K * bits / 8);
        if (bits == 16)  // bf16 weights of moderate size: exponents near 1
          for (size_t i = 1; i < codes.size(); i += 2) codes[i] = 0x3c + (codes[i] & 3);
        const std::vector<float> consts = random_floats((size_t)N / 4 * K / 32 * 8, 0.05f);
        const std::vector<float> a = random_floats((size_t)M * K, 1.0f);
        std::vector<uint16_t> a_bf16(a.size());
        for (size_t i = 0; i < a.size(); ++i) {
          const float r = bf16_round(a[i]);
          uint32_t u;
          memcpy(&u, &r, 4);
          a_bf16[i] = (uint16_t)(u >> 16);
        }
        auto gemm = [&](int m0, int rows, float* c) {
          const void* x = a_f32 ? (const void*)(a.data() + (size_t)m0 * K) : (const void*)(a_bf16.data() + (size_t)m0 * K);
          lm_block_gemm(x, a_f32, codes.data(), consts.data(), c, 0, rows, N, K, bits, 2);
        };
        std::vector<double> ref((size_t)M * N);
        for (int m = 0; m < M; ++m)
          for (int n = 0; n < N; ++n)
            for (int k = 0; k < K; ++k)
              ref[m * N + n] += (a_f32 ? a[m * K + k] : bf16_round(a[m * K + k])) *
                                block_weight(codes, consts, bits, K, n, k);
        const bool tiles = lm_block_gemm_tiles();
        for (int on : {1, 0}) {
          if (!on && !tiles) continue;  // no tiles: the first pass was the vector path
          lm_block_gemm_use_tiles(on);
          std::vector<float> c((size_t)M * N);
          gemm(0, M, c.data());
          const char* what = on && tiles ? "block_gemm on tiles" : "block_gemm";
          check(what, c, ref, a_f32 ? 2e-4 : 1e-5);
          check_rows_alone(what, c, M, N, [&](int m, float* out) { gemm(m, 1, out); });
          if (!on || !tiles) emit(c.data(), c.size() * 4);
        }
        lm_block_gemm_use_tiles(1);
      }
}

// Float32 weights as they are: within float32 rounding of the float64 product; every row the
// same bits alone (K = 100: six vectors of 16 and a rest of 4; M = 1, 5, 8: one tile of up to 8
// rows; M = 9, 12: two tiles; M = 17: tiles of 4).
void dense_cases() {
  const int N = 23, K = 100;  // N: a last strip of 3 columns for tiles of 4 wide, of 1 for 2 wide
  for (int M : {1, 5, 8, 9, 12, 17}) {
    const std::vector<float> w = random_floats((size_t)N * K, 1.0f), a = random_floats((size_t)M * K, 1.0f);
    std::vector<float> c((size_t)M * N);
    lm_dense_gemm(a.data(), w.data(), c.data(), M, N, K, 2);
    std::vector<double> ref((size_t)M * N);
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) ref[m * N + n] += (double)a[m * K + k] * w[n * K + k];
    check("dense_gemm", c, ref, 1e-6);
    check_rows_alone("dense_gemm", c, M, N, [&](int m, float* out) {
      lm_dense_gemm(a.data() + (size_t)m * K, w.data(), out, 1, N, K, 2);
    });
    emit(c.data(), c.size() * 4);
  }
}

void fused_cases() {
  const int T = 3, D = 80, F = 72;
  std::vector<float> x = random_floats((size_t)T * D, 2.0f);
  const std::vector<float> delta = random_floats((size_t)T * D, 1.0f), weight = random_floats(D, 1.0f);
  std::vector<float> normed((size_t)T * D);
  std::vector<double> ref(normed.size());
  for (int t = 0; t < T; ++t) {
    double sum = 0;
    for (int i = 0; i < D; ++i) {
      const double v = (double)x[t * D + i] + delta[t * D + i];
      sum += v * v;
    }
    for (int i = 0; i < D; ++i)
      ref[t * D + i] = weight[i] * (((double)x[t * D + i] + delta[t * D + i]) / std::sqrt(sum / D + 1e-5));
  }
  lm_add_rms_norm(x.data(), delta.data(), 0, weight.data(), 1e-5f, normed.data(), 0, T, D, 2);
  check("add_rms_norm", normed, ref, 1e-5);
  emit(normed.data(), normed.size() * 4);
  emit(x.data(), x.size() * 4);

  const std::vector<float> gate_up = random_floats((size_t)T * 2 * F, 8.0f);
  std::vector<float> out((size_t)T * F);
  std::vector<double> silu(out.size());
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < F; ++i) {
      const double g = gate_up[t * 2 * F + i];
      silu[t * F + i] = g / (1 + std::exp(-g)) * gate_up[t * 2 * F + F + i];
    }
  lm_silu_mul(gate_up.data(), out.data(), 0, T, F, 2);
  check("silu_mul", out, silu, 1e-6);
  emit(out.data(), out.size() * 4);
}

}  // namespace

int main() {
  fprintf(stderr, "int8_gemm tiles: %s\n", lm_int8_gemm_tiles() ? "on" : "off");
  fprintf(stderr, "block_gemm tiles: %s\n", lm_block_gemm_tiles() ? "on" : "off");
  int8_cases();
  block_cases();
  dense_cases();
  fused_cases();
  return failures ? 1 : 0;
}
