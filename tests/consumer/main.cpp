// Uses the installed shardlab the way an engineer would: a model of its own (a stem, three residual blocks, a
// head; shardlab ships no such model), its own data and its own optimizer, trained through the library's entry
// point on 4 processes started by shardlab-run (`shardlab-run -n 4 -- shardlab_consumer`). It links only the
// library (shardlab::hsdp and what it needs, down to shardlab::core), not the course's models, data or reference
// trainer: CMakeLists.txt checks that.
//
// The same 4 processes train on three meshes of the one world: 2x2 (HSDP, accumulating two micro-batches with the
// all-reduce deferred), 1x4 (FSDP), both built sharded from a ModelBuilder, and 4x1 (DDP), and each rank checks
// the kind it got and its result against the same model trained on one device on the union of the 4 ranks'
// batches. The model FSDP trained is then saved (a sharded checkpoint), exported as one safetensors file, and
// loaded by HSDP built sharded from other values: it must hold the trained values bit for bit. Rank 0 prints
// "consumer: ok" only when every rank's check held on every mesh.
#include <shardlab/core/checkpoint/checkpoint.h>
#include <shardlab/core/comm/world.h>
#include <shardlab/core/model/model.h>
#include <shardlab/core/parallel/standard_facets.h>
#include <shardlab/hsdp/parallelize.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>

namespace {

constexpr int kRanks = 4, kSteps = 4, kGlobalBatch = 16, kFeatures = 16, kClasses = 4;
constexpr uint64_t kSeed = 7;

// One residual block: x + tanh(fc(norm(x))).
struct Block : torch::nn::Module {
  explicit Block(int64_t dim) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc = register_module("fc", torch::nn::Linear(dim, dim));
  }
  at::Tensor forward(const at::Tensor& x) { return x + at::tanh(fc->forward(norm->forward(x))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc{nullptr};
};

// The user's own model: any torch::nn::Module with a mean loss. The blocks are units (sharded and gathered
// together); stem and head are the root. Each part is initialized as it is built, before it is registered: built
// inside parallelize (a ModelBuilder), FSDP shards a unit the moment it is registered, so no rank ever holds the
// whole model. shardlab::Initializer draws in build order, so the values are those of one init over the whole model.
struct ResidualNet : shardlab::Model {
  explicit ResidualNet(uint64_t seed) {
    shardlab::Initializer init(seed);
    stem = register_module("stem", torch::nn::Linear(kFeatures, 24));
    init.fill(*stem);
    for (int i = 0; i < 3; ++i)  // one line a unit
      blocks.push_back(register_unit("block" + std::to_string(i), init(std::make_shared<Block>(24))));
    head = register_module("head", torch::nn::Linear(24, kClasses));
    init.fill(*head);
  }
  at::Tensor loss(const shardlab::Batch& b) override {
    at::Tensor h = stem->forward(b.input);
    for (auto& block : blocks) h = block(h);  // through the unit's slot, where FSDP gathers and frees
    return at::nll_loss(at::log_softmax(head->forward(h), -1), b.target);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<shardlab::UnitRef<Block>> blocks;
};

// The user's data: step s's global batch, the same on every rank (each takes its own slice).
shardlab::Batch global_batch(int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {at::randn({kGlobalBatch, kFeatures}, gen, at::TensorOptions().dtype(at::kFloat)),
          at::randint(kClasses, {kGlobalBatch}, gen, at::TensorOptions().dtype(at::kLong)), step};
}

torch::optim::AdamW adamw(std::vector<at::Tensor> params) {
  return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(1e-2));
}

// The largest |a - b| over two lists of tensors of the same shapes.
double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return a.size() == b.size() ? worst : 1e30;
}

}  // namespace

