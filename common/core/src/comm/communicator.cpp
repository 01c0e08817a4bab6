#include "shardlab/core/comm/communicator.h"

#include "detail/serial_worker.h"
#include "shardlab/core/comm/progress.h"
#include "shardlab/core/errors.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Note [Fallbacks]
// Gloo 1.13 has no ReduceOp::AVG, no bfloat16, no flat (tensor-in, tensor-out) all-gather and no reduce-scatter.
// Gloo 2.6 has bfloat16 and the flat all-gather (compat::gloo_features() says which, for this build); its
// `_reduce_scatter_base` is an all-reduce of the whole input inside, and checks shapes with an abort, so the
// fallback below is used instead, and says honestly what went on the wire. Where the backend lacks something,
// the Communicator keeps one API over every backend and falls back like this:
//  - AVG           → SUM on the wire, then the waiting thread divides by size() (floating dtypes only).
//  - bfloat16      → the tensor is cast to float32 (exact), communicated, and cast back on wait(); the record shows
//                    wire_dtype float32 and twice the bytes.
//  - all_gather    → the ring of send/recv (CPU tensors, Note [Ring all-gather]), or Gloo's own all-gather into
//                    views of the flat output (CUDA tensors, AllGatherAlgorithm::kBackend).
//  - reduce_scatter→ all-reduce of a copy of the whole input, then the waiting thread copies this rank's chunk out;
//                    the record shows wire_op all_reduce and the bytes of the whole input.
// Everything is validated on the calling thread first: an error raised on Gloo's worker thread can terminate the
// process instead of reaching wait().
//
// Note [Ring reduce-scatter]
// Gloo has no reduce-scatter, and the all-reduce fallback hands the backend the whole input: for FSDP, whose
// backward is one reduce-scatter per unit, that is the input's size per rank where (N-1)/N of it is the lower bound
// (PyTorch's own FSDP on Gloo pays the same, PyTorch PR #118911). The ring: split the input into N chunks; in step
// s = 0 .. N-2, rank r sends its partial sum of chunk (r - s - 1) mod N to rank r+1 and receives rank r-1's partial
// sum of chunk (r - s - 2) mod N, adding it to its own. After N-1 steps rank r holds chunk r summed over every rank,
// having sent N-1 chunks: (N-1)/N of the input. The steps are c10d send/recv (Gloo's point-to-point, which matches
// messages by tag, not by order, so they may run beside the group's collectives); a SerialWorker runs them off the
// calling thread, one ring at a time in submission order, so reduce_scatter returns at once like any collective
// and the caller's backward goes on. Every rank numbers its ring collectives in call order, and the tag of a step
// is (that number, step): the same on every rank. The sum of chunk r is accumulated in ring order (r+1, r+2, ...,
// r), another order than Gloo's all-reduce: results agree exactly when the sums are exact, and to rounding
// otherwise. CUDA tensors (Gloo's send/recv take host memory) keep the all-reduce fallback.
// Measured as processes with `shardlab bench --section reduce_scatter` (2 cores, ring / all-reduce time, 16 KiB to
// 4 MiB, three runs; docs/benchmark.md has the last): 2 ranks 0.13-0.95; 3 ranks 0.24-0.82, once a tie (1.00) at
// 16 KiB; 4 ranks 0.8-1.4 at 16-64 KiB (three sequential steps on oversubscribed cores), 0.5-1.6 at 256 KiB-1 MiB
// (noise larger than the difference), 0.67-0.76 at 4 MiB. Hence kAuto: ring_reduce_scatter_pays().

// Note [Ring all-gather]
// Gloo's all-gather gathers into a flat tensor of its own, then copies that into the outputs: while it is in flight
// the rank holds the output twice. Its flat all-gather (`_allgather_base`, libtorch 2.x) is no better: it chunks the
// output and runs the list all-gather. For FSDP that is one more unit's parameters at every all-gather, more than
// the prefetch of a unit costs. The ring writes straight into the output: rank r first copies its input into row r;
// in step s = 0 .. N-2 it sends row (r - s) mod N to rank r+1 and receives row (r - s - 1) mod N from rank r-1,
// straight into that row. After N-1 steps every row is in, and each rank has sent (N-1)/N of the output, as any
// all-gather must. It is built like the ring reduce-scatter (Note [Ring reduce-scatter]): c10d send/recv, tagged
// (ring number, step) in a range of tags of its own, run in submission order by a SerialWorker of its own, so that
// an all-gather prefetched during backward runs beside a reduce-scatter rather than behind it. Nothing is summed:
// the result is bit for bit the backend's. AllGatherAlgorithm::kAuto takes the ring for every CPU tensor on Gloo;
// kBackend keeps Gloo's own, for comparison (`shardlab bench --section reduce_scatter` times both). CUDA tensors
// keep the backend's all-gather (Gloo's send/recv take host memory; NCCL writes into the output).

