// Checkpoints (issue 20): the safetensors files, sharded checkpoints that reload bit for bit at another world size
// and in another wrapper, with the optimizer's state, and the refusals that leave everything as it was.
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/checkpoint/training_state.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/model_factory.h"
#include "shardlab/course/reference.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/hsdp/parallelize.h"
#include "shardlab/naive_ddp/naive_ddp.h"
#include "support/checkpoint_training.h"
#include "support/group.h"
#include "support/spaced_batch.h"
#include "support/temp_dir.h"
#include "support/train_config.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

namespace shardlab {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks
namespace fs = std::filesystem;

// Every tensor a checkpoint holds, whole (its export): what two checkpoints must agree on, bit for bit.
std::map<std::string, at::Tensor> contents(const std::string& checkpoint) {
  const std::string file = checkpoint + ".export.safetensors";
  export_checkpoint(checkpoint, file, /*optimizer_state=*/true);
  auto out = safetensors::load_file(file);
  fs::remove(file);
  return out;
}

// Empty when `a` and `b` hold the same names and bit-identical tensors; else the first difference.
std::string difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  for (const auto& [name, t] : a) {
    const auto it = b.find(name);
    if (it == b.end()) return "'" + name + "' is missing from the second";
    if (t.sizes() != it->second.sizes() || t.scalar_type() != it->second.scalar_type())
      return "'" + name + "' has another shape or dtype";
    if (!t.equal(it->second))
      return "'" + name + "' differs (max |diff| " +
             std::to_string((t.to(at::kDouble) - it->second.to(at::kDouble)).abs().max().item<double>()) + ")";
  }
  for (const auto& [name, t] : b)
    if (!a.count(name)) return "'" + name + "' is missing from the first";
  return "";
}

// On `world` thread ranks, FSDP over `c`'s model with AdamW (lr 0.01) trains `steps` steps from step 0, then saves a
// checkpoint at `path` with `metadata`.
void save_trained_fsdp(const std::string& path, const TrainConfig& c, int world, int steps,
                       const std::map<std::string, std::string>& metadata = {}) {
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed);
        fsdp::FullyShardedModel fsdp(model, comm);
        auto opt = make_optimizer("adamw", fsdp.parameters(), 0.01);
        train(fsdp, *opt, comm, c, 0, steps);
        fsdp.save_checkpoint(path, opt.get(), metadata);
      },
      test_group());
}

// Bytes per element of a safetensors dtype name.
uint64_t back_elem(const std::string& dtype) {
  const std::map<std::string, uint64_t> sizes = {{"I64", 8}, {"F64", 8}, {"F32", 4}, {"BF16", 2}};
  return sizes.at(dtype);
}

