// Stage 01 — naive DDP. N ranks (threads, real Gloo) must train exactly like one device on the union of their
// batches, with one all-reduce per parameter gradient and none inside no_sync.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"
#include "shardlab/naive_ddp/naive_ddp.h"

#include "support/clipping.h"
#include "support/device.h"
#include "support/failing_backend.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/no_sync.h"
#include "support/param_name.h"
#include "support/refusal.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"
#include "support/watched_backend.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <iostream>
#include <mutex>
#include <set>

namespace shardlab::naive_ddp {
namespace {

using test_support::test_group;

// One rank's training through NaiveDDP (see test_support::train_replica); returns the final parameters.
std::vector<at::Tensor> train_rank(Communicator& comm, const TrainConfig& c) {
  auto model = make_model(c.model, c.seed, device_of(c));
  NaiveDDP ddp(model, comm);
  return test_support::train_replica(comm, c, *model, ddp);
}

// Trains on `world` ranks and compares every rank's parameters with the single-device reference.
void expect_matches_reference(int world, const TrainConfig& c, const GroupOptions& group = test_group()) {
  const ReferenceResult ref = train_reference(c);
  std::vector<std::vector<at::Tensor>> finals(world);
  run_ranks(
      world, [&](Communicator& comm) { finals[comm.rank()] = train_rank(comm, c); }, group);
  test_support::expect_ranks_match(finals, ref.params, c.model + "/" + c.optimizer, "world", world, "micro",
                                   c.micro_batches);
}

// On 2 ranks over `group`, NaiveDDP over the mlp of seed 7: `body(comm, model, ddp, data, params)`, with the mlp
// data of that seed and the model's trainable parameters.
template <typename Body>
void on_two_mlp_ranks(Body body, const GroupOptions& group = test_group()) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("mlp", 7);
        NaiveDDP ddp(model, comm);
        auto data = make_dataset("mlp", 7);
        body(comm, *model, ddp, *data, trainable_parameters(*model));
      },
      group);
}

struct EquivalenceCase {
  std::string model, optimizer;
  int world, micro;
};

std::ostream& operator<<(std::ostream& os, const EquivalenceCase& e) {
  return os << e.model << "_" << e.optimizer << "_w" << e.world << "_m" << e.micro;
}

class Equivalence : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(Equivalence, MatchesSingleDeviceReference) {
  const auto& e = GetParam();
  // The global batch divides by 1, 2, 3, 4 and by every micro-batch count used below
  TrainConfig c = test_support::equivalence_config(e.model, e.optimizer, e.micro).steps(6).global_batch(12).seed(11);
  expect_matches_reference(e.world, c);
}

// World size 1 on NCCL (one GPU can host only one NCCL rank): the same training, CUDA tensors, NCCL collectives.
// SGD, compared tightly: two micro-batches sum the gradients in another order than the reference's one batch, and
// the tiny GPT's near-zero gradients make AdamW's parameters drift (Note [Comparing with one device]).
TEST(NeedsAGpu, NaiveDdpOnNcclWorldOneMatchesSingleDevice) {
  if (!test_support::nccl_usable()) GTEST_SKIP() << "needs a CUDA libtorch with NCCL and a GPU";
  TrainConfig c = test_support::config("tiny_gpt")
                      .optimizer("sgd")
                      .lr(0.05)
                      .steps(4)
                      .global_batch(8)
                      .micro_batches(2)
                      .device("cuda:0");
  GroupOptions group = test_group();
  group.kind = BackendKind::kNccl;
  expect_matches_reference(1, c, group);
}

