#pragma once
/// @file fsdp.h
/// Stage 04 — fully sharded data parallelism (FSDP, ZeRO-3): every rank keeps only its shard of each parameter,
/// gathers a unit's parameters just before the unit runs and frees them right after, and reduce-scatters the
/// gradients so that each rank receives only the average of its own shard's gradients.
///
/// Vocabulary:
///  - *unit*: a sub-module the model registered with `Model::register_unit` (a transformer block, an MLP layer);
///    its parameters are gathered and reduced together. The parameters outside every unit form the *root* unit
///    (the tiny GPT's embeddings, final norm and tied output layer). See FsdpUnit for what one unit holds.
///  - *reshard after forward* (raf): free a unit's gathered parameters as soon as its forward returns and gather
///    them again before its backward (ZeRO-3: least memory, one more all-gather per unit), or keep them until the
///    unit's backward is done (ZeRO-2-like: no backward all-gather).
///
/// Life of one training step (B units, root, raf true for units and false for the root, FSDP2's defaults):
///  1. `loss()`: the root is gathered; the model calls each unit through its slot: gather, forward, free. The
///     loss and every unit's output get a backward hook.
///  2. backward: a unit's output hook gathers the unit again just before its backward; once every trainable
///     parameter of the unit has its gradient, the unit is freed and its gradients are reduce-scattered (one
///     collective per unit, launched in reverse forward order, so every rank issues them in the same order).
///  3. end of backward: units whose gradients never came are reduced with zeros (or reported), every
///     reduce-scatter is waited for, every unit is sharded, and each sharded parameter's `.grad()` holds its rows
///     of the average gradient. The optimizer then steps the sharded parameters (`parameters()`).
/// Per step: B+1 all-gathers in forward, B in backward, B+1 reduce-scatters, nothing else.
///
/// References: PyTorch FSDP2 (`fully_shard`, FSDPParamGroup, foreach_all_gather / foreach_reduce), the seed's
/// FSDP homework (unshard / wait_for_unshard / reshard, pre/post forward and backward hooks), ZeRO (Rajbhandari et
/// al., 2019), FSDP (Zhao et al., VLDB 2023).

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/model/grad_ready.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/model/no_sync.h"
#include "shardlab/core/parallel/parallel_model.h"
#include "shardlab/fsdp/fsdp_unit.h"
#include "shardlab/fsdp/memory.h"
#include "shardlab/fsdp/mesh_info.h"
#include "shardlab/fsdp/mixed_precision.h"
#include "shardlab/fsdp/reducer.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::fsdp {

class FullyShardedModel;

/// The points of a unit's step at which FullyShardedModel consults its UnshardSchedule.
enum class SchedulePoint {
  kPreForward,   ///< the unit is unsharded and its forward is about to compute
  kPostForward,  ///< the unit's forward returned (and the unit was resharded, when it reshards after forward)
  kPreBackward,  ///< the unit is unsharded and its backward is about to compute
};

/// "pre_forward", "post_forward", "pre_backward".
const char* to_string(SchedulePoint point);

/// Extension point: which units begin unsharding *before* their own use (stage 05's prefetch plugs in here). Without
/// one (stage 04), every unit is gathered by its own pre-forward and pre-backward, and nothing else is in flight.
///
/// Contract: called on the thread that runs the forward or the backward, the same way on every rank. What it
/// unshards are collectives, so it must decide from what every rank sees alike (the orders, the units' states, its
/// own settings), never from timing. It may only call FullyShardedModel::begin_unshard and
/// FullyShardedModel::cancel_unshard (and read the wrapper).
class UnshardSchedule {
 public:
  virtual ~UnshardSchedule() = default;
  /// A new forward begins (`loss()`), after any backward that ended early was settled.
  virtual void begin_iteration(FullyShardedModel& /*fsdp*/) {}
  /// Unit `u` (an index into FullyShardedModel::units()) is at `point`.
  virtual void at(SchedulePoint point, size_t u, FullyShardedModel& fsdp) = 0;
  /// The forward returned (after the root's post-forward): a unit it did not run will not run in this backward
  /// either (no pre-backward hook was registered for it).
  virtual void end_forward(FullyShardedModel& /*fsdp*/) {}
  /// The most units this schedule holds ahead of their use (all-gather issued, unit not yet used):
  /// FullyShardedModel::memory_theory counts an all-gather buffer for each.
  virtual int max_ahead() const { return 0; }
};

