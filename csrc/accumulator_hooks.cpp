// torchstruct._C.accumulator_hooks(tensor): the hooks registered on a leaf tensor's gradient
// accumulator node itself, as (python, other) counts.
//
// A hook can sit on the AccumulateGrad node of a leaf (`leaf.view_as(leaf).grad_fn
// .next_functions[0][0].register_hook(...)` / `register_prehook`, as DistributedDataParallel's
// reducer, FSDP and ZeRO-style libraries do) rather than on the tensor. Such a hook runs whenever
// a backward executes the node, and never under torch.autograd.grad, which does not execute
// accumulators; PyTorch offers no Python API that lists them, so structural_grad asks here before
// it runs a real backward. `python` counts the hooks registered from Python; `other` those added
// in C++ (the DDP reducer's). A tensor without an accumulator (none made yet, or a non-leaf) has
// none: (0, 0).
#include <torch/csrc/autograd/python_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <cstring>
#include <typeinfo>

namespace torchstruct {
namespace {

// How many Python callables a node hook holds, or -1 for a hook made in C++. PyTorch keeps the
// Python callables registered on a node in one PyFunctionPreHook / PyFunctionPostHook per node,
// whose dict loses an entry when a handle is removed (the hook object itself stays). Their type
// information is not exported from libtorch_python, so the dynamic type's name is read (it
// contains the class name under every C++ ABI) before the cast.
template <typename PyHook, typename Hook>
Py_ssize_t python_callables(Hook& hook, const char* name) {
  if (std::strstr(typeid(hook).name(), name) == nullptr) return -1;
  PyObject* dict = static_cast<PyHook&>(hook).dict;
  return dict != nullptr && PyDict_Check(dict) ? PyDict_Size(dict) : 0;
}

void count(Py_ssize_t callables, long& python, long& other) {
  if (callables < 0) {
    ++other;
  } else {
    python += static_cast<long>(callables);
  }
}

}  // namespace

PyObject* accumulator_hooks(PyObject* /*self*/, PyObject* tensor) {
  if (!THPVariable_Check(tensor)) {
    PyErr_SetString(PyExc_TypeError, "accumulator_hooks: expected a tensor");
    return nullptr;
  }
  long python = 0;
  long other = 0;
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(THPVariable_Unpack(tensor));
  if (accumulator) {
    for (const auto& hook : accumulator->pre_hooks()) {
      count(python_callables<torch::autograd::PyFunctionPreHook>(*hook, "PyFunctionPreHook"),
            python, other);
    }
    for (const auto& hook : accumulator->post_hooks()) {
      count(python_callables<torch::autograd::PyFunctionPostHook>(*hook, "PyFunctionPostHook"),
            python, other);
    }
  }
  return Py_BuildValue("(ll)", python, other);
}

}  // namespace torchstruct
