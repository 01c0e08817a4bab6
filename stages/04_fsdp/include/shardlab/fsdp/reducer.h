#pragma once
/// @file reducer.h
/// Stage 04's extension point for the gradient reduction: the object that turns one unit's rank-major gradients
/// into this rank's row of their average. Stage 03's reduce-scatter-form hooks are reducers (hook_reducers); stage 06
/// plugs in HSDP's, which reduce-scatters within the shard group and all-reduces across the replicas.
///
/// Vocabulary (S = ranks of the unit's shard group):
///  - *input*: S rows of one unit's padded gradients, rank-major (row r = rank r's padded chunk of every trainable
///    parameter), flat, in the reduce dtype. See FsdpUnit's file comment.
///  - *output*: one row, the reduce dtype: after the reduction, this rank's row of the average over *every rank that
///    trains the model* (the shard group in stage 04; replicas × shard group under HSDP).

#include "shardlab/comm_hooks/comm_hook.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/fsdp/mesh_info.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace shardlab::fsdp {

/// Reduces one unit's gradients: what FullyShardedModel asks for per unit (Options::reducer).
///
/// Contract: every rank of the unit's groups calls it for the same units in the same order (its collectives match
/// across ranks); it never blocks the caller (it runs on the backward thread, like stage 03's hooks).
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  /// Starts the reduction of `input` (S rows of `output.numel()` elements, flat) into `output`. When the returned
  /// Handle's `wait()` returns, `output` holds this rank's row of the average; `input` is scratch from the call on.
  /// The caller drops its own reference to `input` at once: the reducer keeps it alive for as long as its
  /// collectives read it, and no longer (a two-phase reducer frees it when its first phase has landed, not at the
  /// end of backward, or every unit's S rows would pile up).
  /// @throws std::invalid_argument naming what was expected and what came, for mismatched sizes or dtypes.
  virtual Handle operator()(const at::Tensor& input, const at::Tensor& output) = 0;
  /// Bytes the reducer (and the Communicators under it) holds privately, beyond `input` and `output`, while a call
  /// on `input_numel` elements of `dtype` on `device` is in flight: what memory meters add to a reduction.
  virtual int64_t scratch_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const = 0;
  /// Of a call on `input_numel` elements of `dtype`: the bytes still held once the returned handle has been
  /// advanced (Handle::advance: a two-phase reducer's first phase landed, its second in flight) until it is waited
  /// for, `output` included; memory meters release the rest of the call's bytes at the advance. The default, a
  /// one-phase reducer (its advance is its wait, which frees everything): 0.
  virtual int64_t second_phase_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const {
    (void)dtype, (void)input_numel, (void)device;
    return 0;
  }
  /// Bytes it holds between calls now (HSDP's partial while its all-reduce is deferred), which memory meters count
  /// with the gradients. The default keeps nothing: 0.
  virtual int64_t held_bytes() const { return 0; }
  /// Bytes it holds between calls while gradients accumulate over micro-batches that all call it (HSDP's deferred
  /// all-reduce: one partial row of `output_numel` elements of `dtype`): what a memory theory of such an
  /// accumulation counts. The default keeps nothing: 0.
  virtual int64_t deferred_bytes(c10::ScalarType dtype, int64_t output_numel) const {
    (void)dtype, (void)output_numel;
    return 0;
  }
  /// True while the reducer has deferred the second phase of what it reduced (HSDP's all-reduce across replicas,
  /// put off for gradient accumulation): the sharded gradients then hold this replica's part only, so nothing may
  /// read them as the mean yet (clip_grad_norm refuses). The default never defers: false.
  virtual bool deferred() const { return false; }
  /// A short name for reports and errors ("reduce_scatter", "fp16", "hsdp").
  virtual std::string name() const = 0;
  /// Drops whatever the reducer keeps between calls, and makes the calls still in flight keep nothing: called after a
  /// backward that threw (when the unit drops its unsharded gradients), so that nothing of it reaches a later step.
  /// Not a collective. The default keeps nothing.
  virtual void discard() {}
};

/// What FullyShardedModel tells a ReducerFactory about the unit it wants a reducer for. The groups come from one
/// place, the wrapper's mesh: the unit is sharded over `mesh.shard`; a second phase runs on `mesh.replicate` (HSDP).
struct ReducerRequest {
  std::string unit;  ///< the unit's name ("block0", "root")
  size_t index = 0;  ///< its index in FullyShardedModel::units()
  MeshInfo mesh;     ///< the wrapper's mesh (checked: its shard group is set; the groups outlive the reducer)
};

/// Makes the reducer of one unit. Called once per unit at construction, on every rank alike.
using ReducerFactory = std::function<std::shared_ptr<GradientReducer>(const ReducerRequest&)>;

/// Stage 03's hook `hook` (reduce-scatter form) as a reducer: `hook(input, output)`, with
/// comm_hooks::reduce_scatter_scratch_bytes as its scratch. Computes exactly what the hook computes.
/// @throws std::invalid_argument for a hook without state or function.
std::shared_ptr<GradientReducer> hook_reducer(comm_hooks::CommHook hook);

/// A factory that gives every unit stage 03's hook `name` on the unit's shard group: "reduce_scatter" (the average
/// in the reduce dtype; FSDP's default), "fp16" or "bf16" (compressed on the wire).
/// @throws std::invalid_argument naming the accepted names, for a name that cannot reduce-scatter ("allreduce");
///         and (from a request) for a mesh of more than one replica, which needs a second phase across them.
ReducerFactory hook_reducers(const std::string& name);

}  // namespace shardlab::fsdp
