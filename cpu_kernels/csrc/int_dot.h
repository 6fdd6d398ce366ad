// What csrc/int_dot.cpp (AVX512-VNNI) and csrc/int_dot_avx2.cpp (AVX2, AVX-VNNI) share: the
// packed records' layout (int_dot_format.py; int_dot.cpp's header comment describes it), the
// problem a kernel sees, and the host side of a call: checks, the activations' 8-bit blocks,
// the column groups split over threads. The two files differ in their instructions alone.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace int_dot {

constexpr int64_t kBlock = 32;
constexpr int64_t kChunkBytes = 64;
enum Encoding : int64_t { kFp32 = 0, kFp16 = 1, kUnits = 2 };  // int_dot_format.ENCODINGS' order

// The two weight kinds: how many 64-byte chunks a record's values take, and what follows them.
struct Int4 {
  static constexpr int kChunks = 4;
  static constexpr bool kZeros = true;
};
struct Int8 {
  static constexpr int kChunks = 8;
  static constexpr bool kZeros = false;
};

template <typename W>
int64_t record_bytes(int64_t encoding) {
  const int64_t parts = W::kZeros ? 2 : 1;
  return W::kChunks * kChunkBytes + parts * 16 * (encoding == kFp32 ? 4 : 2);
}

struct Problem {
  const int8_t* xq;    // [M, K] activations' 8-bit values
  const float* xd;     // [M, blocks] each block's d
  const float* xe;     // [M, blocks] each block's float(sum(a)) * d
  const int32_t* xs;   // [M, blocks] each block's 128 * sum(a): int8 weights' offset
  const uint8_t* w;    // records
  void* out;           // [M, N] float32, or bf16 bits
  bool fp32;           // x and out float32
  int64_t M, N, K, G, blocks, encoding, bytes;  // bytes: a record's

  const uint8_t* record(int64_t g, int64_t b) const { return w + (g * blocks + b) * bytes; }
};

// y = x @ W^T for a W-kind weight: `quantize_row(x_row, blocks, q, d, e, s)` (called with
// const float* or const uint16_t* bf16 bits) writes one row's 8-bit blocks, `group(p, g)`
// computes column group g for every row. Threads split the column groups: each streams its
// share of the weights once, every row tile rereading the group's records from L2. One group
// a task reads one sequential stream: one row, one thread, weights in memory (the LM head),
// 1.3x faster than csrc/mxfp4_int8.cpp's pairs of groups (two streams) on a Zen 4 VM.
template <typename W, typename QuantizeRow, typename Group>
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t encoding, QuantizeRow quantize_row,
                  Group group) {
  const bool fp32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(x.dim() == 2 && (fp32 || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "x must be a contiguous 2-D bfloat16 or float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), G = (N + 15) / 16, blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && K > 0 && N > 0, "K must be a positive multiple of 32, N positive");
  TORCH_CHECK(encoding >= kFp32 && encoding <= (W::kZeros ? kUnits : kFp16),
              "encoding: want 0 (fp32), 1 (fp16) or, for int4, 2 (units)");
  const int64_t bytes = record_bytes<W>(encoding);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == G * blocks * bytes,
              "packed weights: want ", G * blocks * bytes, " bytes for N=", N, ", K=", K, ", got ", w.numel());
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * blocks), xe(M * blocks);
  std::vector<int32_t> xs(M * blocks);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {  // a decode step's rows stay on one thread
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* q = xq.data() + m * K;
      float *d = xd.data() + m * blocks, *e = xe.data() + m * blocks;
      int32_t* s = xs.data() + m * blocks;
      if (fp32) quantize_row(x.data_ptr<float>() + m * K, blocks, q, d, e, s);
      else quantize_row(reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * K, blocks, q, d, e, s);
    }
  });
  const Problem p{xq.data(), xd.data(), xe.data(), xs.data(), w.data_ptr<uint8_t>(), out.data_ptr(), fp32,
                  M, N, K, G, blocks, encoding, bytes};
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) group(p, g);
  });
  return out;
}

}  // namespace int_dot
