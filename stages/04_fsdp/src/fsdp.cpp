// FullyShardedModel's step: the hooks around each unit's forward and backward, the reduce-scatters in one order, the
// end of backward, and the calls that gather full values. Construction is in fsdp_build.cpp, the checkpoints in
// fsdp_checkpoint.cpp, the memory theory in fsdp_memory.cpp.
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/progress.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/model/grad_clip.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <exception>
#include <map>
#include <stdexcept>

// Note [Reduce-scatters in one order on every rank]
// A unit's gradients are complete when its last trainable parameter's accumulator has run; on every rank that
// happens in the same place of the same backward graph. But a unit whose gradients never complete (a parameter
// unused in this backward) is only settled by the end-of-backward sweep, and a rank must never issue unit A's
// reduce-scatter while another issues unit B's: Gloo pairs collectives by their order, and two different
// reductions paired together are wrong values or a hang. So reduce-scatters are launched in one fixed order, the
// reverse of this forward's unit order (then any unit that did not run forward): a complete unit waits until
// every unit before it in that order has been launched (the same rule as stage 02's buckets).
//
// Note [A parameter unused on some ranks]
// The contract asks every rank to leave the same trainable parameters without gradient in a step. What happens when
// one rank does not (its batch never reaches a parameter the others use), by what can and cannot be checked:
//  - Which reduce-scatters pair is never in question: every rank launches them in reduce_order_, which depends on
//    the forward's unit order only, and a unit still missing a gradient holds back every unit after it. The rank
//    without the gradient launches that unit's reduce-scatter at the end of backward, with zeros for it; the others
//    launched it when its last gradient came. The sum is then the gradient of the union of the batches (the rank's
//    batch does not depend on the parameter), as PyTorch DDP's find_unused_parameters gives.
//  - What changes is how the reduce-scatters interleave with backward's all-gathers. Gloo with CPU tensors runs
//    both as rings of tagged send/recv, each kind numbered in its own order (Note [Ring reduce-scatter] in common),
//    and the all-reduce fallback of small reduce-scatters is the only user of the group's collective order in a
//    backward: the interleaving cannot pair unlike collectives, and the result is exact. Tested:
//    FullyShardedModel.AParameterUnusedOnOneRankOnlyTrainsLikeOneDeviceOnGlooTensorsOnCpu. (Checked collectives,
//    which compare every call in one order, report it: Note [Checked collectives] in common.)
//  - NCCL, and Gloo with CUDA tensors, order every collective of the group in one sequence: there the late
//    reduce-scatter can meet another rank's all-gather. Noticing it would take a collective every step, for every
//    user, to catch one user's mistake. What keeps it from passing silently: with allow_unused_parameters false
//    (the default) the rank that lacked a gradient throws at the end of that backward, naming the parameter, and
//    the job stops (the launcher stops every rank when one fails); a pairing that does not complete is a
//    collective timeout on the caller's thread, naming the operation. Allowing unused parameters on those backends
//    is the user's promise that the set is the same on every rank (the `edge` model's is: its step, not its data,
//    decides).

// Note [One reduce-scatter in flight]
// A reduce-scatter holds its input (S rows of the unit's padded gradients) and output until it completes. Left to
// the end of backward, every unit's buffers would be alive at once: the whole model's unsharded gradients again,
// which is what sharding set out to avoid. Before a unit's reduce-scatter is launched the previous one is waited
// for (as FSDP2 waits for the previous reduce-scatter's event): it ran while this unit's backward computed, so the
// wait is short, and at most two units' reduction buffers exist at any time.
//
// Note [Progress points in forward]
// Backward gives its core to communication at every gradient (Note [Yielding to communication] in common); a
// forward has no such points of its own, and on a machine whose cores all compute, an all-gather issued ahead of its
// use (stage 05) would then barely move until its unit waits for it. The unit slot is a progress point on both
// sides of the unit's forward: after pre-forward (when the schedule has just issued the next all-gather) and
// before post-forward. It yields only while a collective is in flight, and `set_yield_to_communication(false)`
// (the tool's `--comm-yield off`) turns it off with the others.
//
// Note [When a unit may be freed in backward]
// Once every trainable parameter of a unit has its gradient, every backward node that reads the unit's
// parameters has run (each such node produces a contribution to one of those gradients), so the gathered
// parameters can go at once. A frozen parameter has no accumulator to tell us, so a unit with one is freed only at
// the end of backward. The reasoning assumes the unit reads its parameters through autograd: a unit that saves a
// `param.detach()` (or computes with a parameter under NoGradGuard) for its backward must freeze nothing and
// cannot be freed early; such a unit is not supported.

