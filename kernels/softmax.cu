// Scaled masked softmax and scaled causal (upper-triangular masked) softmax, forward and backward.
//
// x is [batch, heads, sq, sk], contiguous; each row is one query's sk scores. Forward:
//   y = softmax(scale * x) over the keys a query may see, 0 on the others.
// Masked: the keys with mask[b or 0, 0, q or 0, k] true are hidden (the mask is broadcast over
// heads, and over queries when its third dimension is 1, as a padding mask is).
// Causal: key k is hidden from query q when k > q (top-left aligned, as in SDPA's is_causal);
// the mask is never materialised, and of the hidden part of a row only what shares a vector
// load with visible keys is read.
// Without a mask and not causal it is the plain scaled softmax.
// A row with every key hidden gives zeros (no NaN). Backward: dx = scale * y * (dy - sum(dy * y)).
#include "common.cuh"

namespace megalite {

template <typename T, int THREADS, int ITEMS, int VEC, bool CAUSAL>
__global__ void __launch_bounds__(THREADS * rows_per_block<THREADS>())
softmax_forward_kernel(const T* __restrict__ x, const uint8_t* __restrict__ mask, T* __restrict__ y,
                       int64_t rows, int cols, int sq, int64_t rows_per_mask_batch, int64_t mask_batch_stride,
                       int64_t mask_query_stride, float scale) {
  __shared__ float scratch[32];
  using Slot = RowThread<THREADS, ITEMS, VEC>;
  const Slot me;
  for (int64_t row = me.first_row(); row < rows; row += me.row_stride()) {
    const int q = static_cast<int>(row % sq);
    const int visible = CAUSAL ? min(q + 1, cols) : cols;  // keys [0, visible) may be seen
    const T* xr = x + row * cols;
    const uint8_t* mr = nullptr;
    if (!CAUSAL && mask != nullptr) {
      mr = mask + (row / rows_per_mask_batch) * mask_batch_stride + q * mask_query_stride;
    }
    float v[ITEMS];
    float row_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < Slot::kChunks; ++c) {
      const int col = me.col(c);
      float chunk[VEC];
      if (col < visible) {
        load<T, VEC>(xr + col, chunk);
        uint8_t hidden[VEC] = {};
        if (!CAUSAL && mr != nullptr) {
          Vec<uint8_t, VEC> m = *reinterpret_cast<const Vec<uint8_t, VEC>*>(mr + col);
#pragma unroll
          for (int i = 0; i < VEC; ++i) hidden[i] = m.v[i];
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const bool off = CAUSAL ? (col + i >= visible) : (hidden[i] != 0);
          chunk[i] = off ? -INFINITY : chunk[i] * scale;
        }
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) chunk[i] = -INFINITY;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        v[c * VEC + i] = chunk[i];
        row_max = fmaxf(row_max, chunk[i]);
      }
    }
    row_max = group_reduce<THREADS>(row_max, MaxOp{}, scratch);
    float sum = 0.f;
    if (row_max != -INFINITY) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        v[i] = v[i] == -INFINITY ? 0.f : expf(v[i] - row_max);
        sum += v[i];
      }
    }
    sum = group_reduce<THREADS>(sum, SumOp{}, scratch);
    // Every key hidden: row_max is -inf, sum 0, and the row is written as zeros.
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    me.store_row(y + row * cols, cols, [&](int k) { return row_max == -INFINITY ? 0.f : v[k] * inv; });
  }
}

template <typename T, int THREADS, int ITEMS, int VEC, bool CAUSAL>
__global__ void __launch_bounds__(THREADS * rows_per_block<THREADS>())
softmax_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                        int64_t rows, int cols, int sq, float scale) {
  __shared__ float scratch[32];
  using Slot = RowThread<THREADS, ITEMS, VEC>;
  const Slot me;
  for (int64_t row = me.first_row(); row < rows; row += me.row_stride()) {
    // y is 0 on hidden keys, so their gradient is 0; causal rows need not read them at all.
    const int visible = CAUSAL ? min(static_cast<int>(row % sq) + 1, cols) : cols;
    const int64_t base = row * cols;
    float g[ITEMS], p[ITEMS];
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < Slot::kChunks; ++c) {
      const int col = me.col(c);
      float gc[VEC], pc[VEC];
      if (col < visible) {
        load<T, VEC>(dy + base + col, gc);
        load<T, VEC>(y + base + col, pc);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) gc[i] = pc[i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        g[c * VEC + i] = gc[i];
        p[c * VEC + i] = pc[i];
        dot += gc[i] * pc[i];
      }
    }
    dot = group_reduce<THREADS>(dot, SumOp{}, scratch);
    me.store_row(dx + base, cols, [&](int k) { return scale * p[k] * (g[k] - dot); });
  }
}

