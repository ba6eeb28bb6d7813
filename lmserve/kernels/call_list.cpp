// lmserve-isa: avx512 avx2 neon
// Runs a list of kernel calls in one go, so a step's decoder layers cost one call from Python
// instead of eight a layer (see layers/call_list.py and LlamaModel.layer_calls); or pass after
// pass, as a chain of one-token passes does (greedy_chain.py: a draft model's drafts, a lone
// sequence's multi-step run).
//
// Each row of `calls` (n rows of `stride` 64-bit words) is a function taking its arguments as
// 64-bit words (the kernels' *_packed entry points), followed by those arguments.
#include <stdint.h>

extern "C" void lm_run_calls(const int64_t* calls, int n, int stride) {
  for (int i = 0; i < n; ++i) {
    const int64_t* row = calls + (int64_t)i * stride;
    reinterpret_cast<void (*)(const int64_t*)>(row[0])(row + 1);
  }
}

// Runs the list up to `passes` times, adding strides[j] to word moving[j] (a flat index into
// calls) before every pass but the first; returns the passes run: it stops after one that sets
// *stop.
extern "C" int lm_run_call_passes(int64_t* calls, int n, int stride, int passes, const int64_t* moving,
                                  const int64_t* strides, int n_moving, const int32_t* stop) {
  for (int p = 0; p < passes; ++p) {
    if (p)
      for (int j = 0; j < n_moving; ++j) calls[moving[j]] += strides[j];
    lm_run_calls(calls, n, stride);
    if (*stop) return p + 1;
  }
  return passes;
}
