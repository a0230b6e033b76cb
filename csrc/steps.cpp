// torchstruct._C.sgd_step_(...) and torchstruct._C.adamw_step_(...): the fused optimizer steps
// (torch.ops.torchstruct.sgd_step_ / adamw_step_, same arguments, all positional) called from
// Python without the boxed path of torch.ops. The caller runs them under torch.no_grad().
//
// A step hands the op five or six lists of one tensor per parameter. Through torch.ops each
// element is converted into a boxed value and back, and each reference released on the
// dispatcher's side takes the GIL again: about a microsecond per tensor, which on a GPU can
// cost more than the update's own kernels. Here the lists are read into vectors with the GIL
// held, the op runs unboxed without it, straight to the kernel of the tensors' device (the
// autograd keys excluded: the kernels bump the version counters of what they write), and the
// vectors are released after the GIL is back. The op's errors are raised as torch.ops raises
// them. Under torch.compile the Python side calls torch.ops (this function is not traceable).
//
// torchstruct._C.check_sgd_step_(...) / check_adamw_step_(...), same arguments: the op's input
// checks alone (those of both kernels, optim_common.h), writing nothing, so that a step of
// several param groups checks every group before the first is written.
//
// torchstruct._C.common_device(tensors): the device of every tensor in a list or tuple, or None
// when they are on several, the list is empty, or one is a tensor subclass with Python
// dispatch (a DTensor: its local shards are stepped).
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "optim_common.h"

#include <ATen/core/List.h>
#include <c10/util/MaybeOwned.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <vector>

namespace torchstruct {
namespace {

using OptionalTensors = c10::List<std::optional<at::Tensor>>;
using Optional = std::optional<at::Tensor>;

// Tensors borrowed from their Python objects, which are held (Py_INCREF) until this is
// destroyed, with the GIL held: no TensorImpl reference count moves. (Each move of one that
// has a Python object goes through the Python interpreter and takes the GIL: for the lists of
// a step, hundreds of tensors, that cost more than the checks themselves.)
class Tensors {
 public:
  Tensors() = default;
  Tensors(const Tensors&) = delete;
  Tensors& operator=(const Tensors&) = delete;
  ~Tensors() {
    for (at::Tensor& t : tensors_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
    for (PyObject* owner : owners_) Py_DECREF(owner);
  }
  void reserve(size_t n) {
    tensors_.reserve(n);
    owners_.reserve(n);
  }
  void push_back(PyObject* obj) {
    Py_INCREF(obj);
    owners_.push_back(obj);
    tensors_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(THPVariable_Unpack(obj)));
  }
  operator at::TensorList() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<PyObject*> owners_;
};

// A Python list or tuple of tensors; false with a TypeError set otherwise.
bool read_tensors(PyObject* seq, const char* what, Tensors& out) {
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list of tensors, got %s", what,
                 Py_TYPE(seq)->tp_name);
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(items[i])) {
      PyErr_Format(PyExc_TypeError, "%s[%zd] must be a tensor, got %s", what, i,
                   Py_TYPE(items[i])->tp_name);
      return false;
    }
    out.push_back(items[i]);
  }
  return true;
}

bool read_optional(PyObject* obj, const char* what, Optional& out) {
  if (obj == Py_None) return true;
  if (!THPVariable_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a tensor or None, got %s", what,
                 Py_TYPE(obj)->tp_name);
    return false;
  }
  out = THPVariable_Unpack(obj);
  return true;
}

// Masks: a list or tuple of bool tensors or None (one per parameter), or empty.
bool read_masks(PyObject* seq, OptionalTensors& out) {
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
    PyErr_Format(PyExc_TypeError, "masks must be a list, got %s", Py_TYPE(seq)->tp_name);
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    Optional mask;
    if (!read_optional(items[i], "a mask", mask)) return false;
    out.push_back(std::move(mask));
  }
  return true;
}

