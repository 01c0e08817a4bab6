#include "shardlab/bucketed_ddp/bucketed_ddp.h"

#include "shardlab/bucketed_ddp/order_agreement.h"
#include "shardlab/core/checkpoint/training_state.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/model/grad_clip.h"
#include "shardlab/core/model/model_check.h"
#include "shardlab/core/storage/flat_storage.h"
#include "shardlab/naive_ddp/broadcast_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

namespace shardlab::bucketed_ddp {
namespace {
// Note [Settling a complete backward]: true on the thread running finish_sync while it waits for the buckets of a
// backward that will succeed. A reducer's continuation (stage 03's optimizer step) runs inside those waits; the
// same waits after a backward that failed or was cut short (loss(), the destructor) must not step anything.
thread_local bool settling_complete = false;

struct SettlingScope {
  explicit SettlingScope(bool complete) : previous_(settling_complete) { settling_complete = complete; }
  ~SettlingScope() { settling_complete = previous_; }
  SettlingScope(const SettlingScope&) = delete;
  SettlingScope& operator=(const SettlingScope&) = delete;

 private:
  bool previous_;
};
}  // namespace

bool settling_a_complete_backward() { return settling_complete; }

BucketedDDP::BucketedDDP(std::shared_ptr<Model> module, Communicator& comm, Options options)
    : module_(std::move(module)), comm_(comm), options_(std::move(options)) {
  if (!module_) throw std::invalid_argument("BucketedDDP: expected a model; got a null pointer");
  // First: the checks below depend on the model, and a rank must not fail one alone while the others wait.
  check_same_model(*module_, comm_, "BucketedDDP");
  check_caps("BucketedDDP", options_.caps);
  // Frozen parameters are never communicated; a tied weight has one slot, under its first name.
  for (auto& [name, p] : named_state(*module_, StateParts::kParameters, /*once=*/true)) {
    if (!p.requires_grad()) continue;
    params_.push_back(p);
    names_.push_back(name);
  }
  if (params_.empty())
    throw std::invalid_argument("BucketedDDP: expected a model with at least one trainable parameter; got none");
  for (size_t i = 1; i < params_.size(); ++i)  // the flat buffers live on one device (see lay_out)
    if (params_[i].device() != params_.front().device())
      throw std::invalid_argument("BucketedDDP: every trainable parameter must be on one device; '" + names_.front() +
                                  "' is on " + params_.front().device().str() + ", '" + names_[i] + "' on " +
                                  params_[i].device().str());
  naive_ddp::broadcast_state(*module_, comm_, naive_ddp::StructureCheck::kAlreadyCompared);
  // Before any backward the best guess of the ready order is the reverse of registration (last layer first).
  std::vector<size_t> order(params_.size());
  std::iota(order.rbegin(), order.rend(), size_t{0});
  lay_out(order);
  readiness_ = std::make_unique<GradientReadiness>(
      params_, [this](size_t i) { on_gradient_ready(i); }, [this] { finish_sync(); });
  // Its buckets are a facet (Note [Facets, not downcasts]): a loop or a facade reaches them as facet<BucketedDDP>().
  facets_.add<BucketedDDP>(this);
}

BucketedDDP::~BucketedDDP() {
  // Collectives still in flight write into buffers we are about to free: finish them first (a destructor must not
  // throw; backward reported, or will report, any error).
  try {
    wait_launched();
  } catch (...) {  // NOLINT(bugprone-empty-catch): the failure was, or will be, reported by backward
  }
}

at::Tensor BucketedDDP::grad_buffer(c10::ScalarType dtype) const {
  auto it = buffers_.find(dtype);
  return it == buffers_.end() ? at::Tensor() : it->second;
}

void BucketedDDP::lay_out(const std::vector<size_t>& order) {
  layout_order_ = order;
  const auto groups = assign_buckets(params_, order, options_.caps);
  std::vector<Bucket> buckets;
  std::map<c10::ScalarType, at::Tensor> buffers;  // dtype -> flat gradient buffer
  std::vector<at::Tensor> slots(params_.size());  // parameter -> its gradient slot (what .grad() is)
  // The buffers live on the parameters' device (the constructor checked there is one): a bucket is reduced where
  // its gradients are, with no copy. A gradient that exists already (a rebuild runs at the next forward, after the
  // optimizer may have used, or the user may have kept, the gradients) keeps its values in its new slot.
  // BEGIN SOLUTION(02): every .grad() is its slot in the buckets' flat storage (the layout on the sheet)
  // Offsets first: each bucket is a contiguous slice of its dtype's buffer, in launch order.
  std::map<c10::ScalarType, int64_t> total;
  for (const auto& group : groups) {
    Bucket b;
    b.dtype = params_[group.front()].scalar_type();
    b.params = group;
    b.offset = total[b.dtype];
    for (size_t i : group) b.numel += params_[i].numel();
    total[b.dtype] += b.numel;
    buckets.push_back(std::move(b));
  }
  for (const auto& [dtype, numel] : total) buffers[dtype] = at::zeros({numel}, params_.front().options().dtype(dtype));
  // Then each .grad becomes its slot (alias_slot: same storage, not an autograd view); its values move along.
  for (auto& b : buckets) {
    b.flat = buffers[b.dtype].narrow(0, b.offset, b.numel);
    int64_t at = 0;
    for (size_t i : b.params) {
      at::Tensor view = alias_slot(b.flat, at, params_[i].sizes());  // not a view: see flat_storage.h
      at += params_[i].numel();
      if (params_[i].grad().defined()) view.copy_(params_[i].grad());
      params_[i].mutable_grad() = view;
      slots[i] = view;
    }
  }
  // END SOLUTION
  // Whatever built the layout (stage 02's task), each parameter's slot must be able to stand for its gradient, and
  // the buckets' sizes must add up to their buffer's.
  for (size_t i = 0; i < params_.size(); ++i)
    SHARDLAB_INTERNAL_ASSERT(
        slots[i].defined() && slots[i].device() == params_[i].device() &&
            slots[i].scalar_type() == params_[i].scalar_type() && slots[i].sizes() == params_[i].sizes(),
        "lay_out (stage 02): parameter '" + names_[i] + "' has no gradient slot of its device, dtype and shape");
  for (const auto& [dtype, buffer] : buffers) {
    int64_t covered = 0;
    for (const auto& b : buckets) covered += b.dtype == dtype ? b.numel : 0;
    SHARDLAB_INTERNAL_ASSERT(covered == buffer.numel(), "lay_out (stage 02): the " + std::string(c10::toString(dtype)) +
                                                            " buffer has " + std::to_string(buffer.numel()) +
                                                            " elements, its buckets " + std::to_string(covered));
  }
  buffers_ = std::move(buffers);
  buckets_ = std::move(buckets);
  slots_ = std::move(slots);
  bucket_of_.assign(params_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t i : buckets_[b].params) bucket_of_[i] = b;
  reset_iteration();
}

void BucketedDDP::attach_grads() {
  for (size_t i = 0; i < params_.size(); ++i) attach_grad(i);
}

void BucketedDDP::attach_grad(size_t i) {
  // The optimizer (libtorch 2.x zero_grad), autograd (a backward with create_graph replaces .grad instead of
  // adding into it) or the user may have dropped or replaced a .grad: put it back into its slot of the flat
  // buffer, keeping its value, so the bucket sees it.
  at::Tensor& grad = params_[i].mutable_grad();
  const at::Tensor& slot = slots_[i];
  if (grad.defined() && grad.data_ptr() == slot.data_ptr()) return;
  if (grad.defined())
    slot.copy_(grad);
  else
    slot.zero_();
  grad = slot;
}

double BucketedDDP::clip_grad_norm(double max_norm, double p) {
  if (!sync_enabled_)
    throw std::logic_error(
        "BucketedDDP::clip_grad_norm: called inside no_sync, where each rank holds its own, unaveraged "
        "gradients; clip after the synchronized backward that ends the accumulation");
  return shardlab::clip_grad_norm(params_, max_norm, p, nullptr);
}

// Note [The bucket layout in a checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The layout sets the summation order: Gloo's all-reduce adds each element's ranks in an order that depends on
// where the element sits in its bucket, so the same gradients laid out otherwise round otherwise. A run resumed
// from a checkpoint continues bit for bit only with the layout the uninterrupted run had: the rebuilt order (by
// parameter name) and the caps (tuned ones included) travel in the metadata, and a load lays the buckets out that
// way at the next training forward. A checkpoint from another wrapper has none: the wrapper keeps its own layout
// (a fresh one rebuilds it after its first backward, as a fresh run does). The loaded caps replace the ones it was
// built with, and whether set_caps had chosen them travels too (caps_set), so that a tuner does not tune a resumed
// run twice.

namespace {
constexpr const char* kOrderKey = "bucketed_ddp.rebuilt_order";  // names, one per line
constexpr const char* kCapsKey = "bucketed_ddp.caps";            // "first_bytes bytes"
constexpr const char* kCapsSetKey = "bucketed_ddp.caps_set";     // present when set_caps chose them
}  // namespace

void BucketedDDP::save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                                  const std::map<std::string, std::string>& metadata) {
  std::map<std::string, std::string> meta = metadata;
  if (rebuilt_ || rebuild_pending_) {
    // The layout the next training forward uses: a loaded one not laid out yet, a rebuild pending (after the first
    // backward, or set_caps) from the last ready order (rank 0's, which the rebuild adopts and whose metadata is
    // the one saved), or the one in place.
    const std::vector<size_t>& next = !restored_order_.empty() ? restored_order_
                                      : rebuild_pending_       ? ready_order_
                                                               : layout_order_;
    std::string order;
    for (size_t p : next) order += names_[p] + "\n";
    meta[kOrderKey] = order;
    meta[kCapsKey] = std::to_string(options_.caps.first_bytes) + " " + std::to_string(options_.caps.bytes);
    if (caps_set_) meta[kCapsSetKey] = "1";
  }
  save_training_checkpoint(dir, replicated_state(*module_, comm_.rank()), optimizer, comm_, meta);
}

