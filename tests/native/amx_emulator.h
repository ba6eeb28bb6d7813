// The AMX tile instructions the kernels use, in software, written from the definitions in Intel's
// SDM (LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBSUD, TDPBF16PS, TILERELEASE), for the ISA
// harness's
// "amx emulated" build (kernels/amx.h includes it when LM_AMX_EMULATED is set): the kernels'
// tile paths then run, and are checked against the vector paths and scalar references, on any AVX-512 CPU,
// not only on the Intel machines that have tiles. Each instruction checks what the CPU checks (a
// configured palette; the shapes a multiply needs) and aborts where the CPU would fault.
#pragma once
#include <immintrin.h>  // first: its tile macros are replaced below
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace lm::emulated {

struct Tiles {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};             // bytes a row
  alignas(64) uint8_t data[8][16][64] = {};
};
inline thread_local Tiles tiles;  // tile state is per thread, as the CPU's

[[noreturn]] inline void fault(const char* what, int tile) {
  fprintf(stderr, "AMX emulator: %s (tile %d)\n", what, tile);
  abort();
}

inline void check(int t) {
  if (!tiles.configured) fault("a tile instruction before LDTILECFG", t);
  if (t < 0 || t > 7) fault("no such tile", t);
  if (tiles.rows[t] == 0) fault("an unconfigured tile", t);
}

// The operands' shapes a multiply of tiles c += a . b needs (the CPU faults otherwise).
inline void check_multiply(int c, int a, int b) {
  check(c), check(a), check(b);
  if (c == a || c == b || a == b) fault("a multiply naming one tile twice", c);
  if (tiles.rows[a] != tiles.rows[c] || tiles.colsb[a] != 4 * tiles.rows[b] || tiles.colsb[b] != tiles.colsb[c])
    fault("a multiply of mismatched shapes", c);
}

inline void loadconfig(const void* config) {
  const uint8_t* c = (const uint8_t*)config;
  if (c[0] != 1) fault("a palette other than 1", -1);
  Tiles fresh;
  for (int t = 0; t < 8; ++t) {
    memcpy(&fresh.colsb[t], c + 16 + 2 * t, 2);
    fresh.rows[t] = c[48 + t];
    if (fresh.rows[t] > 16 || fresh.colsb[t] > 64 || (fresh.rows[t] == 0) != (fresh.colsb[t] == 0))
      fault("a shape palette 1 does not have", t);
  }
  fresh.configured = true;
  tiles = fresh;
}

inline void release() { tiles = Tiles(); }

inline void zero(int t) {
  check(t);
  memset(tiles.data[t], 0, sizeof tiles.data[t]);
}

// Rows past the configured ones and bytes past a row's configured width read as zeros.
inline void loadd(int t, const void* base, long stride) {
  zero(t);
  for (int r = 0; r < tiles.rows[t]; ++r) memcpy(tiles.data[t][r], (const uint8_t*)base + r * stride, tiles.colsb[t]);
}

inline void stored(int t, void* base, long stride) {
  check(t);
  for (int r = 0; r < tiles.rows[t]; ++r) memcpy((uint8_t*)base + r * stride, tiles.data[t][r], tiles.colsb[t]);
}

// C[m][n] += sum over k, i < 4 of signed A[m][4k + i] * unsigned B[k][4n + i], in int32 that wraps.
inline void dpbsud(int c, int a, int b) {
  check_multiply(c, a, b);
  for (int m = 0; m < tiles.rows[c]; ++m)
    for (int n = 0; n < tiles.colsb[c] / 4; ++n) {
      uint32_t sum;
      memcpy(&sum, tiles.data[c][m] + 4 * n, 4);
      for (int k = 0; k < tiles.colsb[a] / 4; ++k)
        for (int i = 0; i < 4; ++i)
          sum += (uint32_t)((int32_t)(int8_t)tiles.data[a][m][4 * k + i] * (int32_t)tiles.data[b][k][4 * n + i]);
      memcpy(tiles.data[c][m] + 4 * n, &sum, 4);
    }
}

// Denormals as zeros (TDPBF16PS takes its inputs and gives its results so).
inline float flush(float x) { return fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x; }

inline float bf16_at(const uint8_t* row, int i) {  // bf16 element i of a tile row, as float32
  uint32_t u = 0;
  memcpy((uint8_t*)&u + 2, row + 2 * i, 2);
  float f;
  memcpy(&f, &u, 4);
  return flush(f);
}

// For each row m and column n: the even products of A's row m and B's column n (pairs of bf16
// elements) summed from zero over k, the odd ones likewise, each step one rounding; then their
// sum added to C[m][n]: two more roundings. Not vdpbf16ps's order, which adds each product to
// the running sum.
inline void dpbf16ps(int c, int a, int b) {
  check_multiply(c, a, b);
  for (int m = 0; m < tiles.rows[c]; ++m)
    for (int n = 0; n < tiles.colsb[c] / 4; ++n) {
      float even = 0, odd = 0, sum;
      for (int k = 0; k < tiles.colsb[a] / 4; ++k) {
        even = flush(fmaf(bf16_at(tiles.data[a][m], 2 * k), bf16_at(tiles.data[b][k], 2 * n), even));
        odd = flush(fmaf(bf16_at(tiles.data[a][m], 2 * k + 1), bf16_at(tiles.data[b][k], 2 * n + 1), odd));
      }
      memcpy(&sum, tiles.data[c][m] + 4 * n, 4);
      sum = flush(flush(sum) + flush(even + odd));
      memcpy(tiles.data[c][m] + 4 * n, &sum, 4);
    }
}

}  // namespace lm::emulated

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbsud
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) lm::emulated::loadconfig(config)
#define _tile_release() lm::emulated::release()
#define _tile_zero(t) lm::emulated::zero(t)
#define _tile_loadd(t, base, stride) lm::emulated::loadd(t, base, stride)
#define _tile_stored(t, base, stride) lm::emulated::stored(t, base, stride)
#define _tile_dpbsud(c, a, b) lm::emulated::dpbsud(c, a, b)
#define _tile_dpbf16ps(c, a, b) lm::emulated::dpbf16ps(c, a, b)