/// One event of a unit, as an observer sees it (FullyShardedModel::set_observer).
struct UnitEvent {
  UnitEventKind kind = UnitEventKind::kBeginUnshard;  ///< what happened
  size_t unit = 0;                                    ///< index into FullyShardedModel::units()
  uint64_t seq = 0;                                   ///< this rank's event count before it (0, 1, 2, ...)
};

/// Receives every UnitEvent, on the thread that caused it.
using UnitObserver = std::function<void(const UnitEvent&)>;

/// How FullyShardedModel shards, gathers and reduces.
struct Options {
  bool reshard_after_forward = true;         ///< units: free after forward, gather again in backward
  bool root_reshard_after_forward = false;   ///< the root: FSDP2 keeps it gathered until its backward
  MixedPrecision mixed_precision;            ///< param / reduce dtypes (default: none, all original)
  ReducerFactory reducer;                    ///< makes each unit's gradient reducer (empty: stage 03's
                                             ///< reduce_scatter hook, the average in the reduce dtype, on the
                                             ///< wrapper's group); hook_reducers("fp16") / ("bf16") compress
  bool allow_unused_parameters = false;      ///< false: a trainable parameter without gradient is an error
  bool pool_buffers = true;                  ///< CPU: take the units' buffers from a BufferPool and reuse them,
                                             ///< instead of malloc and free every step (Note [Why FSDP pools its
                                             ///< buffers] in common); false: the device's allocator
  std::shared_ptr<const GatherSeam> gather;  ///< how every unit's all-gather packs and unpacks its shards
                                             ///< (gather.h; null: cast_gather(), the shards in the param dtype)
};

/// How a step of several micro-batches accumulates its gradients (FullyShardedModel::memory_theory).
enum class Accumulation {
  kNoSync,  ///< every micro-batch but the last under no_sync: the unsharded gradients are kept until the last
  kReduce,  ///< every micro-batch reduces; a reducer may keep a partial between them (HSDP's deferred all-reduce)
};

/// The memory a step should need per rank, from the layout (what MemoryStats is compared with).
struct MemoryTheory {
  int64_t sharded_param_bytes = 0;       ///< Σψ/N: every unit's padded shards
  int64_t largest_unit_bytes = 0;        ///< the largest non-root unit gathered (param dtype)
  int64_t all_units_bytes = 0;           ///< every non-root unit gathered at once (raf false)
  int64_t root_bytes = 0;                ///< the root gathered
  int64_t sharded_grad_bytes = 0;        ///< the sharded gradients of the trainable parameters
  int64_t largest_unit_grad_bytes = 0;   ///< the largest unit's unsharded gradients (param dtype)
  int64_t peak_param_bytes = 0;          ///< the parameter peak of a step with the options and schedule used: Σψ/N
                                         ///< + what stays gathered (the root; every unit without raf) + the largest
                                         ///< moment of one unit: its gathered buffer beside its own all-gather buffer
                                         ///< at copy-out and those of the units `ahead` (walked in the expected
                                         ///< forward order, FullyShardedModel::expected_forward_order)
  int64_t peak_grad_bytes = 0;           ///< the gradient peak of a synchronized step, walked over the backward
                                         ///< (Note [The gradient peak, walked]): sharded grads + the root's
                                         ///< unsharded grads (counted from the start of backward, an upper bound)
                                         ///< + the largest moment of one unit: its unsharded grads beside its own
                                         ///< reduce-scatter buffers, or beside the previous unit's in flight
  int64_t largest_reduce_bytes = 0;      ///< the largest unit's reduce-scatter buffers (FsdpUnit::reduce_bytes)
  int64_t largest_all_gather_bytes = 0;  ///< the largest unit's all-gather buffers (FsdpUnit::all_gather_bytes)
  /// The Communicator's private copies of the largest unit's all-gather (FsdpUnit::all_gather_comm_bytes): held
  /// beside the peak while it is in flight, and not in it (the meter counts FSDP's own allocations).
  int64_t largest_all_gather_comm_bytes = 0;
  int64_t ahead = 0;  ///< units the schedule may hold ahead of their use (UnshardSchedule)
};

