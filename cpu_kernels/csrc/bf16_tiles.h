// What the bf16 kernel families share (quant_linear_bf16.cpp, fp8_linear.cpp): VDPBF16PS's
// broadcast of an activation pair, AMX's tile configuration, and the per-process grant of the
// tile data state. Each part is here only where the build has its instructions. compile.py
// hashes this header into every family's cache key.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedserve_bf16 {

// x[k], x[k+1] (bf16) in every lane.
inline __m512bh x_pair(const uint16_t* x) {
  int32_t bits;
  std::memcpy(&bits, x, 4);
  return (__m512bh)_mm512_set1_epi32(bits);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Tiles of 16 rows x 64 bytes: 16 rows of x by 32 k, 16 pairs of k by 16 columns, 16 x 16 fp32.
constexpr int64_t kTileRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Per thread: the tile registers' shapes (LDTILECFG is per-thread state). The config is a
// static: GCC does not see LDTILECFG read its operand, and dropped the stores that filled a
// local one (the tiles then stayed unconfigured and the first TILELOADD trapped).
inline void configure_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = kTileRows, c.colsb[t] = 64;
    return c;
  }();
  _tile_loadconfig(&config);
}

// Whether the kernel granted this process the tile data state. Linux keeps it off until a
// process asks (ARCH_REQ_XCOMP_PERM); a tile instruction before then traps with SIGILL, which
// is how llama.cpp's AMX path crashes on some of our VMs. Asked once per process; a refusal
// (an old kernel, a seccomp filter) means no AMX, never a crash.
inline bool amx_tiles_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}
#endif

}  // namespace pagedserve_bf16
#endif