// Note [Streams on CUDA: NCCL's stream is the side stream]
// On CUDA the overlap that stage 05 builds needs no stream of shardlab's own. c10d's NCCL backend issues each
// collective on an NCCL stream of its own per device, after making that stream wait for the current one (the inputs
// are ready), and its Work::wait() makes the *current* stream wait for the collective's end event: the host does
// not block (only with NCCL_BLOCKING_WAIT / TORCH_NCCL_BLOCKING_WAIT set, or for a barrier). c10d also tells the
// CUDA caching allocator that its stream uses the collective's tensors (recordStream; with 2.x's
// TORCH_NCCL_AVOID_RECORD_STREAMS it keeps them alive until the work completes instead), so a buffer freed by the
// host after wait() is not handed out before the collective is done with it. So FSDP's prefetched all-gather runs on
// NCCL's stream beside the compute queued after it; finish_unshard's Handle::wait is a stream wait, and the copy-out
// is queued behind it on the compute stream. Nothing of shardlab's runs on another stream, so nothing of ours needs
// record_stream (stream.h has it for code that does). What FSDP2 adds beyond this: its copy-in and copy-out run on
// streams of their own, so they do not queue behind the compute; ours are in the compute stream (a shard's copy in,
// one unit's copy out per all-gather).
// Timing: on CUDA, Handle::wait returns once the stream wait is queued, so a host wait span reads ~0 and a record's
// end_ns is when the host waited, not when the GPU finished (CollectiveRecord says so). Overlap on a GPU must be
// measured on the device: libtorch 2.x has Backend::enableCollectivesTiming with Work::getDuration (c10d's own CUDA
// events around the collective on its stream) and the device-generic c10::Event::elapsedTime (events made with
// EventFlag::BACKEND_DEFAULT: the stall of the compute stream around a stream wait is the exposed part); 1.13 has
// neither, only at::cuda::CUDAEvent::elapsed_time in a CUDA build (Debian 12's 1.13 has no CUDA). The device timing
// is not built: no session so far had a GPU to run it on, and a timing path never run would be a stub. The CUDA
// path compiles in CI (.ci/libtorch2 cuda); tools/gpu-check and the NeedsAGpu tests run it where a GPU is lent.

namespace shardlab {
namespace {

bool is_floating(c10::ScalarType t) { return c10::isFloatingType(t); }

bool gloo_supports(c10::ScalarType t) {
  if (t == c10::kBFloat16) return compat::gloo_features().bfloat16;
  switch (t) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kHalf:
    case c10::kLong:
    case c10::kInt:
    case c10::kChar:
    case c10::kByte:
      return true;
    default:
      return false;
  }
}

const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

// Tier 3 of Note [Three error tiers]: legal, but more bytes than the user may think.
void warn_bf16_sent_as_f32(const char* op) {
  warn_once("bf16 sent as f32", std::string(op) +
                                    ": this Gloo has no bf16, so bf16 tensors travel as f32 "
                                    "(twice the bytes) and are rounded back on arrival; see Note [Fallbacks]");
}

}  // namespace

Handle::Handle(c10::intrusive_ptr<compat::Work> work, std::function<void()> finish, std::string what,
               std::chrono::milliseconds timeout)
    : work_(std::move(work)), finish_(std::move(finish)), what_(std::move(what)), timeout_(timeout), done_(false) {}

// Note [Overwriting a pending Handle]
// A pending handle owns the collective's finish step (divide for AVG, copy back a cast, copy out a chunk): only
// wait() runs it. Move-assigning onto a pending handle would drop that step silently, and the result would be wrong
// with nothing to show for it (an AVG left as a SUM). The assignment could wait for it instead, but that hides a
// blocking call (and its errors) inside an `=`. So it refuses: std::logic_error naming the op, like std::thread's
// assignment refuses a joinable thread (which terminates). Nothing is moved in that case, so the pending handle can
// still be waited for. Handles that are done (waited for, moved from, default) are overwritten freely. Containers
// move-construct when they grow (fine); erase or remove_if move-assign onto the erased element, so erase a
// handle only once it is done.
Handle& Handle::operator=(Handle&& other) {  // NOLINT(performance-noexcept-move-constructor): see the Note
  if (this == &other) return *this;
  if (!done_)
    throw std::logic_error("Handle: move-assigning onto a pending " + what_ +
                           " would drop its finish step; expected a handle that is done (call wait() first)");
  work_ = std::move(other.work_);
  finish_ = std::move(other.finish_);
  what_ = std::move(other.what_);
  timeout_ = other.timeout_;
  error_ = std::move(other.error_);
  advance_ = std::move(other.advance_);
  done_ = std::exchange(other.done_, true);
  return *this;
}

void Handle::wait() {
  if (error_) std::rethrow_exception(error_);
  if (done_) return;
  // Take everything out first: whatever happens below, the finish steps cannot run a second time.
  auto work = std::move(work_);
  auto finish = std::move(finish_);
  finish_ = nullptr;
  done_ = true;
  const auto waited_from = std::chrono::steady_clock::now();
  try {
    if (work && !work->wait(timeout_)) throw std::runtime_error("the backend reported failure");
  } catch (const std::exception& e) {
    // Which of the two: the limit ran out (a peer never came), or the backend failed at once (a peer's connection
    // was reset, a peer threw). Gloo names its timeouts; a wait as long as the limit is one too.
    const std::string why = e.what();
    const auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - waited_from);
    const bool timed_out =
        waited >= timeout_ || why.find("imed out") != std::string::npos || why.find("imeout") != std::string::npos;
    const std::string limit = std::to_string(timeout_.count()) + " ms";
    error_ = std::make_exception_ptr(
        std::runtime_error(what_ +
                           (timed_out ? " timed out (limit " + limit + "): "
                                      : " failed after " + std::to_string(waited.count()) + " ms, before its " + limit +
                                            " limit (not a timeout: the backend reported an error, such as a peer's "
                                            "connection reset): ") +
                           why));
    std::rethrow_exception(error_);
  }
  if (finish) {
    try {
      finish();
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
  }
}

