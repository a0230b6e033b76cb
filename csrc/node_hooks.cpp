// Hooks on autograd graph nodes, which PyTorch offers no Python API to list; structural_grad
// asks here before it runs a real backward (the exact path of reentrant checkpointing), which
// would run hooks that torch.autograd.grad does not.
//
// torchstruct._C.accumulator_hooks(tensor): the hooks registered on a leaf tensor's gradient
// accumulator node itself, as (python, other) counts. A hook can sit on the AccumulateGrad node
// of a leaf (`leaf.view_as(leaf).grad_fn.next_functions[0][0].register_hook(...)` /
// `register_prehook`, as DistributedDataParallel's reducer, FSDP and ZeRO-style libraries do)
// rather than on the tensor. Such a hook runs whenever a backward executes the node, and never
// under torch.autograd.grad, which does not execute accumulators. `python` counts the hooks
// registered from Python; `other` those added in C++ (the DDP reducer's). A tensor without an
// accumulator (none made yet, or a non-leaf) has none: (0, 0).
//
// torchstruct._C.off_path_hooks(roots, targets): the nodes a backward from `roots` (tensors)
// executes and torch.autograd.grad(roots, targets) would not, that hold a hook: reachable from
// a root, not a gradient accumulator (those are asked about one by one, above), and with no
// path to a target (a target tensor's accumulator, or a node named like a checkpoint, whose
// inner backward may reach one). A list of (node name, kind, hooks), kind "retain_grad" (a
// non-leaf tensor's retain_grad(), whose .grad the backward would write; hooks empty) or
// "hook" (register_hook on the tensor or the node, register_prehook, a module's backward
// hooks), hooks the callables registered from Python (None for a hook made in C++).
#include <torch/csrc/autograd/python_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace torchstruct {
namespace {

using torch::autograd::Node;

// How many Python callables a node hook holds, or -1 for a hook made in C++. PyTorch keeps the
// Python callables registered on a node in one PyFunctionPreHook / PyFunctionPostHook /
// PyFunctionTensorPreHook per node or tensor, whose dict loses an entry when a handle is removed
// (the hook object itself stays). Their type information is not exported from libtorch_python,
// so the dynamic type's name is read (it contains the class name under every C++ ABI) before
// the cast.
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

// (python, other) counts of the hooks registered on the node itself.
void node_hooks(Node& node, long& python, long& other) {
  for (const auto& hook : node.pre_hooks()) {
    count(python_callables<torch::autograd::PyFunctionPreHook>(*hook, "PyFunctionPreHook"),
          python, other);
  }
  for (const auto& hook : node.post_hooks()) {
    count(python_callables<torch::autograd::PyFunctionPostHook>(*hook, "PyFunctionPostHook"),
          python, other);
  }
}

// Appends to `out` the Python callables a node hook holds (its dict's values), or None for a
// hook made in C++. Returns false on a Python error.
template <typename PyHook, typename Hook>
bool append_callables(Hook& hook, const char* name, PyObject* out) {
  if (std::strstr(typeid(hook).name(), name) == nullptr) return PyList_Append(out, Py_None) == 0;
  PyObject* dict = static_cast<PyHook&>(hook).dict;
  if (dict == nullptr || !PyDict_Check(dict)) return true;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    if (PyList_Append(out, value) != 0) return false;
  }
  return true;
}

// What the node holds that a backward through it would run: "retain_grad", "hook" or nullptr;
// the hooks' callables (None for one made in C++) appended to `callables`.
const char* hooked(Node& node, PyObject* callables, bool& failed) {
  if (!node.retains_grad_hooks().empty()) return "retain_grad";
  const Py_ssize_t before = PyList_GET_SIZE(callables);
  bool ok = true;
  for (const auto& hook : node.pre_hooks()) {
    ok = ok && append_callables<torch::autograd::PyFunctionPreHook>(*hook, "PyFunctionPreHook",
                                                                      callables);
  }
  for (const auto& hook : node.post_hooks()) {
    ok = ok && append_callables<torch::autograd::PyFunctionPostHook>(*hook, "PyFunctionPostHook",
                                                                       callables);
  }
  for (const auto& hook : node.tensor_pre_hooks()) {
    ok = ok && append_callables<torch::autograd::PyFunctionTensorPreHook>(
                   *hook, "PyFunctionTensorPreHook", callables);
  }
  failed = !ok;
  return PyList_GET_SIZE(callables) > before ? "hook" : nullptr;
}