std::map<std::string, std::string> BucketedDDP::load_checkpoint(const std::string& path,
                                                                torch::optim::Optimizer* optimizer,
                                                                bool optimizer_if_saved, const SavedNames& names) {
  auto meta = load_training_checkpoint(path, replicated_state(*module_, comm_.rank()), optimizer, comm_,
                                       optimizer_if_saved, names);
  const auto order = meta.find(kOrderKey);
  const auto caps = meta.find(kCapsKey);
  if (order == meta.end() || caps == meta.end()) return meta;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < names_.size(); ++i) index[names_[i]] = i;
  std::vector<size_t> restored;
  std::istringstream lines(order->second);
  for (std::string name; std::getline(lines, name);) {
    const auto it = index.find(name);
    if (it == index.end()) return meta;  // another model's layout: rebuild from the first backward
    restored.push_back(it->second);
  }
  BucketCaps c;
  std::istringstream(caps->second) >> c.first_bytes >> c.bytes;
  std::vector<char> seen(params_.size(), 0);
  bool permutation = restored.size() == params_.size();
  for (size_t i : restored) permutation = permutation && seen[i]++ == 0;
  if (!permutation || c.first_bytes <= 0 || c.bytes <= 0) {
    warn_once("bucketed_ddp.checkpoint_layout",
              "BucketedDDP::load_checkpoint: the checkpoint's bucket layout is not a layout of this model's "
              "parameters; the buckets are rebuilt from the first backward (the continuation may round "
              "differently from the saved run's)");
    return meta;
  }
  options_.caps = c;
  caps_set_ = meta.count(kCapsSetKey) > 0;
  restored_order_ = std::move(restored);
  rebuilt_ = true;
  rebuild_pending_ = true;
  return meta;
}

