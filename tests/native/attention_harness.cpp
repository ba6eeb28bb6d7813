// Runs lmserve's paged attention kernel (rotary, KV-cache store and causal attention in one call)
// on fixed pseudo-random inputs: a prefill step of two sequences (37 and 5 tokens) and a decode
// step of one token each, dense and under a sliding window with sinks, with float32, bf16 and
// int8 caches. Checks the float32 cases against a plain scalar reference (double precision), and
// writes every output's and cache's bytes to stdout, so that builds for different instruction
// sets (AVX-512, AVX2, Arm64 NEON under qemu-user) can be compared bit for bit
// (tests/test_kernel_isas.py). Exit status 1 and a message on stderr when a check fails.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmath>
#include <vector>

extern "C" void lm_paged_attention(const void* qkv, const float* cos, const float* sin, const int64_t* slots,
                                   float* q_buf, void* kc, void* vc, const int32_t* pages,
                                   const int64_t* page_off, const int32_t* ctx, const int32_t* tree_start,
                                   const uint64_t* tree_bits, void* out, int T, int H, int KVH, int D,
                                   int page_size, float scale, int flags, int threads,
                                   const float* sink_cos, const float* sink_sin, float* q_sink,
                                   const int32_t* page_skip, int window, int sinks);

namespace {

constexpr int H = 4, KVH = 2, D = 64, kPage = 16, kPages = 8, kExtra = 8;  // int8 caches add <= 8
constexpr int kSeqs = 2, kPrompt[kSeqs] = {37, 5};
constexpr int kRow = (H + 2 * KVH) * D;

uint64_t state = 0x243F6A8885A308D3ull;
float uniform() {  // xorshift64*, [-1, 1)
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

uint16_t to_bf16(float f) {  // nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

int failures = 0;
void emit(const void* p, size_t bytes) { fwrite(p, 1, bytes, stdout); }

// Sequence s's page i (its page table: disjoint pages of the pool).
int32_t page_of(int s, int i) { return s * (kPages / kSeqs) + i; }

// The tokens of one step: for each sequence, positions [start, start + count).
struct Step {
  int start[kSeqs], count[kSeqs];
};

// A sequence's q/k/v rows by position, the same in every build.
std::vector<float> qkv_rows[kSeqs];

void cos_sin(int pos, float* c, float* s) {
  for (int i = 0; i < D; ++i) {
    const double angle = pos * std::pow(10000.0, -2.0 * (i % (D / 2)) / D);
    c[i] = (float)std::cos(angle);
    s[i] = (float)std::sin(angle);
  }
}

void rotate(const float* x, const float* c, const float* s, double* y) {
  for (int i = 0; i < D / 2; ++i) {
    y[i] = (double)x[i] * c[i] - (double)x[i + D / 2] * s[i];
    y[i + D / 2] = (double)x[i + D / 2] * c[i + D / 2] + (double)x[i] * s[i + D / 2];
  }
}

// Attention output of sequence s's token at `pos` (keys 0..pos, or the window and sinks).
void reference(int s, int pos, int window, int sinks, double* out) {
  float c[D], sn[D];
  for (int h = 0; h < H; ++h) {
    const int kvh = h / (H / KVH);
    cos_sin(pos, c, sn);
    double q[D];
    rotate(&qkv_rows[s][(size_t)pos * kRow + h * D], c, sn, q);
    std::vector<double> w;
    std::vector<int> keys;
    for (int j = 0; j <= pos; ++j)
      if (!window || j > pos - window || j < sinks) keys.push_back(j);
    double top = -INFINITY;
    for (int j : keys) {
      double k[D];
      cos_sin(j, c, sn);
      rotate(&qkv_rows[s][(size_t)j * kRow + (H + kvh) * D], c, sn, k);
      double dot = 0;
      for (int i = 0; i < D; ++i) dot += q[i] * k[i];
      w.push_back(dot / std::sqrt((double)D));
      top = std::fmax(top, w.back());
    }
    double total = 0;
    for (double& x : w) total += (x = std::exp(x - top));
    for (int i = 0; i < D; ++i) {
      double acc = 0;
      for (size_t n = 0; n < keys.size(); ++n)
        acc += w[n] * qkv_rows[s][(size_t)keys[n] * kRow + (H + KVH + kvh) * D + i];
      out[h * D + i] = acc / total;
    }
  }
}

// Runs one step on the caches with `flags` (bit 0 bf16 q/k/v, bit 1 bf16 caches, bit 4 int8
// caches), checks float32 results against the reference, and emits the output.
void run_step(const Step& step, int flags, int window, int sinks, std::vector<uint8_t>& kc,
              std::vector<uint8_t>& vc) {
  std::vector<float> qkv, cos, sin;
  std::vector<int64_t> slots, page_off;
  std::vector<int32_t> ctx, pages;
  std::vector<int> seq, pos;
  for (int s = 0; s < kSeqs; ++s)
    for (int i = 0; i < kPages / kSeqs; ++i) pages.push_back(page_of(s, i));
  for (int s = 0; s < kSeqs; ++s)
    for (int p = step.start[s]; p < step.start[s] + step.count[s]; ++p) {
      qkv.insert(qkv.end(), &qkv_rows[s][(size_t)p * kRow], &qkv_rows[s][(size_t)(p + 1) * kRow]);
      cos.resize(cos.size() + D);
      sin.resize(sin.size() + D);
      cos_sin(p, &cos[cos.size() - D], &sin[sin.size() - D]);
      slots.push_back((int64_t)page_of(s, p / kPage) * kPage + p % kPage);
      page_off.push_back(s * (kPages / kSeqs));
      ctx.push_back(p + 1);
      seq.push_back(s);
      pos.push_back(p);
    }
  const int T = (int)ctx.size();
  std::vector<uint16_t> qkv_bf16(qkv.size());
  for (size_t i = 0; i < qkv.size(); ++i) qkv_bf16[i] = to_bf16(qkv[i]);
  std::vector<float> q_buf((size_t)T * H * D), out((size_t)T * H * D);
  lm_paged_attention(flags & 1 ? (const void*)qkv_bf16.data() : (const void*)qkv.data(), cos.data(), sin.data(),
                     slots.data(), q_buf.data(), kc.data(), vc.data(), pages.data(), page_off.data(), ctx.data(),
                     nullptr, nullptr, out.data(), T, H, KVH, D, kPage, 1.0f / std::sqrt((float)D), flags, 2,
                     nullptr, nullptr, nullptr, nullptr, window, sinks);
  if (flags == 0) {
    double err = 0, scale = 0;
    for (int t = 0; t < T; ++t) {
      double ref[H * D];
      reference(seq[t], pos[t], window, sinks, ref);
      for (int i = 0; i < H * D; ++i) {
        scale = std::fmax(scale, std::fabs(ref[i]));
        err = std::fmax(err, std::isfinite(out[(size_t)t * H * D + i])
                                 ? std::fabs(out[(size_t)t * H * D + i] - ref[i]) : INFINITY);
      }
    }
    if (!(err <= 1e-5 * scale)) {
      fprintf(stderr, "paged attention (window %d): max error %g, allowed %g\n", window, err, 1e-5 * scale);
      ++failures;
    }
  }
  emit(out.data(), out.size() * 4);
}

}  // namespace

int main() {
  for (int s = 0; s < kSeqs; ++s) {
    qkv_rows[s].resize((size_t)(kPrompt[s] + 1) * kRow);
    for (float& x : qkv_rows[s]) x = uniform();
  }
  const Step prefill{{0, 0}, {kPrompt[0], kPrompt[1]}}, decode{{kPrompt[0], kPrompt[1]}, {1, 1}};
  for (int flags : {0, 3, 16})
    for (int window : {0, 20}) {
      const int element = flags & 2 ? 2 : flags & 16 ? 1 : 4;
      const size_t bytes = (size_t)kPages * KVH * (D + (flags & 16 ? kExtra : 0)) * kPage * element;
      std::vector<uint8_t> kc(bytes), vc(bytes);
      run_step(prefill, flags, window, 4, kc, vc);
      run_step(decode, flags, window, 4, kc, vc);
      emit(kc.data(), kc.size());
      emit(vc.data(), vc.size());
    }
  return failures ? 1 : 0;
}