std::vector<EquivalenceCase> equivalence_cases() {
  std::vector<EquivalenceCase> cases;
  for (const char* opt : {"sgd", "adamw"})
    for (int w : {1, 2, 3, 4}) cases.push_back({"mlp", opt, w, 1});
  // gradient accumulation with no_sync: local batch 12/w split into m micro-batches
  cases.push_back({"mlp", "sgd", 1, 3});
  cases.push_back({"mlp", "adamw", 2, 3});
  cases.push_back({"mlp", "sgd", 3, 2});
  cases.push_back({"mlp", "adamw", 4, 3});
  // the edge cases (frozen, sometimes-unused, odd dim 0, buffer) and the tied embedding.
  // The tiny GPT trains with SGD here: a few of its gradient entries cancel to ~eps, which AdamW turns into
  // differences of lr's order under some BLAS kernels. See Note [Comparing with one device]
  // (common/course/src/reference.cpp).
  cases.push_back({"edge", "sgd", 2, 1});
  cases.push_back({"edge", "adamw", 4, 1});
  cases.push_back({"tiny_gpt", "sgd", 2, 1});
  cases.push_back({"tiny_gpt", "sgd", 4, 3});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Stage01, Equivalence, ::testing::ValuesIn(equivalence_cases()), test_support::StreamedName());

TEST(NaiveDDP, RanksStartFromDifferentWeightsAndHoldRankZerosAfterConstruction) {
  const int world = 3;
  std::vector<std::vector<at::Tensor>> before(world), after(world);
  std::vector<std::vector<at::Tensor>> buffers(world);
  std::vector<size_t> broadcasts(world);
  std::vector<std::string> param_names, buffer_names;
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = make_model("edge", 100 + comm.rank());  // a different seed on every rank
        for (const auto& p : model->parameters()) before[comm.rank()].push_back(p.detach().clone());
        NaiveDDP ddp(model, comm);
        for (const auto& p : model->parameters()) after[comm.rank()].push_back(p.detach().clone());
        for (const auto& b : model->buffers()) buffers[comm.rank()].push_back(b.detach().clone());
        for (const auto& c : comm.recorder().snapshot())  // besides the model check's all-gather, which comes first
          if (c.op == "broadcast") ++broadcasts[comm.rank()];
        if (comm.rank() == 0) {
          for (const auto& item : model->named_parameters()) param_names.push_back(item.key());
          for (const auto& item : model->named_buffers()) buffer_names.push_back(item.key());
        }
      },
      test_group());
  // "'frozen' (max diff 0.17)": the tensors of `got` that differ from `want`, by name
  auto differing = [](const std::vector<std::string>& names, const std::vector<at::Tensor>& got,
                      const std::vector<at::Tensor>& want) {
    std::string list;
    for (size_t i = 0; i < names.size(); ++i)
      if (!at::equal(got[i], want[i]))
        list += (list.empty() ? "'" : ", '") + names[i] + "' (max diff " +
                std::to_string(test_support::max_diff(got[i], want[i])) + ")";
    return list;
  };
  for (int r = 1; r < world; ++r) {
    const double start = max_abs_diff(before[r], before[0]);
    const double end = max_abs_diff(after[r], before[0]);
    std::cout << "rank " << r << ": max diff to rank 0 before " << start << ", after " << end << "\n";
    EXPECT_GT(start, 0.0);
    EXPECT_EQ(end, 0.0) << "rank " << r << ": after construction these parameters differ from rank 0's: "
                        << differing(param_names, after[r], before[0]) << ". broadcast_state broadcasts every "
                        << "parameter, frozen ones included, from root 0, and waits for the broadcasts (task 1)";
    EXPECT_EQ(max_abs_diff(buffers[r], buffers[0]), 0.0)
        << "rank " << r << ": these buffers differ from rank 0's: " << differing(buffer_names, buffers[r], buffers[0])
        << ". Buffers are broadcast too (task 1)";
  }
  // one broadcast per parameter (frozen included) and per buffer: edge has 6 parameters and 1 buffer
  ASSERT_EQ(param_names.size(), 6u);
  ASSERT_EQ(buffer_names.size(), 1u);
  for (int r = 0; r < world; ++r)
    EXPECT_EQ(broadcasts[r], 7u) << "rank " << r << ": exactly one broadcast per parameter (6, frozen included) and "
                                 << "per buffer (1) (task 1)";
}