at::Tensor BucketedDDP::loss(const Batch& batch) {
  const bool aborted = readiness_->forget_pending_end();  // its end-of-backward callback never ran
  if (in_sync_ || aborted) {
    // The last backward was cut short (see in_sync_): wait for what it launched and start afresh, also when that
    // wait fails (a peer never came): the next backward must not inherit half a machine.
    in_sync_ = false;
    std::exception_ptr error;
    try {
      wait_launched();
    } catch (...) {
      error = std::current_exception();
    }
    reset_iteration();
    if (error) std::rethrow_exception(error);
  }
  // A forward without grad (evaluation, maybe on one rank only) must not run the rebuild's collective.
  const bool training = at::GradMode::is_enabled();
  if (rebuild_pending_ && training) rebuild_buckets();
  attach_grads();
  at::Tensor out = module_->loss(batch);
  if (options_.find_unused_parameters && training && out.requires_grad()) mark_unused_from_graph(out);
  return out;
}

void BucketedDDP::mark_unused_from_graph(const at::Tensor& loss) {
  // A parameter the loss does not depend on has no gradient accumulator in the loss's autograd graph: walk the
  // graph once now, and mark those parameters ready when backward reaches the loss (a hook on it), not here:
  // a collective launched in the forward could interleave differently with the user's own collectives on each
  // rank. Their slots are reduced as they are: zero, or what no_sync micro-batches accumulated.
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  if (loss.grad_fn()) stack.push_back(loss.grad_fn().get());
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  std::vector<size_t> unused;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!seen.count(readiness_->accumulator(i))) unused.push_back(i);
  if (unused.empty()) return;
  std::weak_ptr<int> alive = alive_;
  loss.register_hook([this, alive, unused](const at::Tensor&) {
    if (alive.expired() || !sync_enabled_) return;
    begin_backward();
    for (size_t i : unused) {
      // Normally none is ready yet (backward starts at the loss), but a backward of `loss + f(p)` may have
      // accumulated p's gradient already.
      if (ready_ns_[i] != 0) continue;
      ready_ns_[i] = now_ns();
      mark_ready(i);
    }
  });
}

