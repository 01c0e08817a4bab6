// Loading files whose names are not the model's own: a tied weight saved under any of its names, or under all of
// them (Note [A tied weight in a file] in common/core/src/checkpoint/state_match.cpp), and a load that maps a file's
// names to the model's (SavedNames: Hugging Face's dotted names). Every wrapper loads through the same load_checkpoint;
// FSDP's sharded rows and a replica's whole tensor are both checked.
#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/checkpoint/training_state.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/model_factory.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/naive_ddp/naive_ddp.h"
#include "support/group.h"
#include "support/temp_dir.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <iostream>
#include <map>
#include <memory>
#include <regex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {
namespace {

using test_support::TempDir;
using test_support::test_group;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

// A weight registered as "w" and again as "alias" (tied), 4 rows: FSDP at 2 ranks gives each rank 2 of them.
class Tied : public Model {
 public:
  Tied() {
    w_ = register_parameter("w", at::zeros({4, 3}));
    register_parameter("alias", w_);
  }
  at::Tensor loss(const Batch& batch) override { return at::matmul(batch.input, w_.t()).sum(); }

 private:
  at::Tensor w_;
};

at::Tensor values(double start) { return at::arange(start, start + 12.0).reshape({4, 3}); }

// What `wrapper` ("fsdp" or "naive") holds of the tied weight after loading `file` on 2 ranks, or the error each
// rank threw ("" when it loaded), and the weight on every rank after a refused load (it must be unchanged: zeros).
struct Loaded {
  std::vector<at::Tensor> weight{2};
  std::vector<std::string> error{2};
};

Loaded load_tied(const std::string& wrapper, const std::string& file) {
  Loaded out;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<Tied>();
        std::unique_ptr<fsdp::FullyShardedModel> fsdp;
        std::unique_ptr<naive_ddp::NaiveDDP> naive;
        if (wrapper == "fsdp")
          fsdp = std::make_unique<fsdp::FullyShardedModel>(model, comm);
        else
          naive = std::make_unique<naive_ddp::NaiveDDP>(model, comm);
        try {
          if (fsdp)
            fsdp->load_checkpoint(file, nullptr);
          else
            naive->load_checkpoint(file, nullptr);
        } catch (const std::invalid_argument& e) {
          out.error[comm.rank()] = e.what();
        }
        out.weight[comm.rank()] = fsdp ? fsdp->full_parameters().at(0) : model->parameters().at(0).clone();
      },
      test_group());
  return out;
}

TEST(TiedWeights, LoadUnderEitherOfItsNamesOrUnderBothWhenEqual) {
  TempDir dir("tied-names");
  const at::Tensor a = values(1.0);
  const std::map<std::string, Named> files = {
      {"first name only (shardlab's own save)", {{"w", a}}},
      {"the alias only (Hugging Face's save_model keeps the name that sorts first)", {{"alias", a}}},
      {"both names, equal (a plain state_dict)", {{"alias", a}, {"w", a.clone()}}},
  };
  for (const std::string wrapper : {"fsdp", "naive"}) {
    for (const auto& [what, tensors] : files) {
      const std::string file = dir / "file.safetensors";
      safetensors::write_file(file, tensors);
      const Loaded got = load_tied(wrapper, file);
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(got.error[r], "") << wrapper << ", " << what;
        EXPECT_TRUE(got.weight[r].equal(a)) << wrapper << ", " << what << ": rank " << r << " holds\n" << got.weight[r];
      }
    }
  }
}

TEST(TiedWeights, TwoNamesWithDifferentValuesAreRefusedOnEveryRankAndNothingChanges) {
  TempDir dir("tied-differ");
  const at::Tensor a = values(1.0);
  at::Tensor b = a.clone();
  b[3][2] = -1.0;  // the last row differs: under FSDP at 2 ranks, only rank 1's rows
  const std::string file = dir / "file.safetensors";
  safetensors::write_file(file, {{"w", a}, {"alias", b}});
  for (const std::string wrapper : {"fsdp", "naive"}) {
    const Loaded got = load_tied(wrapper, file);
    for (int r = 0; r < 2; ++r) {
      std::cout << wrapper << " rank " << r << ": " << got.error[r] << "\n";
      EXPECT_NE(got.error[r].find("holds the tied weight 'w' as 'alias' and as 'w', with different values"),
                std::string::npos)
          << got.error[r];
      EXPECT_TRUE(got.weight[r].equal(at::zeros({4, 3}))) << wrapper << ": rank " << r << " changed its weight";
    }
    if (wrapper == "fsdp")
      EXPECT_NE(got.error[0].find("rank 1: "), std::string::npos)
          << "rank 0's rows agree; rank 1 found the difference and every rank says so: " << got.error[0];
  }
}