namespace {

void check_scores(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.is_cuda(), what, ": expected a CUDA tensor");
  TORCH_CHECK(x.dim() == 4, what, ": expected [batch, heads, sq, sk], got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), what, ": expected a contiguous tensor");
  TORCH_CHECK(x.size(3) >= 1 && x.size(3) <= kMaxCols, what, ": sk must be in [1, ", kMaxCols, "], got ",
              x.size(3));
}

}  // namespace

at::Tensor softmax_forward(const at::Tensor& x, const c10::optional<at::Tensor>& mask, double scale,
                           bool causal) {
  check_scores(x, "softmax_forward");
  const int64_t b = x.size(0), heads = x.size(1), sq = x.size(2), sk = x.size(3);
  const uint8_t* mask_ptr = nullptr;
  int64_t mask_batch_stride = 0, mask_query_stride = 0;
  if (!causal && mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.is_cuda() && m.device() == x.device() && m.scalar_type() == at::ScalarType::Bool &&
                    m.is_contiguous() && m.dim() == 4,
                "softmax_forward: mask must be a contiguous bool tensor [batch or 1, 1, sq or 1, sk] on the "
                "scores' device");
    TORCH_CHECK((m.size(0) == b || m.size(0) == 1) && m.size(1) == 1 && (m.size(2) == sq || m.size(2) == 1) &&
                    m.size(3) == sk,
                "softmax_forward: mask ", m.sizes(), " does not broadcast over scores ", x.sizes());
    mask_ptr = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
    mask_query_stride = m.size(2) == 1 ? 0 : sk;
    mask_batch_stride = m.size(0) == 1 ? 0 : m.size(2) * sk;
  }
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  const int64_t rows = x.numel() / sk;
  if (rows == 0) return y;
  const bool aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) && (mask_ptr == nullptr || aligned16(mask_ptr));
  launch_rows("softmax_forward", x.scalar_type(), rows, int(sk), aligned, [&](auto launch) {
    using L = decltype(launch);
    const auto kernel = causal ? softmax_forward_kernel<typename L::T, L::kThreads, L::kItems, L::kVec, true>
                               : softmax_forward_kernel<typename L::T, L::kThreads, L::kItems, L::kVec, false>;
    // Causal: mask_ptr is null and its strides 0.
    kernel<<<launch.grid, launch.block, 0, launch.stream>>>(L::in(x), mask_ptr, L::out(y), rows, int(sk), int(sq),
                                                            heads * sq, mask_batch_stride, mask_query_stride,
                                                            float(scale));
  });
  return y;
}

at::Tensor softmax_backward(const at::Tensor& dy, const at::Tensor& y, double scale, bool causal) {
  check_scores(y, "softmax_backward");
  TORCH_CHECK(dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type() && dy.device() == y.device(),
              "softmax_backward: the gradient ", dy.sizes(), " does not match the output ", y.sizes());
  const at::Tensor g = dy.contiguous();
  const int64_t sq = y.size(2), sk = y.size(3);
  const c10::cuda::OptionalCUDAGuard guard(y.device());
  at::Tensor dx = at::empty_like(y);
  const int64_t rows = y.numel() / sk;
  if (rows == 0) return dx;
  const bool aligned = aligned16(g.data_ptr()) && aligned16(y.data_ptr()) && aligned16(dx.data_ptr());
  launch_rows("softmax_backward", y.scalar_type(), rows, int(sk), aligned, [&](auto launch) {
    using L = decltype(launch);
    const auto kernel = causal ? softmax_backward_kernel<typename L::T, L::kThreads, L::kItems, L::kVec, true>
                               : softmax_backward_kernel<typename L::T, L::kThreads, L::kItems, L::kVec, false>;
    kernel<<<launch.grid, launch.block, 0, launch.stream>>>(L::in(g), L::in(y), L::out(dx), rows, int(sk), int(sq),
                                                            float(scale));
  });
  return dx;
}

}  // namespace megalite
