// The one registration file: op schemas of the torchstruct library, and the
// (empty) Python module whose import loads this shared object, which runs the
// static registrations below and those of the cpu/ and cuda/ kernels.
#include <Python.h>

#include <torch/library.h>

TORCH_LIBRARY(torchstruct, m) {
  // Fused optimizer steps (torchstruct.optim), in place, over lists that
  // match `params` one to one (same shape, dtype, device, layout). The
  // arithmetic follows torch.optim.SGD / AdamW (foreach=False) operation by
  // operation; float16/bfloat16 compute in float32. masks: empty, or one
  // optional bool tensor per param: where it is False, param and state keep
  // their bits. clip_coef multiplies the gradient inside the update (grads are
  // only read). grad_scale / found_inf as torch's fused optimizers take them
  // (grad * float32(1/grad_scale); found_inf != 0: nothing is written, step
  // counts included; read on the device, no host sync). All input is checked
  // before anything is written.
  // SGD: momentum_buffers empty iff momentum == 0; first_step: the buffers
  // are new and take the (decayed) gradient, as torch's first step does.
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor?[] masks, float lr, float momentum, float dampening, float weight_decay, "
      "bool nesterov, bool maximize, bool first_step, Tensor? clip_coef=None, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  // AdamW: steps are one-element float32 tensors on the params' device
  // (incremented by the op; bias corrections from the incremented count);
  // max_exp_avg_sqs empty iff not amsgrad.
  m.def(
      "adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] steps, "
      "Tensor?[] masks, float lr, float beta1, float beta2, float weight_decay, float eps, "
      "bool amsgrad, bool maximize, Tensor? clip_coef=None, Tensor? grad_scale=None, "
      "Tensor? found_inf=None) -> ()");
  // p-norm of the concatenation of all elements of `tensors` (all on one
  // device). Returns a 0-dim tensor: float64 if any input is float64, else
  // float32. norm_type: any p > 0, or inf.
  m.def("global_norm(Tensor[] tensors, float norm_type) -> Tensor");
  // In place: every tensor *= scale (a 0-dim floating tensor; on CUDA it may
  // live on the device, read there without a host sync). Same arithmetic as
  // Tensor.mul_(scale).
  m.def("scale_(Tensor(a!)[] tensors, Tensor scale) -> ()");
  // torch.nn.utils.clip_grad_norm_ on the gradients themselves, in one call:
  // the global p-norm of `grads` (fp16/bf16 accumulate in fp32), then every
  // grad *= min(max_norm / (norm + 1e-6), 1) in place (coefficient computed on
  // the device). Returns the norm as a 0-dim tensor in the promoted dtype of
  // the grads (what clip_grad_norm_ returns). max_norm >= 0.
  m.def("clip_by_global_norm_(Tensor(a!)[] grads, float max_norm, float norm_type) -> Tensor");
}

namespace torchstruct {
PyObject* clip_grads(PyObject* self, PyObject* args);  // grads.cpp
PyObject* step_plan(PyObject* self, PyObject* args);   // plan.cpp
PyObject* sgd_step(PyObject* self, PyObject* args);    // steps.cpp
PyObject* adamw_step(PyObject* self, PyObject* args);  // steps.cpp
PyObject* common_device(PyObject* self, PyObject* tensors);  // steps.cpp
PyObject* check_sgd_step(PyObject* self, PyObject* args);    // steps.cpp
PyObject* check_adamw_step(PyObject* self, PyObject* args);  // steps.cpp
PyObject* grads_of(PyObject* self, PyObject* params);         // plan.cpp
PyObject* accumulator_hooks(PyObject* self, PyObject* tensor);  // node_hooks.cpp
PyObject* off_path_hooks(PyObject* self, PyObject* args);       // node_hooks.cpp
}

namespace {

PyMethodDef torchstruct_methods[] = {
    {"clip_grads_", torchstruct::clip_grads, METH_VARARGS,
     "clip_grads_(params, max_norm, norm_type): clip_by_global_norm_ of the params' .grad, "
     "read in C++; None when the input needs the checked path."},
    {"step_plan", torchstruct::step_plan, METH_VARARGS,
     "step_plan(groups, parameter_type): the parameters an optimizer step updates, one list "
     "per group; None when the input needs the checked path."},
    {"grads_of", torchstruct::grads_of, METH_O,
     "grads_of(params): each parameter's .grad, laid out as the parameter; None otherwise."},
    {"common_device", torchstruct::common_device, METH_O,
     "common_device(tensors): the one device of all tensors (no subclasses); None otherwise."},
    {"sgd_step_", torchstruct::sgd_step, METH_VARARGS,
     "torch.ops.torchstruct.sgd_step_ (all arguments positional), without the boxed path."},
    {"check_sgd_step_", torchstruct::check_sgd_step, METH_VARARGS,
     "the input checks of sgd_step_ alone (same arguments); writes nothing."},
    {"check_adamw_step_", torchstruct::check_adamw_step, METH_VARARGS,
     "the input checks of adamw_step_ alone (same arguments); writes nothing."},
    {"adamw_step_", torchstruct::adamw_step, METH_VARARGS,
     "torch.ops.torchstruct.adamw_step_ (all arguments positional), without the boxed path."},
    {"accumulator_hooks", torchstruct::accumulator_hooks, METH_O,
     "accumulator_hooks(tensor): (python, other) counts of the hooks on the tensor's gradient "
     "accumulator node."},
    {"off_path_hooks", torchstruct::off_path_hooks, METH_VARARGS,
     "off_path_hooks(roots, targets): (node name, kind) of the hooked nodes a backward from "
     "roots runs and autograd.grad(roots, targets) would not."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef torchstruct_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Compiled torchstruct kernels; importing registers torch.ops.torchstruct.*",
    -1,
    torchstruct_methods,
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