// Structure: per step, one all-reduce (average) per parameter that received a gradient, of that parameter's size;
// and it was that parameter's: its .grad() ends as the average of the ranks' own gradients (exact at 2 ranks, see
// mean_of_two), which the all-reduce of another parameter cannot leave there. The edge model's `head.weight` and
// `sometimes` have the same shape, so counting sizes alone would not tell which of them was reduced.
TEST(NaiveDDP, OneAllReducePerParameterThatReceivedAGradientAndNoneForFrozen) {
  constexpr int kSteps = 4;
  std::vector<std::string> names;  // trainable parameters, registration order
  // [rank][step][parameter]: the rank's own gradient (undefined: no gradient this step), and .grad() after backward
  std::vector<std::vector<std::vector<at::Tensor>>> own(2), synced(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("edge", 5);
        NaiveDDP ddp(model, comm);
        auto data = make_dataset("edge", 5);
        auto named = model->named_parameters();
        const at::Tensor frozen_before = named["frozen"].detach().clone();
        const auto params = trainable_parameters(*model);
        if (comm.rank() == 0)
          for (const auto& item : named)
            if (item.value().requires_grad()) names.push_back(item.key());
        auto opt = make_optimizer("sgd", params, 0.1);
        for (int step = 0; step < kSteps; ++step) {
          compat::zero_grad(*opt);
          const Batch batch = rank_slice(data->global_batch(step, 8), comm.rank(), 2);
          own[comm.rank()].push_back(test_support::local_gradients(*model, batch, params));
          const size_t mark = comm.recorder().size();
          ddp.loss(batch).backward();
          auto recs = comm.recorder().since(mark);
          // Expected: every trainable parameter, except `sometimes` on odd steps (not used, so no gradient).
          std::multiset<int64_t> expected, seen;
          for (const auto& item : named)
            if (item.value().requires_grad() && !(item.key() == "sometimes" && step % 2 == 1))
              expected.insert(item.value().numel());
          for (const auto& r : recs) {
            EXPECT_EQ(r.op, "all_reduce");
            EXPECT_EQ(r.reduce, "avg");
            EXPECT_EQ(r.bytes, r.numel * 4);
            EXPECT_GT(r.end_ns, 0) << "every all-reduce is complete when backward returns";
            seen.insert(r.numel);
          }
          if (comm.rank() == 0)
            std::cout << "step " << step << ": " << recs.size() << " all-reduces (expected " << expected.size()
                      << ")\n";
          EXPECT_EQ(seen, expected) << "step " << step;
          std::vector<at::Tensor> grads;
          for (const auto& p : params) grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
          synced[comm.rank()].push_back(grads);
          opt->step();
        }
        EXPECT_TRUE(at::equal(named["frozen"], frozen_before)) << "the frozen parameter never changes";
      },
      test_group());
  ASSERT_EQ(names.size(), 5u);
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < names.size(); ++i) {
      const at::Tensor& mine0 = own[0][step][i];
      EXPECT_EQ(mine0.defined(), !(names[i] == "sometimes" && step % 2 == 1)) << names[i] << " step " << step;
      for (int r = 0; r < 2; ++r) {
        const at::Tensor& got = synced[r][step][i];
        if (!mine0.defined()) {  // no gradient this step: nothing may have been written into it (zeroed before)
          EXPECT_TRUE(!got.defined() || got.eq(0).all().item<bool>())
              << names[i] << " step " << step << " rank " << r << ": got a gradient without using the parameter";
          continue;
        }
        const at::Tensor want = test_support::mean_of_two(own[0][step][i], own[1][step][i]);
        EXPECT_TRUE(at::equal(got, want))
            << names[i] << " step " << step << " rank " << r << ": .grad() is not the average of the ranks' own "
            << "gradients (max diff " << test_support::max_diff(got, want) << "; to this rank's own gradient "
            << test_support::max_diff(got, own[r][step][i]) << ")";
      }
    }
  }
}

