// Uses the installed shardlab the way an engineer would, on two wrappers:
//  - bucketed DDP with the fp16 hook: two ranks (threads, real Gloo) must agree;
//  - FSDP on a model shardlab does not ship (a stem, three residual blocks, a head): three ranks must train it
//    like one device. Sharding it takes one line per block: register_unit instead of register_module; stage 05's
//    prefetch is one more line.
#include <shardlab/bucketed_ddp/bucketed_ddp.h>
#include <shardlab/comm_hooks/comm_hook.h>
#include <shardlab/common/data.h>
#include <shardlab/common/reference.h>
#include <shardlab/common/thread_ranks.h>
#include <shardlab/fsdp/fsdp.h>
#include <shardlab/prefetch/prefetch.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <iostream>

namespace {

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

// The user's own model: any torch::nn::Module with a mean loss. The blocks are FSDP units; stem and head the root.
struct ResidualNet : shardlab::Model {
  explicit ResidualNet(uint64_t seed) {
    stem = register_module("stem", torch::nn::Linear(16, 24));
    for (int i = 0; i < 3; ++i)
      blocks.push_back(register_unit("block" + std::to_string(i), std::make_shared<Block>(24)));  // one line a unit
    head = register_module("head", torch::nn::Linear(24, 4));
    shardlab::init_parameters(*this, seed);
  }
  at::Tensor loss(const shardlab::Batch& b) override {
    at::Tensor h = stem->forward(b.input);
    for (auto& block : blocks) h = block(h);  // through the unit's slot, where FSDP gathers and frees
    return at::nll_loss(at::log_softmax(head->forward(h), -1), b.target);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<shardlab::UnitRef<Block>> blocks;
};

}  // namespace

int main() {
  using namespace shardlab;
  std::vector<std::vector<at::Tensor>> finals(2);
  run_ranks(2, [&](Communicator& comm) {
    auto model = make_model("mlp", 42 + comm.rank());  // different starts: DDP broadcasts rank 0's
    bucketed_ddp::Options options;
    options.caps = {1024, 8192};  // a few buckets
    options.reducer = comm_hooks::as_bucket_reducer(comm_hooks::make_hook("fp16", comm));
    bucketed_ddp::BucketedDDP ddp(model, comm, options);
    auto data = make_dataset("mlp", 42);
    auto opt = make_optimizer("sgd", trainable_parameters(*model), 0.05);
    for (int step = 0; step < 3; ++step) {
      opt->zero_grad();
      ddp.loss(rank_slice(data->global_batch(step, 8), comm.rank(), comm.size())).backward();
      opt->step();
    }
    finals[comm.rank()] = model->parameters();
  });
  const double diff = max_abs_diff(finals[0], finals[1]);
  std::cout << "consumer: 2 ranks trained, max parameter difference between ranks " << diff << "\n";

  // FSDP: 3 ranks on the user's model against the same model trained on one device on the whole batch.
  auto data = make_dataset("mlp", 7);
  auto reference = std::make_shared<ResidualNet>(7);
  auto ref_opt = make_optimizer("adamw", trainable_parameters(*reference), 1e-2);
  for (int step = 0; step < 3; ++step) {
    ref_opt->zero_grad();
    reference->loss(data->global_batch(step, 12)).backward();
    ref_opt->step();
  }
  std::vector<at::Tensor> sharded_final;
  run_ranks(3, [&](Communicator& comm) {
    auto model = std::make_shared<ResidualNet>(7);
    fsdp::FullyShardedModel sharded(model, comm);  // 3 units + root; each rank keeps a third of every parameter
    prefetch::enable_prefetch(sharded);            // the next block's all-gather in flight while this one runs
    auto opt = make_optimizer("adamw", sharded.parameters(), 1e-2);  // the optimizer steps the shards
    for (int step = 0; step < 3; ++step) {
      opt->zero_grad();
      sharded.loss(rank_slice(data->global_batch(step, 12), comm.rank(), comm.size())).backward();
      opt->step();
    }
    auto full = sharded.full_parameters();  // a collective: every rank calls it
    if (comm.rank() == 0) sharded_final = full;
  });
  const double fsdp_diff = max_abs_diff(sharded_final, reference->parameters());
  std::cout << "consumer: FSDP on a user's model, 3 ranks vs one device, max parameter difference " << fsdp_diff
            << "\n";
  // ctest matches "consumer: ok" (a pass regex ignores the exit code): print it only when both hold.
  const bool ok = diff == 0.0 && fsdp_diff <= 1e-5;
  std::cout << (ok ? "consumer: ok" : "consumer: FAILED") << "\n";
  return ok ? 0 : 1;
}
