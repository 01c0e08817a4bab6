#pragma once
/// @file communicator.h
/// The one small collective API every stage uses, on top of a real c10d process group.
///
/// Vocabulary: a *Communicator* is one rank's handle on one process group. Every call is asynchronous and returns
/// a Handle; nothing is complete until `Handle::wait()` returns. Arguments are validated on the calling thread
/// before anything is submitted, so a mistake one rank can see is a C++ exception at the call. One rank alone cannot
/// see that another rank issued a different size: Gloo fails such a pair on its own transport thread, which ends
/// the process (PyTorch's own Gloo groups do the same). The wrappers size every collective from the model and their
/// options, and compare the ranks' models before their first one (check_same_model, model_check.h; the options are
/// the caller's to keep alike); a direct caller must issue the same collectives, of the same sizes, in the same
/// order on every rank. To find where one does not, turn on set_check_collectives (or SHARDLAB_CHECK_COLLECTIVES=1
/// for the groups make_communicator makes): every collective is then compared across the ranks first, and a
/// difference is an exception on every rank's own thread, as PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL does (Note
/// [Checked collectives] in collective_checks.cpp).
///
/// Where the backend lacks an operation or dtype (Gloo 1.13: no AVG, no bf16, no flat all-gather, no
/// reduce-scatter; Gloo 2.6: no AVG, and a reduce-scatter that is an all-reduce inside) the Communicator falls back to
/// what it has, correctly, and the CommRecorder says what was really sent. See Note [Fallbacks] in collectives.cpp.
/// Gloo's missing reduce-scatter is built from c10d's point-to-point ops as a ring (Note [Ring reduce-scatter]).

#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/compat.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

/// Reduction applied by all_reduce and reduce_scatter. kMax (the elementwise maximum: a global gradient norm for
/// p = infinity) is for all_reduce only.
enum class ReduceOp { kSum, kAvg, kMax };

class Handle;

/// Waits for every handle, also after one of them failed (a collective still in flight writes into its tensors),
/// and returns the first failure (null when all succeeded). Every handle is advanced (Handle::advance) in order
/// before any is waited for. For end-of-backward waits and destructors.
std::exception_ptr wait_all(std::vector<Handle>& handles);

/// Which c10d backend a Communicator runs on.
enum class BackendKind { kGloo, kNccl };

/// How reduce_scatter runs where the backend has no reduce-scatter of its own (Gloo, CPU tensors).
enum class ReduceScatterAlgorithm {
  kAuto,       ///< the ring where it was measured faster (ring_reduce_scatter_pays), else the all-reduce
  kRing,       ///< N-1 steps of send/recv around a ring: each rank sends (N-1)/N of the input (the lower bound)
  kAllReduce,  ///< one all-reduce of the whole input, this rank's chunk kept: the input's size on the wire
};

/// kAuto's rule: the ring at 2 and 3 ranks (half the bytes; faster, or tied, at every size measured, 16 KiB-4 MiB), and
/// from 1 MiB of input at more ranks (below that its N-1 sequential steps cost as much as Gloo's all-reduce or more).
/// Measured as processes on 2 cores (`shardlab bench --section reduce_scatter`); see Note [Ring reduce-scatter] in
/// ring_collectives.cpp.
bool ring_reduce_scatter_pays(int world_size, int64_t input_bytes);

/// How all_gather runs on Gloo with CPU tensors. See Note [Ring all-gather] in ring_collectives.cpp.
enum class AllGatherAlgorithm {
  kAuto,     ///< the ring (Gloo's own all-gather, flat or list, fills a flat output of its own first)
  kRing,     ///< N-1 steps of send/recv around a ring, each received straight into the output: no copy beside it
  kBackend,  ///< the backend's own: its flat all-gather where it has one (Gloo from libtorch 2.x: the list one
             ///< inside), else its list all-gather; Gloo gathers into a flat output of its own and copies it out,
             ///< one more output's bytes while in flight
};

/// The point-to-point tags of the Communicator's ring collectives: ring all-gathers (Note [Ring all-gather]) use
/// tags from this value up, ring reduce-scatters (Note [Ring reduce-scatter]) tags below it. A backend wrapper
/// (GroupOptions::wrap_backend: delay or fault injection, tracing) tells the two apart by it.
inline constexpr int kRingAllGatherTagBase = 1 << 30;