// Clipping after the average (NaiveDDP::clip_grad_norm): every rank holds the whole averaged gradient, so no
// collective runs, every rank gets the same norm, and training with a bound that binds matches the clipped single
// device, in the 2-norm and the max norm. Inside no_sync the gradients are a rank's own: refused.
TEST(NaiveDDP, ClippingMatchesTheClippedSingleDeviceWithoutACollective) {
  TrainConfig base = test_support::config("mlp").steps(4).micro_batches(2);
  for (const double p : {2.0, test_support::kInfNorm})
    expect_matches_reference(2, test_support::binding_clip(base, 0.01, p));
  std::vector<double> norms(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("mlp", 3);
        NaiveDDP ddp(model, comm);
        auto data = make_dataset("mlp", 3);
        const Batch batch = rank_slice(data->global_batch(0, 8), comm.rank(), 2);
        {
          auto scope = ddp.no_sync();
          ddp.loss(batch).backward();
          EXPECT_THROW(ddp.clip_grad_norm(1.0), std::logic_error) << "inside no_sync";
        }
        ddp.loss(batch).backward();
        const size_t marker = comm.recorder().size();
        norms[comm.rank()] = ddp.clip_grad_norm(1e9);
        EXPECT_EQ(comm.recorder().size(), marker) << "rank " << comm.rank() << ": clipping DDP's gradients ran a "
                                                  << "collective; every rank already holds the whole gradient";
      },
      test_group());
  EXPECT_EQ(norms[0], norms[1]) << "every rank computes the same norm";
}

TEST(NaiveDDP, TiedEmbeddingIsReducedOnce) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("tiny_gpt", 3);
        const size_t built = comm.recorder().size();
        NaiveDDP ddp(model, comm);
        const auto start = comm.recorder().since(built);
        const auto broadcasts =
            std::count_if(start.begin(), start.end(), [](const auto& r) { return r.op == "broadcast"; });
        EXPECT_EQ(static_cast<size_t>(broadcasts), trainable_parameters(*model).size())
            << "one broadcast per tensor: the tied embedding (wte.weight, lm_head.weight) once";
        auto data = make_dataset("tiny_gpt", 3);
        const size_t mark = comm.recorder().size();
        ddp.loss(rank_slice(data->global_batch(0, 4), comm.rank(), 2)).backward();
        auto recs = comm.recorder().since(mark);
        const at::Tensor wte = model->named_parameters()["wte.weight"];
        const auto of_wte =
            std::count_if(recs.begin(), recs.end(), [&](const auto& r) { return r.numel == wte.numel(); });
        EXPECT_EQ(recs.size(), trainable_parameters(*model).size()) << "one all-reduce per tensor, the tie once";
        EXPECT_EQ(of_wte, 1) << "the embedding is used twice (input and output) but reduced once";
      },
      test_group());
}

TEST(NaiveDDP, NoSyncSkipsCommunicationThenTheNextBackwardAveragesTheAccumulatedGradients) {
  test_support::expect_no_sync_contract("mlp", [](std::shared_ptr<Model> model, Communicator& comm) {
    return std::make_unique<NaiveDDP>(std::move(model), comm);
  });
}

