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

// Note [The parameter peak, walked]
// The peak is not one formula: it depends on which units stay gathered (the root; every unit without raf) and on
// what is in flight beside the unit at its copy-out. So the theory walks the forward in its expected order (the
// last forward's, or registration order with the root first) and keeps the largest of, at each unit u:
//  - its copy-out: what stays gathered so far + u's gathered buffer + u's all-gather buffer + those of the units
//    already ahead beside it (the next k-1 when k units may be ahead; none before the first unit);
//  - right after it, when the schedule prefetches: the same without u's all-gather buffer, with the next k units'.
// The walk is the steady state: a forward that runs its units in the expected order. A forward that does not (the
// first one of a model registered in another order than it runs, or one that skips a unit) may hold a prefetched
// unit's all-gather buffer beside units it was not expected beside, until its use or the end of the forward; the
// next forward expects the new order.
// Backward with raf meets the same moments in the reverse order (a unit is freed when its gradients are in, before
// the next unit's copy-out), except that a unit with a frozen parameter stays gathered to the end of backward: a
// second walk, over the backward, counts those.
int64_t FullyShardedModel::parameter_peak(int64_t ahead) const {
  std::vector<size_t> order = last_forward_order_;
  if (order.empty()) {
    if (has_root_) order.push_back(units_.size() - 1);
    for (size_t u = 0; u + (has_root_ ? 1 : 0) < units_.size(); ++u) order.push_back(u);
  }
  const auto is_root = [&](size_t u) { return has_root_ && u + 1 == units_.size(); };
  int64_t shards = 0;
  for (const auto& unit : units_) shards += unit->sharded_bytes();
  // Walks `units` in the order they are gathered from `held` bytes on; `stays(u)`: u stays gathered after its use.
  auto walk = [&](const std::vector<size_t>& units, int64_t held, const auto& stays) {
    int64_t peak = held;
    auto next_all_gathers = [&](size_t i, int64_t count) {
      int64_t bytes = 0;
      for (size_t j = i + 1; j < units.size() && static_cast<int64_t>(j - i) <= count; ++j)
        bytes += units_[units[j]]->all_gather_bytes();
      return bytes;
    };
    for (size_t i = 0; i < units.size(); ++i) {
      const FsdpUnit& unit = *units_[units[i]];
      const int64_t beside = i == 0 ? 0 : next_all_gathers(i, ahead - 1);
      const int64_t gathered = held + unit.gathered_capacity_bytes();
      peak = std::max({peak, gathered + unit.all_gather_bytes() + beside, gathered + next_all_gathers(i, ahead)});
      if (stays(units[i])) held = gathered;
    }
    return peak;
  };
  // Forward: the root (its forward is the whole loss) and every unit without raf stay gathered.
  int64_t peak = walk(order, shards, [&](size_t u) { return is_root(u) || !raf(u); });
  if (options_.reshard_after_forward) {
    // Backward gathers the units again in the reverse order, the root gathered throughout; a unit with a frozen
    // parameter stays gathered to the end of backward (Note [When a unit may be freed in backward]).
    std::vector<size_t> backward;
    for (auto it = order.rbegin(); it != order.rend(); ++it)
      if (!is_root(*it)) backward.push_back(*it);
    const int64_t root = has_root_ ? units_.back()->gathered_capacity_bytes() : 0;
    peak = std::max(peak, walk(backward, shards + root, [&](size_t u) { return units_[u]->has_frozen(); }));
  }
  return peak;
}