std::exception_ptr wait_all(std::vector<Handle>& handles) {
  std::exception_ptr first;
  // Advance every chained handle first, in order, so that each one's second collective is in flight before any is
  // waited for (Note [Advancing a chained reduction]); for a plain handle advance() is its wait().
  for (auto& h : handles) {
    try {
      h.advance();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  for (auto& h : handles) {
    try {
      h.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  return first;
}

Handle Handle::then(std::function<void()> next) && {
  std::function<void()> first = std::move(finish_);
  auto chained = [first = std::move(first), next = std::move(next), was_done = done_] {
    if (!was_done && first) first();
    if (next) next();
  };
  Handle h(std::move(work_), std::move(chained), std::move(what_), timeout_);
  h.error_ = std::move(error_);
  h.advance_ = std::move(advance_);
  done_ = true;
  return h;
}

// Note [Advancing a chained reduction]
// A two-phase reduction (HSDP: reduce-scatter within the shard group, all-reduce of the result across the replicas)
// cannot chain its second collective with then(): a then() step runs at wait(), and its owner (FSDP) waits for a
// reduction only when it must, so the all-reduce would start late, and a wait() before the next reduce-scatter
// would hold the host until the all-reduce is over. then_issue() splits the wait: advance() waits for the first
// collective and issues the second; wait() finishes the rest. FSDP advances the previous unit's reduction before it
// issues the next unit's reduce-scatter (the host waited there already in stage 04, for the reduce-scatter's
// buffers) and waits for all of them at the end of backward. Every rank advances in the same order, so each
// group's collectives come in the same order on every rank ((unit, phase) order), whatever the timing.
Handle Handle::then_issue(std::function<Handle()> issue) && {
  struct Chain {
    Handle first;
    std::function<Handle()> issue;
    Handle second;
    bool issued = false;
    std::exception_ptr error;  // what issue() threw: every later advance rethrows it
  };
  auto chain = std::make_shared<Chain>();
  std::string what = what_ + ", then its second collective";
  const std::chrono::milliseconds timeout = timeout_;
  chain->first = std::move(*this);
  chain->issue = std::move(issue);
  auto advance = [chain] {
    if (chain->error) std::rethrow_exception(chain->error);
    if (chain->issued) return;
    chain->first.wait();   // a failure sticks in `first`: the next advance rethrows it
    chain->issued = true;  // issue() runs once: a throwing one is not retried, its error sticks
    try {
      if (chain->issue) chain->second = chain->issue();
      chain->issue = nullptr;  // what it captured (the first phase's buffers) goes now, not at wait()
    } catch (...) {
      chain->error = std::current_exception();
      throw;
    }
  };
  Handle h(
      c10::intrusive_ptr<compat::Work>(),
      [chain, advance] {
        advance();
        chain->second.wait();
      },
      std::move(what), timeout);
  h.advance_ = advance;
  return h;
}

void Handle::advance() {
  if (error_) std::rethrow_exception(error_);
  if (done_) return;
  if (!advance_) {
    wait();
    return;
  }
  try {
    advance_();
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
}

Handle Handle::on_advance(std::function<void()> step) && {
  auto once = std::make_shared<std::function<void()>>(std::move(step));
  auto run = [once] {
    if (!*once) return;
    auto f = std::exchange(*once, nullptr);
    f();
  };
  std::function<void()> advance = std::move(advance_);
  advance_ = nullptr;
  Handle h = std::move(*this).then(run);  // wait() without an advance() first
  if (advance)
    h.advance_ = [advance = std::move(advance), run] {
      advance();
      run();
    };
  return h;
}

Communicator::Communicator(c10::intrusive_ptr<compat::Backend> backend, BackendKind kind, std::string name,
                           std::chrono::milliseconds timeout, std::shared_ptr<CommRecorder> recorder)
    : backend_(std::move(backend)),
      kind_(kind),
      name_(std::move(name)),
      timeout_(timeout),
      recorder_(recorder ? std::move(recorder) : std::make_shared<CommRecorder>()),
      rank_(backend_->getRank()),
      size_(backend_->getSize()) {}

bool Communicator::reduces_natively(c10::ScalarType dtype) const {
  return kind_ == BackendKind::kNccl || gloo_supports(dtype);
}

bool Communicator::has_flat_all_gather(const at::Tensor& t) const {
  return kind_ == BackendKind::kNccl || (compat::gloo_features().flat_all_gather && t.is_cpu());
}

namespace {
bool gather_by_ring(BackendKind kind, AllGatherAlgorithm algorithm, bool cpu) {
  return kind == BackendKind::kGloo && cpu && algorithm != AllGatherAlgorithm::kBackend;
}
}  // namespace

bool Communicator::all_gather_uses_ring(const at::Tensor& t) const {
  return gather_by_ring(kind_, ag_algorithm_, t.is_cpu());
}

// Note [What the Communicator allocates]
// Beside the caller's tensors, a collective may need private ones while it is in flight; a memory meter that
// leaves them out reports less than the step holds. all_gather_scratch_bytes, reduce_scatter_scratch_bytes and
// all_reduce_scratch_bytes state them by the same rules the collectives below follow (they are tested against a
// counting CPU allocator):
//  - a dtype the backend cannot carry (bf16 on Gloo 1.13) goes as f32 copies of input and output;
//  - Gloo's own all-gather (AllGatherAlgorithm::kBackend, or CUDA tensors) gathers into a flat tensor of its own,
//    then copies it out; its flat all-gather (libtorch 2.x) is the list one inside, with the same copy. The ring
//    all-gather and NCCL write straight into the output;
//  - reduce_scatter on Gloo works on a copy of the whole input (the ring reduces into it; the fallback all-reduces
//    it), and the ring receives into one more row.
// Not counted: what a backend holds inside (Gloo's staging for its ring all-reduce and all-gather algorithms)
// and the small tensors of barrier.
int64_t Communicator::all_gather_scratch_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const {
  const bool f32 = !reduces_natively(dtype);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(f32 ? c10::kFloat : dtype));
  int64_t bytes = f32 ? (size_ + 1) * input_numel * elem : 0;
  // Gloo's flat all-gather (libtorch 2.x) is its list all-gather inside: the same flat copy of the output.
  if (kind_ == BackendKind::kGloo && !gather_by_ring(kind_, ag_algorithm_, device.is_cpu()))
    bytes += size_ * input_numel * elem;
  return bytes;
}

int64_t Communicator::all_reduce_scratch_bytes(c10::ScalarType dtype, int64_t numel) const {
  return reduces_natively(dtype) ? 0 : numel * static_cast<int64_t>(c10::elementSize(c10::kFloat));
}

int64_t Communicator::reduce_scatter_scratch_bytes(c10::ScalarType dtype, int64_t input_numel,
                                                   c10::Device device) const {
  if (has_reduce_scatter()) return 0;
  const bool f32 = !reduces_natively(dtype);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(f32 ? c10::kFloat : dtype));
  const int64_t input_bytes = input_numel * static_cast<int64_t>(c10::elementSize(dtype));
  const bool ring = rs_algorithm_ == ReduceScatterAlgorithm::kRing ||
                    (rs_algorithm_ == ReduceScatterAlgorithm::kAuto && ring_reduce_scatter_pays(size_, input_bytes));
  if (device.is_cpu() && ring) return size_ == 1 ? input_numel * elem : (input_numel + input_numel / size_) * elem;
  return input_numel * elem;
}

c10::intrusive_ptr<compat::Work> Communicator::issue(const std::function<c10::intrusive_ptr<compat::Work>()>& call) {
  std::lock_guard<std::mutex> lock(*issuing_);
  return call();
}

bool ring_reduce_scatter_pays(int world_size, int64_t input_bytes) {
  return world_size <= 3 || input_bytes >= (int64_t{1} << 20);
}

Communicator::~Communicator() = default;  // ring_ (if any) finishes its queue, then joins

bool Communicator::has_reduce_scatter() const { return kind_ == BackendKind::kNccl; }

void Communicator::check_tensor(const at::Tensor& t, const char* what, const char* op) const {
  auto fail = [&](const std::string& msg) {
    std::ostringstream s;
    s << op << " on group '" << name_ << "' (rank " << rank_ << "): " << what << ' ' << msg;
    throw std::invalid_argument(s.str());
  };
  if (!t.defined()) fail("is undefined; expected a tensor");
  if (t.layout() != c10::kStrided) fail("must be a dense (strided) tensor");
  if (!t.is_contiguous())
    fail("must be contiguous; got sizes " + c10::str(t.sizes()) + " strides " + c10::str(t.strides()));
  if (kind_ == BackendKind::kNccl && !t.is_cuda()) fail("must be a CUDA tensor for NCCL; got " + t.device().str());
  if (kind_ == BackendKind::kGloo && !(t.is_cpu() || t.is_cuda()))
    fail("must be on CPU or CUDA for Gloo; got " + t.device().str());
  const auto dt = t.scalar_type();
  if (kind_ == BackendKind::kGloo && !gloo_supports(dt) && dt != c10::kBFloat16)
    fail(std::string("has dtype ") + c10::toString(dt) +
         "; expected one of float, double, half, bfloat16, long, int, char, byte");
}

size_t Communicator::record(const char* op, const char* wire_op, const at::Tensor& t, const at::Tensor& wire,
                            ReduceOp* red) {
  CollectiveRecord r;
  r.op = op;
  r.wire_op = wire_op;
  r.dtype = t.scalar_type();
  r.wire_dtype = wire.scalar_type();
  r.numel = t.numel();
  r.bytes = static_cast<int64_t>(wire.numel() * wire.element_size());
  r.group = name_;
  r.group_size = size_;
  r.reduce = red ? reduce_name(*red) : "";
  r.start_ns = now_ns();
  return recorder_->begin(std::move(r));
}

Handle Communicator::submit(c10::intrusive_ptr<compat::Work> work, size_t record_index, std::function<void()> finish,
                            const char* op, bool on_cpu) {
  // CPU tensors: the completion time comes from the backend's future (set on its worker thread), so the record
  // shows when the collective really ended, not when someone waited for it. CUDA tensors: the future completes
  // when the work is queued on the GPU, so the record ends when wait() has synchronized with it instead.
  // CPU collectives are counted in flight until the future completes (Note [Yielding to communication]).
  std::shared_ptr<CommRecorder> rec = recorder_;
  std::shared_ptr<detail::InFlight> in_flight = on_cpu ? std::make_shared<detail::InFlight>() : nullptr;
  if (on_cpu) {
    try {
      work->getFuture()->addCallback([rec, record_index, in_flight](c10::ivalue::Future&) {
        rec->finish(record_index);
        in_flight->end();
      });
    } catch (const std::exception&) {
      // a backend without a future: timed, and no longer counted, at wait() below
    }
  }
  // Either way the record is closed by the time wait() returns: the backend's future may run its callbacks (on its
  // own thread) only after the work reports completion to wait(), and a record still open then would be missing
  // from traces and from comm_time. CommRecorder::finish keeps the first time, so the future's wins when it came.
  finish = [rec, record_index, in_flight, inner = std::move(finish)] {
    rec->finish(record_index);
    if (in_flight) in_flight->end();
    if (inner) inner();
  };
  std::ostringstream what;
  what << op << " on group '" << name_ << "' (rank " << rank_ << " of " << size_ << ")";
  return Handle(std::move(work), std::move(finish), what.str(), timeout_);
}

// Note [Checked collectives]
// Gloo pairs the k-th collective of every rank; when their sizes differ, the receiving side finds more bytes than
// it posted, on Gloo's transport thread, and the process ends (gloo::EnforceNotMet, "op.preamble.length <=
// op.nbytes"). PyTorch 1.13 ends the same way; its TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the group so that every
// collective first all-gathers a fingerprint of the call and compares. The check here is that: the call's
// operation, dtypes, element counts, reduction or root, device types and the path it will take (the ring or not),
// as int64s of a fixed count, all-gathered through the backend and waited for on the calling thread, right after the
// tensors' own checks and before the checks one rank can make alone (so a size only one rank got wrong is reported by
// every rank, as the difference it is). A fixed-size gather cannot itself mismatch, and a rank that never comes is the
// group's timeout (on NCCL, the backend's own). Every rank compares every rank's fingerprint with rank 0's, so
// every rank throws the same error, at the call, before anything of the real call is sent.
// What it compares is every call in the order each rank makes it, of every kind: as strict as NCCL, which orders
// everything, and stricter than Gloo's rings, which pair all-gathers and reduce-scatters apart (Note [Ring
// all-gather]). So FSDP with a parameter unused on some ranks only is reported (Note [A parameter unused on some
// ranks]): exact on Gloo with CPU tensors, a mismatch on NCCL. What it costs: one small collective per call, which
// also makes each call wait until every rank has reached it (a rank can no longer run ahead of the others). Hence
// off by default, for finding a bug, as in PyTorch.
namespace {

enum CallField : int64_t {
  kOpField,
  kDtypeField,
  kNumelField,
  kOutputField,
  kOutputDtypeField,
  kDetailField,  // the reduction, or the broadcast's root
  kDeviceField,  // 16 x the input's device type + the output's (Gloo takes CPU and CUDA tensors by different paths)
  kPathField,    // how the call travels: 0 the backend's own, 1 the ring, 2 an all-reduce (reduce-scatter)
  kCallFields
};

std::string describe_call(const int64_t* f) {
  static const char* const ops[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"};
  std::ostringstream s;
  const int64_t op = f[kOpField];
  s << (op >= 0 && op < 5 ? ops[op] : "an unknown collective");
  if (op == 4) return s.str();
  s << " of " << f[kNumelField] << ' ' << c10::toString(static_cast<c10::ScalarType>(f[kDtypeField])) << " elements";
  if (op == 2 || op == 3) s << " (output " << f[kOutputField] << ")";
  if (op == 1) s << " from root " << f[kDetailField];
  if (op == 0 || op == 3) s << " (" << reduce_name(static_cast<ReduceOp>(f[kDetailField])) << ")";
  s << " on " << c10::DeviceTypeName(static_cast<c10::DeviceType>(f[kDeviceField] / 16), /*lower_case=*/true);
  if (op == 2 || op == 3) {
    static const char* const paths[] = {"by the backend", "by the ring", "as an all-reduce"};
    s << ", output " << c10::toString(static_cast<c10::ScalarType>(f[kOutputDtypeField])) << " on "
      << c10::DeviceTypeName(static_cast<c10::DeviceType>(f[kDeviceField] % 16), /*lower_case=*/true);
    if (f[kPathField] >= 0 && f[kPathField] < 3) s << ", " << paths[f[kPathField]];
  }
  return s.str();
}

}  // namespace

int Communicator::reduce_scatter_path(const at::Tensor& input) const {
  if (has_reduce_scatter()) return 0;  // NCCL's own
  const int64_t bytes = static_cast<int64_t>(input.numel() * input.element_size());
  const bool ring = rs_algorithm_ == ReduceScatterAlgorithm::kRing ||
                    (rs_algorithm_ == ReduceScatterAlgorithm::kAuto && ring_reduce_scatter_pays(size_, bytes));
  return input.is_cpu() && ring ? 1 : 2;
}

void Communicator::check_same_call(const char* op, const at::Tensor& t, const at::Tensor& output, int64_t detail) {
  if (!check_collectives_) return;
  static const std::map<std::string, int64_t> codes{
      {"all_reduce", 0}, {"broadcast", 1}, {"all_gather", 2}, {"reduce_scatter", 3}, {"barrier", 4}};
  at::Tensor mine = at::empty({kCallFields}, at::kLong);
  int64_t* f = mine.data_ptr<int64_t>();
  f[kOpField] = codes.at(op);
  f[kDtypeField] = static_cast<int64_t>(t.scalar_type());
  f[kNumelField] = t.numel();
  f[kOutputField] = output.numel();
  f[kOutputDtypeField] = static_cast<int64_t>(output.scalar_type());
  f[kDetailField] = detail;
  f[kDeviceField] = 16 * static_cast<int64_t>(t.device().type()) + static_cast<int64_t>(output.device().type());
  // The path the call will take, not the setting: kAuto and kRing both take the ring for CPU tensors on Gloo.
  f[kPathField] = f[kOpField] == 2 ? (all_gather_uses_ring(t) ? 1 : 0) : f[kOpField] == 3 ? reduce_scatter_path(t) : 0;
  // NCCL carries CUDA tensors only: the call's device, or the current one for a barrier (whose tensor is empty).
  const c10::Device device = kind_ != BackendKind::kNccl ? c10::Device(c10::kCPU)
                             : t.is_cuda()               ? t.device()
                                                         : c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
  at::Tensor wire = mine.to(device);
  at::Tensor all = at::empty({size_, kCallFields}, wire.options());
  std::vector<at::Tensor> rows;
  rows.reserve(size_);
  for (int r = 0; r < size_; ++r) rows.push_back(all[r]);
  std::vector<std::vector<at::Tensor>> outputs{rows};
  std::vector<at::Tensor> inputs{wire};
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  auto work = issue([&] { return backend_->allgather(outputs, inputs, opts); });
  Handle(std::move(work), nullptr,
         std::string("the check of ") + op + " on group '" + name_ + "' (rank " + std::to_string(rank_) + " of " +
             std::to_string(size_) + ")",
         timeout_)
      .wait();
  const at::Tensor got = all.cpu();
  const int64_t* g = got.data_ptr<int64_t>();
  for (int r = 1; r < size_; ++r) {
    if (std::equal(g, g + kCallFields, g + r * kCallFields)) continue;
    throw std::invalid_argument("collectives differ on group '" + name_ + "': rank 0 calls " + describe_call(g) +
                                ", rank " + std::to_string(r) + " calls " + describe_call(g + r * kCallFields) +
                                ". Every rank must issue the same collectives, of the same sizes, in the same "
                                "order (found by set_check_collectives)");
  }
}

Handle Communicator::all_reduce(const at::Tensor& t, ReduceOp op) {
  check_tensor(t, "tensor", "all_reduce");
  check_same_call("all_reduce", t, t, static_cast<int64_t>(op));
  const bool bf16_fallback = !reduces_natively(t.scalar_type());
  const bool native_avg = kind_ == BackendKind::kNccl;
  if (op == ReduceOp::kAvg && !is_floating(t.scalar_type()))
    throw std::invalid_argument(std::string("all_reduce: avg needs a floating dtype; got ") +
                                c10::toString(t.scalar_type()));
  if (bf16_fallback) warn_bf16_sent_as_f32("all_reduce");
  at::Tensor wire = bf16_fallback ? t.to(c10::kFloat) : t;
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::kMax                   ? c10d::ReduceOp::MAX
                  : (op == ReduceOp::kAvg && native_avg) ? c10d::ReduceOp::AVG
                                                         : c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  const size_t idx = record("all_reduce", "all_reduce", t, wire, &op);
  std::vector<at::Tensor> tensors{wire};
  auto work = issue([&] { return backend_->allreduce(tensors, opts); });
  const bool divide = op == ReduceOp::kAvg && !native_avg;
  std::function<void()> finish;
  if (divide || bf16_fallback) {
    finish = [t, wire, divide, n = size_] {
      if (divide) wire.div_(n);
      if (!wire.is_same(t)) t.copy_(wire);
    };
  }
  return submit(std::move(work), idx, std::move(finish), "all_reduce", t.is_cpu());
}

Handle Communicator::broadcast(const at::Tensor& t, int root) {
  check_tensor(t, "tensor", "broadcast");
  check_same_call("broadcast", t, t, root);
  if (root < 0 || root >= size_)
    throw std::invalid_argument("broadcast: root must be in [0, " + std::to_string(size_) + "); got " +
                                std::to_string(root));
  const bool bf16_fallback = !reduces_natively(t.scalar_type());
  if (bf16_fallback) warn_bf16_sent_as_f32("broadcast");
  at::Tensor wire = bf16_fallback ? t.to(c10::kFloat) : t;
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout_;
  const size_t idx = record("broadcast", "broadcast", t, wire, nullptr);
  std::vector<at::Tensor> tensors{wire};
  auto work = issue([&] { return backend_->broadcast(tensors, opts); });
  std::function<void()> finish;
  if (bf16_fallback) finish = [t, wire] { t.copy_(wire); };
  return submit(std::move(work), idx, std::move(finish), "broadcast", t.is_cpu());
}

Handle Communicator::all_gather(const at::Tensor& output, const at::Tensor& input) {
  check_tensor(output, "output", "all_gather");
  check_tensor(input, "input", "all_gather");
  check_same_call("all_gather", input, output, 0);
  if (output.scalar_type() != input.scalar_type() || output.device() != input.device())
    throw std::invalid_argument(std::string("all_gather: output and input must share dtype and device; got ") +
                                c10::toString(output.scalar_type()) + "/" + output.device().str() + " and " +
                                c10::toString(input.scalar_type()) + "/" + input.device().str());
  if (output.numel() != size_ * input.numel())
    throw std::invalid_argument(
        "all_gather: output must have world_size * input.numel() = " + std::to_string(size_ * input.numel()) +
        " elements; got " + std::to_string(output.numel()));
  const bool bf16_fallback = !reduces_natively(input.scalar_type());
  if (bf16_fallback) warn_bf16_sent_as_f32("all_gather");
  at::Tensor wire_in = bf16_fallback ? input.to(c10::kFloat) : input;
  at::Tensor wire_out =
      bf16_fallback ? at::empty({output.numel()}, output.options().dtype(c10::kFloat)) : output.view({-1});
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  std::function<void()> finish;
  if (bf16_fallback) finish = [output, wire_out] { output.view({-1}).copy_(wire_out); };
  if (all_gather_uses_ring(input)) return ring_all_gather(output, wire_out, wire_in.contiguous(), input);
  if (has_flat_all_gather(input)) {
    at::Tensor in = wire_in.contiguous().view({-1});  // the backend splits the output into pieces shaped like this
    const size_t idx = record("all_gather", "all_gather", input, in, nullptr);
    auto work = issue([&] { return backend_->_allgather_base(wire_out, in, opts); });
    return submit(std::move(work), idx, std::move(finish), "all_gather", input.is_cpu());
  }
  std::vector<at::Tensor> chunks;
  chunks.reserve(size_);
  at::Tensor rows = wire_out.view({size_, -1});
  for (int r = 0; r < size_; ++r) chunks.push_back(rows[r].view(wire_in.sizes()));
  std::vector<std::vector<at::Tensor>> outputs{chunks};
  std::vector<at::Tensor> inputs{wire_in.contiguous()};
  const size_t idx = record("all_gather", "all_gather(list)", input, wire_in, nullptr);
  auto work = issue([&] { return backend_->allgather(outputs, inputs, opts); });
  return submit(std::move(work), idx, std::move(finish), "all_gather", input.is_cpu());
}

Handle Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  check_tensor(output, "output", "reduce_scatter");
  check_tensor(input, "input", "reduce_scatter");
  check_same_call("reduce_scatter", input, output, static_cast<int64_t>(op));
  if (output.scalar_type() != input.scalar_type() || output.device() != input.device())
    throw std::invalid_argument(std::string("reduce_scatter: output and input must share dtype and device; got ") +
                                c10::toString(output.scalar_type()) + "/" + output.device().str() + " and " +
                                c10::toString(input.scalar_type()) + "/" + input.device().str());
  if (input.numel() != size_ * output.numel())
    throw std::invalid_argument(
        "reduce_scatter: input must have world_size * output.numel() = " + std::to_string(size_ * output.numel()) +
        " elements; got " + std::to_string(input.numel()));
  if (op == ReduceOp::kMax)
    throw std::invalid_argument("reduce_scatter: expected ReduceOp::kSum or kAvg; got kMax (all_reduce only)");
  if (op == ReduceOp::kAvg && !is_floating(input.scalar_type()))
    throw std::invalid_argument(std::string("reduce_scatter: avg needs a floating dtype; got ") +
                                c10::toString(input.scalar_type()));
  if (has_reduce_scatter()) {  // NCCL: reduces (AVG included) and scatters by itself
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = op == ReduceOp::kAvg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    opts.timeout = timeout_;
    at::Tensor in = input.view({-1}), out = output.view({-1});
    const size_t idx = record("reduce_scatter", "reduce_scatter", input, in, &op);
    auto work = issue([&] { return backend_->_reduce_scatter_base(out, in, opts); });
    return submit(std::move(work), idx, nullptr, "reduce_scatter", input.is_cpu());
  }
  const int64_t bytes = static_cast<int64_t>(input.numel() * input.element_size());
  const bool ring_pays = ring_reduce_scatter_pays(size_, bytes);
  if (reduce_scatter_path(input) == 1) return ring_reduce_scatter(output, input, op);
  if (ring_pays)
    warn_once(
        "reduce_scatter sent as all_reduce",
        "reduce_scatter of " + std::to_string(bytes) + " bytes at " + std::to_string(size_) +
            " ranks sent as an all-reduce of the whole input (" +
            (input.is_cpu() ? std::string("ReduceScatterAlgorithm::kAllReduce was chosen")
                            : "the ring runs on CPU tensors only") +
            "): each rank receives the whole reduced input, world size times what it keeps; see Note [Fallbacks]");
  const bool bf16_fallback = !reduces_natively(input.scalar_type());
  if (bf16_fallback) warn_bf16_sent_as_f32("reduce_scatter");
  // See Note [Fallbacks]: all-reduce a private copy of the whole input, keep this rank's chunk.
  at::Tensor wire = bf16_fallback ? input.to(c10::kFloat) : input.clone();
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  const size_t idx = record("reduce_scatter", "all_reduce", input, wire, &op);
  std::vector<at::Tensor> tensors{wire};
  auto work = issue([&] { return backend_->allreduce(tensors, opts); });
  auto finish = [output, wire, op, r = rank_, n = size_] {
    at::Tensor mine = wire.view({n, -1})[r];
    if (op == ReduceOp::kAvg) mine.div_(n);
    output.view({-1}).copy_(mine);
  };
  return submit(std::move(work), idx, std::move(finish), "reduce_scatter", input.is_cpu());
}

Handle Communicator::ring_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  // See Note [Ring reduce-scatter]. The ring works on a private copy (in f32 where Gloo cannot carry bf16).
  const bool bf16_fallback = !reduces_natively(input.scalar_type());
  if (bf16_fallback) warn_bf16_sent_as_f32("reduce_scatter");
  if (size_ > 4096) throw std::invalid_argument("reduce_scatter: the ring supports up to 4096 ranks");
  at::Tensor work = (bf16_fallback ? input.to(c10::kFloat) : input.clone()).view({size_, -1});
  const int64_t n = work.size(1);
  at::Tensor sent = work.narrow(0, 0, size_ > 1 ? size_ - 1 : 0);  // what the ring sends: N-1 chunks
  const size_t idx = record("reduce_scatter", "reduce_scatter(ring)", input, sent, &op);
  auto finish = [output, work, op, r = rank_, n = size_] {
    at::Tensor mine = work[r];
    if (op == ReduceOp::kAvg) mine.div_(n);
    output.view({-1}).copy_(mine);
  };
  if (size_ == 1) {
    recorder_->finish(idx);
    return Handle(c10::intrusive_ptr<compat::Work>(), std::move(finish), "reduce_scatter", timeout_);
  }
  auto task_work = c10::make_intrusive<detail::TaskWork>();
  if (!ring_) ring_ = std::make_unique<detail::SerialWorker>();
  const uint64_t sequence = ring_sequence_++;
  ring_->submit([backend = backend_, issuing = issuing_, task_work, work, n, rank = rank_, size = size_, sequence,
                 timeout = timeout_]() mutable {
    try {
      at::Tensor incoming = at::empty({n}, work.options());
      const int right = (rank + 1) % size, left = (rank + size - 1) % size;
      for (int step = 0; step + 1 < size; ++step) {
        const int send_chunk = ((rank - step - 1) % size + size) % size;
        const int recv_chunk = ((rank - step - 2) % size + size) % size;
        // (ring number, step), the same on every rank; 4096 steps per ring (ranks) at most, then wraps.
        const int tag = static_cast<int>((sequence % (uint64_t{1} << 18)) * 4096 + static_cast<uint64_t>(step));
        std::vector<at::Tensor> out{work[send_chunk]}, in{incoming};
        c10::intrusive_ptr<compat::Work> sending, receiving;
        {
          std::lock_guard<std::mutex> lock(*issuing);  // c10d's backends expect one issuing thread at a time
          sending = backend->send(out, right, tag);
          receiving = backend->recv(in, left, tag);
        }
        // Wait for both even when one fails: the send's buffer must outlive it.
        std::exception_ptr failed;
        for (auto* w : {&receiving, &sending}) {
          try {
            if (!(*w)->wait(timeout)) throw std::runtime_error("the backend reported failure");
          } catch (...) {
            if (!failed) failed = std::current_exception();
          }
        }
        if (failed) std::rethrow_exception(failed);
        work[recv_chunk].add_(incoming);
      }
      incoming = at::Tensor();  // before complete(): what the caller frees after its wait is free at once
      work = at::Tensor();
      task_work->complete(nullptr);
    } catch (...) {
      work = at::Tensor();
      task_work->complete(std::current_exception());
    }
  });
  return submit(task_work, idx, std::move(finish), "reduce_scatter", /*on_cpu=*/true);
}

Handle Communicator::ring_all_gather(const at::Tensor& output, const at::Tensor& wire_out, const at::Tensor& wire_in,
                                     const at::Tensor& input) {
  // See Note [Ring all-gather]. wire_out is the output itself, or its f32 copy where Gloo cannot carry the dtype.
  if (size_ > 4096) throw std::invalid_argument("all_gather: the ring supports up to 4096 ranks");
  at::NoGradGuard no_grad;  // raw data movement, as the backend's own: an output that requires grad is fine
  at::Tensor rows = wire_out.view({size_, -1});
  rows[rank_].copy_(wire_in.view({-1}));
  const size_t idx = record("all_gather", "all_gather(ring)", input, wire_in, nullptr);
  std::function<void()> finish;
  if (!wire_out.is_same(output) && !wire_out.is_alias_of(output))
    finish = [output, wire_out] { output.view({-1}).copy_(wire_out); };
  if (size_ == 1) {
    recorder_->finish(idx);
    return Handle(c10::intrusive_ptr<compat::Work>(), std::move(finish), "all_gather", timeout_);
  }
  auto task_work = c10::make_intrusive<detail::TaskWork>();
  if (!ag_ring_) ag_ring_ = std::make_unique<detail::SerialWorker>();
  const uint64_t sequence = ag_ring_sequence_++;
  ag_ring_->submit([backend = backend_, issuing = issuing_, task_work, rows, rank = rank_, size = size_, sequence,
                    timeout = timeout_]() mutable {
    at::NoGradGuard no_grad;  // grad mode is per thread
    try {
      const int right = (rank + 1) % size, left = (rank + size - 1) % size;
      for (int step = 0; step + 1 < size; ++step) {
        const int send_row = ((rank - step) % size + size) % size;
        const int recv_row = ((rank - step - 1) % size + size) % size;
        // Tags from kRingAllGatherTagBase (2^30) up: the ring reduce-scatters' (below it) never meet them.
        const int tag = static_cast<int>(static_cast<uint64_t>(kRingAllGatherTagBase) +
                                         (sequence % (uint64_t{1} << 18)) * 4096 + static_cast<uint64_t>(step));
        std::vector<at::Tensor> out{rows[send_row]}, in{rows[recv_row]};
        c10::intrusive_ptr<compat::Work> sending, receiving;
        {
          std::lock_guard<std::mutex> lock(*issuing);  // c10d's backends expect one issuing thread at a time
          sending = backend->send(out, right, tag);
          receiving = backend->recv(in, left, tag);
        }
        std::exception_ptr failed;  // wait for both even when one fails: their buffers must outlive them
        for (auto* w : {&receiving, &sending}) {
          try {
            if (!(*w)->wait(timeout)) throw std::runtime_error("the backend reported failure");
          } catch (...) {
            if (!failed) failed = std::current_exception();
          }
        }
        if (failed) std::rethrow_exception(failed);
      }
      rows = at::Tensor();  // before complete(): a waiter that drops the output returns its storage at once
      task_work->complete(nullptr);
    } catch (...) {
      rows = at::Tensor();
      task_work->complete(std::current_exception());
    }
  });
  return submit(task_work, idx, std::move(finish), "all_gather", /*on_cpu=*/true);
}

void Communicator::barrier() {
  c10d::BarrierOptions opts;
  opts.timeout = timeout_;
  at::Tensor none = at::empty({0});
  check_same_call("barrier", none, none, 0);
  const size_t idx = record("barrier", "barrier", none, none, nullptr);
  submit(issue([&] { return backend_->barrier(opts); }), idx, nullptr, "barrier", kind_ == BackendKind::kGloo).wait();
}

}  // namespace shardlab
