// Host-only check of torchstruct::cuda::for_each_launch (multi_tensor.cuh), built and run by
// tests/test_setup_detect.py where nvcc is found (no GPU needed): every chunk of every
// non-empty item is covered exactly once, every launch respects the table sizes, and every
// slot points at the right item. Not part of the extension (setup.py builds csrc/cuda/*.cu).
#include "cuda/multi_tensor.cuh"
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <vector>

using namespace torchstruct::cuda;

[[noreturn]] void fail(const char* what) {
  printf("%s\n", what);
  exit(1);
}

template <typename Args>
int check(const std::vector<int64_t>& numels) {
  std::map<std::pair<int64_t, int64_t>, int> seen;
  int launches = 0;
  for_each_launch<Args>(
      static_cast<int64_t>(numels.size()),
      [&](Args& a, int slot, int64_t i) {
        for (int k = 0; k < Args::ptrs; ++k) {
          a.ptr[k][slot] = reinterpret_cast<void*>(i * 8 + k + 1);
        }
        a.numel[slot] = numels[i];
      },
      [&](int64_t i) { return numels[i]; },
      [&](const Args& a, int blocks) {
        ++launches;
        if (blocks <= 0 || blocks > Args::max_blocks) fail("bad block count");
        for (int b = 0; b < blocks; ++b) {
          const int slot = a.block_to_tensor[b];
          if (slot >= Args::max_tensors) { printf("bad slot\n"); exit(1); }
          const int64_t item = (reinterpret_cast<int64_t>(a.ptr[0][slot]) - 1) / 8;
          for (int k = 0; k < Args::ptrs; ++k) {
            if (reinterpret_cast<int64_t>(a.ptr[k][slot]) != item * 8 + k + 1) fail("bad ptr");
          }
          if (a.numel[slot] != numels[item]) { printf("bad numel\n"); exit(1); }
          const int64_t chunk = a.block_to_chunk[b];
          if (chunk * kChunk >= numels[item]) { printf("chunk past the end\n"); exit(1); }
          seen[{item, chunk}]++;
        }
      });
  int64_t expected = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    for (int64_t c = 0; c < num_chunks(numels[i]); ++c) {
      ++expected;
      if (seen[{static_cast<int64_t>(i), c}] != 1) fail("a chunk not covered exactly once");
    }
  }
  int64_t total = 0;
  for (auto& kv : seen) total += kv.second;
  if (total != expected) { printf("extra chunks\n"); exit(1); }
  return launches;
}

int main() {
  std::mt19937_64 rng(0);
  int cases = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int64_t> numels(rng() % 400);
    for (auto& n : numels) {
      const int kind = rng() % 6;
      n = kind == 0 ? 0 : kind == 1 ? 1 + rng() % 10 : kind == 2 ? kChunk * (1 + rng() % 3)
        : kind == 3 ? kChunk * (rng() % 700) + rng() % kChunk : 1 + rng() % (3 * kChunk);
    }
    check<ChunkArgs<1, 110, 320>>(numels);
    check<ChunkArgs<7, 32, 256>>(numels);
    check<ChunkArgs<2, 3, 4>>(numels);
    ++cases;
  }
  // exact boundaries: a tensor filling the block table, tensors filling the slots
  check<ChunkArgs<1, 110, 320>>({320 * kChunk, 320 * kChunk, 1});
  check<ChunkArgs<1, 110, 320>>(std::vector<int64_t>(110, kChunk));
  check<ChunkArgs<1, 110, 320>>(std::vector<int64_t>(221, 3));
  check<ChunkArgs<1, 110, 320>>({int64_t(1) << 31, 5});
  printf("ok %d\n", cases);
  return 0;
}
