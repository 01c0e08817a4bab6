// Full files written one tensor at a time (Note [Full files written one tensor at a time] in full_file.cpp):
// save_full_checkpoint from FSDP's shards and export_checkpoint from a sharded checkpoint never hold the model,
// only about one tensor, and write the file write_file writes for the same tensors, byte for byte.
#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/model_factory.h"
#include "shardlab/course/reference.h"
#include "shardlab/fsdp/fsdp.h"
#include "support/counting_allocator.h"
#include "support/eight_block_gpt.h"
#include "support/group.h"
#include "support/temp_dir.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
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
  const TrainConfig c = test_support::eight_block_gpt();
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

// Every kind of piece a full save meets, on 3 ranks: rows split over the ranks, a tensor only rank 2 holds, one
// only rank 0 holds, a 0-dim tensor, tensors with no element (no rows; rows of no width, split), and dtypes that
// Gloo cannot carry (bool, bfloat16). The file holds each whole, every CRC-32 checks, and a save that cannot
// create its file fails on every rank and leaves nothing behind.
TEST(FullFiles, EveryKindOfPieceIsWrittenWholeAndAFailedSaveLeavesNothing) {
  const int world = 3;
  TempDir dir("full-pieces");
  const at::Tensor split = at::arange(18, at::kFloat).reshape({6, 3});
  const at::Tensor flags = at::arange(6, at::kLong).remainder(2).to(at::kBool);
  const at::Tensor halves = at::arange(12, at::kFloat).reshape({6, 2}).to(at::kBFloat16);
  const at::Tensor only_two = at::arange(5, at::kLong);
  const at::Tensor only_zero = at::full({2, 2}, 7.0, at::kDouble);
  const at::Tensor scalar = at::scalar_tensor(3.5);
  std::vector<std::string> errors(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        const int r = comm.rank();
        ShardedState state;
        state.tensors.push_back({"split", split.narrow(0, 2 * r, 2).clone(), {6, 3}, 2 * r, true});
        state.tensors.push_back({"flags", flags.narrow(0, 2 * r, 2).clone(), {6}, 2 * r, true});
        state.tensors.push_back({"halves", halves.narrow(0, 2 * r, 2).clone(), {6, 2}, 2 * r, true});
        state.tensors.push_back({"only_two", only_two.clone(), {5}, 0, r == 2});
        state.tensors.push_back({"only_zero", only_zero.clone(), {2, 2}, 0, r == 0});
        state.tensors.push_back({"scalar", scalar.clone(), {}, 0, r == 0});
        state.tensors.push_back({"no_rows", at::empty({0, 3}), {0, 3}, 0, r == 0});
        state.tensors.push_back({"no_width", at::empty({2, 0}), {6, 0}, 2 * r, true});
        save_full_checkpoint(dir / "all.safetensors", state, comm);
        try {
          save_full_checkpoint(dir / "missing/dir/all.safetensors", state, comm);
        } catch (const std::runtime_error& e) {
          errors[r] = e.what();
        }
      },
      test_group());
  const auto back = safetensors::load_file(dir / "all.safetensors");
  const std::vector<std::pair<std::string, at::Tensor>> want = {{"split", split},
                                                                {"flags", flags},
                                                                {"halves", halves},
                                                                {"only_two", only_two},
                                                                {"only_zero", only_zero},
                                                                {"scalar", scalar},
                                                                {"no_rows", at::empty({0, 3})},
                                                                {"no_width", at::empty({6, 0})}};
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_EQ(back.at(name).sizes(), t.sizes()) << name;
    EXPECT_TRUE(back.at(name).equal(t)) << name << " came back as\n" << back.at(name);
  }
  ShardedState reread;  // the CRC-32s the header recorded, checked by a load of every tensor
  for (const auto& [name, t] : want) reread.tensors.push_back({name, at::zeros_like(t), t.sizes().vec(), 0, true});
  run_ranks(
      1, [&](Communicator& comm) { load_checkpoint(dir / "all.safetensors", reread, comm); }, test_group());
  for (int r = 0; r < world; ++r)
    EXPECT_NE(errors[r].find("missing/dir/all.safetensors"), std::string::npos) << "rank " << r << ": " << errors[r];
  EXPECT_FALSE(std::filesystem::exists(dir / "missing")) << "a failed save made something";
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path)) files += entry.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 1U) << "only the saved file: no staging file is left behind";
}

}  // namespace
}  // namespace shardlab