// Note [The gradient peak, walked]
// A synchronized backward meets the units in the reverse of the forward order, the root last (its gradients are
// complete only when the embedding's, the last, has come). At each unit u:
//  - while u's backward runs, its unsharded gradients come in beside the previous unit's reduction, still in
//    flight (one at a time: Note [One reduce-scatter in flight]);
//  - when u is ready, the previous reduction is advanced (a one-phase one waited for, its buffers freed; a two-phase
//    one keeps its second phase's bytes to the end of backward: Note [A reduction's bytes, phase by phase]) and u's
//    buffers made while its unsharded gradients still exist; they are freed as they are copied in.
// Beside every moment: the sharded gradients (all of them: after the first step they stay), and the root's
// unsharded gradients, counted whole from the start. That last term makes the theory an upper bound: the root's
// gradients do not all come at the start (the head's does, the embedding's comes last), and nothing tells when
// each will.
// With accumulation under no_sync (Accumulation::kNoSync), every unit's gradients from the earlier micro-batches are
// there when the last backward starts: in `.grad()` (reduce dtype = param dtype: autograd adds the last
// micro-batch's in place) or in reduce-dtype accumulators, beside which the last micro-batch's come in the param
// dtype. Each unit's are freed as its reduction's input is laid out, so the peak is at the first units of backward.
// When every micro-batch reduces (kReduce), nothing unsharded is kept, but a reducer may keep a partial row per
// unit between them (GradientReducer::deferred_bytes: HSDP's deferred all-reduce); it goes into the last
// micro-batch's reduction and is freed with its first phase. The last micro-batch is the largest: the earlier ones
// hold the same partials and no second phases.
int64_t FullyShardedModel::gradient_peak(int micro_batches, Accumulation accumulation) const {
  const bool no_sync = micro_batches > 1 && accumulation == Accumulation::kNoSync;
  const bool partials = micro_batches > 1 && accumulation == Accumulation::kReduce;
  std::vector<size_t> order = last_forward_order_;
  if (order.empty()) {
    if (has_root_) order.push_back(units_.size() - 1);
    for (size_t u = 0; u + (has_root_ ? 1 : 0) < units_.size(); ++u) order.push_back(u);
  }
  int64_t held = 0;
  for (const auto& unit : units_)
    for (const auto& fp : unit->params())
      if (fp.trainable) held += fp.sharded.numel() * static_cast<int64_t>(c10::elementSize(unit->dtypes().orig));
  // What accumulation keeps of unit u from the earlier micro-batches, and what the last one adds beside it.
  auto kept = [&](const FsdpUnit& u) {
    if (partials) return u.deferred_bytes();
    if (!no_sync) return int64_t{0};
    const int64_t numel = u.unsharded_grad_bytes() / static_cast<int64_t>(c10::elementSize(u.dtypes().param));
    return numel * static_cast<int64_t>(c10::elementSize(u.dtypes().reduce));
  };
  auto incoming = [&](const FsdpUnit& u) {
    const bool in_place = no_sync && u.dtypes().reduce == u.dtypes().param;
    return in_place ? int64_t{0} : u.unsharded_grad_bytes();
  };
  for (const auto& unit : units_) held += kept(*unit);
  if (has_root_) held += incoming(*units_.back());  // the root's: counted from the start (an upper bound)
  // The backward reduces in reverse forward order, then (at its end, as zeros) the trainable units the forward
  // did not run: launch_ready_reductions' order.
  std::vector<size_t> walk(order.rbegin(), order.rend());
  for (size_t u = 0; u < units_.size(); ++u)
    if (std::find(order.begin(), order.end(), u) == order.end()) walk.push_back(u);
  int64_t peak = held, in_flight = 0, in_flight_second = 0, second_phases = 0;
  for (size_t u : walk) {
    const FsdpUnit& unit = *units_[u];
    if (unit.trainable_count() == 0) continue;
    const bool is_root = has_root_ && u + 1 == units_.size();
    const int64_t grads = is_root ? 0 : incoming(unit);  // the root's are in `held`
    peak = std::max(peak, held + second_phases + in_flight + grads);
    second_phases += in_flight_second;  // the previous reduction advanced
    peak = std::max(peak, held + second_phases + grads + unit.reduce_bytes());
    held -= kept(unit);  // laid out into the reduction's input (no_sync), or taken in by it (a partial)
    in_flight = unit.reduce_bytes() + (partials ? kept(unit) : 0);
    in_flight_second = unit.second_phase_bytes();
  }
  return std::max(peak, held + second_phases + in_flight);
}

MemoryTheory FullyShardedModel::memory_theory(int micro_batches, Accumulation accumulation) const {
  if (micro_batches < 1)
    throw std::invalid_argument("memory_theory: expected micro_batches >= 1; got " + std::to_string(micro_batches));
  MemoryTheory t;
  for (size_t u = 0; u < units_.size(); ++u) {
    const FsdpUnit& unit = *units_[u];
    const bool is_root = has_root_ && u + 1 == units_.size();
    t.sharded_param_bytes += unit.sharded_bytes();
    const int64_t unsharded_grads = unit.unsharded_grad_bytes();
    for (const auto& fp : unit.params())
      if (fp.trainable)
        t.sharded_grad_bytes += fp.sharded.numel() * static_cast<int64_t>(c10::elementSize(unit.dtypes().orig));
    t.largest_reduce_bytes = std::max(t.largest_reduce_bytes, unit.reduce_bytes());
    t.largest_all_gather_bytes = std::max(t.largest_all_gather_bytes, unit.all_gather_bytes());
    if (is_root) {
      t.root_bytes = unit.gathered_capacity_bytes();
    } else {
      t.largest_unit_bytes = std::max(t.largest_unit_bytes, unit.gathered_capacity_bytes());
      t.all_units_bytes += unit.gathered_capacity_bytes();
      t.largest_unit_grad_bytes = std::max(t.largest_unit_grad_bytes, unsharded_grads);
    }
  }
  t.ahead = schedule_ ? schedule_->max_ahead() : 0;
  t.peak_param_bytes = parameter_peak(t.ahead);
  t.peak_grad_bytes = gradient_peak(micro_batches, accumulation);
  return t;
}

}  // namespace shardlab::fsdp
