// Dispatch: how a collective reaches the c10d process group once its arguments are checked. The Communicator's
// construction, issuing work on the backend under one lock (issue), the CollectiveRecord every call opens (record),
// and wrapping the backend's work into a Handle whose wait closes the record (submit). What this means on CUDA,
// where NCCL's stream does the waiting, is Note [Streams on CUDA: NCCL's stream is the side stream].

#include "shardlab/core/comm/communicator.h"

#include "detail/collective_common.h"
#include "detail/serial_worker.h"  // ~Communicator destroys the ring workers
#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/comm/progress.h"

#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>

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
namespace detail {

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

}  // namespace detail

Communicator::Communicator(c10::intrusive_ptr<compat::Backend> backend, BackendKind kind, std::string name,
                           std::chrono::milliseconds timeout, std::shared_ptr<CommRecorder> recorder)
    : backend_(std::move(backend)),
      kind_(kind),
      name_(std::move(name)),
      timeout_(timeout),
      recorder_(recorder ? std::move(recorder) : std::make_shared<CommRecorder>()),
      rank_(backend_->getRank()),
      size_(backend_->getSize()) {}

Communicator::~Communicator() = default;  // ring_ (if any) finishes its queue, then joins

c10::intrusive_ptr<compat::Work> Communicator::issue(const std::function<c10::intrusive_ptr<compat::Work>()>& call) {
  std::lock_guard<std::mutex> lock(*issuing_);
  return call();
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
  r.reduce = red ? detail::reduce_name(*red) : "";
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

}  // namespace shardlab