bool named_like_a_checkpoint(const std::string& name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower.find("checkpoint") != std::string::npos;
}

bool tensors(PyObject* seq, const char* what, std::vector<at::Tensor>& out) {
  PyObject* fast = PySequence_Fast(seq, what);
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(fast, i);
    if (!THPVariable_Check(item)) {
      Py_DECREF(fast);
      PyErr_Format(PyExc_TypeError, "%s", what);
      return false;
    }
    out.push_back(THPVariable_Unpack(item));
  }
  Py_DECREF(fast);
  return true;
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
    node_hooks(*accumulator, python, other);
  }
  return Py_BuildValue("(ll)", python, other);
}

PyObject* off_path_hooks(PyObject* /*self*/, PyObject* args) {
  PyObject* roots_arg = nullptr;
  PyObject* targets_arg = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &roots_arg, &targets_arg)) return nullptr;
  std::vector<at::Tensor> roots;
  std::vector<at::Tensor> targets;
  if (!tensors(roots_arg, "off_path_hooks: roots must be a sequence of tensors", roots) ||
      !tensors(targets_arg, "off_path_hooks: targets must be a sequence of tensors", targets)) {
    return nullptr;
  }
  // every node reachable from the roots, and each one's parents (the nodes with an edge to it)
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  std::unordered_map<Node*, std::vector<Node*>> parents;
  std::vector<Node*> stack;
  for (const auto& root : roots) {
    if (Node* fn = root.grad_fn().get()) stack.push_back(fn);
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    order.push_back(node);
    for (const auto& edge : node->next_edges()) {
      Node* child = edge.function.get();
      if (child == nullptr) continue;
      parents[child].push_back(node);
      if (seen.count(child) == 0) stack.push_back(child);
    }
  }
  // the nodes with a path to a target: searched back from the targets along the parents
  std::vector<Node*> useful_stack;
  for (const auto& target : targets) {
    const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(target);
    if (accumulator && seen.count(accumulator.get()) != 0) useful_stack.push_back(accumulator.get());
  }
  std::vector<std::string> names(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    names[i] = order[i]->name();
    if (named_like_a_checkpoint(names[i])) useful_stack.push_back(order[i]);
  }
  std::unordered_set<Node*> useful;
  while (!useful_stack.empty()) {
    Node* node = useful_stack.back();
    useful_stack.pop_back();
    if (!useful.insert(node).second) continue;
    const auto up = parents.find(node);
    if (up == parents.end()) continue;
    for (Node* parent : up->second) {
      if (useful.count(parent) == 0) useful_stack.push_back(parent);
    }
  }
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < order.size(); ++i) {
    if (useful.count(order[i]) != 0 || names[i].find("AccumulateGrad") != std::string::npos) {
      continue;
    }
    PyObject* callables = PyList_New(0);
    if (callables == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    bool failed = false;
    const char* kind = hooked(*order[i], callables, failed);
    PyObject* item = failed || kind == nullptr
                         ? nullptr
                         : Py_BuildValue("(ssO)", names[i].c_str(), kind, callables);
    Py_DECREF(callables);
    if (failed || (kind != nullptr && (item == nullptr || PyList_Append(out, item) != 0))) {
      Py_XDECREF(item);
      Py_DECREF(out);
      return nullptr;
    }
    Py_XDECREF(item);
  }
  return out;
}

}  // namespace torchstruct