/// Wraps a Model so that N ranks train it sharded, exactly like one device on the union of their batches.
///
/// Contract:
///  - Construct on every rank with a model of the same structure. Construction broadcasts every parameter and
///    buffer from rank 0 of the mesh (MeshInfo::everyone(): the shard group, or under HSDP every replica too; a
///    collective, after every check), then keeps this rank's shard of each parameter. Or construct from a ModelBuilder
///    (sharded construction, for a model larger than one rank): each unit is sharded as the model registers it, and
///    nothing is broadcast. From then on the model's registered parameters are *gathered* tensors that hold values only
///    while their unit runs: the optimizer must be built on `parameters()` (the sharded ones), and the full values are
///    read with `full_parameters()`. Buffers are replicated, not sharded.
///  - Call `loss(batch)` for the forward, then `.backward()` on it (or on a tensor computed from it), on every
///    rank, the same way: every unit is a collective. Every rank must run the same units in the same order, and
///    leave the same trainable parameters without gradient (Note [A parameter unused on some ranks] in fsdp.cpp:
///    exact on Gloo with CPU tensors; on NCCL a rank that differs must fail, which allow_unused_parameters false
///    makes it do). Without allow_unused_parameters, a trainable parameter without gradient makes backward throw
///    std::runtime_error naming each, quoted ('sometimes'; several: ", "-joined), once every unit was
///    reduced (with zeros for it), so that no rank hangs.
///  - After a synchronized backward, each sharded parameter's `.grad()` holds its rows of the gradient of the
///    mean loss over all ranks' batches (accumulated into a gradient already there: zero it before each step).
///  - A forward under `NoGradGuard` (evaluation) gathers and frees like a training forward (collectives on every
///    rank) and leaves every unit sharded.
///  - A unit with a frozen parameter (requires_grad false) is gathered for its backward like any other, but freed
///    only at the end of backward: the frozen parameter's backward node may run after the unit's trainable
///    gradients are all in (frozen(x) + fc(x) does), and nothing tells when it has. memory_theory() counts it.
///  - Each unit may run once per forward; a parameter may belong to one unit only; double backward is not
///    supported.
///  - A collective that fails is an exception from the call that waits for it. After a unit's all-gather failed
///    (the unit is left half-way, without its parameters), the wrapper refuses every further loss, gather, clip and
///    checkpoint with std::logic_error naming the unit and the error, "refused, since the all-gather of unit
///    'block1' failed (...)", and saying to make a new group and wrapper (Note [A wrapper whose all-gather failed]):
///    make a new group and wrapper, and load the last checkpoint. After a reduce-scatter failed, backward throws
///    once every other one was waited for; nothing stays pending, and the wrapper is as it was.
///  - The model and the Communicator must outlive the wrapper. Not copyable or movable (hooks point to it). After
///    the wrapper is gone the model's registered parameters have no storage: read `full_parameters()` before.
///  - It offers two facets (parallel/facets.h) to a loop or a facade that holds any ParallelModel: MemoryFacet
///    (standard_facets.h: memory() beside memory_theory() below), and itself, FullyShardedModel, for what only it has
///    (its units, mesh, schedule and pool).
class FullyShardedModel : public ParallelModel {
 public:
  /// Broadcasts the model's state from rank 0 of the mesh, shards every unit and the root over `mesh.shard`, and
  /// puts itself into the units' slots.
  /// Every check comes first, the reducer factory's included (asked once per unit, in units() order): a
  /// constructor that throws has changed no rank's model.
  /// @throws std::invalid_argument for a null model, a malformed `mesh` (MeshInfo::check), a parameter FSDP
  ///         cannot shard (scalar, non-contiguous: named), a parameter shared by two units, a unit with mixed
  ///         dtypes, or a reducer factory that gives no reducer (naming the unit).
  FullyShardedModel(std::shared_ptr<Model> model, const MeshInfo& mesh, Options options = {});
  /// FSDP on one group: the constructor above with MeshInfo::fsdp(comm).
  FullyShardedModel(std::shared_ptr<Model> model, Communicator& comm, Options options = {});
  /// Sharded construction, for a model larger than one rank (Note [Building a model unit by unit] in common, Note
  /// [Sharded construction] in fsdp_build.cpp): calls `build` once inside a UnitBuildScope and shards each unit
  /// the moment the model registers it, so no rank ever holds more than its shards, about two units (the one being
  /// built, and its gathered buffer) and the root. Nothing
  /// is broadcast: every rank's builder must give the same values (the same seed), as the shipped models do at any
  /// world size; the structure check after the build catches ranks that disagree on the structure. The wrapper is
  /// then the one the other constructor makes from the same model.
  /// @param build makes the model on the CPU, initializing each unit before it registers it; it must build the
  ///        model inside the call (a model built before has no units registered in the scope: refused).
  /// @param mesh where the wrapper sits: sharded over `mesh.shard`; the build's outcome and the structure are
  ///        compared over every rank of the mesh, which all construct alike.
  /// @param options as the other constructor's.
  /// @param device where each unit moves before it is sharded, and the root after the build.
  /// @throws as the other constructor, and std::invalid_argument for an empty builder, a null model, units
  ///         registered outside the call ("the builder's model has 2 units, of which 0 were registered while it
  ///         ran") or a unit changed after it was registered ("unit 'block0' changed after it was registered": a
  ///         parameter added, replaced or frozen), on every rank alike: a rank whose build threw tells the others
  ///         (one all-gather of the errors), which throw std::runtime_error naming it.
  FullyShardedModel(const ModelBuilder& build, const MeshInfo& mesh, Options options = {},
                    const c10::Device& device = c10::Device(c10::kCPU));
  /// Sharded construction of FSDP on one group: the constructor above with MeshInfo::fsdp(comm).
  FullyShardedModel(const ModelBuilder& build, Communicator& comm, Options options = {},
                    const c10::Device& device = c10::Device(c10::kCPU));
  ~FullyShardedModel() override;
  FullyShardedModel(const FullyShardedModel&) = delete;
  FullyShardedModel& operator=(const FullyShardedModel&) = delete;

