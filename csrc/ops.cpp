// The one registration file: op schemas of the torchstruct library, and the
// (empty) Python module whose import loads this shared object, which runs the
// static registrations below and those of the cpu/ and cuda/ kernels.
#include <Python.h>

#include <torch/library.h>

TORCH_LIBRARY(torchstruct, m) {
  // p-norm of the concatenation of all elements of `tensors` (all on one
  // device). Returns a 0-dim tensor: float64 if any input is float64, else
  // float32. norm_type: any p > 0, or inf.
  m.def("global_norm(Tensor[] tensors, float norm_type) -> Tensor");
}

namespace {

PyModuleDef torchstruct_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Compiled torchstruct kernels; importing registers torch.ops.torchstruct.*",
    -1,
    nullptr,
};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&torchstruct_module);
  if (module == nullptr) return nullptr;
#ifdef TORCHSTRUCT_WITH_CUDA
  const long with_cuda = 1;
#else
  const long with_cuda = 0;
#endif
  if (PyModule_AddIntConstant(module, "WITH_CUDA", with_cuda) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
