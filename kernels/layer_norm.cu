// LayerNorm and RMSNorm over the last dimension, forward and backward, with fp32 statistics.
//
// x is viewed as [rows, cols]. LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1/sqrt(var + eps);
// RMSNorm: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). The forward keeps mean and rstd (fp32,
// one per row) for the backward:
//   xhat = (x - mean) * rstd, g = dy * w,
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (RMSNorm: without the mean(g) term)
//   dw = sum over rows of dy * xhat, db = sum over rows of dy.
// dw and db are summed per block in registers (a thread keeps the same columns for every row it
// visits) into a [blocks, cols] fp32 buffer whose rows the caller sums: no atomics, so the result is
// the same bit for bit on every run.
#include "common.cuh"

namespace megalite {

// Both kernels state a minimum of one block per SM in their launch bounds: without it ptxas (CUDA 13)
// held some configurations to fewer registers than they need and spilled 4-16 B (the vectorized
// 64- and 128-thread backward on sm_90, the scalar fp32 512 x 16 forward on sm_80).
// scripts/check_kernel_spills.sh keeps it so.
template <typename T, int THREADS, int ITEMS, int VEC>
__global__ void __launch_bounds__(THREADS * rows_per_block<THREADS>(), 1)
norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                    T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                    int64_t rows, int cols, float eps, bool rms) {
  __shared__ float scratch[32];
  using Slot = RowThread<THREADS, ITEMS, VEC>;
  const Slot me;
  for (int64_t row = me.first_row(); row < rows; row += me.row_stride()) {
    const T* xr = x + row * cols;
    float v[ITEMS];
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < Slot::kChunks; ++c) {
      const int col = me.col(c);
      float chunk[VEC];
      load_or_fill<T, VEC>(xr, col, cols, 0.f, chunk);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        v[c * VEC + i] = chunk[i];
        sum += chunk[i];
      }
    }
    const float mean = rms ? 0.f : group_reduce<THREADS>(sum, SumOp{}, scratch) / cols;
    // Two passes over the registers: the variance of the centred values, not E[x^2] - mean^2.
    float squares = 0.f;
#pragma unroll
    for (int c = 0; c < Slot::kChunks; ++c) {
      const int col = me.col(c);
      if (col < cols) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = v[c * VEC + i] - mean;
          squares += d * d;
        }
      }
    }
    const float rstd = rsqrtf(group_reduce<THREADS>(squares, SumOp{}, scratch) / cols + eps);
    if (me.t == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
    T* yr = y + row * cols;
#pragma unroll
    for (int c = 0; c < Slot::kChunks; ++c) {
      const int col = me.col(c);
      if (col < cols) {
        float wc[VEC], bc[VEC], out[VEC];
        load<T, VEC>(w + col, wc);
        if (b != nullptr) {
          load<T, VEC>(b + col, bc);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) bc[i] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = (v[c * VEC + i] - mean) * rstd * wc[i] + bc[i];
        store<T, VEC>(yr + col, out);
      }
    }
  }
}

// dy, x (row at `base`) and w at column `col`, VEC values each; zeros past the end of the row.
template <typename T, int VEC>
__device__ __forceinline__ void load_row_chunk(const T* __restrict__ dy, const T* __restrict__ x,
                                               const T* __restrict__ w, int64_t base, int col, int cols,
                                               float (&dyc)[VEC], float (&xc)[VEC], float (&wc)[VEC]) {
  if (col < cols) {
    load<T, VEC>(dy + base + col, dyc);
    load<T, VEC>(x + base + col, xc);
    load<T, VEC>(w + col, wc);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) dyc[i] = xc[i] = wc[i] = 0.f;
  }
}