void BucketedDDP::begin_backward() {
  if (readiness_->end_pending()) return;  // not the first gradient of this backward
  backward_order_.clear();
  ready_ns_.assign(params_.size(), 0);
  in_sync_ = true;
  readiness_->expect_end_of_backward();  // finish_sync() runs once, when this backward ends
}

void BucketedDDP::on_gradient_ready(size_t index) {
  if (!sync_enabled_) return;  // accumulating locally (no_sync): the last micro-batch synchronizes
  if (params_[index].grad().requires_grad())
    throw std::invalid_argument("BucketedDDP: parameter '" + names_[index] +
                                "' got a gradient that requires grad "
                                "(backward with create_graph = true); double backward is not supported");
  attach_grad(index);  // a backward that replaced .grad instead of adding into it: move it into its slot
  begin_backward();    // on the first gradient of a backward: queue finish_sync
  backward_order_.push_back(index);
  ready_ns_[index] = now_ns();
  mark_ready(index);
}

Handle BucketedDDP::reduce(const Bucket& bucket) {
  if (options_.reducer) return options_.reducer(comm_, bucket.flat);
  return comm_.all_reduce(bucket.flat, ReduceOp::kAvg);
}

void BucketedDDP::finish_sync() {
  compute_end_ns_ = now_ns();
  const int64_t wait_start = now_ns();
  // Complete: every parameter's gradient came, or find_unused_parameters makes the missing ones zero.
  const bool complete = options_.find_unused_parameters || backward_order_.size() == params_.size();
  std::vector<size_t> unused;
  {
    SettlingScope scope(complete);
    unused = finish_backward();
  }
  in_sync_ = false;
  comm_.recorder().record_wait("ddp sync", wait_start, now_ns());
  // Every bucket was reduced and waited for. The full order of this backward: hook order, then the parameters that
  // had no gradient. It is recorded, and the first rebuild made pending, before a missing gradient is reported:
  // that error may be this rank's alone (a layer skipped here only), and a rebuild pending on some ranks only
  // would pair one rank's broadcast with another's all-reduce at the next forward.
  std::vector<bool> listed(params_.size(), false);
  for (size_t i : backward_order_) listed[i] = true;
  for (size_t i = params_.size(); i-- > 0;)
    if (!listed[i]) backward_order_.push_back(i);
  ready_order_ = backward_order_;
  // Compute ended with the last gradient (the end-of-backward callback may start later on a busy machine); a
  // parameter found unused only at the end was ready then.
  last_end_ns_ = *std::max_element(ready_ns_.begin(), ready_ns_.end());
  if (last_end_ns_ == 0) last_end_ns_ = compute_end_ns_;
  last_ready_ns_ = ready_ns_;
  for (auto& t : last_ready_ns_)
    if (t == 0) t = last_end_ns_;
  if (options_.rebuild_buckets && !rebuilt_) rebuild_pending_ = true;
  // A parameter without gradient is an error only now: finish_backward reduced its slot as it was, because another
  // rank may have had every gradient and be waiting for that bucket.
  if (!unused.empty() && !options_.find_unused_parameters) {
    std::string list;
    for (size_t i : unused) list += (list.empty() ? "'" : ", '") + names_[i] + "'";
    throw std::runtime_error(
        "BucketedDDP: trainable parameter(s) " + list + " received no gradient in this backward pass, so " +
        "their buckets can never be reduced (PyTorch DDP: \"Expected to have finished reduction in the prior " +
        "iteration\"). Make the loss depend on them, freeze them (requires_grad false), or set " +
        "Options::find_unused_parameters = true to reduce them as zero gradients.");
  }
}

