// CUDA kernel of torchstruct::global_norm.
//
// Multi-tensor and chunked, without host synchronization (see norm.cuh): one
// partial_kernel launch per dtype group, then `finish_kernel` (one block)
// reduces all partials and applies the root, writing the 0-dim result
// (float32, or float64 if any input is float64).
#include "norm.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

namespace torchstruct {
namespace {

using namespace torchstruct::cuda;

template <typename out_t>
__global__ void finish_kernel(const double* __restrict__ partials, int64_t n, int kind,
                              out_t* __restrict__ out) {
  const double v = reduce_partials(partials, n, kind);
  if (threadIdx.x == 0) *out = static_cast<out_t>(v);
}

at::Tensor global_norm_cuda(at::TensorList tensors, double norm_type) {
  const int kind = static_cast<int>(check_norm_type(norm_type));
  const c10::ScalarType out_dtype = check_global_norm_inputs(tensors);
  const c10::Device device = tensors[0].device();
  TORCH_CHECK(device.is_cuda(), "torchstruct::global_norm: CUDA kernel called with tensors on ",
              device);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const Plan plan = make_plan(tensors);
  at::Tensor out = at::empty({}, tensors[0].options().dtype(out_dtype));
  // At least one slot, so the finish kernel always has a valid buffer.
  at::Tensor partials = at::empty({std::max<int64_t>(plan.total_chunks, 1)},
                                  tensors[0].options().dtype(c10::kDouble));
  launch_partials(plan, kind, partials.data_ptr<double>(), stream, "torchstruct::global_norm");

  if (out_dtype == c10::kDouble) {
    finish_kernel<double><<<1, kThreads, 0, stream>>>(partials.const_data_ptr<double>(),
                                                      plan.total_chunks, kind,
                                                      out.data_ptr<double>());
  } else {
    finish_kernel<float><<<1, kThreads, 0, stream>>>(partials.const_data_ptr<double>(),
                                                     plan.total_chunks, kind,
                                                     out.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace torchstruct

TORCH_LIBRARY_IMPL(torchstruct, CUDA, m) {
  m.impl("global_norm", &torchstruct::global_norm_cuda);
}