TEST(Safetensors, WritesTheFormatHuggingFaceReadsAndReadsItBack) {
  TempDir dir("st");
  const std::string file = dir / "a.safetensors";
  std::vector<std::pair<std::string, at::Tensor>> tensors = {{"w", at::arange(12, at::kFloat).view({3, 4})},
                                                             {"half", at::arange(5, at::kFloat).to(at::kBFloat16)},
                                                             {"count", at::scalar_tensor(7, at::kLong)},
                                                             {"strided", at::arange(6, at::kDouble).view({2, 3}).t()}};
  const auto crcs = safetensors::write_file(file, tensors, {{"step", "4"}});
  // The layout itself: an 8-byte little-endian length, a JSON header padded to 8 bytes, the data tiling the rest.
  std::ifstream in(file, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  EXPECT_EQ((8 + n) % 8, 0U) << "the header is padded so the data starts 8-byte aligned";
  const auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["__metadata__"]["step"], "4");
  EXPECT_EQ(j["w"]["dtype"], "F32");
  EXPECT_EQ(j["w"]["shape"], nlohmann::json({3, 4}));
  EXPECT_EQ(j["half"]["dtype"], "BF16");
  EXPECT_EQ(j["count"]["shape"], nlohmann::json::array());
  EXPECT_EQ(fs::file_size(file), 8 + n + 48 + 10 + 8 + 48);
  // Laid out as the safetensors library lays a file out: "__metadata__" first, then by dtype, highest alignment
  // first (I64 before F64 before F32 before BF16: its Dtype order), then by name; the data in that order, each
  // tensor's start aligned to its element size.
  const auto ordered = nlohmann::ordered_json::parse(header);
  std::vector<std::string> keys;
  for (const auto& item : ordered.items()) keys.push_back(item.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"__metadata__", "count", "strided", "w", "half"}));
  uint64_t at = 0;
  for (size_t k = 1; k < keys.size(); ++k) {
    const auto& e = ordered[keys[k]];
    std::vector<std::string> fields;
    for (const auto& item : e.items()) fields.push_back(item.key());
    EXPECT_EQ(fields, (std::vector<std::string>{"dtype", "shape", "data_offsets"})) << keys[k];
    EXPECT_EQ(e["data_offsets"][0].get<uint64_t>(), at) << keys[k] << ": the data follows the header's order";
    at = e["data_offsets"][1].get<uint64_t>();
    const uint64_t elem = back_elem(e["dtype"].get<std::string>());
    EXPECT_EQ((8 + n + e["data_offsets"][0].get<uint64_t>()) % elem, 0U) << keys[k] << " is not aligned";
  }
  const auto back = safetensors::load_file(file);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_TRUE(back.at(name).equal(t.contiguous())) << name << " did not come back bit for bit";
    const at::Tensor c = t.contiguous();
    EXPECT_EQ(crcs[i], safetensors::crc32(c.data_ptr(), c.numel() * c.element_size())) << name;
  }
  // Truncated by one byte, or with a header length past the end: refused, naming the file.
  fs::copy_file(file, dir / "short.safetensors");
  fs::resize_file(dir / "short.safetensors", fs::file_size(file) - 1);
  try {
    safetensors::Reader r(dir / "short.safetensors");
    ADD_FAILURE() << "a truncated file was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("short.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  EXPECT_THROW(safetensors::write_file(dir / "bad.safetensors", {{"x", at::ones({1})}, {"x", at::ones({1})}}),
               std::invalid_argument);
  EXPECT_FALSE(fs::exists(dir / "bad.safetensors")) << "a refused write creates no file";
}

// FSDP at world size 4, AdamW: save, load at 1, 2 and 3 (each then saving again), and at 4 from the world-3 save.
// Every save holds the same tensors bit for bit; the padding never enters a file; the optimizer's step survives.
TEST(Checkpoint, FsdpSavedAtFourReloadsBitExactAtOneTwoThreeAndBack) {
  TempDir dir("reshard");
  const TrainConfig c = mlp_config();
  const std::string at4 = dir / "at4";
  save_trained_fsdp(at4, c, 4, 2, {{"step", "2"}});
  const auto saved = contents(at4);
  const CheckpointIndex index = read_checkpoint_index(at4);
  EXPECT_EQ(index.world_size, 4);
  EXPECT_EQ(index.metadata.at("step"), "2");
  EXPECT_EQ(index.metadata.at("optim.kind"), "adamw");
  EXPECT_EQ(index.metadata.at("optim.fc0.weight.step"), "2");
  // [4, 64] over 4 ranks: a row each; [64] over 4: 16 each. No piece holds padding.
  const SavedTensor& last = index.tensors.at("fc2.weight");
  ASSERT_EQ(last.pieces.size(), 4U);
  for (const SavedPiece& p : last.pieces) EXPECT_EQ(p.rows, 1);
  EXPECT_TRUE(saved.count("optim.fc2.weight.exp_avg_sq"));

  for (int world : {1, 2, 3}) {
    const std::string again = dir / ("at" + std::to_string(world));
    run_ranks(
        world,
        [&](Communicator& comm) {
          auto model = make_model(c.model, c.seed + 100);  // other values: the load must replace them all
          fsdp::FullyShardedModel fsdp(model, comm);
          auto opt = make_optimizer("adamw", fsdp.parameters(), 0.01);
          const auto meta = fsdp.load_checkpoint(at4, opt.get());
          EXPECT_EQ(meta.at("step"), "2");
          fsdp.save_checkpoint(again, opt.get(), meta);
        },
        test_group());
    const std::string diff = difference(saved, contents(again));
    EXPECT_EQ(diff, "") << "saved at 4, loaded and saved again at " << world;
  }
  // And back: the world-3 checkpoint (rows split 22/22/20, 2/2/0) loaded at 4 gives the original again.
  run_ranks(
      4,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed + 7);
        fsdp::FullyShardedModel fsdp(model, comm);
        auto opt = make_optimizer("adamw", fsdp.parameters(), 0.01);
        fsdp.load_checkpoint(dir / "at3", opt.get());
        fsdp.save_checkpoint(dir / "back", opt.get());
      },
      test_group());
  EXPECT_EQ(difference(saved, contents(dir / "back")), "") << "saved at 4, through 3, back at 4";
}

