// torchstruct._C.step_plan(groups, parameter_type): which parameters a fused optimizer step
// updates, found in C++.
//
// `groups` is a list with one list of parameters per param group (an empty list for a group
// the step skips). A parameter is stepped when it requires grad and has a gradient, at the
// first place it is listed (a tied parameter listed in several groups is stepped once). The
// answer is one list per group of the stepped parameters, in order, or None whenever any
// input is outside the plain case this function decides exactly:
//
// - an element that is not exactly a torch.Tensor or `parameter_type` (a tensor subclass,
//   e.g. a DTensor, may override what `.grad` and `.requires_grad` read in Python);
// - a stepped parameter that is not dense (overlaps itself or has gaps), is on the meta
//   device, or has a dtype other than float32, float64, float16 and bfloat16;
// - its gradient sparse, a tensor subclass, or of another dtype, shape or device;
// - two stepped parameters of one group whose bytes overlap.
//
// The caller (torchstruct.optim._base) then takes its checked Python path, which raises the
// error that names the parameter, or accepts what only it handles. Nothing is written here.
// Reading `.grad` and `.requires_grad` attribute by attribute in Python costs several
// microseconds per parameter and step; here it costs a few tens of nanoseconds.
//
// torchstruct._C.grads_of(params): the `.grad` of each parameter in a list, when each is laid
// out as its parameter (the strides of every dimension of size > 1 equal, as the kernels take
// them); None when one is missing or laid out otherwise, or a tensor is a subclass with
// Python dispatch (the caller reads them in Python then).
#include "common.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKey.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace torchstruct {
namespace {

// The bytes [start, end) of a dense tensor's elements in its device's address space.
struct Span {
  int type;
  int index;
  uintptr_t start;
  uintptr_t end;
};

bool plain_tensor(PyObject* obj, PyObject* parameter_type) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  return type == THPVariableClass || type == parameter_type;
}

// A parameter and its gradient as the fused kernels take them without a copy of the
// parameter; the gradient may be laid out differently (the caller copies it then).
bool plain_pair(const at::Tensor& p, const at::Tensor& g) {
  if (p.layout() != c10::kStrided || p.is_meta() || !is_supported_float(p.scalar_type()) ||
      !p.is_non_overlapping_and_dense()) {
    return false;
  }
  for (int64_t d = 0; d < p.dim(); ++d) {
    if (p.size(d) > 1 && p.stride(d) <= 0) return false;
  }
  return g.layout() == c10::kStrided && !g.key_set().has(c10::DispatchKey::Python) &&
         g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes() &&
         g.device() == p.device();
}

bool overlapping(std::vector<Span>& spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::tie(a.type, a.index, a.start, a.end) < std::tie(b.type, b.index, b.start, b.end);
  });
  for (size_t i = 1; i < spans.size(); ++i) {
    const Span& a = spans[i - 1];
    const Span& b = spans[i];
    if (a.type == b.type && a.index == b.index && b.start < a.end) return true;
  }
  return false;
}

// The stepped parameters of one group appended to `out` (a new list); false: not plain.
bool plan_group(PyObject* params, PyObject* parameter_type, std::unordered_set<PyObject*>& seen,
                PyObject* out) {
  if (!PyList_Check(params) && !PyTuple_Check(params)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(params);
  PyObject** items = PySequence_Fast_ITEMS(params);
  std::vector<Span> spans;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    if (!plain_tensor(item, parameter_type)) return false;
    const at::Tensor& p = THPVariable_Unpack(item);
    if (!p.requires_grad()) continue;
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (!seen.insert(item).second) continue;  // stepped at its first place
    if (!plain_pair(p, g)) return false;
    if (p.numel() > 0) {
      const auto start = reinterpret_cast<uintptr_t>(p.const_data_ptr());
      const auto bytes = static_cast<uintptr_t>(p.numel()) * p.element_size();
      spans.push_back(Span{static_cast<int>(p.device().type()), p.device().index(), start,
                           start + bytes});
    }
    if (PyList_Append(out, item) != 0) throw python_error();
  }
  return !overlapping(spans);
}

}  // namespace

PyObject* step_plan(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* groups = nullptr;
  PyObject* parameter_type = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &groups, &parameter_type)) return nullptr;
  if (!PyList_Check(groups)) Py_RETURN_NONE;
  const Py_ssize_t n = PyList_GET_SIZE(groups);
  THPObjectPtr plan(PyList_New(n));
  if (!plan) return nullptr;
  std::unordered_set<PyObject*> seen;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* stepped = PyList_New(0);
    if (stepped == nullptr) return nullptr;
    PyList_SET_ITEM(plan.get(), i, stepped);  // owned by the plan from here on
    if (!plan_group(PyList_GET_ITEM(groups, i), parameter_type, seen, stepped)) Py_RETURN_NONE;
  }
  return plan.release();
  END_HANDLE_TH_ERRORS
}

PyObject* grads_of(PyObject* /*self*/, PyObject* params) {
  HANDLE_TH_ERRORS
  if (!PyList_Check(params)) Py_RETURN_NONE;
  const Py_ssize_t n = PyList_GET_SIZE(params);
  THPObjectPtr grads(PyList_New(n));
  if (!grads) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(params, i);
    if (!THPVariable_Check(item)) Py_RETURN_NONE;
    const at::Tensor& p = THPVariable_Unpack(item);
    const at::Tensor& g = p.grad();
    if (!g.defined() || p.key_set().has(c10::DispatchKey::Python) ||
        g.key_set().has(c10::DispatchKey::Python) || g.sizes() != p.sizes()) {
      Py_RETURN_NONE;
    }
    for (int64_t d = 0; d < p.dim(); ++d) {
      if (p.size(d) > 1 && p.stride(d) != g.stride(d)) Py_RETURN_NONE;
    }
    PyList_SET_ITEM(grads.get(), i, THPVariable_Wrap(g));
  }
  return grads.release();
  END_HANDLE_TH_ERRORS
}

}  // namespace torchstruct
