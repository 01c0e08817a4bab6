// Stage 04 (given) — the gather seam (gather.h): a compressed all-gather plugs in through Options::gather without
// editing FSDP. Here an int8 all-gather with one scale per rank's block, written in this test as a user would: every
// unshard sends bytes, the forward computes with the dequantized parameters, and everything that must stay exact
// (the full parameters, checkpoints, the shards the optimizer steps) does.
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/fsdp/gather.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/data.h"
#include "shardlab/course/model_factory.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>

namespace shardlab::fsdp {
namespace {

using test_support::test_group;

// Each rank's block: its scale (4 bytes, a float) then its padded shards as int8 (value / scale, rounded).
class Int8Gather final : public GatherSeam {
 public:
  GatherWire wire(int64_t shard_numel, c10::ScalarType) const override { return {kScale + shard_numel, at::kByte}; }
  at::Tensor pack(const at::Tensor& shards, c10::ScalarType, const BufferMaker& buffer) const override {
    at::Tensor block = buffer(kScale + shards.numel(), at::kByte);
    const float scale = std::max(shards.abs().max().item<float>(), 1e-30F) / 127.0F;
    block.narrow(0, 0, kScale).view(at::kFloat).fill_(scale);
    block.narrow(0, kScale, shards.numel()).view(at::kChar).copy_((shards / scale).round().clamp(-127, 127));
    return block;
  }
  at::Tensor unpack(const at::Tensor& block, int64_t shard_numel, c10::ScalarType param_dtype,
                    const BufferMaker& buffer) const override {
    const float scale = block.narrow(0, 0, kScale).clone().view(at::kFloat).item<float>();  // a block may sit unaligned
    return buffer(shard_numel, param_dtype).copy_(block.narrow(0, kScale, shard_numel).view(at::kChar)).mul_(scale);
  }
  int64_t pack_bytes(int64_t shard_numel, c10::ScalarType, c10::ScalarType) const override {
    return kScale + shard_numel;
  }
  int64_t unpack_bytes(int64_t shard_numel, c10::ScalarType param_dtype) const override {
    return shard_numel * static_cast<int64_t>(c10::elementSize(param_dtype));
  }