// A run resumed from a checkpoint continues exactly as the run that was not stopped, even in another wrapper at
// another world size (the same single-device mathematics: compared within the stages' tolerance there, bit for
// bit at the same world size and wrapper).
TEST(Checkpoint, ResumingContinuesAsTheUninterruptedRun) {
  TempDir dir("resume");
  const TrainConfig c = mlp_config();
  std::vector<at::Tensor> straight, resumed, other;
  for (int pass = 0; pass < 2; ++pass)
    run_ranks(
        2,
        [&](Communicator& comm) {
          auto model = make_model(c.model, c.seed);
          fsdp::FullyShardedModel fsdp(model, comm);
          auto opt = make_optimizer("sgd", fsdp.parameters(), 0.05);
          if (pass == 0) {
            train(fsdp, *opt, comm, c, 0, 2);
            fsdp.save_checkpoint(dir / "mid", opt.get());
            train(fsdp, *opt, comm, c, 2, 2);
            auto full = fsdp.full_parameters();
            if (comm.rank() == 0) straight = full;
          } else {
            fsdp.load_checkpoint(dir / "mid", opt.get());
            train(fsdp, *opt, comm, c, 2, 2);
            auto full = fsdp.full_parameters();
            if (comm.rank() == 0) resumed = full;
          }
        },
        test_group());
  // The same checkpoint into bucketed DDP at world size 3: SGD's momentum goes along.
  run_ranks(
      3,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed + 1);
        bucketed_ddp::BucketedDDP ddp(model, comm);
        auto opt = make_optimizer("sgd", ddp.parameters(), 0.05);
        ddp.load_checkpoint(dir / "mid", opt.get());
        train(ddp, *opt, comm, c, 2, 2);
        if (comm.rank() == 0)
          for (const auto& p : model->parameters()) other.push_back(p.detach().clone());
      },
      test_group());
  ASSERT_EQ(straight.size(), resumed.size());
  ASSERT_EQ(straight.size(), other.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(straight[i].equal(resumed[i])) << "parameter " << i << ": resumed at the same world size differs by "
                                               << (straight[i] - resumed[i]).abs().max().item<double>();
    const double d = (straight[i] - other[i]).abs().max().item<double>();
    std::cout << "parameter " << i << ": FSDP x2 uninterrupted vs DDP x3 resumed, max |diff| " << d << "\n";
    EXPECT_TRUE(at::allclose(straight[i], other[i], 1e-5, 1e-6)) << "parameter " << i << " max diff " << d;
  }
}

// HSDP 2x2 saves once per row of the mesh (the first replica's ranks write); DDP at 3 loads it.
TEST(Checkpoint, HsdpWritesOneReplicaAndAnyWrapperLoadsIt) {
  TempDir dir("hsdp");
  const TrainConfig c = mlp_config();
  std::vector<at::Tensor> before;
  run_world(
      4,
      [&](World& world) {
        Mesh mesh(world, 2, 2);
        auto model = make_model(c.model, c.seed);
        auto dp = parallelize(model, mesh);
        auto opt = make_optimizer("adamw", dp->parameters(), 0.01);
        train(*dp, *opt, world.world(), c, 0, 1);
        dp->save_checkpoint(dir / "hsdp", opt.get());
        auto full = dp->full_parameters();
        if (world.rank() == 0) before = full;
      },
      test_group());
  const CheckpointIndex index = read_checkpoint_index(dir / "hsdp");
  EXPECT_EQ(index.files.size(), 2U) << "ranks 0 and 1 (the first replica) write; ranks 2 and 3 hold the same rows";
  test_support::expect_naive_ddp_loads(dir / "hsdp", c, 3, before, "naive DDP at 3");
}

