// Stage 04, task 4 — FSDP's memory: the measured peak equals the layout's accounting, a unit is gathered while its
// forward and its backward run (with a frozen parameter, until its frozen node has run), and an evaluation forward
// frees every unit it gathered.
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/storage/flat_storage.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/fsdp_case.h"
#include "support/spaced_batch.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <iostream>

namespace shardlab::fsdp {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

TEST(FullyShardedModel, MeasuredPeakEqualsTheAccountingOfTheLayout) {
  TrainConfig c = test_support::config("tiny_gpt").global_batch(4);
  run_ranks(
      2,
      [&](Communicator& comm) {
        for (bool raf : {true, false}) {
          auto model = make_model(c, at::kCPU);
          Options options;
          options.reshard_after_forward = raf;
          FullyShardedModel fsdp(model, comm, options);
          auto data = make_dataset(c.model, c.seed);
          fsdp.reset_memory_peaks();
          fsdp.loss(rank_slice(data->global_batch(0, c.global_batch), comm.rank(), 2)).backward();
          const MemoryTheory t = fsdp.memory_theory();
          // The copy-out needs the all-gather buffer (S blocks of the unit's shards) beside the gathered buffer, for
          // the unit being gathered: what the unit allocated, as the meter counts it (the Communicator's own copies,
          // Note [What the Communicator allocates], are stated beside: largest_all_gather_comm_bytes). raf: the
          // largest such moment is the root plus one block; kept: every block.
          auto gather_buffers = [&](const FsdpUnit& unit) { return 2 * unit.sharded_bytes(); };
          int64_t largest_gather = 0, every_block = 0;
          for (size_t u = 0; u + 1 < fsdp.units().size(); ++u) {
            const FsdpUnit& unit = *fsdp.units()[u];
            largest_gather = std::max(largest_gather, unit.gathered_capacity_bytes() + gather_buffers(unit));
            every_block += unit.gathered_capacity_bytes();
          }
          const FsdpUnit& last = *fsdp.units()[fsdp.units().size() - 2];  // the last block gathered in forward
          const int64_t expected =
              t.sharded_param_bytes + t.root_bytes + (raf ? largest_gather : every_block + gather_buffers(last));
          const MemoryStats& m = fsdp.memory();
          if (comm.rank() == 0)
            std::cout << (raf ? "raf" : "keep") << ": peak parameter bytes measured " << m.peak_param_bytes
                      << ", theory " << t.peak_param_bytes << " (" << double(m.peak_param_bytes) / t.peak_param_bytes
                      << "x), accounting " << expected << "; gradient bytes measured " << m.peak_grad_bytes
                      << ", theory " << t.peak_grad_bytes << "\n";
          EXPECT_EQ(m.peak_param_bytes, expected);
          EXPECT_EQ(m.peak_param_bytes, t.peak_param_bytes)
              << "the theory counts every buffer the design holds; the meter counted what was allocated";
          EXPECT_EQ(m.param_bytes, t.sharded_param_bytes) << "after the step only the shards are held";
          EXPECT_EQ(m.grad_bytes, t.sharded_grad_bytes) << "after the step only the sharded gradients are held";
          // Gradients, in a step whose sharded gradients are already there (zeroed in place): the theory walks the
          // backward (Note [The gradient peak, walked]) and counts the root's unsharded gradients from its start,
          // although the embedding's comes last. That is its only slack: measured <= theory <= measured + the root's.
          for (const auto& p : fsdp.parameters()) p.mutable_grad().zero_();
          fsdp.reset_memory_peaks();
          fsdp.loss(rank_slice(data->global_batch(1, c.global_batch), comm.rank(), 2)).backward();
          const int64_t root_grads = fsdp.units().back()->unsharded_grad_bytes();
          if (comm.rank() == 0)
            std::cout << "  second step: gradient bytes measured " << fsdp.memory().peak_grad_bytes << ", theory "
                      << t.peak_grad_bytes << " (the root's unsharded gradients: " << root_grads << ")\n";
          EXPECT_LE(fsdp.memory().peak_grad_bytes, t.peak_grad_bytes) << "a buffer the theory does not count";
          EXPECT_LE(t.peak_grad_bytes - fsdp.memory().peak_grad_bytes, root_grads)
              << "the theory counts more than the design holds";
          // An optimizer that drops the gradients (libtorch 2.x zero_grad sets them to None): new ones replace them
          // in the count, nothing is counted twice.
          for (const auto& p : fsdp.parameters()) p.mutable_grad().reset();
          fsdp.loss(rank_slice(data->global_batch(1, c.global_batch), comm.rank(), 2)).backward();
          EXPECT_EQ(fsdp.memory().grad_bytes, t.sharded_grad_bytes) << "after a step whose gradients were dropped";
        }
      },
      test_group());
}

// The theory of a step of several micro-batches accumulated under no_sync (memory_theory(k, kNoSync)): the unsharded
// gradients are kept from one micro-batch to the next (in the reduce dtype when it differs from the param dtype), and
// the last one reduces them. The same bounds as a plain step: measured <= theory <= measured + the root's unsharded
// gradients; the parameter peak is the plain step's, exactly. Stage 04's own check of the micro-batch branches (a
// theory that ignores them counts too little: a buffer the theory does not count).
TEST(FullyShardedModel, AStepOfSeveralMicroBatchesStaysWithinItsTheory) {
  TrainConfig c = test_support::config("tiny_gpt").global_batch(12);
  run_ranks(
      2,
      [&](Communicator& comm) {
        for (const bool mixed : {false, true}) {
          for (const int k : {2, 3}) {
            Options options;
            if (mixed) options.mixed_precision = {at::kBFloat16, at::kFloat};
            FullyShardedModel fsdp(make_model(c, at::kCPU), comm, options);
            auto data = make_dataset(c.model, c.seed);
            auto step = [&](int s) {
              auto micro = micro_batches(rank_slice(data->global_batch(s, c.global_batch), comm.rank(), 2), k);
              for (int i = 0; i + 1 < k; ++i) {
                auto scope = fsdp.no_sync();
                (fsdp.loss(micro[i]) / k).backward();
              }
              (fsdp.loss(micro[k - 1]) / k).backward();
            };
            step(0);  // the sharded gradients exist from here on, as in every later step
            for (const auto& p : fsdp.parameters()) p.mutable_grad().zero_();
            fsdp.reset_memory_peaks();
            step(1);
            const MemoryTheory t = fsdp.memory_theory(k, Accumulation::kNoSync);
            const MemoryStats& m = fsdp.memory();
            const int64_t root_grads = fsdp.units().back()->unsharded_grad_bytes();
            const std::string what =
                std::string(mixed ? "bf16 params, f32 reduce" : "f32") + ", " + std::to_string(k) + " micro-batches";
            if (comm.rank() == 0)
              std::cout << what << ": gradient peak measured " << m.peak_grad_bytes << ", theory " << t.peak_grad_bytes
                        << " (slack allowed: the root's unsharded gradients, " << root_grads
                        << "); parameter peak measured " << m.peak_param_bytes << ", theory " << t.peak_param_bytes
                        << "\n";
            EXPECT_LE(m.peak_grad_bytes, t.peak_grad_bytes) << what << ": a buffer the theory does not count";
            EXPECT_LE(t.peak_grad_bytes - m.peak_grad_bytes, root_grads) << what << ": the theory counts more";
            EXPECT_EQ(m.peak_param_bytes, t.peak_param_bytes) << what;
            EXPECT_EQ(m.grad_bytes, t.sharded_grad_bytes) << what << ": after the step only the sharded gradients";
          }
        }
      },
      test_group());
}

// Note [When a unit may be freed in backward] says a unit with a frozen parameter must stay gathered until the end of
// backward, because the frozen parameter's backward node can run after the trainable gradients are all in. This
// unit computes frozen(x) + fc(x): autograd runs fc's node first (made later), fc's gradients complete the unit, and
// only then does frozen's node compute the input's gradient from the frozen weight. Freed early, the unit would hand
// that node a weight without storage: this test must fail (wrong values or a crash) when `has_frozen()` is ignored.
TEST(FullyShardedModel, AUnitWithAFrozenParameterStaysGatheredUntilItsFrozenNodeHasRun) {
  struct Mix : torch::nn::Module {
    Mix()
        : frozen(register_module("frozen", torch::nn::Linear(8, 8))),
          fc(register_module("fc", torch::nn::Linear(8, 8))) {
      for (auto& p : frozen->parameters()) p.requires_grad_(false);
    }
    // The hook on frozen(x) runs as the frozen node is about to compute: its weight must hold its values then.
    at::Tensor forward(const at::Tensor& x) {
      at::Tensor a = frozen->forward(x);
      if (a.requires_grad()) {
        const at::Tensor w = frozen->weight;
        std::atomic<int64_t>* least = &least_bytes_at_frozen_node;
        a.register_hook([w, least](const at::Tensor&) { *least = std::min<int64_t>(*least, storage_bytes(w)); });
      }
      return a + fc->forward(x);
    }
    torch::nn::Linear frozen, fc;
    std::atomic<int64_t> least_bytes_at_frozen_node{INT64_MAX};
  };
  struct Net : Model {
    Net() {
      in = register_module("in", torch::nn::Linear(16, 8));
      mix = register_unit("mix", std::make_shared<Mix>());
      head = register_module("head", torch::nn::Linear(8, 4));
      init_parameters(*this, 5);
      for (auto& p : mix->frozen->parameters()) p.requires_grad_(false);
    }
    at::Tensor loss(const Batch& b) override {
      return at::cross_entropy_loss(head->forward(mix(at::tanh(in->forward(b.input)))), b.target);
    }
    torch::nn::Linear in{nullptr}, head{nullptr};
    UnitRef<Mix> mix;
  };
  auto data = make_dataset("mlp", 4);
  const int steps = 2, world = 2, batch = 8;
  auto reference = std::make_shared<Net>();
  auto ref_opt = make_optimizer("sgd", trainable_parameters(*reference), 0.1);
  for (int step = 0; step < steps; ++step) {
    ref_opt->zero_grad();
    reference->loss(data->global_batch(step, batch)).backward();
    ref_opt->step();
  }
  std::vector<std::vector<at::Tensor>> finals(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = std::make_shared<Net>();
        FullyShardedModel fsdp(model, comm);
        ASSERT_TRUE(fsdp.units()[0]->has_frozen());
        auto opt = make_optimizer("sgd", fsdp.parameters(), 0.1);
        for (int step = 0; step < steps; ++step) {
          opt->zero_grad();
          try {
            fsdp.loss(rank_slice(data->global_batch(step, batch), comm.rank(), world)).backward();
          } catch (const std::exception& e) {
            ADD_FAILURE() << "rank " << comm.rank() << " step " << step << ": backward threw (" << e.what()
                          << "); the frozen weight held " << model->mix->least_bytes_at_frozen_node
                          << " bytes when its backward node ran: the unit was freed before its backward was done "
                             "(Note [When a unit may be freed in backward])";
            return;
          }
          EXPECT_EQ(fsdp.units()[0]->state(), UnitState::kSharded)
              << "rank " << comm.rank() << " step " << step << ": the unit is " << to_string(fsdp.units()[0]->state())
              << " after backward; a unit kept gathered for its frozen parameter is freed at the end of backward";
          opt->step();
        }
        const int64_t least = model->mix->least_bytes_at_frozen_node;
        EXPECT_EQ(least, fsdp.units()[0]->gathered_capacity_bytes())
            << "rank " << comm.rank() << ": the frozen weight held " << least
            << " bytes when its backward node ran; the unit was freed before its backward was done";
        finals[comm.rank()] = on_cpu(fsdp.full_parameters());
      },
      test_group());
  for (int r = 0; r < world; ++r) {
    if (finals[r].empty()) continue;  // its backward failed, reported above
    const double diff = max_abs_diff(finals[r], on_cpu(reference->parameters()));
    std::cout << "rank " << r << ": max |param - one device| with a frozen parameter in the unit = " << diff << "\n";
    EXPECT_TRUE(all_close(finals[r], on_cpu(reference->parameters()), kRtol, kAtol)) << "max diff " << diff;
  }
}

