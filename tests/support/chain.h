#pragma once
// A chain model whose blocks run in an order other than their registration (stage 04's forward-order test, stage
// 05's prefetch tests), its batches, and the unit names of an order, for failure messages.
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/model/model.h"
#include "shardlab/course/data.h"
#include "shardlab/fsdp/fsdp.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::test_support {

/// A block of the chain: one square Linear and a tanh.
struct ChainBlockImpl : torch::nn::Module {
  explicit ChainBlockImpl(int64_t dim) : fc(register_module("fc", torch::nn::Linear(dim, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc->forward(x)); }
  torch::nn::Linear fc;
};

/// Blocks registered as block0, block1, ... but run in `run_order`; the root is an input and an output layer.
/// Trains on the mlp dataset (make_dataset("mlp", seed): input [B, 16] float, target [B] classes in [0, 4)).
class Chain : public Model {
 public:
  explicit Chain(std::vector<size_t> run_order, int64_t dim = 8)
      : run_order_(std::move(run_order)),
        in_(register_module("in", torch::nn::Linear(16, dim))),
        out_(register_module("out", torch::nn::Linear(dim, 4))) {
    for (size_t i = 0; i < run_order_.size(); ++i)
      blocks_.push_back(register_unit("block" + std::to_string(i), std::make_shared<ChainBlockImpl>(dim)));
    init_parameters(*this, 7);
  }
  /// Runs the blocks in `order` from the next forward on (a block left out gets no gradient in that step).
  void set_run_order(std::vector<size_t> order) { run_order_ = std::move(order); }
  /// Runs block `b` first, on the raw input (which needs no gradient), before the input layer; it must not be in the
  /// run order, and the chain's width must be the input's (16).
  void set_first_on_input(size_t b) { first_on_input_ = static_cast<int64_t>(b); }
  at::Tensor loss(const Batch& batch) override {
    at::Tensor x = first_on_input_ < 0 ? batch.input : blocks_[static_cast<size_t>(first_on_input_)](batch.input);
    x = in_->forward(x);
    for (size_t i : run_order_) x = blocks_[i](x);
    return at::cross_entropy_loss(out_->forward(x), batch.target);
  }

 private:
  std::vector<size_t> run_order_;
  int64_t first_on_input_ = -1;
  torch::nn::Linear in_, out_;
  std::vector<UnitRef<ChainBlockImpl>> blocks_;
};

/// This rank's slice of global batch `step` (8 examples) of the mlp dataset of seed 3: what the chain trains on.
inline Batch chain_batch(int step, const Communicator& comm) {
  auto data = make_dataset("mlp", 3);
  return rank_slice(data->global_batch(step, 8), comm.rank(), comm.size());
}

/// "U root, U block0, ..." for a failure message.
inline std::string joined(const std::vector<std::string>& items) {
  std::ostringstream os;
  for (size_t i = 0; i < items.size(); ++i) os << (i ? ", " : "") << items[i];
  return os.str();
}

/// The unit names of `order` (indices into fsdp.units()).
inline std::vector<std::string> names_of(const fsdp::FullyShardedModel& fsdp, const std::vector<size_t>& order) {
  std::vector<std::string> out;
  for (size_t u : order) out.push_back(fsdp.units().at(u)->name());
  return out;
}

}  // namespace shardlab::test_support