// What a refused load must leave: every parameter and every optimizer state as it was.
struct Snapshot {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> moments;
  static Snapshot of(const std::vector<at::Tensor>& params, torch::optim::Optimizer& opt, Communicator& comm) {
    Snapshot s;
    for (const auto& p : params) s.params.push_back(p.detach().clone());
    ShardedState state;
    for (size_t i = 0; i < params.size(); ++i)
      state.tensors.push_back({"p" + std::to_string(i), params[i], params[i].sizes().vec(), 0, comm.rank() == 0});
    add_optimizer_state(state, opt);
    for (const auto& t : state.tensors) s.moments.push_back(t.local.detach().clone());
    return s;
  }
  bool operator==(const Snapshot& o) const {
    if (params.size() != o.params.size() || moments.size() != o.moments.size()) return false;
    for (size_t i = 0; i < params.size(); ++i)
      if (!params[i].equal(o.params[i])) return false;
    for (size_t i = 0; i < moments.size(); ++i)
      if (!moments[i].equal(o.moments[i])) return false;
    return true;
  }
};

// A truncated, a corrupt, an incomplete and a mismatched checkpoint are each refused on every rank, naming the file
// or the tensor, before any parameter or optimizer state changes.
TEST(Checkpoint, ABrokenCheckpointIsRefusedOnEveryRankBeforeAnythingChanges) {
  TempDir dir("broken");
  const TrainConfig c = mlp_config();
  const std::string good = dir / "good";
  save_trained_fsdp(good, c, 2, 1);
  const std::string file1 = "rank-00001-of-00002.safetensors";
  struct Case {
    std::string name;
    std::function<void(const std::string&)> breaks;
    bool invalid_argument;  // else std::runtime_error
    std::string named;      // what the message must name
  };
  const std::vector<Case> cases = {
      {"truncated", [&](const std::string& d) { fs::resize_file(d + "/" + file1, fs::file_size(d + "/" + file1) - 3); },
       false, file1},
      {"corrupt",
       [&](const std::string& d) {
         std::fstream f(d + "/" + file1, std::ios::in | std::ios::out | std::ios::binary);
         f.seekg(-5, std::ios::end);  // inside the last tensor's data: only its CRC-32 can tell
         const char byte = static_cast<char>(f.get());
         f.seekp(-5, std::ios::end);
         f.put(static_cast<char>(byte ^ 0x40));
       },
       false, "), half-open) is "},  // "... is corrupt: the CRC-32 of 'x' (rows [a, b), half-open) is ..."
      {"incomplete", [&](const std::string& d) { fs::remove(d + "/" + file1); }, false, file1},
      {"another model",
       [&](const std::string& d) {
         std::ifstream in(d + "/index.json");
         auto j = nlohmann::json::parse(in);
         j["tensors"]["fc0.weight"]["shape"] = {64, 17};
         std::ofstream(d + "/index.json") << j.dump();
       },
       true, "fc0.weight"},
  };
  for (const Case& k : cases) {
    const std::string broken = dir / k.name;
    fs::copy(good, broken, fs::copy_options::recursive);
    k.breaks(broken);
    run_ranks(
        2,
        [&](Communicator& comm) {
          auto model = make_model(c.model, c.seed + 9);
          fsdp::FullyShardedModel fsdp(model, comm);
          auto opt = make_optimizer("adamw", fsdp.parameters(), 0.01);
          train(fsdp, *opt, comm, c, 0, 1);  // a state of its own, to be kept
          const Snapshot before = Snapshot::of(fsdp.parameters(), *opt, comm);
          std::string message;
          bool right_type = false;
          try {
            fsdp.load_checkpoint(broken, opt.get());
          } catch (const std::invalid_argument& e) {
            message = e.what();
            right_type = k.invalid_argument;
          } catch (const std::runtime_error& e) {
            message = e.what();
            right_type = !k.invalid_argument;
          }
          if (comm.rank() == 0) std::cout << k.name << ": " << message << "\n";
          EXPECT_TRUE(right_type) << k.name << ", rank " << comm.rank() << ": wrong or no exception: " << message;
          EXPECT_NE(message.find(k.named), std::string::npos) << k.name << ": the message must name " << k.named;
          EXPECT_TRUE(Snapshot::of(fsdp.parameters(), *opt, comm) == before)
              << k.name << ", rank " << comm.rank() << ": a refused load changed the parameters or the optimizer";
        },
        test_group());
  }
}

