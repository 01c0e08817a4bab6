#include "shardlab/comm_hooks/reduce_scatter_bucketer.h"

#include "shardlab/core/errors.h"
#include "shardlab/core/storage/flat_storage.h"

#include <ATen/ATen.h>

#include <exception>
#include <stdexcept>
#include <utility>

// Note [Asynchronous buckets]
// fairscale's bucketer flushes a full bucket synchronously (reduce-scatter, then callbacks, then reuse of the
// buffer). Here a full bucket is *launched* and handed over, buffer and all, to the in-flight list; the bucket
// continues in a spare buffer (or a new one). Nothing waits until flush(), which waits for every collective in
// launch order and only then runs callbacks, so callbacks always run on the caller's thread. Buffers come back to
// their bucket's spare list in flush(): in steady state no allocation happens.
//
// Collectives must match across ranks: a full bucket is launched during reduce_scatter_async, at the same call on
// every rank (same sizes, same caps); flush() launches the partial buckets in creation order, which is the same on
// every rank because buckets are created by the same sequence of calls. (A map keyed by the Communicator's address
// would not be: addresses differ between ranks.)

namespace shardlab::comm_hooks {
namespace {

// free_storage (common, flat_storage.h) gives a buffer 0 bytes even while other tensors share its storage.
bool has_storage(const at::Tensor& t) { return storage_bytes(t) > 0; }

}  // namespace

ReduceScatterBucketer::ReduceScatterBucketer(int64_t bucket_cap_bytes) : cap_bytes_(bucket_cap_bytes) {}

ReduceScatterBucketer::~ReduceScatterBucketer() {
  for (auto& f : in_flight_) {
    try {
      f.handle.wait();
    } catch (...) {  // a destructor must not throw; flush() is where errors are reported
    }
  }
}

int64_t ReduceScatterBucketer::shard_capacity(c10::ScalarType dtype, int world_size) const {
  if (cap_bytes_ <= 0 || world_size <= 0) return 0;
  return cap_bytes_ / static_cast<int64_t>(c10::elementSize(dtype)) / world_size;
}

size_t ReduceScatterBucketer::pending_callbacks() const {
  size_t n = 0;
  for (const auto& b : buckets_) n += b.queued.size();
  for (const auto& f : in_flight_) n += f.callbacks.size();
  return n;
}

std::vector<at::Tensor> ReduceScatterBucketer::buffers() const {
  std::vector<at::Tensor> out;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) out.push_back(t);
  };
  for (const auto& b : buckets_) {
    add(b.open.data);
    add(b.open.output);
    for (const auto& s : b.spare) {
      add(s.data);
      add(s.output);
    }
  }
  for (const auto& f : in_flight_) {
    if (f.buffer.data.defined()) {
      add(f.buffer.data);
      add(f.buffer.output);
    } else {
      add(f.output);  // a large input's result
    }
  }
  return out;
}

int64_t ReduceScatterBucketer::allocated_bytes() const {
  int64_t total = 0;
  for (const auto& t : buffers()) total += static_cast<int64_t>(t.storage().nbytes());
  return total;
}

ReduceScatterBucketer::Bucket& ReduceScatterBucketer::bucket_for(const at::Tensor& input, Communicator& comm,
                                                                 size_t* index) {
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    if (b.dtype == input.scalar_type() && b.device == input.device() && b.comm == &comm) {
      *index = i;
      return buckets_[i];
    }
  }
  buckets_.push_back(Bucket{
      input.scalar_type(), input.device(), &comm, shard_capacity(input.scalar_type(), comm.size()), {}, 0, {}, {}});
  *index = buckets_.size() - 1;
  return buckets_.back();
}

void ReduceScatterBucketer::ensure_open(Bucket& b) {
  if (has_storage(b.open.data)) return;
  while (!b.spare.empty()) {
    Buffer s = std::move(b.spare.back());
    b.spare.pop_back();
    if (has_storage(s.data)) {
      b.open = std::move(s);
      return;
    }
  }
  const auto options = at::TensorOptions().dtype(b.dtype).device(b.device);
  b.open.data = at::empty({b.comm->size(), b.capacity}, options);
  b.open.output = at::empty({b.capacity}, options);
}