// A backward that throws after some gradients were ready has launched their all-reduces, and its end-of-backward
// callback (which waits for them and finishes them: Gloo has no AVG, the halving is the finish step) never runs.
// The next forward settles them: when loss() returns, those gradients hold the average, and the next backward
// synchronizes as usual.
TEST(NaiveDDP, TheForwardAfterABackwardThatThrewSettlesTheAllReducesItLaunched) {
  std::vector<std::string> names;
  // [rank][parameter]: own gradients of the aborted and of the next backward, and .grad() after each
  std::vector<std::vector<at::Tensor>> own_aborted(2), own_next(2), settled(2), next(2);
  std::vector<size_t> launched(2), waits(2);
  on_two_mlp_ranks(
      [&](Communicator& comm, Model& model, NaiveDDP& ddp, const Dataset& data, const std::vector<at::Tensor>& params) {
        if (comm.rank() == 0)
          for (const auto& item : model.named_parameters()) names.push_back(item.key());
        // The first layer's weight is the last gradient backward reaches: the hook on it throws before it is
        // accumulated, after the later layers' gradients were (and their all-reduces launched).
        const auto cut = test_support::cut_short_backward(comm, model, ddp, data, params);
        EXPECT_TRUE(cut.threw);
        own_aborted[comm.rank()] = cut.own_aborted;
        own_next[comm.rank()] = cut.own_next;
        launched[comm.rank()] = cut.launched;
        const size_t waits_before = comm.recorder().waits().size();
        ddp.loss(cut.next);  // the forward settles; its graph is dropped
        waits[comm.rank()] = comm.recorder().waits().size() - waits_before;
        for (const auto& p : params)
          settled[comm.rank()].push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
        for (const auto& p : params)
          if (p.grad().defined()) p.mutable_grad().zero_();  // the optimizer's zero_grad before the next step
        ddp.loss(cut.next).backward();
        for (const auto& p : params) next[comm.rank()].push_back(p.grad().clone());
      });
  size_t reduced = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(waits[r], 1u) << "rank " << r << ": the forward waits once for what the aborted backward launched";
    for (size_t i = 0; i < names.size(); ++i) {
      const at::Tensor& got = settled[r][i];
      if (!got.defined()) continue;  // backward threw before this gradient: nothing was launched for it
      if (r == 0) ++reduced;
      const at::Tensor want = test_support::mean_of_two(own_aborted[0][i], own_aborted[1][i]);
      EXPECT_TRUE(at::equal(got, want)) << names[i] << " rank " << r
                                        << ": after the settling forward .grad() is not the average (max diff "
                                        << test_support::max_diff(got, want) << "; to the sum of the ranks' gradients "
                                        << test_support::max_diff(got, own_aborted[0][i] + own_aborted[1][i]) << ")";
    }
    for (size_t i = 0; i < names.size(); ++i) {
      const at::Tensor want = test_support::mean_of_two(own_next[0][i], own_next[1][i]);
      EXPECT_TRUE(at::equal(next[r][i], want))
          << names[i] << " rank " << r << ": the next backward's .grad() "
          << "differs from the average by " << test_support::max_diff(next[r][i], want);
    }
  }
  std::cout << "the aborted backward launched " << launched[0] << " all-reduces; " << reduced << " of " << names.size()
            << " gradients were settled by the next forward\n";
  EXPECT_EQ(launched[0], reduced) << "one all-reduce per gradient accumulated before the throw";
  EXPECT_GT(reduced, 0u);
  EXPECT_LT(reduced, names.size()) << "the throw came before the first layer's weight";
}

// Ranks whose models differ are stopped before any broadcast pairs the wrong tensors (broadcast_state compares the
// structures first: Note [Comparing the ranks' models]); every rank throws the same std::invalid_argument. First
// equal models, which must construct.
TEST(NaiveDDP, ARankWhoseModelDiffersIsStoppedBeforeAnyBroadcast) {
  std::vector<test_support::Refusal> seen(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        NaiveDDP equal(make_model("mlp", 1 + comm.rank()), comm);
        seen[comm.rank()] = test_support::refusal_of(
            comm, [&] { NaiveDDP ddp(make_model(comm.rank() == 0 ? "mlp" : "edge", 1), comm); });
      },
      test_group());
  test_support::expect_same_refusal(seen);
}

