// Shared pieces of megalite's fused kernels: dtype conversion, vector loads, row-group reductions
// and the launch configurations that map one row to a warp or a block.
//
// Every kernel here works on rows: a softmax row (one query's scores over the keys) or a
// normalization row (one token's hidden vector). A row of `cols` values is held in registers by a
// *group* of THREADS threads, ITEMS values each, loaded VEC at a time (16-byte loads when the row
// length and the pointers allow it). Statistics are computed in fp32 whatever the input dtype.
#pragma once

#include <cstdint>
#include <type_traits>

#include <algorithm>
#include <atomic>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace megalite {

// Longest row any kernel takes (512 threads x 32 values); longer rows use PyTorch's path.
constexpr int kMaxCols = 16384;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }

// N consecutive elements starting at p (p aligned to N * sizeof(T) when N > 1).
template <typename T, int N>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(v.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// N elements from p + col on when col < end, else N copies of `fill` (nothing is read).
template <typename T, int N>
__device__ __forceinline__ void load_or_fill(const T* p, int col, int end, float fill, float (&out)[N]) {
  if (col < end) {
    load<T, N>(p + col, out);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = fill;
  }
}

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  __device__ __forceinline__ static float identity() { return 0.f; }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ static float identity() { return -INFINITY; }
};

