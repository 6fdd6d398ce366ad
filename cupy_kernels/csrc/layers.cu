// The small per-layer operations of a decoder, fused: one launch each instead of the 5-10
// torch kernels (and their temporaries) that eager PyTorch runs for them. At 256 decode rows
// those launches were a third of a small model's step on an H100 (docs/kernels.md). Each
// rounds where the eager model rounds, in the same order, as cpu_kernels/csrc/layer_ops.cpp
// does (R(.): round to T, nearest even; identity for float):
//
//   rms_norm      out = R(w * R(x * r)),  r = rsqrt(mean(x^2) + eps)        (HF LlamaRMSNorm)
//   add_rms_norm  residual = R(x + residual); x = rms_norm(residual)       (in place)
//   rotary        x = R(R(x * c) + R(rotate_half(x) * s)), c = R(cos[pos]), s = R(sin[pos]),
//                 on the first `num_heads` heads of each row, in place    (HF apply_rotary)
//   silu_and_mul  out = R(R(g / (1 + exp(-g))) * u), [g | u] = x           (F.silu(g) * u)
//
// Rows may be strided (a view of a fused projection); elements within a row are contiguous.
// One 128-thread CTA per row (silu_and_mul: per row and 128 outputs); the sums are fp32.

template <typename T>
__device__ __forceinline__ float rnd(float x) {
  return Pack<T>::to_float(Pack<T>::from_float(x));
}

// Sum over the CTA; every thread gets the same total (the warps' partials added in one order).
__device__ __forceinline__ float block_sum(float x, float* partial) {
  x = warp_sum(x);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += partial[w];
  return total;
}

template <typename T>
__global__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                         float eps, int n, long long x_stride) {
  __shared__ float partial[32];
  const T* row = x + blockIdx.x * x_stride;
  float squares = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = Pack<T>::to_float(row[i]);
    squares += v * v;
  }
  const float r = rsqrtf(block_sum(squares, partial) / n + eps);
  T* o = out + (long long)blockIdx.x * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    o[i] = Pack<T>::from_float(Pack<T>::to_float(weight[i]) * rnd<T>(Pack<T>::to_float(row[i]) * r));
}

template <typename T>
__global__ void add_rms_norm(T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                             float eps, int n, long long x_stride, long long residual_stride) {
  __shared__ float partial[32];
  T* xr = x + blockIdx.x * x_stride;
  T* rr = residual + blockIdx.x * residual_stride;
  float squares = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float s = rnd<T>(Pack<T>::to_float(xr[i]) + Pack<T>::to_float(rr[i]));
    rr[i] = Pack<T>::from_float(s);
    squares += s * s;
  }
  const float r = rsqrtf(block_sum(squares, partial) / n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x)  // each thread reads back what it wrote
    xr[i] = Pack<T>::from_float(Pack<T>::to_float(weight[i]) * rnd<T>(Pack<T>::to_float(rr[i]) * r));
}

// Each thread takes pairs (j, j + half) of a head: it reads both before writing either.
template <typename T>
__global__ void rotary(T* __restrict__ x, const long long* __restrict__ positions, const float* __restrict__ cos,
                       const float* __restrict__ sin, int num_heads, int head_dim, long long x_stride) {
  const int half = head_dim / 2;
  T* row = x + blockIdx.x * x_stride;
  const long long base = positions[blockIdx.x] * head_dim;
  for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
    const int j = i % half;
    T* head = row + (i / half) * head_dim;
    const float a = Pack<T>::to_float(head[j]), b = Pack<T>::to_float(head[j + half]);
    const float c1 = rnd<T>(cos[base + j]), s1 = rnd<T>(sin[base + j]);
    const float c2 = rnd<T>(cos[base + j + half]), s2 = rnd<T>(sin[base + j + half]);
    head[j] = Pack<T>::from_float(rnd<T>(a * c1) + rnd<T>(-b * s1));
    head[j + half] = Pack<T>::from_float(rnd<T>(b * c2) + rnd<T>(a * s2));
  }
}

template <typename T>
__global__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ x, int inter, long long x_stride) {
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const T* row = x + blockIdx.x * x_stride;
  const float g = Pack<T>::to_float(row[i]), u = Pack<T>::to_float(row[inter + i]);
  out[(long long)blockIdx.x * inter + i] = Pack<T>::from_float(rnd<T>(g / (1.f + expf(-g))) * u);
}
