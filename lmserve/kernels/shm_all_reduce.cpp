// lmserve-isa: avx512 avx2 neon
// All-reduce (sum) between the tensor-parallel ranks of one host through shared memory
// (parallel/all_reduce.py). gloo's loopback all-reduce costs tens of microseconds; a decode step
// makes two per layer, so ranks on one host meet in a shared segment instead, as the CPU
// backends of vLLM and SGLang do.
//
// Segment: a header (an error word, then a cache line per rank: its round counter and the
// nanoseconds it has spent in this function, for benchmarks), then two buffers of `world` slots
// of `slot_bytes`. In round g a rank copies its part into slot
// `rank` of buffer g % 2, publishes g, waits until every rank has published g, and sums the slots
// in rank order, so every rank computes the same bits. Two buffers suffice: a rank writes buffer
// g % 2 again in round g + 2 only after every rank has published g + 1, that is after each has
// finished reading round g.
//
// A wait that sees no progress for `timeout_ms`, or an error word set by anyone (the Python
// watchdog sets it when a rank's process dies), stores 1 + the rank waited for in the error word
// and returns; every later call returns at once. Python reads the word after the step.
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <atomic>

#include "simd.h"

namespace {

constexpr int kLine = 64;  // bytes between two ranks' counters

struct Header {
  std::atomic<int64_t>* round(int rank) {
    return reinterpret_cast<std::atomic<int64_t>*>(reinterpret_cast<char*>(this) + kLine * (1 + rank));
  }
  int64_t* nanoseconds(int rank) {
    return reinterpret_cast<int64_t*>(reinterpret_cast<char*>(this) + kLine * (1 + rank) + 8);
  }
  std::atomic<int32_t>* error() { return reinterpret_cast<std::atomic<int32_t>*>(this); }
};

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// Wait until `rank` has published round g; false (error word set) on timeout or error.
bool wait_for(Header* h, int rank, int64_t g, int64_t timeout_ms) {
  std::atomic<int64_t>* r = h->round(rank);
  for (int spin = 0; spin < 4096; ++spin) {
    if (r->load(std::memory_order_acquire) >= g) return true;
    lm::cpu_relax();
  }
  int64_t start = now_ns();
  for (;;) {  // a rank that is slow (or shares a core): give the core away while waiting
    if (r->load(std::memory_order_acquire) >= g) return true;
    if (h->error()->load(std::memory_order_relaxed) != 0) return false;
    if (now_ns() - start > timeout_ms * 1000000) {
      int32_t none = 0;
      h->error()->compare_exchange_strong(none, 1 + rank);
      return false;
    }
    sched_yield();
  }
}

}  // namespace

extern "C" {

// Sum `data` (rows x width of float32, or bf16 when bf16 = 1) over the ranks, in place.
void lm_shm_all_reduce(void* segment, int rank, int world, int64_t slot_bytes, void* data, int bf16,
                       int64_t rows, int64_t width, int64_t timeout_ms) {
  Header* h = static_cast<Header*>(segment);
  if (h->error()->load(std::memory_order_relaxed) != 0) return;
  const int64_t entered = now_ns();
  char* buffers = static_cast<char*>(segment) + kLine * (1 + world);
  const int64_t elem = bf16 ? 2 : 4, n = rows * width, per_round = slot_bytes / elem;
  for (int64_t off = 0; off < n; off += per_round) {
    const int64_t count = n - off < per_round ? n - off : per_round;
    const int64_t g = h->round(rank)->load(std::memory_order_relaxed) + 1;
    char* buffer = buffers + (g & 1) * world * slot_bytes;
    memcpy(buffer + rank * slot_bytes, static_cast<char*>(data) + off * elem, count * elem);
    h->round(rank)->store(g, std::memory_order_release);
    for (int r = 0; r < world; ++r)
      if (r != rank && !wait_for(h, r, g, timeout_ms)) return;
    if (bf16) {
      uint16_t* out = static_cast<uint16_t*>(data) + off;
      for (int64_t i = 0; i < count; ++i) {
        float s = 0.0f;
        for (int r = 0; r < world; ++r)
          s += lm::bf16_to_f32(reinterpret_cast<const uint16_t*>(buffer + r * slot_bytes)[i]);
        out[i] = lm::f32_to_bf16(s);
      }
    } else {
      float* out = static_cast<float*>(data) + off;
      for (int64_t i = 0; i < count; ++i) {
        float s = 0.0f;
        for (int r = 0; r < world; ++r) s += reinterpret_cast<const float*>(buffer + r * slot_bytes)[i];
        out[i] = s;
      }
    }
  }
  *h->nanoseconds(rank) += now_ns() - entered;
}

// A counter in shared memory (parallel/commands.py): publish `value` after the stores before this
// call (release), and wait until the counter exceeds `value`, for at most `wait_ns` (spinning,
// then yielding the core); returns the counter as last seen (acquire).
void lm_shm_publish(void* counter, int64_t value) {
  static_cast<std::atomic<int64_t>*>(counter)->store(value, std::memory_order_release);
}

int64_t lm_shm_wait_above(void* counter, int64_t value, int64_t wait_ns) {
  std::atomic<int64_t>* c = static_cast<std::atomic<int64_t>*>(counter);
  for (int spin = 0; spin < 4096; ++spin) {
    int64_t seen = c->load(std::memory_order_acquire);
    if (seen > value) return seen;
    lm::cpu_relax();
  }
  const int64_t start = now_ns();
  for (;;) {
    int64_t seen = c->load(std::memory_order_acquire);
    if (seen > value || now_ns() - start > wait_ns) return seen;
    sched_yield();
  }
}

// The same with its arguments as 64-bit words, for call lists (call_list.cpp).
void lm_shm_all_reduce_packed(const int64_t* a) {
  lm_shm_all_reduce((void*)a[0], (int)a[1], (int)a[2], a[3], (void*)a[4], (int)a[5], a[6], a[7], a[8]);
}

}