  /// The forward: this rank's mean loss on `batch`. Settles a backward that ended early first.
  at::Tensor loss(const Batch& batch) override;
  /// The wrapped model (its registered parameters are the gathered tensors; see the contract).
  Model& module() { return *model_; }

  /// The trainable sharded parameters (this rank's rows, original dtype), in the model's registration order:
  /// what the optimizer steps.
  std::vector<at::Tensor> parameters() const override;
  /// Every parameter's full values in the original dtype, in the model's registration order (fresh tensors).
  /// A collective: every rank must call it.
  std::vector<at::Tensor> full_parameters() override;
  /// full_parameters for a model larger than one rank: calls `visit(index, full)` for every parameter in
  /// registration order (`index` counts them from 0), gathering a unit's full values when its first parameter comes
  /// and dropping them when the order moves to another unit, so at most one unit's full values are held (a unit
  /// the order comes back to is gathered again). `full` is fresh, in the original dtype; `visit` may keep it. A
  /// collective: every rank must call it.
  void visit_full_parameters(const std::function<void(size_t index, const at::Tensor& full)>& visit) override;
  /// The model as one device holds it, named: (full name, fresh full tensor) for every parameter in registration
  /// order (a tied weight under each of its names), then every buffer: PyTorch's state_dict() of the unsharded
  /// model. A collective: every rank must call it.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override;