int main() {
  auto world = shardlab::World::from_environment();  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  if (world->size() != kRanks) {
    std::cerr << "consumer: expected " << kRanks << " ranks (shardlab-run -n " << kRanks << "); got " << world->size()
              << "\n";
    return 1;
  }
  const int rank = world->rank();

  // One device on the union batch: what every rank must match.
  auto reference = std::make_shared<ResidualNet>(kSeed);
  auto ref_opt = adamw(reference->parameters());
  for (int step = 0; step < kSteps; ++step) {
    ref_opt.zero_grad();
    reference->loss(global_batch(step)).backward();
    ref_opt.step();
  }

  bool ok = true;
  struct Case {
    int replicate, shard;
    const char* kind;  // what parallelize must give for this shape
    bool defer;        // HSDP: accumulate 2 micro-batches with the all-reduce deferred to the second
  };
  for (const Case& c : {Case{2, 2, "hsdp", true}, Case{1, 4, "fsdp", false}, Case{4, 1, "ddp", false}}) {
    shardlab::Mesh mesh(*world, c.replicate, c.shard);
    // FSDP and HSDP: the model built sharded, unit by unit, every rank from the same seed (nothing is broadcast).
    // DDP holds the whole model anyway: here each rank starts from its own values, and parallelize broadcasts rank
    // 0's (the reference's start).
    auto dp = c.shard > 1 ? shardlab::parallelize([] { return std::make_shared<ResidualNet>(kSeed); }, mesh)
                          : shardlab::parallelize(std::make_shared<ResidualNet>(kSeed + rank), mesh);
    // What the shape gave, by the facets it offers: DDP its buckets; FSDP and HSDP measured memory and the switch
    // for the all-reduce across replicas.
    const bool sharded = dp->facet<shardlab::MemoryFacet>() != nullptr && dp->facet<shardlab::ReplicaSync>() != nullptr;
    const bool buckets = dp->facet<shardlab::bucketed_ddp::BucketedDDP>() != nullptr;
    if (sharded != (c.shard > 1) || buckets != (c.shard == 1)) {
      std::cout << "consumer: a " << mesh.to_string() << " mesh gave " << (buckets ? "buckets" : "no buckets")
                << " and " << (sharded ? "" : "no ") << "sharded facets; expected " << c.kind << "'s" << std::endl;
      ok = false;
    }
    auto opt = adamw(dp->parameters());  // DDP: the replica's parameters; FSDP and HSDP: this rank's shards
    const int64_t slice = kGlobalBatch / kRanks;
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      const shardlab::Batch mine = global_batch(step).slice(rank * slice, slice);
      if (c.defer) {  // two micro-batches: reduce-scatter both, all-reduce across the replicas once
        for (int half = 0; half < 2; ++half) {
          dp->required_facet<shardlab::ReplicaSync>("HSDP's deferred all-reduce").set_requires_all_reduce(half == 1);
          (dp->loss(mine.slice(half * slice / 2, slice / 2)) / 2).backward();
        }
      } else {
        dp->loss(mine).backward();
      }
      opt.step();
    }
    const double diff = max_diff(dp->full_parameters(), reference->parameters());  // a collective
    const bool held = diff <= 1e-5;
    std::cout << "consumer: " << c.kind << " on a " << mesh.to_string() << " mesh, rank " << rank
              << (c.defer ? " (2 micro-batches, all-reduce deferred)" : "")
              << " vs one device: max parameter difference " << diff << " (allowed 1e-5)" << (held ? "" : " FAILED")
              << std::endl;
    ok = ok && held;
    if (std::string(c.kind) != "fsdp") continue;
    // The trained model through files, as a user keeps it: a sharded checkpoint, exported as one safetensors file
    // (rank 0), loaded by HSDP built from other values. The ranks share the file system; MASTER_PORT names the run.
    const std::string dir =
        (std::filesystem::temp_directory_path() / ("shardlab-consumer-" + std::string(std::getenv("MASTER_PORT"))))
            .string();
    const std::vector<at::Tensor> trained = dp->full_parameters();
    dp->save_checkpoint(dir + "/checkpoint", nullptr);
    if (rank == 0) shardlab::export_checkpoint(dir + "/checkpoint", dir + "/model.safetensors");
    world->world().barrier();
    shardlab::Mesh other(*world, 2, 2);
    auto loaded = shardlab::parallelize([] { return std::make_shared<ResidualNet>(kSeed + 100); }, other);
    loaded->load_checkpoint(dir + "/model.safetensors", nullptr);
    const double round_trip = max_diff(loaded->full_parameters(), trained);
    std::cout << "consumer: fsdp's model saved, exported and loaded by hsdp, rank " << rank << ": max difference "
              << round_trip << " (allowed 0)" << (round_trip == 0 ? "" : " FAILED") << std::endl;
    ok = ok && round_trip == 0;
    world->world().barrier();
    if (rank == 0) std::filesystem::remove_all(dir);
  }
  // Every rank's verdict, so that rank 0 speaks for all of them.
  at::Tensor failed = at::full({1}, ok ? 0.0F : 1.0F);
  world->world().all_reduce(failed).wait();
  const bool all_ok = failed.item<float>() == 0.0F;
  if (rank == 0) std::cout << (all_ok ? "consumer: ok" : "consumer: FAILED") << std::endl;
  return all_ok ? 0 : 1;
}