// Reduce v over the THREADS threads of a row group; every thread of the group gets the result.
// A group of 32 is one warp (several groups share a block); a larger group is the whole block, and
// `scratch` (32 floats of shared memory) carries the per-warp partials. The order of operations is
// fixed, so results are bitwise reproducible.
template <int THREADS, typename Op>
__device__ __forceinline__ float group_reduce(float v, Op op, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if constexpr (THREADS > 32) {
    constexpr int kWarps = THREADS / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // the previous reduction may still be reading scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < kWarps ? scratch[lane] : Op::identity();
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// How many rows one block serves: four warps of one row each for short rows, else one row.
template <int THREADS>
__host__ __device__ constexpr int rows_per_block() { return THREADS == 32 ? 4 : 1; }

// One thread's place in a row-group kernel. A block holds kRows row groups of THREADS threads;
// group g of block b takes row b * kRows + g, then every gridDim.x * kRows-th row after it (a grid
// stride, so any grid covers any number of rows). In each row the thread holds kChunks chunks of
// VEC values, chunk c from column col(c) on: neighbouring threads read neighbouring vectors.
template <int THREADS, int ITEMS, int VEC>
struct RowThread {
  static constexpr int kRows = rows_per_block<THREADS>();
  static constexpr int kChunks = ITEMS / VEC;
  int t;  // index in the row group

  __device__ __forceinline__ RowThread() : t(threadIdx.x % THREADS) {}
  __device__ __forceinline__ int group() const { return threadIdx.x / THREADS; }  // in the block
  __device__ __forceinline__ int64_t first_row() const { return int64_t(blockIdx.x) * kRows + group(); }
  __device__ __forceinline__ int64_t row_stride() const { return int64_t(gridDim.x) * kRows; }
  __device__ __forceinline__ int col(int c) const { return (c * THREADS + t) * VEC; }

  // Writes this thread's chunks of the row at `row_out` (those before `cols`): its k-th value
  // (k = c * VEC + i, as the thread holds them) is value(k).
  template <typename T, typename Value>
  __device__ __forceinline__ void store_row(T* row_out, int cols, Value&& value) const {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (col(c) < cols) {
        float out[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = value(c * VEC + i);
        store<T, VEC>(row_out + col(c), out);
      }
    }
  }
};

// Candidate (threads per row, values per thread) pairs, shortest rows first: a warp for rows up to
// 256 values, then a block with 8 values a thread (few registers, so many blocks stay resident)
// up to 4096, then 16 or 32 values a thread. The first pair whose THREADS * ITEMS covers the row
// and whose ITEMS is a multiple of the vector width is launched: `launch(threads, items, vec)`
// receives std::integral_constant arguments.
template <int VEC, typename Launch>
bool dispatch_row_config(int cols, Launch&& launch) {
  using std::integral_constant;
  bool done = false;
  auto try_config = [&](auto threads, auto items) {
    constexpr int TH = decltype(threads)::value, IT = decltype(items)::value;
    if constexpr (IT % VEC == 0) {
      if (!done && TH * IT >= cols) {
        launch(threads, items, integral_constant<int, VEC>{});
        done = true;
      }
    }
  };
  try_config(integral_constant<int, 32>{}, integral_constant<int, 4>{});
  try_config(integral_constant<int, 32>{}, integral_constant<int, 8>{});
  try_config(integral_constant<int, 64>{}, integral_constant<int, 8>{});
  try_config(integral_constant<int, 128>{}, integral_constant<int, 8>{});
  try_config(integral_constant<int, 256>{}, integral_constant<int, 8>{});
  try_config(integral_constant<int, 512>{}, integral_constant<int, 8>{});
  try_config(integral_constant<int, 512>{}, integral_constant<int, 16>{});
  try_config(integral_constant<int, 512>{}, integral_constant<int, 32>{});
  return done;
}

// 16-byte vectors when every row starts 16-byte aligned, else one element at a time.
template <typename T>
constexpr int vector_width() { return 16 / sizeof(T); }

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Streaming multiprocessors of the current device (ATen's CUDAContext would pull in the cuBLAS and
// cuSPARSE headers for this one number).
// Asked once per device and kept (the count never changes).
inline int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int count = device < kMaxDevices ? counts[device].load(std::memory_order_relaxed) : 0;
  if (count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    if (device < kMaxDevices) counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// Blocks for a row-parallel kernel: enough to fill the device several times over; the kernels
// loop over rows with a grid stride, so any row count works.
inline int grid_for_rows(int64_t rows, int rows_per_block) {
  int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  const int cap = multiprocessor_count() * 32;
  return static_cast<int>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

// Calls fn(T{}) with T the C++ type of `dtype` (float, at::Half, at::BFloat16).
template <typename Fn>
void dispatch_dtype(at::ScalarType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case at::ScalarType::Float: fn(float{}); break;
    case at::ScalarType::Half: fn(at::Half{}); break;
    case at::ScalarType::BFloat16: fn(at::BFloat16{}); break;
    default: TORCH_CHECK(false, what, ": dtype ", dtype, " is not supported (float32, float16, bfloat16)");
  }
}

// A row kernel's launch, once the element type and the row configuration are chosen: instantiate
// the kernel as kernel<typename L::T, L::kThreads, L::kItems, L::kVec> (L = decltype(launch)) and
// launch it with <<<grid, block, 0, stream>>>; in() and out() give a tensor's data as T.
template <typename Element, int THREADS, int ITEMS, int VEC>
struct RowLaunch {
  using T = Element;
  static constexpr int kThreads = THREADS, kItems = ITEMS, kVec = VEC;
  int grid, block;
  cudaStream_t stream;

  static const T* in(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
  static T* out(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
};

// Launches a row kernel over `rows` rows of `cols` values of `dtype` on the current stream: calls
// launch(RowLaunch<...>{grid, block, stream}) for dtype's C++ type, with 16-byte vectors when the
// row length and `pointers_aligned` allow, the first row configuration that covers `cols`, and the
// usual row-parallel grid (a kernel may launch another grid of the same block).
template <typename Launch>
void launch_rows(const char* what, at::ScalarType dtype, int64_t rows, int cols, bool pointers_aligned,
                 Launch&& launch) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(dtype, what, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = vector_width<T>();
    auto with_shape = [&](auto threads, auto items, auto width) {
      constexpr int TH = decltype(threads)::value, IT = decltype(items)::value, V = decltype(width)::value;
      launch(RowLaunch<T, TH, IT, V>{grid_for_rows(rows, rows_per_block<TH>()), TH * rows_per_block<TH>(), stream});
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    const bool ok = pointers_aligned && cols % kVec == 0 ? dispatch_row_config<kVec>(cols, with_shape)
                                                         : dispatch_row_config<1>(cols, with_shape);
    TORCH_CHECK(ok, what, ": no launch configuration for rows of ", cols);
  });
}

}  // namespace megalite