namespace shardlab::fsdp {

const char* to_string(SchedulePoint point) {
  switch (point) {
    case SchedulePoint::kPreForward:
      return "pre_forward";
    case SchedulePoint::kPostForward:
      return "post_forward";
    case SchedulePoint::kPreBackward:
      return "pre_backward";
  }
  return "?";
}

FullyShardedModel::~FullyShardedModel() {
  wait_all(pending_);  // they write into the units' buffers; backward reported (or will report) any error
  std::vector<Unit>& slots = model_->units();
  for (size_t u = 0; u < inner_forward_.size(); ++u) slots[u].forward = inner_forward_[u];
}

bool FullyShardedModel::raf(size_t u) const {
  const bool is_root = has_root_ && u + 1 == units_.size();
  return is_root ? options_.root_reshard_after_forward : options_.reshard_after_forward;
}

std::vector<at::Tensor> FullyShardedModel::parameters() const {
  std::vector<at::Tensor> out;
  std::vector<std::vector<bool>> taken(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) taken[u].assign(units_[u]->params().size(), false);
  for (const auto& [u, k] : order_) {
    const FsdpParam& fp = units_[u]->params()[k];
    if (fp.trainable && !taken[u][k]) out.push_back(fp.sharded);
    taken[u][k] = true;
  }
  return out;
}

// Note [A wrapper whose all-gather failed]
// A unit whose all-gather was issued and failed (a rank died, a timeout) never got its parameters: it stays
// unsharding, and every later wait on it rethrows the first error. Going on would mean computing with a buffer the
// collective never filled, or issuing collectives on a group whose ranks may no longer agree on what comes next. So
// from then on every call that would gather, compute or save (loss, full_parameters, full_state_dict, clip_grad_norm,
// the checkpoints, a schedule's begin_unshard) refuses, naming the unit and the first error: nothing more is sent on
// this wrapper, and nothing hangs. The way on is a new group and wrapper, and the last checkpoint (the tool: the
// launcher stops every rank, and --resume). Other failures leave no unit half-way, and the wrapper as it was: a
// failed reduce-scatter (backward throws it after waiting for every other one; the parameters are untouched, and
// the next step may go on if the group still works, as stage 01's invariant 4), the all-gathers of
// full_parameters and of a checkpoint's text (into buffers of their own), and a call refused by checked
// collectives before anything was sent.
void FullyShardedModel::check_usable(const char* call) const {
  for (const auto& unit : units_)
    if (!unit->failure().empty())
      throw std::logic_error(std::string("FullyShardedModel::") + call + ": refused, since the all-gather of unit '" +
                             unit->name() + "' failed (" + unit->failure() +
                             "). Its parameters never arrived and the ranks may be out of step; nothing more is "
                             "sent on this wrapper. Make a new group and wrapper, and load the last checkpoint");
}

std::vector<at::Tensor> FullyShardedModel::full_parameters() {
  check_usable("full_parameters");
  std::vector<std::vector<at::Tensor>> full;
  for (auto& unit : units_) full.push_back(unit->gather_full_parameters());
  std::vector<at::Tensor> out;
  for (const auto& [u, k] : order_) out.push_back(full[u][k]);
  return out;
}

void FullyShardedModel::visit_full_parameters(const std::function<void(size_t, const at::Tensor&)>& visit) {
  check_usable("visit_full_parameters");
  size_t held = units_.size();  // the unit whose full values `full` holds (none yet)
  std::vector<at::Tensor> full;
  for (size_t i = 0; i < order_.size(); ++i) {
    const auto [u, k] = order_[i];
    if (u != held) {
      full.clear();  // the previous unit's go first
      full = units_[u]->gather_full_parameters();
      held = u;
    }
    visit(i, full[k]);
  }
}

double FullyShardedModel::clip_grad_norm(double max_norm, double p) {
  check_usable("clip_grad_norm");
  if (!sync_enabled_)
    throw std::logic_error(
        "FullyShardedModel::clip_grad_norm: called inside no_sync, where the gradients are unsharded and "
        "unreduced; clip after the synchronized backward that ends the accumulation");
  for (const auto& unit : units_)
    if (unit->reducer().deferred())
      throw std::logic_error("FullyShardedModel::clip_grad_norm: unit '" + unit->name() + "' reduces with '" +
                             unit->reducer().name() +
                             "', which has deferred its second phase (each replica's shards hold its own sum); clip "
                             "after the backward that completes the reduction");
  return shardlab::clip_grad_norm(parameters(), max_norm, p, &comm_);
}

at::Tensor FullyShardedModel::loss(const Batch& batch) {
  check_usable("loss");
  settle_aborted_backward();
  // A forward that threw, or one whose backward never came, may have left units gathered or all-gathers in flight
  // (a schedule's prefetches): every rank settles them alike before any new collective.
  reshard_all();
  forward_order_.clear();
  post_forward_order_.clear();
  awaits_backward_.assign(units_.size(), false);
  if (schedule_) schedule_->begin_iteration(*this);
  const bool training = at::GradMode::is_enabled();
  const size_t root = units_.size() - 1;
  if (has_root_) pre_forward(root);
  at::Tensor out = model_->loss(batch);
  if (has_root_) post_forward(root, out);
  last_forward_order_ = forward_order_;
  if (schedule_) schedule_->end_forward(*this);
  if (training && out.requires_grad()) {
    std::weak_ptr<int> alive = alive_;
    out.register_hook([this, alive](const at::Tensor&) {
      if (!alive.expired()) readiness_->expect_end_of_backward();
    });
  } else {
    reshard_all();  // no backward will come for this forward
  }
  return out;
}

std::vector<size_t> FullyShardedModel::expected_forward_order() const {
  if (!last_forward_order_.empty()) return last_forward_order_;
  std::vector<size_t> order;  // before any forward: the root first (its forward is the whole loss), then the units
  if (has_root_) order.push_back(root_index());
  for (size_t u = 0; u < units_.size(); ++u)
    if (u != root_index()) order.push_back(u);
  return order;
}

void FullyShardedModel::pre_forward(size_t u) {
  if (std::find(forward_order_.begin(), forward_order_.end(), u) != forward_order_.end())
    throw std::logic_error("FullyShardedModel: unit '" + units_[u]->name() +
                           "' ran twice in one forward; each unit may run once per loss()");
  forward_order_.push_back(u);
  // TODO(stage04): the unit's parameters must hold their full values while its forward runs
  throw ::shardlab::NotImplemented("04", "the unit's parameters must hold their full values while its forward runs");
  consult_schedule(SchedulePoint::kPreForward, u);
}

void FullyShardedModel::post_forward(size_t u, const at::Tensor& output) {
  // TODO(stage04): free after forward (raf) and make sure the unit is gathered again before its backward
  throw ::shardlab::NotImplemented("04", "free after forward (raf) and make sure the unit is gathered again before its backward");
  post_forward_order_.push_back(u);
  if (awaits_backward_.size() != units_.size()) awaits_backward_.assign(units_.size(), false);  // before any loss()
  awaits_backward_[u] = at::GradMode::is_enabled() && output.defined() && output.requires_grad();
  consult_schedule(SchedulePoint::kPostForward, u);
}

void FullyShardedModel::pre_backward(size_t u) {
  readiness_->expect_end_of_backward();
  // TODO(stage04): the unit's backward is next: its parameters must be gathered
  throw ::shardlab::NotImplemented("04", "the unit's backward is next: its parameters must be gathered");
  consult_schedule(SchedulePoint::kPreBackward, u);
}

void FullyShardedModel::consult_schedule(SchedulePoint point, size_t u) {
  if (schedule_) schedule_->at(point, u, *this);
}

void FullyShardedModel::begin_unshard(size_t u) {
  if (u >= units_.size())
    throw std::invalid_argument("FullyShardedModel::begin_unshard: expected a unit index below " +
                                std::to_string(units_.size()) + "; got " + std::to_string(u));
  check_usable("begin_unshard");
  units_[u]->begin_unshard();
}

void FullyShardedModel::cancel_unshard(size_t u) {
  if (u >= units_.size())
    throw std::invalid_argument("FullyShardedModel::cancel_unshard: expected a unit index below " +
                                std::to_string(units_.size()) + "; got " + std::to_string(u));
  if (std::find(forward_order_.begin(), forward_order_.end(), u) != forward_order_.end())
    throw std::logic_error("FullyShardedModel::cancel_unshard: unit '" + units_[u]->name() +
                           "' ran its forward in this iteration; expected a unit whose use did not come");
  units_[u]->cancel_unshard();
}

void FullyShardedModel::wait_for_reduce(Handle& reduce) {
  const int64_t start = now_ns();
  // advance(), not wait(): a two-phase reduction (stage 06's HSDP) issues its second collective here and goes on in
  // flight; for a one-collective reduction it is wait(). See Note [Advancing a chained reduction] in common.
  reduce.advance();
  comm_.recorder().record_wait("fsdp reduce", start, now_ns());
}

void FullyShardedModel::on_gradient_ready(size_t g) {
  const auto [u, k] = owner_[g];
  const FsdpParam& fp = units_[u]->params()[k];
  if (fp.param.grad().requires_grad())
    throw std::invalid_argument("FullyShardedModel: parameter '" + fp.name +
                                "' got a gradient that requires grad "
                                "(backward with create_graph = true); double backward is not supported");
  readiness_->expect_end_of_backward();
  units_[u]->note_gradient(k);
  if (ready_[g]) return;  // the same accumulator twice in one backward (a retained graph): counted once
  ready_[g] = true;
  if (--missing_[u] == 0) on_unit_ready(u);
}

void FullyShardedModel::on_unit_ready(size_t u) {
  // TODO(stage04): the unit's backward is done: free it, then keep (no_sync) or reduce its gradients in order
  throw ::shardlab::NotImplemented("04", "the unit's backward is done: free it, then keep (no_sync) or reduce its gradients in order");
}

void FullyShardedModel::launch_ready_reductions() {
  if (reduce_order_.empty()) {  // see Note [Reduce-scatters in one order on every rank]
    for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
      if (units_[*it]->trainable_count() > 0) reduce_order_.push_back(*it);
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u]->trainable_count() > 0 &&
          std::find(reduce_order_.begin(), reduce_order_.end(), u) == reduce_order_.end())
        reduce_order_.push_back(u);
  }
  // TODO(stage04): launch every complete unit whose predecessors in reduce_order_ have all been launched
  throw ::shardlab::NotImplemented("04", "launch every complete unit whose predecessors in reduce_order_ have all been launched");
}