namespace detail {
class SerialWorker;
}  // namespace detail

/// An asynchronous collective in flight. Move-only; waiting twice is a no-op.
class Handle {
 public:
  /// An already-complete handle (for world size 1 or empty tensors).
  Handle() = default;
  /// Wraps c10d work plus a `finish` step (divide, copy back, cast) run by `wait()` on the waiting thread.
  /// A null `work` means nothing is in flight: `wait()` only runs `finish`.
  Handle(c10::intrusive_ptr<compat::Work> work, std::function<void()> finish, std::string what,
         std::chrono::milliseconds timeout);
  /// Moves the pending collective; the source becomes a completed handle.
  Handle(Handle&& other) noexcept
      : work_(std::move(other.work_)),
        finish_(std::move(other.finish_)),
        what_(std::move(other.what_)),
        timeout_(other.timeout_),
        error_(std::move(other.error_)),
        advance_(std::move(other.advance_)),
        done_(std::exchange(other.done_, true)) {}
  /// Moves the pending collective; the source becomes a completed handle. The handle overwritten must be done
  /// (waited for, moved from, or default-constructed): see Note [Overwriting a pending Handle] in handle.cpp.
  /// @throws std::logic_error naming the pending op when this handle is still pending; both handles are then left
  ///         as they were.
  Handle& operator=(Handle&& other);  // NOLINT(performance-noexcept-move-constructor): it refuses by throwing
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  /// Does not wait: a pending handle's finish step goes with it (owners wait first, e.g. with wait_all).
  ~Handle() = default;

  /// Blocks until the collective is complete and its result is in the caller's output tensor. The finish steps
  /// run exactly once. After a failure every later `wait()` rethrows the same error (a failed collective never
  /// looks complete).
  /// @throws std::runtime_error naming the rank, group and op if the backend failed or timed out.
  void wait();
  /// True once `wait()` has returned (or for a default-constructed handle).
  bool done() const { return done_; }
  /// Chains a step after this collective: the returned handle's `wait()` waits for this one, runs its own finish
  /// step, then runs `next` on the waiting thread (e.g. a communication hook's post-divide or cast back).
  /// Consumes this handle. On an already-complete handle, `next` runs at the returned handle's `wait()`.
  Handle then(std::function<void()> next) &&;
  /// Chains a second collective after this one (a two-phase reduction, such as HSDP's reduce-scatter in the shard
  /// group and then all-reduce across the replicas): the returned handle's `advance()` waits for this collective
  /// (its finish steps run) and then calls `issue` once, which starts the second and returns its handle; its `wait()`
  /// advances, then waits for the second. Every rank that advances its handles in the same order issues the second
  /// collectives in that order. Consumes this handle. A failure of either collective, or of `issue`, sticks.
  Handle then_issue(std::function<Handle()> issue) &&;
  /// Brings the collective to where its owner may issue its own next collective without waiting for the rest: for a
  /// handle made by then_issue (and then() of one), it waits for the first collective and issues the second, once;
  /// for any other handle it is wait(). The rest is waited for by wait(). See Note [Advancing a chained reduction].
  /// @throws std::runtime_error as wait() does, and whatever `issue` threw; a failure sticks.
  void advance();
  /// Runs `step` once, on the thread that brings this handle there: at advance() once it has returned (for a
  /// handle made by then_issue: its first collective landed and the second issued), else at wait(), after this
  /// handle's own finish steps. For a plain handle that is then(step). Consumes this handle. Memory meters release
  /// a two-phase reduction's first-phase buffers with it.
  Handle on_advance(std::function<void()> step) &&;

 private:
  c10::intrusive_ptr<compat::Work> work_;
  std::function<void()> finish_;
  std::string what_;
  std::chrono::milliseconds timeout_{0};
  std::exception_ptr error_;
  std::function<void()> advance_;  // then_issue: wait for the first collective, issue the second (idempotent)
  bool done_ = true;
};