// Task 1: collectives are paired by position, so every rank issues the same broadcasts in the same order. The edge
// model's tensors have different sizes: two ranks broadcasting them in different orders would make Gloo abort the
// process; the backend below refuses the first broadcast that differs from another rank's instead, and says which.
// It also counts the waits: broadcast_state returns only once every broadcast it started has landed.
TEST(NaiveDDP, EveryRankIssuesTheSameBroadcastsInTheSameOrder) {
  const int world = 3;
  std::vector<test_support::Watch> watches(world);
  test_support::Sequences sequences(world);
  std::vector<std::string> errors(world);
  GroupOptions group = test_support::watched_group(watches, &sequences);
  group.timeout = std::chrono::milliseconds(10'000);  // a rank left waiting fails after 10 s, not 30
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = make_model("edge", 100 + comm.rank());
        try {
          NaiveDDP ddp(model, comm);
        } catch (const std::exception& e) {
          errors[comm.rank()] = e.what();
        }
      },
      group);
  std::string mismatches;
  for (const auto& m : sequences.mismatches) mismatches += "\n  " + m;
  std::cout << "rank 0 issued:";
  for (const auto& c : sequences.issued[0]) std::cout << " [" << c << "]";
  std::cout << "\n";
  EXPECT_TRUE(sequences.mismatches.empty())
      << "every rank must issue the same broadcasts in the same order (task 1: collectives are paired by position, "
      << "not by name):" << mismatches;
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(sequences.issued[r], sequences.issued[0]) << "rank " << r << "'s broadcasts differ from rank 0's";
    EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": construction threw: " << errors[r].substr(0, 300);
    EXPECT_EQ(watches[r].waited_ns.size(), sequences.issued[r].size())
        << "rank " << r << ": broadcast_state waits for every broadcast it started before it returns (task 1: "
        << "afterwards every tensor holds rank 0's values)";
  }
}

// Invariant 2, "never wait inside on_gradient_ready". Rank 1 starts its backward only once rank 0's backward has
// accumulated every gradient and returned from every hook. A hook that waited for its own all-reduce would wait
// for rank 1, which waits for that hook: rank 1 gives up after kPatience and goes on, so the test ends (the
// patience bounds only the failing case; a correct hook lets rank 1 go at once).
TEST(NaiveDDP, EveryHookReturnsBeforeItsAllReduceCanComplete) {
  constexpr auto kPatience = std::chrono::seconds(20);
  std::mutex mu;
  std::condition_variable cv;
  size_t total = 0, ready = 0, ready_when_rank1_gave_up = 0;
  bool all_ready = false, gave_up = false;
  std::vector<std::vector<at::Tensor>> own(2), got(2);
  on_two_mlp_ranks(
      [&](Communicator& comm, Model& model, NaiveDDP& ddp, const Dataset& data, const std::vector<at::Tensor>& params) {
        const Batch batch = rank_slice(data.global_batch(0, 8), comm.rank(), 2);
        own[comm.rank()] = test_support::local_gradients(model, batch, params);
        if (comm.rank() == 0) {
          {
            std::lock_guard<std::mutex> lock(mu);
            total = params.size();
          }
          // Registered after NaiveDDP's: on each accumulator they run after its hook has returned.
          std::vector<std::shared_ptr<torch::autograd::Node>> hooks;
          for (const auto& p : params)
            hooks.push_back(compat::add_post_accumulate_hook(p, [&] {
              std::lock_guard<std::mutex> lock(mu);
              if (++ready == total) {
                all_ready = true;
                cv.notify_all();
              }
            }));
          ddp.loss(batch).backward();
        } else {
          std::unique_lock<std::mutex> lock(mu);
          if (!cv.wait_for(lock, kPatience, [&] { return all_ready; })) {
            gave_up = true;
            ready_when_rank1_gave_up = ready;
          }
          lock.unlock();
          ddp.loss(batch).backward();
        }
        for (const auto& p : params) got[comm.rank()].push_back(p.grad().clone());
      });
  std::cout << "rank 0 returned from " << (gave_up ? ready_when_rank1_gave_up : total) << " of " << total
            << " hooks before rank 1 started its backward\n";
  EXPECT_FALSE(gave_up) << "rank 0's backward got through " << ready_when_rank1_gave_up << " of " << total
                        << " gradient hooks in " << kPatience.count()
                        << " s while rank 1 had not started its backward: a hook waits for its all-reduce "
                           "(invariant 2: never wait inside on_gradient_ready; only wait_pending waits)";
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < got[r].size(); ++i) {
      const at::Tensor want = test_support::mean_of_two(own[0][i], own[1][i]);
      EXPECT_TRUE(at::equal(got[r][i], want)) << "rank " << r << " parameter " << i << ": max diff from the average "
                                              << test_support::max_diff(got[r][i], want);
    }
}

