#pragma once
// What stage 05's tests share: a chain model whose blocks run in an order other than their registration, an event
// log of the units as "U name" (a real begin_unshard) and "R name" (a real reshard), and the step they drive.
#include "shardlab/core/model/model.h"
#include "shardlab/course/data.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/prefetch/prefetch.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <functional>
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

/// Every real begin_unshard ("U name") and reshard ("R name") of `fsdp`'s units from now on; `mark()` starts a new
/// phase (forward, backward) so each can be compared on its own.
class UnitLog {
 public:
  explicit UnitLog(fsdp::FullyShardedModel& fsdp) : fsdp_(fsdp) {
    fsdp.set_observer([this](const fsdp::UnitEvent& e) {
      events_.push_back(e);
      if (e.kind == fsdp::UnitEventKind::kBeginUnshard || e.kind == fsdp::UnitEventKind::kReshard)
        current_.push_back(std::string(e.kind == fsdp::UnitEventKind::kBeginUnshard ? "U " : "R ") +
                           fsdp_.units()[e.unit]->name());
      if (on_event) on_event(e);
    });
  }
  ~UnitLog() { fsdp_.set_observer({}); }
  UnitLog(const UnitLog&) = delete;
  UnitLog& operator=(const UnitLog&) = delete;
  /// The U/R sequence since the last take(), and starts a new one.
  std::vector<std::string> take() { return std::exchange(current_, {}); }
  /// Every event so far.
  const std::vector<fsdp::UnitEvent>& events() const { return events_; }
  /// Called after each event is logged.
  std::function<void(const fsdp::UnitEvent&)> on_event;

 private:
  fsdp::FullyShardedModel& fsdp_;
  std::vector<fsdp::UnitEvent> events_;
  std::vector<std::string> current_;
};

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
