// Chunk tables passed as kernel arguments (as PyTorch's multi_tensor_apply does), shared by
// the torchstruct CUDA kernels.
//
// A launch covers at most kMaxTensors tensors and kMaxBlocks chunks of kChunk elements:
// block b works on chunk block_to_chunk[b] of tensor block_to_tensor[b], whose addresses
// (kPtrs of them: param, grad, state, ...) and size travel in the argument struct itself.
// Nothing is staged in host or device buffers, so the launches are safe to capture in a
// CUDA graph and to replay (the addresses are those of the captured tensors, as for any
// captured kernel), and need no host synchronization. `for_each_launch` cuts a list into
// as many launches as needed; a tensor whose chunks do not fit continues, as slot 0, in the
// next launch. Kernel arguments are limited to 4 KiB: the sizes below keep every struct
// under that.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace torchstruct {
namespace cuda {

constexpr int64_t kChunk = 64 * 1024;  // elements per block
constexpr int kThreads = 512;

template <int kPtrs, int kMaxTensors, int kMaxBlocks>
struct ChunkArgs {
  static constexpr int ptrs = kPtrs;
  static constexpr int max_tensors = kMaxTensors;
  static constexpr int max_blocks = kMaxBlocks;
  void* ptr[kPtrs][kMaxTensors];
  int64_t numel[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];
};

// The chunk of the current block: its tensor slot and [begin, end) element range.
struct Chunk {
  int tensor;
  int64_t begin;
  int64_t size;
};

template <typename Args>
__device__ __forceinline__ Chunk chunk_of(const Args& args) {
  const int t = args.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.block_to_chunk[blockIdx.x]) * kChunk;
  const int64_t left = args.numel[t] - begin;
  return Chunk{t, begin, left < kChunk ? left : kChunk};
}

inline int64_t num_chunks(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// Calls launch(args, num_blocks) for consecutive pieces of items 0..n-1 (non-empty ones;
// empty ones are skipped). `fill(args, slot, i)` writes item i's pointers and numel into
// `slot`; `numel(i)` is item i's element count.
template <typename Args, typename Fill, typename Numel, typename Launch>
void for_each_launch(int64_t n, Fill fill, Numel numel, Launch launch) {
  static_assert(Args::max_tensors <= 256, "block_to_tensor is one byte");
  static_assert(sizeof(Args) <= 4000, "kernel arguments are limited to 4 KiB");
  Args args;
  int slot = 0;
  int blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t chunks = num_chunks(numel(i));
    if (chunks == 0) continue;
    TORCH_CHECK(chunks - 1 <= INT32_MAX, "torchstruct: a tensor has too many elements");
    fill(args, slot, i);
    for (int64_t c = 0; c < chunks; ++c) {
      args.block_to_tensor[blocks] = static_cast<unsigned char>(slot);
      args.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == Args::max_blocks || (last_chunk && slot == Args::max_tensors - 1)) {
        launch(args, blocks);
        blocks = 0;
        if (!last_chunk) {  // the tensor goes on in the next launch, as slot 0
          for (int k = 0; k < Args::ptrs; ++k) args.ptr[k][0] = args.ptr[k][slot];
          args.numel[0] = args.numel[slot];
          slot = 0;
        } else {
          slot = -1;  // the next tensor starts at slot 0
        }
      }
    }
    ++slot;
  }
  if (blocks > 0) launch(args, blocks);
}

}  // namespace cuda
}  // namespace torchstruct
