// The smallest torch extension: what tests/serving/test_cpp_build.py builds to check the build lock.
#include <torch/extension.h>

int answer() { return 42; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