// A save that never completed (killed: a staging directory left, no swap) leaves the previous checkpoint, whole;
// the next save goes through. A directory that is not a checkpoint is never replaced.
TEST(Checkpoint, AnUnfinishedSaveLeavesThePreviousCheckpointAndUserFilesAreNeverReplaced) {
  TempDir dir("atomic");
  const TrainConfig c = mlp_config();
  const std::string ckpt = dir / "ckpt";
  fs::create_directories(dir / "mine");
  std::ofstream(dir / "mine/notes.txt") << "keep me";
  std::map<std::string, at::Tensor> first;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed);
        naive_ddp::NaiveDDP ddp(model, comm);
        auto opt = make_optimizer("sgd", trainable_parameters(*model), 0.05);
        train(ddp, *opt, comm, c, 0, 1);
        ddp.save_checkpoint(ckpt, opt.get());
        EXPECT_THROW(ddp.save_checkpoint(dir / "mine", opt.get()), std::invalid_argument) << "rank " << comm.rank();
        // Under a regular file: the error names the file, not a staging path std::filesystem could not make.
        try {
          ddp.save_checkpoint(dir / "mine/notes.txt/deeper/ckpt", opt.get());
          ADD_FAILURE() << "saved under a regular file";
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("'" + dir / "mine/notes.txt" + "' is a file, not a directory"),
                    std::string::npos)
              << e.what();
        }
      },
      test_group());
  first = contents(ckpt);
  EXPECT_TRUE(fs::exists(dir / "mine/notes.txt"));
  // What a save killed before its swap leaves: a staging directory with a rank's file and no index.
  fs::create_directories(ckpt + ".shardlab-partial");
  std::ofstream(ckpt + ".partial/rank-00000-of-00002.safetensors") << "half a file";
  EXPECT_EQ(difference(first, contents(ckpt)), "") << "the previous checkpoint must load as it was";
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed);
        naive_ddp::NaiveDDP ddp(model, comm);
        auto opt = make_optimizer("sgd", trainable_parameters(*model), 0.05);
        ddp.load_checkpoint(ckpt, opt.get());
        train(ddp, *opt, comm, c, 1, 1);
        ddp.save_checkpoint(ckpt, opt.get());
      },
      test_group());
  EXPECT_FALSE(fs::exists(ckpt + ".shardlab-partial")) << "the staging directory is gone after a save";
  EXPECT_NE(difference(first, contents(ckpt)), "") << "the second save replaced the first";
}

