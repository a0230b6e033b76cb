// torchstruct._C.clip_grads_(params, max_norm, norm_type): torchstruct::clip_by_global_norm_ of
// the .grad of each parameter in a Python list or tuple, read here rather than in Python.
//
// Clipping thousands of small gradients is bound by per-tensor overhead, not by arithmetic:
// reading `.grad` attribute by attribute in Python and converting a Python list of tensors into
// the dispatcher's boxed arguments cost more than the reduction itself. This entry point reads
// the gradients in C++ and calls the op unboxed. It handles only the plain case and returns None
// for anything else (an element that is not a tensor, no gradient at all, input the kernel
// refuses, a device other than CPU and CUDA, a tensor subclass such as DTensor, an inference
// tensor): the caller then
// takes the checked Python path, which explains the problem. The kernels check every input
// before writing, so a refused call has written nothing; an error raised after the kernel began
// to write (it counts its writes first: the first gradient's version counter moved) is raised,
// never retried. Running out of memory (or a device error) is not a refusal either.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>

// c10::AcceleratorError (a CUDA error) exists from torch 2.8 on; before, a CUDA error is a plain
// c10::Error whose message begins "CUDA error".
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define TORCHSTRUCT_ACCELERATOR_ERROR 1
#endif

namespace torchstruct {
namespace {

bool is_device_error(const c10::Error& err) {
  return std::string(err.what_without_backtrace()).rfind("CUDA error", 0) == 0;
}

}  // namespace

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
        grad.key_set().has(c10::DispatchKey::Python) || grad.is_inference()) {
      // another device type, a tensor subclass, or an inference tensor (it has no version
      // counter to read below): the checked path
      Py_RETURN_NONE;
    }
    grads.push_back(grad);
  }
  if (grads.empty()) Py_RETURN_NONE;

  at::Tensor norm;
  std::exception_ptr failure;  // not a refusal: raised below
  std::exception_ptr refusal;  // the checked path explains
  const int64_t version = grads[0]._version();
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
#ifdef TORCHSTRUCT_ACCELERATOR_ERROR
  } catch (const c10::AcceleratorError&) {
    failure = std::current_exception();
#endif
  } catch (const c10::Error& err) {
    (is_device_error(err) ? failure : refusal) = std::current_exception();
  } catch (const std::exception&) {
    refusal = std::current_exception();
  }
  if (refusal && grads[0]._version() != version) {
    // the kernel got past its checks (it counts its writes first): taking the checked path
    // would clip a second time, so the error is raised
    failure = std::exchange(refusal, nullptr);
  }
  PyEval_RestoreThread(thread);
  if (refusal) Py_RETURN_NONE;
  if (failure) {
    HANDLE_TH_ERRORS
    std::rethrow_exception(failure);
    END_HANDLE_TH_ERRORS
  }
  return THPVariable_Wrap(std::move(norm));
}

}  // namespace torchstruct
