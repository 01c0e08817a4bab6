// Ring algorithms: the collectives Gloo lacks or does worse, built from c10d's point-to-point send/recv around a
// ring of the ranks and run off the calling thread by a SerialWorker, so that each returns at once like any
// collective: the ring reduce-scatter (Note [Ring reduce-scatter]), kAuto's rule for when it pays
// (ring_reduce_scatter_pays), and the ring all-gather (Note [Ring all-gather]).

#include "shardlab/core/comm/communicator.h"

#include "detail/collective_common.h"
#include "detail/serial_worker.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

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

namespace shardlab {

bool ring_reduce_scatter_pays(int world_size, int64_t input_bytes) {
  return world_size <= 3 || input_bytes >= (int64_t{1} << 20);
}

Handle Communicator::ring_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  // See Note [Ring reduce-scatter]. The ring works on a private copy (in f32 where Gloo cannot carry bf16).
  const bool bf16_fallback = !reduces_natively(input.scalar_type());
  if (bf16_fallback) detail::warn_bf16_sent_as_f32("reduce_scatter");
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

}  // namespace shardlab