// A full checkpoint: one safetensors file, written by rank 0 from every rank's rows, under the model's names.
TEST(Checkpoint, AFullCheckpointHoldsTheWholeModelUnderItsNames) {
  TempDir dir("full");
  const TrainConfig c = mlp_config();
  std::vector<at::Tensor> full;
  run_ranks(
      3,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed);
        fsdp::FullyShardedModel fsdp(model, comm);
        auto opt = make_optimizer("sgd", fsdp.parameters(), 0.05);
        train(fsdp, *opt, comm, c, 0, 1);
        save_full_checkpoint(dir / "model.safetensors", fsdp.checkpoint_state(), comm);
        ShardedState other_format = fsdp.checkpoint_state();  // "format" is the file's: refused before anything moves
        other_format.metadata["format"] = "tf";
        EXPECT_THROW(save_full_checkpoint(dir / "tf.safetensors", other_format, comm), std::invalid_argument);
        auto f = fsdp.full_parameters();
        if (comm.rank() == 0) full = f;
      },
      test_group());
  const auto file = safetensors::load_file(dir / "model.safetensors");
  // Hugging Face's transformers refuses a safetensors file whose metadata lacks "format": "pt"; a load does not
  // hand it back as the user's metadata.
  const safetensors::Reader reader(dir / "model.safetensors");
  EXPECT_EQ(reader.header().metadata.count("format") ? reader.header().metadata.at("format") : "(none)", "pt");
  EXPECT_EQ(read_checkpoint_index(dir / "model.safetensors").metadata.count("format"), 0U);
  auto single = make_model(c.model, c.seed + 3);
  size_t i = 0;
  for (const auto& item : single->named_parameters()) {
    ASSERT_TRUE(file.count(item.key())) << item.key();
    EXPECT_TRUE(file.at(item.key()).equal(full[i++])) << item.key();
  }
  EXPECT_EQ(file.size(), single->named_parameters().size());

  // Rows of any dtype, sharded over 3 ranks (5 rows: 2, 2, 1), gathered exactly: also those Gloo cannot carry
  // (bool, int16; bfloat16 on 1.13, which would otherwise travel as float32).
  const std::vector<c10::ScalarType> dtypes{at::kBool, at::kShort, at::kBFloat16, at::kDouble};
  std::map<std::string, at::Tensor> whole;
  for (const auto dt : dtypes)
    whole[c10::toString(dt)] = (at::arange(15, at::kDouble).reshape({5, 3}) * 0.37).remainder(2.0).to(dt);
  run_ranks(
      3,
      [&](Communicator& comm) {
        ShardedState state;
        const int64_t first = std::min<int64_t>(2 * comm.rank(), 5), rows = std::min<int64_t>(2, 5 - first);
        for (const auto& [name, t] : whole)
          state.tensors.push_back({name, t.narrow(0, first, rows).clone(), {5, 3}, first, true});
        save_full_checkpoint(dir / "dtypes.safetensors", state, comm);
      },
      test_group());
  const auto saved = safetensors::load_file(dir / "dtypes.safetensors");
  for (const auto& [name, t] : whole) {
    ASSERT_TRUE(saved.count(name)) << name;
    EXPECT_EQ(saved.at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(saved.at(name).equal(t)) << name << ": saved " << saved.at(name) << " expected " << t;
  }
}

// ---- Names: the state dict, tied weights, the errors' names ------------------------------------------------------

// One weight registered under two names (tied).
class TiedModel : public Model {
 public:
  TiedModel() {
    w_ = register_parameter("w", at::ones({2, 2}));
    register_parameter("alias", w_);
  }
  at::Tensor loss(const Batch& batch) override { return at::matmul(batch.input, w_).pow(2).sum(1).mean(); }

 private:
  at::Tensor w_;
};

TEST(Names, TrainableParametersListATiedWeightOnceSoTheOptimizerStepsItOnce) {
  TiedModel model;
  ASSERT_EQ(model.parameters().size(), 2U) << "libtorch lists the tied weight under both names";
  EXPECT_EQ(trainable_parameters(model).size(), 1U);
  const ShardedState state = replicated_state(model, 0);
  ASSERT_EQ(state.tensors.size(), 1U);
  EXPECT_EQ(state.tensors[0].name, "w") << "saved once, under its first name";
  // FSDP too: its state holds the tied weight once, so a save and a load go through.
  TempDir dir("tied");
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto tied = std::make_shared<TiedModel>();
        fsdp::FullyShardedModel fsdp(tied, comm);
        auto opt = make_optimizer("sgd", fsdp.parameters(), 0.1);
        EXPECT_EQ(fsdp.checkpoint_state().tensors.size(), 1U);
        fsdp.save_checkpoint(dir / "tied", opt.get());
        fsdp.load_checkpoint(dir / "tied", opt.get());
      },
      test_group());
}