BackwardProfile BucketedDDP::last_backward_profile() const {
  if (ready_order_.empty()) return {};
  return {params_, last_ready_ns_, ready_order_, last_end_ns_};
}

void BucketedDDP::set_caps(BucketCaps caps) {
  check_caps("BucketedDDP::set_caps", caps);
  if (ready_order_.empty())
    throw std::logic_error(
        "BucketedDDP::set_caps: expected a completed synchronized backward (its ready order lays "
        "the buckets out); got none yet");
  options_.caps = caps;
  caps_set_ = true;
  rebuild_pending_ = true;
}

void BucketedDDP::rebuild_buckets() {
  rebuild_pending_ = false;
  rebuilt_ = true;
  // Ranks may have seen their gradients in different orders: all adopt rank 0's (task 2). A loaded checkpoint's
  // layout comes first (Note [The bucket layout in a checkpoint]).
  const std::vector<size_t> order = restored_order_.empty() ? ready_order_ : std::move(restored_order_);
  restored_order_.clear();
  lay_out(agree_on_order(comm_, order, params_.front().device()));
}

// ---- Task 4: the ready -> launch -> finish machine (contracts and invariants in bucketed_ddp.h).

void BucketedDDP::reset_iteration() {
  // BEGIN SOLUTION(02, keep): a fresh backward over buckets_: nothing ready, nothing launched
  handles_.clear();
  missing_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) missing_[b] = buckets_[b].params.size();
  ready_.assign(params_.size(), false);
  next_bucket_ = 0;
  // END SOLUTION
}

void BucketedDDP::mark_ready(size_t index) {
  // BEGIN SOLUTION(02): the parameter is ready: buckets go out strictly in bucket order, and none is waited for
  if (ready_[index])
    throw std::logic_error("BucketedDDP: parameter '" + names_[index] +
                           "' became ready twice in one synchronized backward; call loss() before each backward "
                           "and run extra backward passes inside no_sync()");
  ready_[index] = true;
  if (--missing_[bucket_of_[index]] > 0) return;
  // A later bucket may complete first (a tied weight, a layer used early): it waits for the ones before it, so
  // every rank launches the same sequence whatever order its gradients arrive in.
  while (next_bucket_ < buckets_.size() && missing_[next_bucket_] == 0)
    handles_.push_back(reduce(buckets_[next_bucket_++]));
  // END SOLUTION
}

std::vector<size_t> BucketedDDP::finish_backward() {
  std::vector<size_t> unused;
  // BEGIN SOLUTION(02): every bucket reduced, missing parameters too; nothing in flight; ready for the next backward
  for (size_t i = 0; i < params_.size(); ++i)
    if (!ready_[i]) unused.push_back(i);
  for (size_t i : unused) mark_ready(i);
  std::vector<Handle> handles = std::move(handles_);
  reset_iteration();
  if (std::exception_ptr error = wait_all(handles)) std::rethrow_exception(error);
  // END SOLUTION
  return unused;
}

void BucketedDDP::wait_launched() {
  // BEGIN SOLUTION(02): wait for the buckets launched so far
  std::vector<Handle> handles = std::move(handles_);
  handles_.clear();
  if (std::exception_ptr error = wait_all(handles)) std::rethrow_exception(error);
  // END SOLUTION
}

}  // namespace shardlab::bucketed_ddp