template <typename T, int THREADS, int ITEMS, int VEC>
__global__ void __launch_bounds__(THREADS * rows_per_block<THREADS>(), 1)
norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                     const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                     T* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part,
                     int64_t rows, int cols, bool rms) {
  __shared__ float scratch[32];
  using Slot = RowThread<THREADS, ITEMS, VEC>;
  constexpr int kRows = Slot::kRows;
  const Slot me;
  const int t = me.t, group = me.group();
  // Up to 16 values a thread, the row's xhat and g stay in registers between the two passes. Beyond
  // that they would not fit beside the dw / db accumulators (ptxas spilled 288-528 B a thread at
  // 512 x 32): the second pass reads dy, x and w again instead (the block has just read them, so
  // they come from cache) and recomputes the same values, bit for bit.
  constexpr bool kKeepRow = ITEMS <= 16;
  constexpr int kKept = kKeepRow ? ITEMS : 1;
  float dw_acc[ITEMS], db_acc[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) dw_acc[i] = db_acc[i] = 0.f;

  for (int64_t row = me.first_row(); row < rows; row += me.row_stride()) {
    const float mean = mean_in[row], rstd = rstd_in[row];
    const int64_t base = row * cols;
    float xhat[kKept], g[kKept];
    float g_sum = 0.f, gx_sum = 0.f;
#pragma unroll
    for (int c = 0; c < Slot::kChunks; ++c) {
      const int col = me.col(c);
      float dyc[VEC], xc[VEC], wc[VEC];
      load_row_chunk<T, VEC>(dy, x, w, base, col, cols, dyc, xc, wc);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int k = c * VEC + i;
        const float xh = col < cols ? (xc[i] - mean) * rstd : 0.f;
        const float gk = dyc[i] * wc[i];
        if constexpr (kKeepRow) {
          xhat[k] = xh;
          g[k] = gk;
        }
        dw_acc[k] += dyc[i] * xh;
        db_acc[k] += dyc[i];
        g_sum += gk;
        gx_sum += gk * xh;
      }
    }
    const float g_mean = rms ? 0.f : group_reduce<THREADS>(g_sum, SumOp{}, scratch) / cols;
    const float gx_mean = group_reduce<THREADS>(gx_sum, SumOp{}, scratch) / cols;
#pragma unroll
    for (int c = 0; c < Slot::kChunks; ++c) {
      const int col = me.col(c);
      if (col < cols) {
        float dyc[VEC], xc[VEC], wc[VEC], out[VEC];
        if constexpr (!kKeepRow) load_row_chunk<T, VEC>(dy, x, w, base, col, cols, dyc, xc, wc);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int k = c * VEC + i;
          const float xh = kKeepRow ? xhat[k] : (xc[i] - mean) * rstd;
          const float gk = kKeepRow ? g[k] : dyc[i] * wc[i];
          out[i] = rstd * (gk - g_mean - xh * gx_mean);
        }
        store<T, VEC>(dx + base + col, out);
      }
    }
  }

  // One partial row per block: the row groups of a block add theirs in a fixed order.
  if constexpr (kRows > 1) {
    __shared__ float stage[kRows - 1][2][THREADS * ITEMS];
    if (group > 0) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        stage[group - 1][0][k * THREADS + t] = dw_acc[k];
        stage[group - 1][1][k * THREADS + t] = db_acc[k];
      }
    }
    __syncthreads();
    if (group > 0) return;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      for (int r = 0; r < kRows - 1; ++r) {
        dw_acc[k] += stage[r][0][k * THREADS + t];
        db_acc[k] += stage[r][1][k * THREADS + t];
      }
    }
  }
  float* dwr = dw_part + int64_t(blockIdx.x) * cols;
  float* dbr = db_part + int64_t(blockIdx.x) * cols;
#pragma unroll
  for (int c = 0; c < Slot::kChunks; ++c) {
    const int col = me.col(c);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (col + i < cols) {
        dwr[col + i] = dw_acc[c * VEC + i];
        dbr[col + i] = db_acc[c * VEC + i];
      }
    }
  }
}

namespace {

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && x.device() == w.device(), what, ": expected CUDA tensors on one device");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), what, ": expected contiguous tensors");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), what, ": weight ", w.sizes(),
              " does not match the last dimension of ", x.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": weight dtype ", w.scalar_type(),
              " differs from the input's ", x.scalar_type());
  TORCH_CHECK(x.size(-1) >= 1 && x.size(-1) <= kMaxCols, what, ": the normalized size must be in [1, ",
              kMaxCols, "], got ", x.size(-1));
}