void ReduceScatterBucketer::launch(size_t index) {
  Bucket& b = buckets_[index];
  if (b.queued.empty()) return;
  InFlight f;
  f.bucket = index;
  f.callbacks = std::move(b.queued);
  b.queued.clear();
  if (b.offset > 0) {
    // Row r's first `offset` columns are every input's chunk r: packed rank-major, they form the reduce-scatter
    // input (a partial bucket needs one copy to close the gaps between rows).
    f.input =
        b.offset == b.capacity ? b.open.data.view({-1}) : b.open.data.narrow(1, 0, b.offset).contiguous().view({-1});
    f.output = b.open.output.narrow(0, 0, b.offset);
    f.handle = b.comm->reduce_scatter(f.output, f.input, ReduceOp::kSum);
  } else {
    f.output = at::empty({0}, at::TensorOptions().dtype(b.dtype).device(b.device));  // only empty inputs
  }
  f.buffer = std::move(b.open);
  b.open = Buffer{};
  b.offset = 0;
  in_flight_.push_back(std::move(f));
}

void ReduceScatterBucketer::launch_large(const at::Tensor& input, int64_t shard, Communicator& comm,
                                         Callback callback) {
  InFlight f;
  f.input = input.contiguous().view({-1});
  f.output = at::empty({shard}, input.options());
  f.handle = comm.reduce_scatter(f.output, f.input, ReduceOp::kSum);
  f.callbacks.push_back(Pending{0, shard, std::move(callback)});
  in_flight_.push_back(std::move(f));
}

void ReduceScatterBucketer::reduce_scatter_async(const at::Tensor& input, Communicator& comm, Callback callback) {
  const int world = comm.size();
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument("ReduceScatterBucketer::reduce_scatter_async (rank " + std::to_string(comm.rank()) +
                                " of group '" + comm.name() + "'): " + what);
  };
  if (!input.defined()) fail("expected an input tensor; got an undefined tensor");
  if (input.layout() != c10::kStrided) fail("expected a dense (strided) input");
  const auto dtype = input.scalar_type();
  if (!(c10::isFloatingType(dtype) || c10::isIntegralType(dtype, /*includeBool=*/false)))
    fail(std::string("expected a floating or integral (non-bool) dtype; got ") + c10::toString(dtype));
  // Checked here, not when the bucket is launched later: by then the error would lose other inputs' callbacks.
  if (!comm.reduces_natively(dtype) && dtype != c10::kBFloat16)
    fail(std::string("group '") + comm.name() + "' cannot reduce dtype " + c10::toString(dtype) +
         " (Gloo: float, double, half, bfloat16, long, int, char, byte)");
  if (input.numel() % world != 0)
    fail("expected comm.size() * n elements (rank r's chunk at [r*n, (r+1)*n)); got " + std::to_string(input.numel()) +
         " elements, not a multiple of " + std::to_string(world));
  // TODO(stage03): queue one input for a reduce-scatter of at most the cap's bytes; never wait
  throw ::shardlab::NotImplemented("03", "queue one input for a reduce-scatter of at most the cap's bytes; never wait");
}

void ReduceScatterBucketer::flush() {
  // TODO(stage03): settle all that is queued: callbacks after their collectives, buffers back, even on failure
  throw ::shardlab::NotImplemented("03", "settle all that is queued: callbacks after their collectives, buffers back, even on failure");
}

void ReduceScatterBucketer::teardown() {
  size_t open = 0;
  for (const auto& b : buckets_) open += b.queued.size();
  if (open > 0 || !in_flight_.empty())
    throw std::logic_error("ReduceScatterBucketer::teardown: " + std::to_string(pending_callbacks()) +
                           " reduce-scatter(s) still pending (" + std::to_string(open) + " queued in open buckets, " +
                           std::to_string(in_flight_.size()) +
                           " collective(s) in flight); call flush() before teardown()");
  for (auto& b : buckets_) {
    free_storage(b.open.data);
    free_storage(b.open.output);
    for (auto& s : b.spare) {
      free_storage(s.data);
      free_storage(s.output);
    }
    b.spare.clear();
  }
}

}  // namespace shardlab::comm_hooks
