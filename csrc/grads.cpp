// torchstruct._C.clip_grads_(params, max_norm, norm_type): torchstruct::clip_by_global_norm_ of
// the .grad of each parameter in a Python list or tuple, read here rather than in Python.
//
// Clipping thousands of small gradients is bound by per-tensor overhead, not by arithmetic:
// reading `.grad` attribute by attribute in Python and converting a Python list of tensors into
// the dispatcher's boxed arguments cost more than the reduction itself. This entry point reads
// the gradients in C++ and calls the op unboxed. It handles only the plain case and returns None
// for anything else (an element that is not a tensor, no gradient at all, input the kernel
// refuses, a device other than CPU and CUDA, a tensor subclass such as DTensor): the caller then
// takes the checked Python path, which explains the problem. The kernels check every input
// before writing, so a refused call has written nothing. Running out of memory (or a device
// error) is not a refusal and may come after a write: it is raised, never retried.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <exception>
#include <utility>
#include <vector>

namespace torchstruct {

PyObject* clip_grads(PyObject* /*self*/, PyObject* args) {
  PyObject* params = nullptr;
  double max_norm = 0.0;
  double norm_type = 0.0;
  if (!PyArg_ParseTuple(args, "Odd", &params, &max_norm, &norm_type)) return nullptr;
  if (!PyList_Check(params) && !PyTuple_Check(params)) Py_RETURN_NONE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(params);
  PyObject** items = PySequence_Fast_ITEMS(params);
  std::vector<at::Tensor> grads;
  grads.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(items[i])) Py_RETURN_NONE;
    const at::Tensor& grad = THPVariable_Unpack(items[i]).grad();
    if (!grad.defined()) continue;
    const c10::DeviceType device = grad.device().type();
    if ((device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) ||
        grad.key_set().has(c10::DispatchKey::Python)) {
      Py_RETURN_NONE;  // another device type, or a tensor subclass: the checked path
    }
    grads.push_back(grad);
  }
  if (grads.empty()) Py_RETURN_NONE;

  at::Tensor norm;
  std::exception_ptr failure;  // not a refusal: raised below
  PyThreadState* thread = PyEval_SaveThread();
  try {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("torchstruct::clip_by_global_norm_", "")
                               .typed<at::Tensor(at::TensorList, double, double)>();
    // Straight to the device kernel: gradients written in place under no_grad need no
    // autograd handling (the kernels bump the version counters themselves).
    c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    norm = op.call(grads, max_norm, norm_type);
  } catch (const c10::OutOfMemoryError&) {
    failure = std::current_exception();
  } catch (const c10::AcceleratorError&) {
    failure = std::current_exception();
  } catch (const std::exception&) {
    PyEval_RestoreThread(thread);
    Py_RETURN_NONE;  // refused: the checked path explains
  }
  PyEval_RestoreThread(thread);
  if (failure) {
    HANDLE_TH_ERRORS
    std::rethrow_exception(failure);
    END_HANDLE_TH_ERRORS
  }
  return THPVariable_Wrap(std::move(norm));
}

}  // namespace torchstruct
