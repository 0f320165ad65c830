// Python bindings of megalite's fused kernels; megalite/ops builds this file with the .cu sources.
#include <torch/extension.h>

#include <vector>

namespace megalite {
at::Tensor softmax_forward(const at::Tensor& x, const c10::optional<at::Tensor>& mask, double scale, bool causal);
at::Tensor softmax_backward(const at::Tensor& dy, const at::Tensor& y, double scale, bool causal);
std::vector<at::Tensor> norm_forward(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                                     double eps, bool rms);
std::vector<at::Tensor> norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                      const at::Tensor& mean, const at::Tensor& rstd, bool rms);
}  // namespace megalite

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megalite fused kernels: scaled masked/causal softmax, LayerNorm and RMSNorm";
  m.attr("max_cols") = 16384;
  m.def("softmax_forward", &megalite::softmax_forward, "y = softmax(scale * x) with a mask or causal",
        py::arg("x"), py::arg("mask"), py::arg("scale"), py::arg("causal"));
  m.def("softmax_backward", &megalite::softmax_backward, "dx = scale * y * (dy - sum(dy * y))",
        py::arg("dy"), py::arg("y"), py::arg("scale"), py::arg("causal"));
  m.def("norm_forward", &megalite::norm_forward, "LayerNorm / RMSNorm forward: (y, mean, rstd)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("rms"));
  m.def("norm_backward", &megalite::norm_backward, "LayerNorm / RMSNorm backward: (dx, dw partials, db partials)",
        py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("rstd"), py::arg("rms"));
}
