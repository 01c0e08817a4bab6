// Tests of the deterministic models, data, sampler, reference trainer and torchrun environment parsing.
#include "shardlab/core/comm/process_group.h"
#include "shardlab/course/data.h"
#include "shardlab/course/models.h"
#include "shardlab/course/reference.h"

#include "support/train_config.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

namespace shardlab {
namespace {

std::vector<at::Tensor> all_params(const torch::nn::Module& m) { return m.parameters(true); }

TEST(Models, SameSeedSameWeightsOtherSeedOtherWeights) {
  for (const auto& name : model_names()) {
    auto a = make_model(name, 7), b = make_model(name, 7), c = make_model(name, 8);
    const double same = max_abs_diff(all_params(*a), all_params(*b));
    const double other = max_abs_diff(all_params(*a), all_params(*c));
    std::cout << name << ": same seed max diff " << same << ", other seed max diff " << other << "\n";
    EXPECT_EQ(same, 0.0) << name;
    EXPECT_GT(other, 0.0) << name;
  }
}

TEST(Initializer, PartByPartDrawsWhatTheWholeModelDraws) {
  // The shipped models fill each unit before registering it (Note [Building a model unit by unit]); one
  // init_parameters over the finished model, as the models did before, must give the same values bit for bit.
  for (const std::string name : {"mlp", "tiny_gpt", "edge"}) {
    auto built = make_model(name, 5);
    auto whole = make_model(name, 6);  // other values first, so that the check cannot pass by coincidence
    init_parameters(*whole, 5);
    const auto a = named_state(*built, StateParts::kParametersAndBuffers, false);
    const auto b = named_state(*whole, StateParts::kParametersAndBuffers, false);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << name << " " << a[i].first << " differs";
  }
}

TEST(UnitBuildScope, SeesEveryUnitAsItIsRegisteredAndDoesNotNest) {
  std::vector<std::string> seen;
  std::vector<int64_t> rows;
  {
    UnitBuildScope scope([&](Unit& unit) {
      seen.push_back(unit.name);
      rows.push_back(unit.module->parameters().front().size(0));
    });
    EXPECT_THROW(UnitBuildScope([](Unit&) {}), std::logic_error);
    make_model("mlp", 1);
  }
  EXPECT_EQ(seen, (std::vector<std::string>{"fc0", "fc1", "fc2"}));
  EXPECT_EQ(rows, (std::vector<int64_t>{64, 64, 4}));
  make_model("mlp", 1);  // the scope is gone: nothing more is seen
  EXPECT_EQ(seen.size(), 3u);
}

TEST(Models, UnknownModelIsAClearError) {
  try {
    make_model("resnet", 1);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("mlp, tiny_gpt, edge"), std::string::npos) << e.what();
  }
}

TEST(Models, TinyGptTiesItsOutputLayerToTheEmbedding) {
  auto model = std::dynamic_pointer_cast<TinyGpt>(make_model("tiny_gpt", 1));
  ASSERT_TRUE(model);
  const auto& c = model->config();
  int64_t matrices_of_vocab_rows = 0;
  for (const auto& p : trainable_parameters(*model))
    if (p.dim() == 2 && p.size(0) == c.vocab) ++matrices_of_vocab_rows;
  EXPECT_EQ(matrices_of_vocab_rows, 1) << "one [vocab, dim] matrix: embedding and output are the same parameter";
  const auto named = model->named_parameters();
  EXPECT_TRUE(named["lm_head.weight"].is_same(named["wte.weight"]))
      << "the output layer's name for it, as GPT-2's lm_head.weight, is the same tensor";
  auto data = make_dataset("tiny_gpt", 1);
  Batch b = data->global_batch(0, 2);
  EXPECT_EQ(model->forward(b.input).sizes(), (std::vector<int64_t>{2, c.block, c.vocab}));
  const double loss = model->loss(b).item<double>();
  std::cout << "tiny_gpt initial loss " << loss << " (log vocab = " << std::log(double(c.vocab)) << ")\n";
  EXPECT_GT(loss, 1.0);
}

TEST(Models, EdgeModelHasEveryEdgeCase) {
  EdgeModel m(3);
  auto params = m.named_parameters();
  ASSERT_TRUE(params.contains("frozen") && params.contains("sometimes") && params.contains("trunk.weight"));
  EXPECT_FALSE(params["frozen"].requires_grad());
  EXPECT_EQ(params["trunk.weight"].size(0) % 2, 1) << "dim 0 must not divide by the world size";
  EXPECT_EQ(m.buffers().size(), 1u);
  auto data = make_dataset("edge", 3);
  for (int64_t step : {0, 1}) {
    for (auto& p : m.parameters()) p.mutable_grad() = at::Tensor();
    m.loss(data->global_batch(step, 4)).backward();
    EXPECT_EQ(params["sometimes"].grad().defined(), step % 2 == 0) << "step " << step;
    EXPECT_FALSE(params["frozen"].grad().defined());
  }
}

TEST(Data, GlobalBatchIsDeterministicAndSlicesPartitionIt) {
  for (const auto& name : model_names()) {
    auto d1 = make_dataset(name, 5), d2 = make_dataset(name, 5);
    Batch a = d1->global_batch(3, 12), b = d2->global_batch(3, 12), c = d1->global_batch(4, 12);
    EXPECT_TRUE(at::equal(a.input, b.input) && at::equal(a.target, b.target)) << name;
    EXPECT_FALSE(at::equal(a.input, c.input)) << name << ": steps must differ";
    for (int w : {1, 2, 3, 4}) {
      std::vector<at::Tensor> parts;
      for (int r = 0; r < w; ++r) parts.push_back(rank_slice(a, r, w).input);
      EXPECT_TRUE(at::equal(at::cat(parts), a.input)) << name << " world " << w;
    }
  }
}

TEST(Data, IndivisibleGlobalBatchIsAClearError) {
  Batch b = make_dataset("mlp", 1)->global_batch(0, 10);
  try {
    rank_slice(b, 0, 4);
    FAIL();
  } catch (const std::invalid_argument& e) {
    std::cout << e.what() << "\n";
    EXPECT_NE(std::string(e.what()).find("global batch 10 does not divide by world size 4"), std::string::npos);
  }
  EXPECT_THROW(micro_batches(b, 3), std::invalid_argument);
  EXPECT_EQ(micro_batches(b, 5).size(), 5u);
}

TEST(Data, CorpusIsShippedAscii) {
  const std::string& text = tiny_corpus();
  EXPECT_GT(text.size(), 5000u);
  for (char ch : text) ASSERT_TRUE(static_cast<unsigned char>(ch) < 128) << "non-ASCII character in corpus";
  std::cout << "corpus: " << text.size() << " characters, vocab " << corpus_vocab().size() << "\n";
}

TEST(Reference, IsDeterministicAndLearns) {
  TrainConfig c = test_support::config("mlp").steps(30).global_batch(32);
  auto a = train_reference(c), b = train_reference(c);
  EXPECT_EQ(max_abs_diff(a.params, b.params), 0.0);
  std::cout << "mlp sgd loss " << a.losses.front() << " -> " << a.losses.back() << "\n";
  EXPECT_LT(a.losses.back(), a.losses.front());
}

TEST(RankEnv, ReadsTorchrunVariablesAndRejectsBadOnes) {
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "4", 1);
  unsetenv("LOCAL_RANK");
  setenv("MASTER_ADDR", "10.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  RankEnv env = RankEnv::from_environment();
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  setenv("RANK", "4", 1);
  EXPECT_THROW(RankEnv::from_environment(), std::invalid_argument);
  setenv("RANK", "x", 1);
  try {
    RankEnv::from_environment();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'x'"), std::string::npos) << e.what();
  }
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(v);
  EXPECT_THROW(RankEnv::from_environment(), std::invalid_argument);
}

}  // namespace
}  // namespace shardlab