TEST(TiedWeights, AFileWithoutAnyOfItsNamesSaysWhichNamesWereLookedFor) {
  TempDir dir("tied-missing");
  const std::string file = dir / "file.safetensors";
  safetensors::write_file(file, {{"other", values(0.0)}});
  const Loaded got = load_tied("naive", file);
  EXPECT_NE(got.error[0].find("has no tensor 'w' (nor its tied names 'alias')"), std::string::npos) << got.error[0];
}

TEST(TiedWeights, TheTinyGptIsTiedLikeGpt2AndSavesItsEmbeddingOnceUnderItsFirstName) {
  auto model = make_model("tiny_gpt", 1);
  const std::map<std::string, std::string> tied = tied_names(*model, StateParts::kParametersAndBuffers);
  ASSERT_EQ(tied.size(), 1U);
  EXPECT_EQ(tied.begin()->first, "lm_head.weight");
  EXPECT_EQ(tied.begin()->second, "wte.weight");
  const ShardedState state = replicated_state(*model, 0);
  for (const StateTensor& t : state.tensors) EXPECT_NE(t.name, "lm_head.weight") << "the tie is saved once";
  EXPECT_EQ(state.aliases, tied);
}

// A user's model whose units are named as a Hugging Face file's dotted prefixes cannot be: "layers.0" is not a
// libtorch submodule name. Its file is loaded through a map of names.
class Layers : public Model {
 public:
  Layers() {
    for (int i = 0; i < 2; ++i) {
      layers_.push_back(register_unit("layers_" + std::to_string(i), torch::nn::Linear(3, 3).ptr()));
      at::NoGradGuard no_grad;
      layers_.back()->weight.zero_();
      layers_.back()->bias.zero_();
    }
  }
  at::Tensor loss(const Batch& batch) override { return layers_[1](layers_[0](batch.input)).sum(); }

 private:
  std::vector<UnitRef<torch::nn::LinearImpl>> layers_;
};

// "model.layers.0.weight" -> "layers_0.weight"; a buffer the model does not keep -> "" (left out).
std::string hugging_face_names(const std::string& saved) {
  if (saved == "model.rotary.inv_freq") return "";
  static const std::regex layer(R"(^model\.layers\.(\d+)\.)");
  return std::regex_replace(saved, layer, "layers_$1.");
}

TEST(SavedNames, AFileWithHuggingFacesDottedNamesLoadsThroughAMapOfNames) {
  TempDir dir("saved-names");
  Named hf;
  for (int i = 0; i < 2; ++i) {
    hf.emplace_back("model.layers." + std::to_string(i) + ".weight", at::full({3, 3}, 1.0 + i));
    hf.emplace_back("model.layers." + std::to_string(i) + ".bias", at::full({3}, 10.0 + i));
  }
  hf.emplace_back("model.rotary.inv_freq", at::ones({2}));
  const std::string file = dir / "hf.safetensors";
  safetensors::write_file(file, hf);
  std::vector<std::string> unnamed(2), named(2);
  std::vector<std::vector<at::Tensor>> loaded(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        fsdp::FullyShardedModel fsdp(std::make_shared<Layers>(), comm);
        try {
          fsdp.load_checkpoint(file, nullptr);
        } catch (const std::invalid_argument& e) {
          unnamed[comm.rank()] = e.what();
        }
        fsdp.load_checkpoint(file, nullptr, false, hugging_face_names);
        loaded[comm.rank()] = fsdp.full_parameters();
        try {  // two saved tensors given one name
          fsdp.load_checkpoint(file, nullptr, false, [](const std::string& saved) {
            return hugging_face_names(saved == "model.layers.1.bias" ? "model.layers.0.bias" : saved);
          });
        } catch (const std::invalid_argument& e) {
          named[comm.rank()] = e.what();
        }
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(unnamed[r].find("has no tensor 'layers_0.weight'"), std::string::npos) << unnamed[r];
    ASSERT_EQ(loaded[r].size(), 4U);
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(loaded[r][2 * i].equal(at::full({3, 3}, 1.0 + i))) << "rank " << r << " layers_" << i;
      EXPECT_TRUE(loaded[r][2 * i + 1].equal(at::full({3}, 10.0 + i))) << "rank " << r << " layers_" << i;
    }
    EXPECT_NE(named[r].find("holds 'model.layers.0.bias' and 'model.layers.1.bias', which are both named "
                            "'layers_0.bias' for this model"),
              std::string::npos)
        << named[r];
  }
}

}  // namespace
}  // namespace shardlab
