// One-pass 2:4 magnitude pruning into compressed values + metadata.
//
// Layout (same as sten_cuda24/encoding.py): a row of K values is cut into
// groups of 4; each group keeps two values (packed[r, 2g], packed[r, 2g+1])
// and a 4-bit code idx0 | idx1 << 2; four codes make one int16 word
// (group 4w+j in bits 4j..4j+3). Rows are zero-padded to Kp = ceil(K/16)*16.
// Groups with < 2 nonzeros use CUTLASS's choice of positions, so the metadata
// equals CUTLASS's before its interleaved reordering.
//
// Entry points (extern "C", loaded with ctypes; return a cudaError_t):
//   sten24_rows(x, packed, meta, dense_out|NULL, R, K, dtype, stream)
//       one thread per (row, word): 2 largest |x| of every group of 4.
//   sten24_transposable(x, packed, meta, packed_t, meta_t, dense_out|NULL, R, K, dtype, stream)
//       one thread per 16x16 super-tile; in each 4x4 tile a greedy pass keeps
//       the largest magnitudes while row and column stay <= 2, so the mask is
//       2:4 along rows and columns; writes the pair for W and for W^T.
// dtype: 0 = float16, 1 = bfloat16, 2 = float32.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }

template <typename T> __device__ __forceinline__ T zero();
template <> __device__ __forceinline__ __half zero<__half>() { return __float2half(0.f); }
template <> __device__ __forceinline__ __nv_bfloat16 zero<__nv_bfloat16>() { return __float2bfloat16(0.f); }
template <> __device__ __forceinline__ float zero<float>() { return 0.f; }

// CUTLASS's (idx0, idx1) for a keep-mask with at most two bits set.
__device__ __forceinline__ int code_of_mask(bool m0, bool m1, bool m3) {
  bool e0 = m0 && m1, e1 = !m0 && m1, e2 = !m0 && !m1;
  int i0 = (int)e1 | ((int)e2 << 1);
  int i1 = (int)(e0 || e2 || m3) | ((int)(e1 || !m1) << 1);
  return i0 | (i1 << 2);
}

// Encode one group given its 4 values and keep flags; returns the 4-bit code.
template <typename T>
__device__ __forceinline__ int encode_group(const T v[4], const bool keep[4], T* out2) {
  bool m[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) m[i] = keep[i] && to_f(v[i]) != 0.f;
  int code = code_of_mask(m[0], m[1], m[3]);
  // a filler position (group with < 2 kept values) stores zero, never the pruned value
  out2[0] = m[code & 3] ? v[code & 3] : zero<T>();
  out2[1] = m[code >> 2] ? v[code >> 2] : zero<T>();
  return code;
}

template <typename T>
__global__ void rows_kernel(const T* __restrict__ x, T* __restrict__ packed, int16_t* __restrict__ meta,
                            T* __restrict__ dense, int R, int K) {
  int W = (K + 15) / 16;
  long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)R * W) return;
  int r = (int)(idx / W), w = (int)(idx % W);
  const T* xr = x + (long long)r * K;
  unsigned word = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    int c0 = w * 16 + s * 4;
    T v[4];
    float a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = (c0 + i < K) ? xr[c0 + i] : zero<T>();
      a[i] = fabsf(to_f(v[i]));
      if (isnan(a[i])) a[i] = INFINITY;  // NaN ranks largest (as encoding.row_mask): else 3 kept
    }
    bool keep[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      int rank = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) rank += (j < i) ? (a[j] >= a[i]) : (j > i ? (a[j] > a[i]) : 0);
      keep[i] = rank < 2;
    }
    T out2[2];
    int code = encode_group(v, keep, out2);
    long long p = (long long)r * (W * 8) + w * 8 + s * 2;
    packed[p] = out2[0];
    packed[p + 1] = out2[1];
    word |= (unsigned)code << (4 * s);
    if (dense) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (c0 + i < K) dense[(long long)r * K + c0 + i] = (keep[i] ? v[i] : zero<T>());
    }
  }
  meta[(long long)r * W + w] = (int16_t)(uint16_t)word;
}