  /// Skips the reduce-scatters for backward passes run while the returned scope lives (gradient accumulation):
  /// unsharded gradients accumulate (in the reduce dtype) and the first backward after the scope reduces them.
  [[nodiscard]] NoSync no_sync() override { return NoSync(sync_enabled_); }
  /// True unless inside a `no_sync` scope.
  bool sync_enabled() const { return sync_enabled_; }
  /// Clips the sharded gradients by the global p-norm of the whole model's gradient, as PyTorch's clip_grad_norm_
  /// on an FSDP2 module: each rank sums |g|^p over its own rows (padding holds no gradient), one all-reduce (SUM;
  /// MAX for p = infinity) over the mesh's shard group joins them (the replicas hold the same rows: counted once),
  /// and every rank scales its rows alike. See Note [A norm over shards]. A collective:
  /// call it on every rank, between backward and the optimizer's step.
  /// @param max_norm the bound on the total norm (>= 0).
  /// @param p 2 by default; infinity (std::numeric_limits<double>::infinity()) for the largest |g|.
  /// @return the total norm before clipping, the same on every rank.
  /// @throws std::logic_error inside no_sync (the gradients are not reduced and sharded yet), or while a unit's
  ///         reducer has deferred its second phase (GradientReducer::deferred: HSDP's all-reduce);
  ///         std::invalid_argument for a negative max_norm or
  ///         a p that is not positive.
  double clip_grad_norm(double max_norm, double p = 2.0) override;

