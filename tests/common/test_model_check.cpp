// check_same_model: every rank's model structure compared with rank 0's before any training collective
// (Note [Comparing the ranks' models]). Ranks are threads on real Gloo groups.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/model/model_check.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <iostream>
#include <mutex>
#include <thread>

namespace shardlab {
namespace {

using test_support::test_group;

// What one rank builds: a unit "block" (Linear in -> out) and a root head, optionally with a buffer. The knobs let a
// rank differ from the others in one respect at a time.
struct Shape {
  int64_t in = 7, out = 2;
  at::ScalarType dtype = at::kFloat;
  bool frozen_head = false;
  bool buffer = true;
  bool as_unit = true;   // "block" registered as a unit, or as a plain module
  bool swapped = false;  // head registered before block
};

struct Net : Model {
  explicit Net(const Shape& s) {
    if (s.swapped) head = register_module("head", torch::nn::Linear(s.out, 3));
    auto linear = torch::nn::Linear(s.in, s.out);
    if (s.as_unit) {
      block = register_unit("block", linear.ptr());
    } else {
      register_module("block", linear.ptr());
    }
    if (!s.swapped) head = register_module("head", torch::nn::Linear(s.out, 3));
    if (s.buffer) register_buffer("scale", at::ones({3}));
    to(s.dtype);
    if (s.frozen_head)
      for (auto& p : head->parameters()) p.requires_grad_(false);
  }
  at::Tensor loss(const Batch& b) override { return head->forward(block(b.input)).mean(); }
  UnitRef<torch::nn::LinearImpl> block;
  torch::nn::Linear head{nullptr};
};

struct Outcome {
  std::string error;  // empty: the check passed
  bool invalid_argument = false;
  std::vector<CollectiveRecord> records;
};

// Runs check_same_model on `world` ranks, rank r building shape(r).
std::vector<Outcome> check(int world, const std::function<Shape(int)>& shape) {
  std::vector<Outcome> out(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = std::make_shared<Net>(shape(comm.rank()));
        Outcome& o = out[comm.rank()];
        try {
          check_same_model(*model, comm, "TestWrapper");
        } catch (const std::invalid_argument& e) {
          o.error = e.what();
          o.invalid_argument = true;
        } catch (const std::exception& e) {
          o.error = e.what();
        }
        o.records = comm.recorder().snapshot();
      },
      test_group());
  return out;
}

// Every rank threw the same std::invalid_argument, containing every piece of `expected`.
void expect_refused(const std::vector<Outcome>& out, const std::vector<std::string>& expected) {
  std::cout << "rank 0: " << out[0].error << "\n";
  for (size_t r = 0; r < out.size(); ++r) {
    EXPECT_TRUE(out[r].invalid_argument) << "rank " << r << ": expected std::invalid_argument; got '" << out[r].error
                                         << "'";
    EXPECT_EQ(out[r].error, out[0].error) << "rank " << r << ": every rank throws the same message";
    for (const auto& piece : expected)
      EXPECT_NE(out[r].error.find(piece), std::string::npos)
          << "rank " << r << ": the message should contain \"" << piece << "\"; it is: " << out[r].error;
    // Only the check's own all-gathers ran: the digests, then the structures.
    ASSERT_EQ(out[r].records.size(), 2u) << "rank " << r;
    EXPECT_EQ(out[r].records[0].op, "all_gather");
    EXPECT_EQ(out[r].records[1].op, "all_gather");
  }
}

TEST(ModelCheck, TheStructureListsUnitsParametersAndBuffersInOrder) {
  Shape s;
  s.frozen_head = true;
  const std::vector<std::string> got = model_structure(*std::make_shared<Net>(s));
  const std::vector<std::string> want{
      "unit 0 'block'",
      "parameter 'block.weight': sizes [2, 7], Float, cpu, requires_grad",
      "parameter 'block.bias': sizes [2], Float, cpu, requires_grad",
      "parameter 'head.weight': sizes [3, 2], Float, cpu, frozen",
      "parameter 'head.bias': sizes [3], Float, cpu, frozen",
      "buffer 'scale': sizes [3], Float, cpu",
  };
  EXPECT_EQ(got, want);
}

TEST(ModelCheck, EqualModelsPassWithOneAllGatherOfTheDigests) {
  const int world = 3;
  // Values differ (each rank's own initialization); only the structure is compared.
  const auto out = check(world, [](int) { return Shape{}; });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(out[r].error, "") << "rank " << r;
    ASSERT_EQ(out[r].records.size(), 1u) << "rank " << r << ": one collective in the common case";
    EXPECT_EQ(out[r].records[0].op, "all_gather");
    EXPECT_EQ(out[r].records[0].numel, 4) << "a digest of 4 int64 per rank";
  }
}

