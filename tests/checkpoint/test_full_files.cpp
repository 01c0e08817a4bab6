// Full files written one tensor at a time (Note [Full files written one tensor at a time] in checkpoint.cpp):
// save_full_checkpoint from FSDP's shards and export_checkpoint from a sharded checkpoint never hold the model,
// only about one tensor, and write the file write_file writes for the same tensors, byte for byte.
#include "shardlab/common/checkpoint.h"
#include "shardlab/common/model_factory.h"
#include "shardlab/common/reference.h"
#include "shardlab/common/safetensors.h"
#include "shardlab/common/thread_ranks.h"
#include "shardlab/fsdp/fsdp.h"
#include "support/counting_allocator.h"
#include "support/group.h"
#include "support/temp_dir.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

namespace shardlab {
namespace {

using test_support::TempDir;
using test_support::test_group;

std::string bytes_of_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(FullFiles, SaveAndExportHoldAboutOneTensorNotTheModelAndWriteWhatWriteFileWrites) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.layers = 8;
  c.dim = 64;
  const int world = 4;
  TempDir dir("full-files");
  const std::string saved_full = dir / "full.safetensors", exported = dir / "export.safetensors";
  int64_t model_bytes = 0, largest = 0;
  for (const auto& p : trainable_parameters(*make_model(c, at::kCPU))) {
    model_bytes += p.numel() * p.element_size();
    largest = std::max<int64_t>(largest, p.numel() * p.element_size());
  }
  test_support::CountingCpuAllocator counting;
  int64_t save_peak = 0;
  run_ranks(
      world,
      [&](Communicator& comm) {
        fsdp::FullyShardedModel fsdp([&] { return make_model(c, at::kCPU); }, comm);
        const ShardedState state = fsdp.checkpoint_state();
        save_checkpoint(dir / "sharded", state, comm);
        std::optional<test_support::CountingCpuAllocator::Install> installed;  // one for the process: rank 0's
        if (comm.rank() == 0) installed.emplace(counting);
        comm.barrier();
        save_full_checkpoint(saved_full, state, comm);  // every rank's part, counted at once
        comm.barrier();
        if (comm.rank() == 0) save_peak = counting.peak();
      },
      test_group());
  int64_t export_peak = 0;
  {
    test_support::CountingCpuAllocator::Install installed(counting);
    export_checkpoint(dir / "sharded", exported);
    export_peak = counting.peak();
  }
  // Save, for one tensor at a time: every rank's own rows padded for the all-gather (a quarter of it) and what the
  // all-gather gives every rank (all of it), and rank 0's assembled tensor; export: one tensor read whole. A save
  // or an export that held the model would hold model_bytes, on rank 0 alone.
  const int64_t save_bound = world * (largest + largest / world) + largest + world * (16 << 10);
  const int64_t export_bound = 2 * largest + (16 << 10);
  std::cout << "model " << model_bytes << " B, largest tensor " << largest << " B; allocated at once: save "
            << save_peak << " B (bound " << save_bound << "), export " << export_peak << " B (bound " << export_bound
            << ")\n";
  ASSERT_LT(save_bound, model_bytes) << "the bound must be below the model for the test to say anything";
  EXPECT_LE(save_peak, save_bound);
  EXPECT_LE(export_peak, export_bound);
  // The same bytes as write_file writes for the same tensors and metadata: the file's layout is not the writer's.
  const safetensors::Reader reader(saved_full);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, info] : reader.header().tensors) tensors.emplace_back(name, reader.tensor(name));
  std::reverse(tensors.begin(), tensors.end());  // given in another order than the file's
  safetensors::write_file(dir / "again.safetensors", tensors, reader.header().metadata);
  const std::string full_bytes = bytes_of_file(saved_full);
  EXPECT_TRUE(full_bytes == bytes_of_file(dir / "again.safetensors")) << "save_full_checkpoint != write_file";
  EXPECT_TRUE(full_bytes == bytes_of_file(exported)) << "the export of the same state differs from the full save";
  for (const auto& [name, t] : tensors)
    EXPECT_EQ(reader.header().metadata.at("shardlab.crc32." + name),
              std::to_string(safetensors::crc32(t.data_ptr(), t.numel() * t.element_size())))
        << name << ": the CRC-32 combined from the pieces is not the tensor's";
}

}  // namespace
}  // namespace shardlab