  /// This rank's part of the model's state, for a checkpoint (training_state.h): every parameter's real rows as
  /// its sharded parameter holds them (full name, full sizes, its torch.chunk rows: never the padding), in
  /// registration order, then the buffers (replicated: rank 0 of the mesh saves them). Only the first replica's
  /// ranks save their rows (MeshInfo::saves). Reshards every unit first: a load writes into the sharded
  /// parameters, and a unit left gathered would compute on the old values.
  ShardedState checkpoint_state();
  /// Saves the model's shards and `optimizer`'s state for them (laid out like them) as a sharded checkpoint in
  /// `dir`, each rank of the first replica writing its own rows (training_state.h, checkpoint.h). A collective
  /// over every rank of the mesh, between steps.
  /// @param dir the checkpoint's directory (on a filesystem every rank sees).
  /// @param optimizer built over parameters(); null to save the model only.
  /// @param metadata strings to keep with the checkpoint (rank 0's).
  /// @throws as save_training_checkpoint, on every rank alike.
  void save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                       const std::map<std::string, std::string>& metadata = {}) override;
  /// Loads a checkpoint saved by any wrapper at any world size (or a full safetensors file): each rank reads the
  /// saved rows that overlap its own; all or nothing. A collective over every rank of the mesh, between steps.
  /// @param path the checkpoint's directory, or a safetensors file.
  /// @param optimizer built over parameters(); null to load the model only.
  /// @param optimizer_if_saved true: a checkpoint of weights only (exported, or from PyTorch) loads the model and
  ///        leaves `optimizer` as it is (load_training_checkpoint).
  /// @param names the model's name of each saved tensor, for a file named otherwise (a Hugging Face file's dotted
  ///        names; checkpoint.h's SavedNames); empty: the saved names. A tied weight loads under any of its names.
  /// @return the saved metadata.
  /// @throws as load_training_checkpoint, on every rank alike, before anything changes.
  std::map<std::string, std::string> load_checkpoint(const std::string& path, torch::optim::Optimizer* optimizer,
                                                     bool optimizer_if_saved = false,
                                                     const SavedNames& names = {}) override;

  /// Where the wrapper sits: its shard group, and under HSDP its replicate group and replica.
  const MeshInfo& mesh_info() const { return mesh_; }
  /// The units: the model's units in registration order, then the root (when it has parameters).
  const std::vector<std::unique_ptr<FsdpUnit>>& units() const { return units_; }
  /// The root unit, or null when every parameter belongs to a unit.
  const FsdpUnit* root() const { return has_root_ ? units_.back().get() : nullptr; }

  /// Bytes held now and peaks since reset_memory_peaks() (see MemoryMeter).
  MemoryStats memory() const { return meter_.stats(); }
  /// Starts a new peak window (e.g. at the start of each step).
  void reset_memory_peaks() { meter_.reset_peaks(); }
  /// What the peaks of a step should be for this layout and these options, the step made of `micro_batches`
  /// micro-batches accumulated as `accumulation` says. @throws std::invalid_argument for micro_batches < 1.
  MemoryTheory memory_theory(int micro_batches = 1, Accumulation accumulation = Accumulation::kNoSync) const;
  /// Issues unit `u`'s all-gather now when the unit is sharded (no-op otherwise): its own pre-forward or
  /// pre-backward then only waits for it. For an UnshardSchedule. A collective: every rank issues the same.
  void begin_unshard(size_t u);
  /// Gives up an unshard begun ahead of a use that did not come (a schedule's prediction was wrong): waits for unit
  /// `u`'s all-gather and shards the unit again, so that its buffers are freed. No-op for a sharded unit. For an
  /// UnshardSchedule, on every rank alike. @throws std::logic_error when `u` ran its forward in this iteration (its
  /// parameters may be in use).
  void cancel_unshard(size_t u);
  /// Plugs in a schedule (null: none, stage 04's behaviour). Set it on every rank alike, between steps.
  void set_schedule(std::shared_ptr<UnshardSchedule> schedule) { schedule_ = std::move(schedule); }
  /// The schedule in use, or null.
  UnshardSchedule* schedule() const { return schedule_.get(); }
  /// Calls `observer` with every unit event from now on (an empty function: none).
  void set_observer(UnitObserver observer) { observer_ = std::move(observer); }
  /// The units (indices into units()) in the order their forward began in this forward so far; the root, whose
  /// forward is the whole `loss()`, comes first.
  const std::vector<size_t>& forward_order() const { return forward_order_; }
  /// The units in the order their forward returned in this forward so far (the root last): the order their outputs,
  /// on which post_forward registers each unit's pre-backward hook, were made.
  const std::vector<size_t>& post_forward_order() const { return post_forward_order_; }
  /// True when unit `u`'s forward in this iteration registered its pre-backward hook (training, and its output
  /// requires grad), so that backward may meet it; false for a unit that did not run or whose output needs no
  /// gradient (a frozen unit on inputs that need none): backward never gathers such a unit.
  bool awaits_backward(size_t u) const { return u < awaits_backward_.size() && awaits_backward_[u]; }
  /// forward_order() of the last complete forward (empty before the first one returned).
  const std::vector<size_t>& last_forward_order() const { return last_forward_order_; }
  /// The order the next forward is expected to begin the units in (indices into units()): last_forward_order()
  /// once a forward has completed; before that, registration order with the root first (its forward is the whole
  /// `loss()`). The one rule for predicting a forward: memory_theory() walks this order, and a schedule that
  /// prefetches along it (stage 05) holds ahead what the theory counts. A fresh vector; the same on every rank.
  std::vector<size_t> expected_forward_order() const;
  /// The index of the root in units(), or units().size() when there is no root.
  size_t root_index() const { return has_root_ ? units_.size() - 1 : units_.size(); }

  /// What the buffer pool holds and has held (all zero without one: Options::pool_buffers false, or CUDA).
  PoolStats pool_stats() const { return pool_ ? pool_->stats() : PoolStats{}; }

  /// Keeps a sample of the bytes held at every allocation and free from now on (for timelines; off by default).
  void record_memory_samples(bool on) { meter_.record_samples(on); }
  /// The samples kept so far.
  std::vector<MemorySample> memory_samples() const { return meter_.samples(); }

 private:
  // Construction (fsdp_build.cpp).
  void prepare_options();
  std::shared_ptr<GradientReducer> make_reducer(const std::string& unit, size_t index);
  std::unique_ptr<FsdpUnit> make_unit(const std::string& name,
                                      const std::vector<std::pair<std::string, at::Tensor>>& params,
                                      std::shared_ptr<GradientReducer> reducer);
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> assign_parameters();  // per unit, the root last
  void finish_construction();
  void offer_facets();  // fsdp_memory.cpp

  // The step (fsdp.cpp).
  bool raf(size_t u) const;
  void pre_forward(size_t u);
  void post_forward(size_t u, const at::Tensor& output);
  void pre_backward(size_t u);
  void consult_schedule(SchedulePoint point, size_t u);
  void wait_for_reduce(Handle& reduce);
  void on_gradient_ready(size_t g);
  void on_unit_ready(size_t u);
  void launch_ready_reductions();
  void end_of_backward();
  void settle_aborted_backward();
  void reshard_all();
  void check_usable(const char* call) const;  // Note [A wrapper whose all-gather failed]
  void reset_iteration();

  // The memory theory (fsdp_memory.cpp): the peaks walked over expected_forward_order() and its backward.
  int64_t parameter_peak(int64_t ahead) const;
  int64_t gradient_peak(int micro_batches, Accumulation accumulation) const;

  std::shared_ptr<Model> model_;
  MeshInfo mesh_;
  Communicator& comm_;  // *mesh_.shard
  Options options_;
  MemoryMeter meter_;
  std::unique_ptr<BufferPool> pool_;              // Options::pool_buffers; before the units, which draw from it
  std::vector<std::unique_ptr<FsdpUnit>> units_;  // model units in order, then the root
  bool has_root_ = false;
  std::vector<UnitForward> inner_forward_;        // each model unit's slot before we took it
  std::vector<at::Tensor> watched_;               // every trainable gathered parameter (GradientReadiness indices)
  std::vector<std::pair<size_t, size_t>> owner_;  // watched index -> (unit, index in the unit's params())
  std::vector<std::pair<size_t, size_t>> order_;  // registration order -> (unit, index in the unit)

  std::shared_ptr<UnshardSchedule> schedule_;  // set_schedule; null: none
  UnitObserver observer_;                      // set_observer
  uint64_t events_ = 0;                        // unit events so far (UnitEvent::seq)
  std::vector<size_t> last_forward_order_;     // forward_order_ of the last complete forward

  // One iteration (forward + backward); reset by reset_iteration().
  std::vector<size_t> forward_order_;       // units in the order their forward began
  std::vector<size_t> post_forward_order_;  // units in the order their forward returned
  std::vector<bool> awaits_backward_;       // per unit: its forward registered a pre-backward hook
  std::vector<size_t> reduce_order_;  // the order reduce-scatters are launched in (reverse forward, then the rest)
  size_t next_reduce_ = 0;            // next position of reduce_order_ to launch
  std::vector<size_t> missing_;       // per unit: trainable parameters whose gradient has not come
  std::vector<bool> ready_;           // per watched parameter
  std::vector<Handle> pending_;       // reduce-scatters in flight
  std::vector<std::string> unused_;   // trainable parameters that got no gradient in this backward
  bool sync_enabled_ = true;

  std::unique_ptr<GradientReadiness> readiness_;           // the hooks; declared last, so they go first
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // output hooks do nothing once this is gone
};

}  // namespace shardlab::fsdp