// A unit that notes how many bytes its weight holds when its forward runs, and when its backward reaches it (a hook
// on an inner tensor runs after FSDP's hook on the unit's output, just before the unit's own backward nodes). Its
// input needs no gradient, so its backward never reads the weight: a unit left sharded shows here as 0 bytes, not as
// a read of freed memory.
struct Probe : torch::nn::Module {
  Probe() : fc(register_module("fc", torch::nn::Linear(6, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    forward_bytes = storage_bytes(fc->weight);
    if (forward_bytes == 0)
      throw std::runtime_error("the unit's forward found its weight at 0 bytes: it must be gathered before it runs");
    at::Tensor inner = fc->forward(x);
    if (inner.requires_grad()) {
      const at::Tensor w = fc->weight;
      std::atomic<int64_t>* seen = &backward_bytes;
      inner.register_hook([w, seen](const at::Tensor&) { *seen = storage_bytes(w); });
    }
    return at::tanh(inner);
  }
  torch::nn::Linear fc;
  int64_t forward_bytes = -1;
  std::atomic<int64_t> backward_bytes{-1};
};

TEST(FullyShardedModel, AUnitIsGatheredWhileItsForwardAndItsBackwardRun) {
  struct OneUnit : Model {
    OneUnit() {
      probe = register_unit("probe", std::make_shared<Probe>());
      init_parameters(*this, 9);
    }
    at::Tensor loss(const Batch& b) override { return probe(b.input).pow(2).mean(); }
    UnitRef<Probe> probe;
  };
  const Batch global = test_support::spaced_batch(4, 6);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<OneUnit>();
        FullyShardedModel fsdp(model, comm);  // reshard after forward: gathered again for its backward
        ASSERT_EQ(fsdp.root(), nullptr);
        const FsdpUnit& unit = *fsdp.units()[0];
        for (int step = 0; step < 2; ++step) {
          try {
            at::Tensor loss = fsdp.loss(rank_slice(global, comm.rank(), comm.size()));
            EXPECT_EQ(model->probe->forward_bytes, unit.gathered_capacity_bytes()) << "step " << step;
            loss.backward();
          } catch (const std::exception& e) {
            ADD_FAILURE() << "rank " << comm.rank() << " step " << step << ": " << e.what();
            return;
          }
          EXPECT_EQ(model->probe->backward_bytes.load(), unit.gathered_capacity_bytes())
              << "rank " << comm.rank() << " step " << step << ": the unit's weight held "
              << model->probe->backward_bytes.load() << " bytes when its backward ran; expected "
              << unit.gathered_capacity_bytes()
              << ": a unit freed after its forward is gathered again before its backward (pre_backward, from a "
                 "hook on the unit's output)";
          EXPECT_EQ(unit.state(), UnitState::kSharded) << "and freed after it";
          for (const auto& p : fsdp.parameters()) p.mutable_grad().zero_();
        }
      },
      test_group());
}

TEST(FullyShardedModel, EvaluationGathersAndFreesWithoutBackward) {
  TrainConfig c = test_support::config("tiny_gpt").global_batch(4);
  Options options;
  options.reshard_after_forward = false;
  test_support::fsdp_on_two_ranks(c, options, [&](Communicator&, FullyShardedModel& fsdp, const Batch& batch) {
    torch::NoGradGuard no_grad;
    const double loss = fsdp.loss(batch).item<double>();
    EXPECT_GT(loss, 0);
    for (const auto& unit : fsdp.units()) EXPECT_EQ(unit->gathered_bytes(), 0) << unit->name();
  });
}

}  // namespace
}  // namespace shardlab::fsdp
