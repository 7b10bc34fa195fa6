// Python binding of the CPU kernels of the engine's fp32 path, declared in cpu_kernels.h (built by
// serving/engine/cpu_kernels.py, whose docstring describes them).
#include <torch/extension.h>
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("paged_prefill", torch::wrap_pybind_function(paged_prefill), "paged_prefill");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("rope", torch::wrap_pybind_function(rope), "rope");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
}
