// The smallest extension torch's `load` builds: what tests/serving/test_cpp_build.py builds to check the build lock.
// pybind11 alone, no torch headers: the lock is what is under test, and <torch/extension.h> took 61 s of the
// 2-core host's CPU to compile where this takes 16 s.
#include <pybind11/pybind11.h>

int answer() { return 42; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