// The DDP wrappers reduce a tied weight once: one all-reduce of its gradient per backward (two of one tensor would
// race each other), one slot in BucketedDDP's buckets, and parameters() lists it once, so the optimizer steps it once
// and the step equals one device's on the union batch.
TEST(Names, EveryDdpReducesATiedWeightOnceAndStepsLikeOneDevice) {
  const Batch global = test_support::spaced_batch(4, 2);
  TiedModel reference;
  reference.loss(global).backward();
  const at::Tensor want = reference.parameters()[0].grad().clone();
  for (const std::string wrapper : {"naive", "bucketed", "parallelize"}) {
    std::vector<at::Tensor> grads(2);
    std::vector<size_t> reductions(2), listed(2);
    run_world(
        2,
        [&](World& world) {
          auto model = std::make_shared<TiedModel>();
          Mesh mesh(world, 2, 1);  // shard size 1: parallelize picks bucketed DDP over the replicate group
          Communicator& comm = wrapper == "parallelize" ? mesh.replicate_group() : world.world();
          std::unique_ptr<naive_ddp::NaiveDDP> naive;
          std::unique_ptr<bucketed_ddp::BucketedDDP> bucketed;
          std::unique_ptr<DataParallel> dp;
          if (wrapper == "naive") naive = std::make_unique<naive_ddp::NaiveDDP>(model, comm);
          if (wrapper == "bucketed") bucketed = std::make_unique<bucketed_ddp::BucketedDDP>(model, comm);
          if (wrapper == "parallelize") dp = parallelize(model, mesh);
          listed[comm.rank()] = bucketed ? bucketed->parameters().size()
                                : dp     ? dp->parameters().size()
                                         : trainable_parameters(*model).size();
          const size_t start = comm.recorder().size();
          const Batch mine = rank_slice(global, comm.rank(), 2);
          at::Tensor loss = naive ? naive->loss(mine) : bucketed ? bucketed->loss(mine) : dp->loss(mine);
          loss.backward();
          reductions[comm.rank()] = comm.recorder().size() - start;
          grads[comm.rank()] = model->parameters()[0].grad().clone();
        },
        test_group());
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(listed[r], 1U) << wrapper << ": the tied weight listed twice";
      EXPECT_EQ(reductions[r], 1U) << wrapper << ": expected one all-reduce of the tied weight's gradient";
      const double diff = (grads[r] - want).abs().max().item<double>();
      EXPECT_TRUE(grads[r].allclose(want, 1e-6, 1e-7))
          << wrapper << " rank " << r << ": max |grad - one device| " << diff;
    }
  }
}

// Two units that share one module: the error names the parameter by its full model name in both units.
struct Holder : torch::nn::Module {
  explicit Holder(torch::nn::Linear shared) : fc(register_module("fc", std::move(shared))) {}
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc;
};

class SharedAcrossUnits : public Model {
 public:
  SharedAcrossUnits() {
    torch::nn::Linear shared(3, 3);
    a_ = register_unit("first", std::make_shared<Holder>(shared));
    b_ = register_unit("second", std::make_shared<Holder>(shared));
  }
  at::Tensor loss(const Batch& batch) override { return b_(a_(batch.input)).sum(); }

 private:
  UnitRef<Holder> a_, b_;
};

TEST(Names, AParameterSharedByTwoUnitsIsNamedByItsFullNames) {
  run_ranks(
      1,
      [&](Communicator& comm) {
        try {
          fsdp::FullyShardedModel fsdp(std::make_shared<SharedAcrossUnits>(), comm);
          ADD_FAILURE() << "a parameter in two units was accepted";
        } catch (const std::invalid_argument& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("'second.fc.weight'"), std::string::npos) << m;
          EXPECT_NE(m.find("'first.fc.weight'"), std::string::npos) << m;
        }
      },
      test_group());
}

TEST(Names, TheFullStateDictNamesEveryTensorAsOneDeviceHoldsIt) {
  const TrainConfig c = mlp_config();
  run_ranks(
      3,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed);
        auto single = make_model(c.model, c.seed);  // the same initial values, unwrapped
        fsdp::FullyShardedModel fsdp(model, comm);
        const auto dict = fsdp.full_state_dict();
        const auto expected = single->named_parameters();
        ASSERT_EQ(dict.size(), expected.size());
        size_t i = 0;
        for (const auto& item : expected) {
          EXPECT_EQ(dict[i].first, item.key());
          EXPECT_TRUE(dict[i].second.equal(item.value())) << item.key() << " on rank " << comm.rank();
          ++i;
        }
      },
      test_group());
}

}  // namespace
}  // namespace shardlab