// Invariant 4, "nothing stays pending, even when one average failed". The second all-reduce of the backward fails
// on both ranks (test_support::FailingBackend: never issued, so the others stay paired). The error comes out of
// backward(); every other gradient was still waited for, so it holds the exact average (on Gloo the division by the
// world size happens at wait(): a gradient whose all-reduce nobody waited for holds the sum, or a value in flight);
// and the next step trains normally, so nothing of the failed one was left pending.
TEST(NaiveDDP, AFailedAverageIsAnErrorFromBackwardAndEveryOtherAverageIsStillWaitedFor) {
  GroupOptions options = test_group();
  options.wrap_backend = [](c10::intrusive_ptr<compat::Backend> inner, int) {
    return c10::make_intrusive<test_support::FailingBackend>(std::move(inner), std::set<int>{2});
  };
  std::vector<std::string> errors(2), next_errors(2);
  std::vector<std::vector<at::Tensor>> own(2), own_next(2), got(2), got_next(2);
  on_two_mlp_ranks(
      [&](Communicator& comm, Model& model, NaiveDDP& ddp, const Dataset& data, const std::vector<at::Tensor>& params) {
        const int r = comm.rank();
        const Batch batch = rank_slice(data.global_batch(0, 8), r, 2);
        const Batch next = rank_slice(data.global_batch(1, 8), r, 2);
        own[r] = test_support::local_gradients(model, batch, params);
        own_next[r] = test_support::local_gradients(model, next, params);
        try {
          ddp.loss(batch).backward();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
        for (const auto& p : params) got[r].push_back(p.grad().clone());
        for (const auto& p : params) p.mutable_grad().zero_();
        try {
          ddp.loss(next).backward();
          for (const auto& p : params) got_next[r].push_back(p.grad().clone());
        } catch (const std::exception& e) {
          next_errors[r] = e.what();
        }
      },
      options);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find(test_support::FailingBackend::kMessage), std::string::npos)
        << "rank " << r << ": backward must throw the failed all-reduce's error; it threw '" << errors[r] << "'";
    size_t averaged = 0;
    std::string off;
    for (size_t i = 0; i < got[r].size(); ++i) {
      const at::Tensor want = test_support::mean_of_two(own[0][i], own[1][i]);
      if (at::equal(got[r][i], want)) {
        ++averaged;
      } else {
        off += " parameter " + std::to_string(i) + " (max diff from the average " +
               std::to_string(test_support::max_diff(got[r][i], want)) + ", from the sum " +
               std::to_string(test_support::max_diff(got[r][i], own[0][i] + own[1][i])) + ")";
      }
    }
    std::cout << "rank " << r << ": " << averaged << " of " << got[r].size()
              << " gradients hold the average after the failed backward; not:" << off << "\n";
    EXPECT_EQ(averaged + 1, got[r].size())
        << "rank " << r << ": every gradient but the failed one must hold the average, so every other all-reduce "
        << "was waited for after the failure (invariant 4: wait for all, then rethrow the first error); not:" << off;
    EXPECT_EQ(next_errors[r], "") << "rank " << r << ": the step after the failed one threw: the failed backward "
                                  << "left work pending (invariant 4)";
    for (size_t i = 0; i < got_next[r].size(); ++i) {
      const at::Tensor want = test_support::mean_of_two(own_next[0][i], own_next[1][i]);
      EXPECT_TRUE(at::equal(got_next[r][i], want))
          << "rank " << r << " parameter " << i << ": the next step's gradient differs from the average by "
          << test_support::max_diff(got_next[r][i], want);
    }
  }
}

}  // namespace
}  // namespace shardlab::naive_ddp