// Runs `call` without the GIL; the tensors it reads stay referenced by the caller's vectors,
// which are released with the GIL held.
template <typename F>
PyObject* without_gil(F&& call) {
  HANDLE_TH_ERRORS
  {
    pybind11::gil_scoped_release no_gil;
    // Straight to the device kernel, as under torch.no_grad() (where the caller is): the
    // kernels bump the version counters of what they write themselves.
    c10::impl::ExcludeDispatchKeyGuard no_autograd(
        c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    call();
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace

namespace {

// The three optional scalings every step takes last: clip_coef, grad_scale, found_inf.
struct Scalings {
  Optional clip_coef, grad_scale, found_inf;

  bool read(PyObject* clip_obj, PyObject* scale_obj, PyObject* inf_obj) {
    return read_optional(clip_obj, "clip_coef", clip_coef) &&
           read_optional(scale_obj, "grad_scale", grad_scale) &&
           read_optional(inf_obj, "found_inf", found_inf);
  }
};

struct SgdArgs {
  Tensors params, grads, bufs;
  OptionalTensors masks;
  double lr, momentum, dampening, weight_decay;
  int nesterov, maximize, first_step;
  Scalings sc;

  bool parse(PyObject* args) {
    PyObject *params_obj, *grads_obj, *bufs_obj, *masks_obj, *clip_obj, *scale_obj, *inf_obj;
    return PyArg_ParseTuple(args, "OOOOddddpppOOO", &params_obj, &grads_obj, &bufs_obj,
                            &masks_obj, &lr, &momentum, &dampening, &weight_decay, &nesterov,
                            &maximize, &first_step, &clip_obj, &scale_obj, &inf_obj) &&
           read_tensors(params_obj, "params", params) &&
           read_tensors(grads_obj, "grads", grads) &&
           read_tensors(bufs_obj, "momentum_buffers", bufs) && read_masks(masks_obj, masks) &&
           sc.read(clip_obj, scale_obj, inf_obj);
  }
};

struct AdamwArgs {
  Tensors params, grads, avgs, sqs, maxs, steps;
  OptionalTensors masks;
  double lr, beta1, beta2, weight_decay, eps;
  int amsgrad, maximize;
  Scalings sc;

  bool parse(PyObject* args) {
    PyObject *params_obj, *grads_obj, *avgs_obj, *sqs_obj, *maxs_obj, *steps_obj, *masks_obj;
    PyObject *clip_obj, *scale_obj, *inf_obj;
    return PyArg_ParseTuple(args, "OOOOOOOdddddppOOO", &params_obj, &grads_obj, &avgs_obj,
                            &sqs_obj, &maxs_obj, &steps_obj, &masks_obj, &lr, &beta1, &beta2,
                            &weight_decay, &eps, &amsgrad, &maximize, &clip_obj, &scale_obj,
                            &inf_obj) &&
           read_tensors(params_obj, "params", params) &&
           read_tensors(grads_obj, "grads", grads) &&
           read_tensors(avgs_obj, "exp_avgs", avgs) &&
           read_tensors(sqs_obj, "exp_avg_sqs", sqs) &&
           read_tensors(maxs_obj, "max_exp_avg_sqs", maxs) &&
           read_tensors(steps_obj, "steps", steps) && read_masks(masks_obj, masks) &&
           sc.read(clip_obj, scale_obj, inf_obj);
  }
};

}  // namespace

PyObject* sgd_step(PyObject* /*self*/, PyObject* args) {
  SgdArgs a;
  if (!a.parse(args)) return nullptr;
  return without_gil([&] {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("torchstruct::sgd_step_", "")
            .typed<void(at::TensorList, at::TensorList, at::TensorList, const OptionalTensors&,
                        double, double, double, double, bool, bool, bool, const Optional&,
                        const Optional&, const Optional&)>();
    op.call(a.params, a.grads, a.bufs, a.masks, a.lr, a.momentum, a.dampening, a.weight_decay,
            a.nesterov != 0, a.maximize != 0, a.first_step != 0, a.sc.clip_coef,
            a.sc.grad_scale, a.sc.found_inf);
  });
}

PyObject* adamw_step(PyObject* /*self*/, PyObject* args) {
  AdamwArgs a;
  if (!a.parse(args)) return nullptr;
  return without_gil([&] {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("torchstruct::adamw_step_", "")
            .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                        at::TensorList, at::TensorList, const OptionalTensors&, double, double,
                        double, double, double, bool, bool, const Optional&, const Optional&,
                        const Optional&)>();
    op.call(a.params, a.grads, a.avgs, a.sqs, a.maxs, a.steps, a.masks, a.lr, a.beta1, a.beta2,
            a.weight_decay, a.eps, a.amsgrad != 0, a.maximize != 0, a.sc.clip_coef,
            a.sc.grad_scale, a.sc.found_inf);
  });
}

PyObject* check_sgd_step(PyObject* /*self*/, PyObject* args) {
  SgdArgs a;
  if (!a.parse(args)) return nullptr;
  HANDLE_TH_ERRORS
  check_sgd_inputs(a.params, a.grads, a.bufs, a.masks, a.lr, a.momentum, a.dampening,
                   a.weight_decay, a.sc.clip_coef, a.sc.grad_scale, a.sc.found_inf);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* check_adamw_step(PyObject* /*self*/, PyObject* args) {
  AdamwArgs a;
  if (!a.parse(args)) return nullptr;
  HANDLE_TH_ERRORS
  check_adamw_inputs(a.params, a.grads, a.avgs, a.sqs, a.maxs, a.steps, a.masks, a.lr, a.beta1,
                     a.beta2, a.weight_decay, a.eps, a.amsgrad != 0, a.sc.clip_coef,
                     a.sc.grad_scale, a.sc.found_inf);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* common_device(PyObject* /*self*/, PyObject* tensors) {
  HANDLE_TH_ERRORS
  if ((!PyList_Check(tensors) && !PyTuple_Check(tensors)) ||
      PySequence_Fast_GET_SIZE(tensors) == 0) {
    Py_RETURN_NONE;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors);
  PyObject** items = PySequence_Fast_ITEMS(tensors);
  std::optional<c10::Device> device;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(items[i])) Py_RETURN_NONE;
    const at::Tensor& t = THPVariable_Unpack(items[i]);
    if (t.key_set().has(c10::DispatchKey::Python)) Py_RETURN_NONE;
    if (!device) {
      device = t.device();
    } else if (t.device() != *device) {
      Py_RETURN_NONE;
    }
  }
  return THPDevice_New(*device);
  END_HANDLE_TH_ERRORS
}

}  // namespace torchstruct
