// Intel AMX tiles (Sapphire Rapids on), for kernels built for kernels/build.py's "amx"
// instruction set (LM_AMX): eight 2-D registers of up to 16 rows x 64 bytes, multiplied by one
// instruction (TDPBSUD: 16 x 16 int32 sums of 64 int8 products each).
//
// Linux gives a process the 8 KiB of tile state only when it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); a tile instruction before that faults, which is how
// llama.cpp's AMX build crashes at `ldtilecfg` on some VMs. amx_ready() asks once per process
// and a kernel takes its vector path when refused.
//
// LM_AMX_EMULATED (tests/native/amx_emulator.h on the include path) replaces the tile
// instructions with software ones, so that tests run the tile paths on CPUs without tiles.
#pragma once
#if LM_AMX
#if LM_AMX_EMULATED
#include "amx_emulator.h"
#else
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace lm {

constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

inline bool amx_ready() {
#if LM_AMX_EMULATED
  return true;
#else
  static const bool ready = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
#endif
}

struct TileShape {
  uint8_t rows;
  uint16_t bytes;  // per row
};

// Configures the calling thread's tiles (palette 1), tile i shaped shapes[i]; _tile_release()
// hands them back.
inline void amx_configure(const TileShape (&shapes)[8]) {
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;  // palette
  for (int i = 0; i < 8; ++i) {
    memcpy(config + 16 + 2 * i, &shapes[i].bytes, 2);
    config[48 + i] = shapes[i].rows;
  }
  _tile_loadconfig(config);
}

}  // namespace lm
#endif
