#include "shardlab/naive_ddp/naive_ddp.h"

#include "shardlab/core/checkpoint/training_state.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/model/grad_clip.h"
#include "shardlab/core/model/model_check.h"

#include <stdexcept>

namespace shardlab::naive_ddp {

NaiveDDP::NaiveDDP(std::shared_ptr<Model> module, Communicator& comm) : module_(std::move(module)), comm_(comm) {
  if (!module_) throw std::invalid_argument("NaiveDDP: expected a model; got a null pointer");
  check_same_model(*module_, comm_, "NaiveDDP");  // first: every rank gets the same verdict
  params_ = trainable_parameters(*module_);       // a tied weight once: two all-reduces of one gradient would race
  broadcast_state(*module_, comm_, StructureCheck::kAlreadyCompared);
  readiness_ = std::make_unique<GradientReadiness>(
      params_, [this](size_t i) { on_gradient_ready(i); }, [this] { finish_sync(); });
}

NaiveDDP::~NaiveDDP() {
  // Collectives still in flight write into tensors we do not own any more: finish them first (a destructor must not
  // throw; backward reported, or will report, any error).
  try {
    wait_pending();
  } catch (...) {  // NOLINT(bugprone-empty-catch): the failure was, or will be, reported by backward
  }
}

at::Tensor NaiveDDP::loss(const Batch& batch) {
  if (readiness_->forget_pending_end()) finish_sync();  // the last backward ended early: settle what it launched
  return module_->loss(batch);
}

double NaiveDDP::clip_grad_norm(double max_norm, double p) {
  if (!sync_enabled_)
    throw std::logic_error(
        "NaiveDDP::clip_grad_norm: called inside no_sync, where each rank holds its own, unaveraged gradients; "
        "clip after the synchronized backward that ends the accumulation");
  return shardlab::clip_grad_norm(params_, max_norm, p, nullptr);
}

void NaiveDDP::save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                               const std::map<std::string, std::string>& metadata) {
  save_training_checkpoint(dir, replicated_state(*module_, comm_.rank()), optimizer, comm_, metadata);
}

std::map<std::string, std::string> NaiveDDP::load_checkpoint(const std::string& path,
                                                             torch::optim::Optimizer* optimizer,
                                                             bool optimizer_if_saved, const SavedNames& names) {
  return load_training_checkpoint(path, replicated_state(*module_, comm_.rank()), optimizer, comm_, optimizer_if_saved,
                                  names);
}

void broadcast_state(Model& module, Communicator& comm, StructureCheck check) {
  // Ranks whose models differ are stopped before any broadcast pairs the wrong tensors, on every rank
  // (Note [Comparing the ranks' models]).
  if (check == StructureCheck::kCompare) check_same_model(module, comm, "broadcast_state");
  // All replicas must start identical: every parameter (frozen ones too) and every buffer take rank 0's values.
  // TODO(stage01): broadcast every parameter and buffer from rank 0
  throw ::shardlab::NotImplemented("01", "broadcast every parameter and buffer from rank 0");
}

void NaiveDDP::on_gradient_ready(size_t index) {
  // TODO(stage01): outside no_sync, start averaging this parameter's gradient; never wait here
  throw ::shardlab::NotImplemented("01", "outside no_sync, start averaging this parameter's gradient; never wait here");
}

void NaiveDDP::wait_pending() {
  // TODO(stage01): wait for every average started and not waited for yet
  throw ::shardlab::NotImplemented("01", "wait for every average started and not waited for yet");
}

void NaiveDDP::finish_sync() {
  const int64_t start = now_ns();
  wait_pending();
  comm_.recorder().record_wait("ddp sync", start, now_ns());  // exposed communication, for traces and benchmarks
}

}  // namespace shardlab::naive_ddp
