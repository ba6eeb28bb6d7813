// lmserve-isa: avx512 avx2 neon
// Runs a list of kernel calls in one go, so a step's decoder layers cost one call from Python
// instead of eight a layer (see layers/call_list.py and LlamaModel.layer_calls).
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