int backward_blocks(int64_t rows, int rows_per_block, int block_threads) {
  // Each block adds its rows into one partial row of dw/db: several rows per row group keep that
  // buffer small next to the activations, and the cap keeps about 1-2K threads on each SM.
  const int64_t sms = multiprocessor_count();
  const int64_t cap = sms * std::max<int64_t>(4, 1024 / block_threads);
  const int64_t wanted = (rows + int64_t(rows_per_block) * 4 - 1) / (int64_t(rows_per_block) * 4);
  return static_cast<int>(std::max<int64_t>(1, std::min(cap, wanted)));
}

}  // namespace

std::vector<at::Tensor> norm_forward(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                                     double eps, bool rms) {
  check_rows(x, w, "norm_forward");
  if (b.has_value()) {
    TORCH_CHECK(b->is_cuda() && b->device() == x.device() && b->is_contiguous() && b->sizes() == w.sizes() && b->scalar_type() == w.scalar_type(),
                "norm_forward: bias must be a contiguous CUDA tensor shaped and typed like the weight");
  }
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  at::Tensor y = at::empty_like(x);
  auto stat_options = x.options().dtype(at::ScalarType::Float);
  at::Tensor mean = at::empty({rows}, stat_options), rstd = at::empty({rows}, stat_options);
  if (rows == 0) return {y, mean, rstd};
  const bool aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && aligned16(w.data_ptr()) &&
                       (!b.has_value() || aligned16(b->data_ptr()));
  launch_rows("norm_forward", x.scalar_type(), rows, int(cols), aligned, [&](auto launch) {
    using L = decltype(launch);
    norm_forward_kernel<typename L::T, L::kThreads, L::kItems, L::kVec><<<launch.grid, launch.block, 0, launch.stream>>>(
        L::in(x), L::in(w), b.has_value() ? L::in(*b) : nullptr, L::out(y), mean.data_ptr<float>(),
        rstd.data_ptr<float>(), rows, int(cols), float(eps), rms);
  });
  return {y, mean, rstd};
}

// Returns dx, and the per-block partial sums of dw and db ([blocks, cols], fp32) for the caller to
// add up over blocks.
std::vector<at::Tensor> norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                      const at::Tensor& mean, const at::Tensor& rstd, bool rms) {
  check_rows(x, w, "norm_backward");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && dy.device() == x.device(),
              "norm_backward: the gradient ", dy.sizes(), " does not match the input ", x.sizes());
  const at::Tensor g = dy.contiguous();
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  TORCH_CHECK(mean.numel() == rows && rstd.numel() == rows && mean.device() == x.device() &&
                  rstd.device() == x.device() && mean.scalar_type() == at::ScalarType::Float &&
                  rstd.scalar_type() == at::ScalarType::Float && mean.is_contiguous() && rstd.is_contiguous(),
              "norm_backward: statistics do not match the input");
  at::Tensor dx = at::empty_like(x);
  auto part_options = x.options().dtype(at::ScalarType::Float);
  if (rows == 0) {
    return {dx, at::zeros({1, cols}, part_options), at::zeros({1, cols}, part_options)};
  }
  at::Tensor dw_part, db_part;
  const bool aligned = aligned16(g.data_ptr()) && aligned16(x.data_ptr()) && aligned16(w.data_ptr()) &&
                       aligned16(dx.data_ptr());
  launch_rows("norm_backward", x.scalar_type(), rows, int(cols), aligned, [&](auto launch) {
    using L = decltype(launch);
    // Fewer blocks than the forward: each adds its rows into one partial row of dw / db.
    const int blocks = backward_blocks(rows, rows_per_block<L::kThreads>(), launch.block);
    dw_part = at::empty({blocks, cols}, part_options);
    db_part = at::empty({blocks, cols}, part_options);
    norm_backward_kernel<typename L::T, L::kThreads, L::kItems, L::kVec><<<blocks, launch.block, 0, launch.stream>>>(
        L::in(g), L::in(x), L::in(w), mean.data_ptr<float>(), rstd.data_ptr<float>(), L::out(dx),
        dw_part.data_ptr<float>(), db_part.data_ptr<float>(), rows, int(cols), rms);
  });
  return {dx, dw_part, db_part};
}

}  // namespace megalite
