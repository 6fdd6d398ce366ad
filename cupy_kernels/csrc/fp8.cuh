// float8_e4m3fn <-> float, by hand (no CUDA header, and sm_80 has no fp8 conversion
// instruction). The launcher puts this file first in every source (before common.cuh, whose
// fp8 staging uses it). The same text compiles as host C++ for
// tests/kernels/test_fp8_convert.py, which checks it bit for bit against torch's
// float8_e4m3fn: keep it self-contained, scalar integer and float operations that mean the
// same on both sides.
//
//   e4m3fn byte:  s eeee mmm    exponent bias 7; no infinity; s 1111 111 = NaN
//     e > 0       (1 + m/8) * 2^(e-7)     smallest normal 2^-6, largest 448 (0x7e)
//     e = 0       m * 2^-9                subnormals
//
// Stored = round-to-nearest-even of x clamped to [-448, 448] (the cache convention, as
// CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) rounds): see kv_format.py.

struct fp8_e4m3_t { unsigned char bits; };

// The byte in the low 8 bits of b -> its float value (exact). Subnormals are built as
// m * 2^-9 rather than through a float denormal, which -ftz=true would flush.
__device__ __forceinline__ float fp8_e4m3_to_float(unsigned int b) {
  const unsigned int mag = b & 0x7fu;
  float f = mag >= 0x08u ? __uint_as_float((mag << 20) + (120u << 23))  // rebias 7 -> 127
                         : (float)mag * 0.001953125f;                    // 2^-9
  if (mag == 0x7fu) f = __uint_as_float(0x7fc00000u);
  return __uint_as_float(__float_as_uint(f) | ((b & 0x80u) << 24));
}

// float -> e4m3 byte (in the low 8 bits): NaN stays NaN (sign kept), anything beyond 448
// (infinity too) saturates to +-448, the rest rounds to nearest even.
__device__ __forceinline__ unsigned int float_to_fp8_e4m3(float x) {
  const unsigned int u = __float_as_uint(x);
  const unsigned int sign = (u >> 24) & 0x80u, abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7fu;
  const float a = fminf(__uint_as_float(abs_bits), 448.f);
  unsigned int code;
  if (a < 0.015625f) {
    // Below 2^-6 the codes are multiples of 2^-9, and code 8 is 2^-6, the first normal:
    // rounding a * 2^9 to an integer (even on ties) gives the code directly.
    code = (unsigned int)rintf(a * 512.f);
  } else {
    // Keep 3 of the 23 mantissa bits, rounding the 20 dropped ones to nearest even (a carry
    // may step the exponent), then rebias the exponent 127 -> 7.
    const unsigned int b = __float_as_uint(a);
    code = ((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return sign | code;
}
