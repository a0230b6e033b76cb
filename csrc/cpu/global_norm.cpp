// CPU kernel of torchstruct::global_norm.
//
// One call walks every tensor: the chunked, parallel, vectorized reduction of
// norm.h / norm.cpp over all of them, then the root. Tensors whose memory is a
// dense span (contiguous or a permutation of dims) are read in place; others
// from a contiguous copy.
#include "norm.h"

#include <torch/library.h>

#include <vector>

namespace torchstruct {
namespace {

at::Tensor global_norm_cpu(at::TensorList tensors, double norm_type) {
  const NormKind kind = check_norm_type(norm_type);
  const c10::ScalarType out_dtype = check_global_norm_inputs(tensors);
  TORCH_CHECK(tensors[0].device().is_cpu(),
              "torchstruct::global_norm: CPU kernel called with tensors on ", tensors[0].device());

  std::vector<at::Tensor> owned;  // contiguous copies, alive for the call
  std::vector<cpu::Chunk> chunks;
  chunks.reserve(tensors.size());
  int64_t total = 0;
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    cpu::append_tensor(t, chunks, owned);
    total += t.numel();
  }
  const double result = cpu::norm_of_chunks(chunks, kind, total);
  return cpu::cpu_scalar(result, out_dtype);
}

}  // namespace
}  // namespace torchstruct

TORCH_LIBRARY_IMPL(torchstruct, CPU, m) {
  m.impl("global_norm", &torchstruct::global_norm_cpu);
}