 private:
  static constexpr int64_t kScale = 4;
};

TEST(GatherSeam, ACompressedAllGatherPlugsInThroughOptionsAndOnlyTheUnshardUsesIt) {
  const int world = 2;
  const auto data = make_dataset("mlp", 5);
  run_ranks(
      world,
      [&](Communicator& comm) {
        const Batch batch = rank_slice(data->global_batch(0, 8), comm.rank(), world);
        auto exact_model = make_model("mlp", 5);
        FullyShardedModel exact(exact_model, comm);
        auto int8_model = make_model("mlp", 5);
        Options options;
        options.gather = std::make_shared<Int8Gather>();
        FullyShardedModel int8(int8_model, comm, options);
        // What must stay exact: the full parameters (gathered as they are, not through the seam) and the shards.
        const std::vector<at::Tensor> full = exact.full_parameters(), full_int8 = int8.full_parameters();
        ASSERT_EQ(full.size(), full_int8.size());
        for (size_t i = 0; i < full.size(); ++i)
          EXPECT_TRUE(at::equal(full[i], full_int8[i])) << "full parameter " << i << " went through the seam";
        // The unshards of a forward and its backward all send the seam's blocks: bytes, 4 + Σ padded shard numel.
        const size_t mark = comm.recorder().size();
        const at::Tensor loss_int8 = int8.loss(batch);
        loss_int8.backward();
        size_t gathers = 0;
        for (const auto& r : comm.recorder().since(mark)) {
          if (r.op != "all_gather") continue;
          ++gathers;
          EXPECT_EQ(r.dtype, at::kByte) << "an all-gather of " << c10::toString(r.dtype);
          bool a_unit = false;
          for (const auto& unit : int8.units()) a_unit = a_unit || r.numel == 4 + unit->sharded_bytes() / 4;
          EXPECT_TRUE(a_unit) << "an all-gather of " << r.numel << " bytes: no unit's scale and int8 shards";
        }
        EXPECT_GE(gathers, int8.units().size()) << "every unit gathered through the seam";
        // The forward computed with the dequantized parameters: close to the exact loss, not equal to it.
        const double exact_loss = exact.loss(batch).item<double>(),
                     diff = std::abs(loss_int8.item<double>() - exact_loss);
        if (comm.rank() == 0)
          std::cout << "loss with int8 all-gathers " << loss_int8.item<double>() << ", exact " << exact_loss
                    << ": |difference| " << diff << " over " << gathers << " all-gathers of bytes\n";
        EXPECT_GT(diff, 0.0) << "the int8 blocks were not what the forward used";
        EXPECT_LT(diff, 0.05 * std::abs(exact_loss)) << "dequantized parameters far from the real ones";
        // The gradients land in the exact shards, in their own dtype, for the optimizer.
        for (const auto& p : int8.parameters()) {
          ASSERT_TRUE(p.grad().defined());
          EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
        }
        // The memory the seam declares is in the theory, and the meter counted the step's peak beside it.
        const MemoryTheory with = int8.memory_theory(), without = exact.memory_theory();
        EXPECT_GT(with.largest_all_gather_bytes, 0);
        EXPECT_NE(with.largest_all_gather_bytes, without.largest_all_gather_bytes);
        EXPECT_EQ(int8.memory().peak_param_bytes, with.peak_param_bytes);
      },
      test_group());
}

// A seam that breaks its own contract (pack gives a block of another size than its wire(), unpack another dtype than
// the param dtype) is refused with an error naming the unit and what was expected, before the all-gather is issued
// or before the copy-out writes a parameter.
class WrongSizes final : public GatherSeam {
 public:
  explicit WrongSizes(bool pack_wrong) : pack_wrong_(pack_wrong) {}
  GatherWire wire(int64_t shard_numel, c10::ScalarType param_dtype) const override {
    return {shard_numel, param_dtype};
  }
  at::Tensor pack(const at::Tensor& shards, c10::ScalarType param_dtype, const BufferMaker& buffer) const override {
    return pack_wrong_ ? buffer(shards.numel() + 1, param_dtype) : shards;
  }
  at::Tensor unpack(const at::Tensor& block, int64_t, c10::ScalarType, const BufferMaker&) const override {
    return pack_wrong_ ? block : block.to(at::kDouble);
  }
  int64_t pack_bytes(int64_t, c10::ScalarType, c10::ScalarType) const override { return 0; }
  int64_t unpack_bytes(int64_t, c10::ScalarType) const override { return 0; }

 private:
  bool pack_wrong_;
};

TEST(GatherSeam, ASeamThatBreaksItsContractIsRefusedNamingTheUnit) {
  const auto data = make_dataset("mlp", 5);
  for (const bool pack_wrong : {true, false}) {
    run_ranks(
        2,
        [&](Communicator& comm) {
          Options options;
          options.gather = std::make_shared<WrongSizes>(pack_wrong);
          FullyShardedModel fsdp(make_model("mlp", 5), comm, options);
          const size_t mark = comm.recorder().size();
          try {
            fsdp.loss(rank_slice(data->global_batch(0, 8), comm.rank(), 2));
            ADD_FAILURE() << "a seam whose " << (pack_wrong ? "pack" : "unpack") << " breaks its contract was taken";
          } catch (const std::invalid_argument& e) {
            const std::string what = e.what();
            EXPECT_NE(what.find(std::string("the gather seam's ") + (pack_wrong ? "pack" : "unpack") + " gave"),
                      std::string::npos)
                << what;
            EXPECT_NE(what.find("FSDP unit '"), std::string::npos) << what;
            if (comm.rank() == 0) std::cout << what << "\n";
          }
          if (pack_wrong) EXPECT_EQ(comm.recorder().size(), mark) << "an all-gather issued with a wrong block";
        },
        test_group());
  }
}

}  // namespace
}  // namespace shardlab::fsdp
