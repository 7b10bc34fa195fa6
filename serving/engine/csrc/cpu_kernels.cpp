// The CPU kernels of the engine's fp32 path as one extension (built by serving/engine/cpu_kernels.py, whose
// docstring describes them): this file is the build's only translation unit. It includes the kernels' sources
// and binds the functions cpu_kernels.h declares. One unit, because parsing torch's headers is most of the
// compile: four units took 131 s of CPU on a 2-vCPU host, this one 42 s. The binding needs only pybind11 with
// torch's tensor casters and error translation, not <torch/extension.h> (which alone was 60 s of that).
// Each kernel file keeps its helpers in its own anonymous namespace: names must not clash across the files.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "elementwise.cpp"
#include "paged_decode.cpp"
#include "paged_prefill.cpp"
#include "tiled_gemm.cpp"
#include "lora.cpp"
#include "llama_layers.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("paged_prefill", torch::wrap_pybind_function(paged_prefill), "paged_prefill");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("rope", torch::wrap_pybind_function(rope), "rope");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("tiled_gemm_available", &tiled_gemm_available, "tiled_gemm_available");
  m.def("tiled_pack", torch::wrap_pybind_function(tiled_pack), "tiled_pack");
  m.def("tiled_linear", torch::wrap_pybind_function(tiled_linear), "tiled_linear");
  // every layer of a step (up to tens of ms for a prefill chunk) with the GIL released, as torch's own ops run: an
  // engine in a thread of the API process (--no-engine-process) keeps its event loop meanwhile
  m.def("llama_layers", torch::wrap_pybind_function_no_gil(llama_layers), "llama_layers");
  m.def("lora_add", torch::wrap_pybind_function(lora_add), "lora_add");
}