/// One rank's view of one process group.
class Communicator {
 public:
  /// Wraps an existing c10d backend.
  /// @param backend the c10d backend (from make_communicator or compat::make_gloo / make_nccl).
  /// @param kind which backend it is (decides fallbacks and device checks).
  /// @param name  label written into every CollectiveRecord (e.g. "world", "shard0").
  /// @param timeout applied to every wait().
  /// @param recorder shared log; a new one is made when null.
  Communicator(c10::intrusive_ptr<compat::Backend> backend, BackendKind kind, std::string name,
               std::chrono::milliseconds timeout, std::shared_ptr<CommRecorder> recorder = nullptr);
  /// Finishes what the ring worker has queued (each step bounded by the timeout), then stops it.
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This rank's index in the group, in [0, size()).
  int rank() const { return rank_; }
  /// Number of ranks in the group.
  int size() const { return size_; }
  /// The group's label.
  const std::string& name() const { return name_; }
  /// The backend this group runs on.
  BackendKind kind() const { return kind_; }
  /// Timeout applied to every collective of this group.
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// The log every collective of this rank is written to.
  CommRecorder& recorder() { return *recorder_; }

  /// True when this group's backend reduces `dtype` itself; false when the Communicator falls back to another
  /// wire dtype (Gloo 1.13: bfloat16 goes as float32, see Note [Fallbacks]). Tests and reports use it to know
  /// whether a low-precision all-reduce really halves the bytes.
  bool reduces_natively(c10::ScalarType dtype) const;
  /// True when the backend has a flat all-gather for tensors like `t` (NCCL; Gloo from libtorch 2.x, CPU tensors).
  /// all_gather uses it unless all_gather_uses_ring(t); else Gloo's list all-gather. Either way the result is the
  /// same.
  bool has_flat_all_gather(const at::Tensor& t) const;
  /// True when all_gather of tensors like `t` runs as the ring of send/recv (wire_op "all_gather(ring)"): Gloo, CPU
  /// tensors, and all_gather_algorithm() other than kBackend.
  bool all_gather_uses_ring(const at::Tensor& t) const;
  /// True when reduce_scatter is the backend's own (NCCL); false when the Communicator builds it (Gloo): as a ring
  /// of send/recv for CPU tensors (wire_op "reduce_scatter(ring)", (N-1)/N of the input sent), or as an all-reduce
  /// of the whole input (wire_op "all_reduce"; CUDA tensors, or when reduce_scatter_algorithm() says so).
  bool has_reduce_scatter() const;
  /// Bytes all_gather holds privately, beyond the caller's tensors, while a gather of `input_numel` elements of
  /// `dtype` on `device` is in flight: the f32 copies of input and output where the backend cannot carry the dtype,
  /// and the flat output Gloo's own all-gather fills before copying it out (all_gather_algorithm() kBackend, or CUDA
  /// tensors on Gloo; the ring and NCCL write straight into the output).
  /// Memory meters add it (see Note [What the Communicator allocates]).
  int64_t all_gather_scratch_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const;
  /// Bytes all_reduce holds privately while one of `numel` elements of `dtype` is in flight: the f32 copy where the
  /// backend cannot carry the dtype (bf16 on Gloo 1.13); else 0. See Note [What the Communicator allocates].
  int64_t all_reduce_scratch_bytes(c10::ScalarType dtype, int64_t numel) const;
  /// Bytes reduce_scatter holds privately while one of `input_numel` elements of `dtype` on `device` is in flight:
  /// the copy of the whole input the ring or the all-reduce fallback works on (f32 where the backend cannot carry
  /// the dtype) and the ring's receive row; 0 on NCCL. See Note [What the Communicator allocates].
  int64_t reduce_scatter_scratch_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const;
  /// What a Gloo reduce_scatter of CPU tensors runs (kAuto by default; see Note [Ring reduce-scatter]).
  ReduceScatterAlgorithm reduce_scatter_algorithm() const { return rs_algorithm_; }
  /// Chooses it. Every rank of the group must choose the same, before the collectives it affects.
  void set_reduce_scatter_algorithm(ReduceScatterAlgorithm algorithm) { rs_algorithm_ = algorithm; }
  /// What a Gloo all_gather of CPU tensors runs (kAuto by default; see Note [Ring all-gather]).
  AllGatherAlgorithm all_gather_algorithm() const { return ag_algorithm_; }
  /// Chooses it. Every rank of the group must choose the same, before the collectives it affects.
  void set_all_gather_algorithm(AllGatherAlgorithm algorithm) { ag_algorithm_ = algorithm; }
  /// Whether every collective is first compared across the ranks (Note [Checked collectives]): off by default,
  /// since the comparison is itself a small collective that each call waits for.
  bool checks_collectives() const { return check_collectives_; }
  /// Turns the comparison on or off. Every rank of the group must choose the same, between collectives. When on, a
  /// call whose operation, dtypes, sizes, reduction, root, device types or path (ring or not) differ from another's
  /// throws std::invalid_argument on every rank, at the call, naming both calls, before anything of it is sent;
  /// the comparison's own collective failing (a rank that never comes) throws std::runtime_error at the call too.
  /// Every call is compared in the order each rank makes it, also ring all-gathers against ring reduce-scatters,
  /// which Gloo pairs apart: ranks that interleave those differently are reported.
  void set_check_collectives(bool on) { check_collectives_ = on; }

