#pragma once
/// @file grad_ready.h
/// Gradient readiness: a callback when autograd has accumulated each parameter's gradient, and one callback at
/// the end of each backward pass. The machinery every data-parallel wrapper of the course starts from (stages 01,
/// 02 and 04 react to it; none re-implements it).
///
/// Vocabulary:
///  - *ready*: autograd has accumulated this backward's gradient into `param.grad()` (so a gradient accumulated
///    over micro-batches is visible: a hook on the incoming gradient would miss it, picotron issue #39).
///  - *end of backward*: after every gradient of the backward pass was computed and every ready callback ran.
///
/// Threading: callbacks run on the thread that runs backward (on CPU, the caller of `backward()`). After each ready
/// callback that thread passes a progress point (progress.h): while a collective is in flight it yields its core
/// to the threads that move it (Note [Yielding to communication]).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace shardlab {

/// Calls `ready(i)` each time params[i]'s gradient has been accumulated, and `end_of_backward()` once at the end
/// of a backward pass in which `expect_end_of_backward()` was called.
///
/// Contract:
///  - Hooks live as long as this object; once it is destroyed, hooks still attached to the parameters and an end
///    callback still queued do nothing (an alive guard), so the owner may go away between backward passes.
///  - A backward that throws never runs its end callback: `end_pending()` then stays true until
///    `forget_pending_end()`, which is how an owner notices an aborted backward at its next forward.
///  - Not copyable or movable (the hooks point to it).
class GradientReadiness {
 public:
  /// Called with the index (into the `params` given to the constructor) of the parameter that became ready.
  using Ready = std::function<void(size_t index)>;
  /// Called once at the end of a backward pass.
  using EndOfBackward = std::function<void()>;

  /// Installs one post-accumulate hook per parameter.
  /// @param params leaves that require grad; their order defines the indices passed to `ready`.
  /// @param ready called after each accumulation into params[i].grad(), with i.
  /// @param end_of_backward called once at the end of a backward in which expect_end_of_backward() was called.
  /// @throws std::invalid_argument naming the index of a tensor that is not a leaf requiring grad.
  GradientReadiness(const std::vector<at::Tensor>& params, Ready ready, EndOfBackward end_of_backward);
  ~GradientReadiness();
  GradientReadiness(const GradientReadiness&) = delete;
  GradientReadiness& operator=(const GradientReadiness&) = delete;

  /// From inside a backward pass (a ready callback, or a hook on a tensor of the graph): makes sure
  /// `end_of_backward` runs when this backward ends. Only the first call of a backward queues it.
  void expect_end_of_backward();
  /// True from the first `expect_end_of_backward()` of a backward until its end callback starts.
  bool end_pending() const { return end_pending_; }
  /// Forgets a queued end callback that will never run (its backward threw). Returns whether one was pending.
  bool forget_pending_end();

  /// The gradient accumulator of params[i]: the node of the autograd graph that writes params[i].grad(). A loss
  /// whose graph has no edge to it does not depend on params[i].
  const torch::autograd::Node* accumulator(size_t i) const { return accumulators_.at(i).get(); }
  /// Number of parameters watched.
  size_t size() const { return accumulators_.size(); }

 private:
  Ready ready_;
  EndOfBackward end_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // a tensor keeps only a weak reference
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);             // callbacks do nothing once this is gone
  bool end_pending_ = false;
};

}  // namespace shardlab