template <typename T>
__global__ void transposable_kernel(const T* __restrict__ x, T* __restrict__ packed, int16_t* __restrict__ meta,
                                    T* __restrict__ packed_t, int16_t* __restrict__ meta_t,
                                    T* __restrict__ dense, int R, int K) {
  int W = (K + 15) / 16;   // words per row of W   (16-column strips)
  int Wt = (R + 15) / 16;  // words per row of W^T (16-row strips)
  long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)Wt * W) return;
  int sr = (int)(idx / W), sc = (int)(idx % W);  // super-tile (16x16) coordinates
  unsigned row_words[16];
  unsigned col_words[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) row_words[i] = col_words[i] = 0;
  for (int tr = 0; tr < 4; ++tr) {
    for (int tc = 0; tc < 4; ++tc) {
      int r0 = sr * 16 + tr * 4, c0 = sc * 16 + tc * 4;
      T v[4][4];
      float a[16];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) {
          bool in = (r0 + i < R) && (c0 + j < K);
          v[i][j] = in ? x[(long long)(r0 + i) * K + c0 + j] : zero<T>();
          a[i * 4 + j] = fabsf(to_f(v[i][j]));
          if (isnan(a[i * 4 + j])) a[i * 4 + j] = INFINITY;  // NaN ranks largest, as on the CPU
        }
      // greedy: repeatedly take the largest remaining (lowest index on ties)
      bool keep[4][4] = {};
      bool used[16] = {};
      int rn[4] = {0, 0, 0, 0}, cn[4] = {0, 0, 0, 0};
      for (int step = 0; step < 16; ++step) {
        int best = -1;
        for (int q = 0; q < 16; ++q)
          if (!used[q] && (best < 0 || a[q] > a[best])) best = q;
        used[best] = true;
        int i = best / 4, j = best % 4;
        if (rn[i] < 2 && cn[j] < 2) {
          keep[i][j] = true;
          ++rn[i];
          ++cn[j];
        }
      }
      for (int i = 0; i < 4; ++i) {  // rows of W
        int r = r0 + i;
        T out2[2];
        int code = encode_group(v[i], keep[i], out2);
        if (r < R) {
          long long p = (long long)r * (W * 8) + sc * 8 + tc * 2;
          packed[p] = out2[0];
          packed[p + 1] = out2[1];
        }
        row_words[tr * 4 + i] |= (unsigned)code << (4 * tc);
        if (dense && r < R)
          for (int j = 0; j < 4; ++j)
            if (c0 + j < K) dense[(long long)r * K + c0 + j] = keep[i][j] ? v[i][j] : zero<T>();
      }
      for (int j = 0; j < 4; ++j) {  // rows of W^T
        int c = c0 + j;
        T vt[4];
        bool kt[4];
        for (int i = 0; i < 4; ++i) {
          vt[i] = v[i][j];
          kt[i] = keep[i][j];
        }
        T out2[2];
        int code = encode_group(vt, kt, out2);
        if (c < K) {
          long long p = (long long)c * (Wt * 8) + sr * 8 + tr * 2;
          packed_t[p] = out2[0];
          packed_t[p + 1] = out2[1];
        }
        col_words[tc * 4 + j] |= (unsigned)code << (4 * tr);
      }
    }
  }
  for (int i = 0; i < 16; ++i) {
    int r = sr * 16 + i, c = sc * 16 + i;
    if (r < R) meta[(long long)r * W + sc] = (int16_t)(uint16_t)row_words[i];
    if (c < K) meta_t[(long long)c * Wt + sr] = (int16_t)(uint16_t)col_words[i];
  }
}

template <typename T>
int launch_rows(const void* x, void* packed, int16_t* meta, void* dense, int R, int K, cudaStream_t s) {
  long long n = (long long)R * ((K + 15) / 16);
  if (n == 0) return 0;
  int threads = 256;
  unsigned blocks = (unsigned)((n + threads - 1) / threads);
  rows_kernel<T><<<blocks, threads, 0, s>>>((const T*)x, (T*)packed, meta, (T*)dense, R, K);
  return (int)cudaGetLastError();
}

template <typename T>
int launch_transposable(const void* x, void* packed, int16_t* meta, void* packed_t, int16_t* meta_t, void* dense,
                        int R, int K, cudaStream_t s) {
  long long n = (long long)((R + 15) / 16) * ((K + 15) / 16);
  if (n == 0) return 0;
  int threads = 128;
  unsigned blocks = (unsigned)((n + threads - 1) / threads);
  transposable_kernel<T><<<blocks, threads, 0, s>>>((const T*)x, (T*)packed, meta, (T*)packed_t, meta_t,
                                                     (T*)dense, R, K);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" {

int sten24_rows(const void* x, void* packed, int16_t* meta, void* dense, int R, int K, int dtype, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case 0: return launch_rows<__half>(x, packed, meta, dense, R, K, s);
    case 1: return launch_rows<__nv_bfloat16>(x, packed, meta, dense, R, K, s);
    case 2: return launch_rows<float>(x, packed, meta, dense, R, K, s);
    default: return -1;
  }
}

int sten24_transposable(const void* x, void* packed, int16_t* meta, void* packed_t, int16_t* meta_t, void* dense,
                        int R, int K, int dtype, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case 0: return launch_transposable<__half>(x, packed, meta, packed_t, meta_t, dense, R, K, s);
    case 1: return launch_transposable<__nv_bfloat16>(x, packed, meta, packed_t, meta_t, dense, R, K, s);
    case 2: return launch_transposable<float>(x, packed, meta, packed_t, meta_t, dense, R, K, s);
    default: return -1;
  }
}

const char* sten24_error_string(int code) {
  if (code == -1) return "unsupported dtype code";
  return cudaGetErrorString((cudaError_t)code);
}

}  // extern "C"