  /// In-place all-reduce of `t` over the group (kSum, kAvg, or kMax). @pre t is contiguous and on the group's
  /// device.
  Handle all_reduce(const at::Tensor& t, ReduceOp op = ReduceOp::kSum);
  /// In-place broadcast of `t` from rank `root`.
  Handle broadcast(const at::Tensor& t, int root = 0);
  /// Gathers every rank's `input` into `output`, rank r's at [r*n, (r+1)*n), n = input.numel().
  /// @pre output is contiguous, same dtype/device, and output.numel() == size() * input.numel().
  Handle all_gather(const at::Tensor& output, const at::Tensor& input);
  /// Reduces `input` over the group (kSum or kAvg) and leaves chunk `rank()` of the result in `output`.
  /// @pre input.numel() == size() * output.numel(); same dtype and device.
  Handle reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::kSum);
  /// Blocks until every rank of the group has called it (recorded as "barrier").
  void barrier();

 private:
  void check_tensor(const at::Tensor& t, const char* what, const char* op) const;
  void check_same_call(const char* op, const at::Tensor& t, const at::Tensor& output, int64_t detail);
  int reduce_scatter_path(const at::Tensor& input) const;  // 0 the backend's, 1 the ring, 2 an all-reduce
  size_t record(const char* op, const char* wire_op, const at::Tensor& t, const at::Tensor& wire, ReduceOp* red);
  Handle ring_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op);
  Handle ring_all_gather(const at::Tensor& output, const at::Tensor& wire_out, const at::Tensor& wire_in,
                         const at::Tensor& input);
  c10::intrusive_ptr<compat::Work> issue(const std::function<c10::intrusive_ptr<compat::Work>()>& call);
  Handle submit(c10::intrusive_ptr<compat::Work> work, size_t record_index, std::function<void()> finish,
                const char* op, bool on_cpu);

  c10::intrusive_ptr<compat::Backend> backend_;
  BackendKind kind_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<CommRecorder> recorder_;
  int rank_;
  int size_;
  ReduceScatterAlgorithm rs_algorithm_ = ReduceScatterAlgorithm::kAuto;
  AllGatherAlgorithm ag_algorithm_ = AllGatherAlgorithm::kAuto;
  bool check_collectives_ = false;
  uint64_t ring_sequence_ = 0;     // ring reduce-scatters so far: the tag of the next one
  uint64_t ag_ring_sequence_ = 0;  // ring all-gathers so far: the tag of the next one (another range of tags)
  // Issuing work on a c10d backend is not thread-safe (Gloo numbers its ops unguarded): the calling thread and the
  // ring's worker issue under this lock. Waiting happens outside it.
  std::shared_ptr<std::mutex> issuing_ = std::make_shared<std::mutex>();
  std::unique_ptr<detail::SerialWorker> ring_;  // runs the ring's steps off the calling thread; made on first use
  // The ring all-gathers' own worker: an all-gather prefetched during backward runs beside a reduce-scatter instead
  // of queueing behind it, as the backend's own collectives would.
  std::unique_ptr<detail::SerialWorker> ag_ring_;
};

}  // namespace shardlab