// The two models: rank 1's first layer one row larger ([3, 7] against [2, 7]; at world size 3 the padded
// shards are the same size, so FSDP trained on silently), and two rows larger (FSDP's first all-gather aborted the
// process from Gloo's thread).
TEST(ModelCheck, ARankWithALargerParameterIsNamedWithBothShapesOnEveryRank) {
  for (const int64_t out_rows : {3, 4}) {
    SCOPED_TRACE("rank 1's block has " + std::to_string(out_rows) + " rows");
    const auto out = check(3, [&](int rank) {
      Shape s;
      if (rank == 1) s.out = out_rows;
      return s;
    });
    expect_refused(out, {"TestWrapper", "'block.weight'", "sizes [" + std::to_string(out_rows) + ", 7]", "sizes [2, 7]",
                         "rank 1 has", "rank 0 has", "Ranks that differ from rank 0: 1."});
  }
}

TEST(ModelCheck, EveryKindOfDifferenceIsNamed) {
  struct Case {
    std::string what;
    std::function<void(Shape&)> change;  // applied on rank 2 of 3
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases{
      {"dtype", [](Shape& s) { s.dtype = at::kDouble; }, {"'block.weight'", "Double", "Float"}},
      {"requires_grad", [](Shape& s) { s.frozen_head = true; }, {"'head.weight'", "frozen", "requires_grad"}},
      {"a missing buffer", [](Shape& s) { s.buffer = false; }, {"buffer 'scale'", "nothing (its structure ends"}},
      {"not a unit", [](Shape& s) { s.as_unit = false; }, {"unit 0 'block'", "parameter 'block.weight'"}},
      {"registration order", [](Shape& s) { s.swapped = true; }, {"'head.weight'", "'block.weight'"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const auto out = check(3, [&](int rank) {
      Shape s;
      if (rank == 2) c.change(s);
      return s;
    });
    auto expected = c.expected;
    expected.push_back("rank 2 has");
    expected.push_back("Ranks that differ from rank 0: 2.");
    expect_refused(out, expected);
  }
}

TEST(ModelCheck, SeveralRanksThatDifferAreAllListed) {
  const auto out = check(4, [](int rank) {
    Shape s;
    if (rank == 1) s.in = 5;   // differs at entry 1 (block.weight)
    if (rank == 3) s.out = 4;  // differs at entry 1 too
    return s;
  });
  expect_refused(out, {"Ranks that differ from rank 0: 1, 3.", "rank 1 has", "sizes [2, 5]"});
}

// A rank that never arrives: the others fail after the group's timeout, naming themselves, the group and the check.
TEST(ModelCheck, ARankThatNeverArrivesIsATimeoutNamingTheRankAndTheGroup) {
  GroupOptions options = test_group();
  options.timeout = std::chrono::milliseconds(2000);
  std::vector<std::string> errors(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        if (comm.rank() == 1) {  // alive, but never constructs its wrapper
          std::this_thread::sleep_for(std::chrono::milliseconds(3000));
          return;
        }
        auto model = std::make_shared<Net>(Shape{});
        try {
          check_same_model(*model, comm, "TestWrapper");
        } catch (const std::exception& e) {
          errors[comm.rank()] = e.what();
        }
      },
      options);
  std::cout << "rank 0: " << errors[0] << "\n";
  for (const std::string piece : {"TestWrapper", "rank 0 of group", "all-gather of the structure digests", "timed out"})
    EXPECT_NE(errors[0].find(piece), std::string::npos) << "expected \"" << piece << "\" in: " << errors[0];
}

}  // namespace
}  // namespace shardlab