void FullyShardedModel::end_of_backward() {
  const int64_t start = now_ns();
  std::exception_ptr error;
  // TODO(stage04): settle units whose gradients never all came, wait for every reduce-scatter, shard every unit
  throw ::shardlab::NotImplemented("04", "settle units whose gradients never all came, wait for every reduce-scatter, shard every unit");
  comm_.recorder().record_wait("fsdp sync", start, now_ns());
  std::vector<std::string> unused = std::move(unused_);
  reset_iteration();
  if (error) std::rethrow_exception(error);
  if (!unused.empty() && !options_.allow_unused_parameters) {
    std::string list;
    for (const auto& n : unused) list += (list.empty() ? "'" : ", '") + n + "'";
    throw std::runtime_error("FullyShardedModel: trainable parameter(s) " + list +
                             " received no gradient in this step; they were reduced as zeros so that no rank "
                             "hangs. Make the loss depend on them, freeze them (requires_grad false), or set "
                             "Options::allow_unused_parameters = true.");
  }
}

void FullyShardedModel::settle_aborted_backward() {
  if (!readiness_->forget_pending_end()) return;
  for (auto& unit : units_) unit->discard_unsharded_gradients();  // first: reductions in flight land nowhere
  wait_all(pending_);                                             // the aborted backward already reported its error
  reset_iteration();
  reshard_all();
}

void FullyShardedModel::reshard_all() {
  // Every unit, also after one's all-gather failed: the others' are waited for (they write into their buffers)
  // before the first failure is rethrown.
  std::exception_ptr first;
  for (auto& unit : units_) {
    try {
      unit->reshard();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void FullyShardedModel::reset_iteration() {
  reduce_order_.clear();
  next_reduce_ = 0;
  pending_.clear();
  unused_.clear();
  missing_.assign(units_.size(), 0);
  for (size_t u = 0; u < units_.size(); ++u) missing_[u] = units_[u]->trainable_count();
  ready_.assign(watched_.size(), false);
}

}  // namespace shardlab::fsdp
