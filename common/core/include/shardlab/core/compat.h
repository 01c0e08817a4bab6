#pragma once
/// @file compat.h
/// The one place where libtorch versions differ. Everything else in shardlab talks to c10d and autograd through
/// the aliases and functions below, so porting to another libtorch line means editing this file and compat.cpp only.
///
/// Differences handled here:
///  - 1.13: a c10d backend *is* a `c10d::ProcessGroup`; 2.x: backends derive from `c10d::Backend`.
///  - The signature of autograd's `FunctionPostHook`.
///  - Whether the CUDA/NCCL backend is compiled in (`SHARDLAB_HAS_NCCL`).
///  - 2.x's TCPStore wants libuv by default (Debian's 2.6 is built without it).
///  - 1.13's `Optimizer::zero_grad()` zeroes gradients in place; 2.x's sets them to None by default.
///  - What c10d's Gloo backend can do itself (2.x gained bfloat16 and the flat collectives).
///  - c10::Allocator's interface (2.3 made `allocate` non-const and `copy_data` pure virtual), for BufferPool.

#include <ATen/core/Tensor.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

// c10::Allocator::allocate is const before libtorch 2.3, non-const after, where copy_data became pure virtual.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
/// Expands to `const` where c10::Allocator::allocate is const (before libtorch 2.3), to nothing after.
#define SHARDLAB_ALLOCATE_CONST
/// The copy_data override a c10::Allocator needs from libtorch 2.3 on (nothing before).
#define SHARDLAB_ALLOCATOR_COPY_DATA                                                           \
  void copy_data(void* dest, const void* src, std::size_t count) const override { /* NOLINT */ \
    default_copy_data(dest, src, count);                                                       \
  }
#else
/// Expands to `const` where c10::Allocator::allocate is const (before libtorch 2.3), to nothing after.
#define SHARDLAB_ALLOCATE_CONST const
/// The copy_data override a c10::Allocator needs from libtorch 2.3 on (nothing before).
#define SHARDLAB_ALLOCATOR_COPY_DATA
#endif

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace shardlab::compat {

#if TORCH_VERSION_MAJOR >= 2
/// The c10d class that concrete backends (Gloo, NCCL) derive from in this libtorch line.
using Backend = c10d::Backend;
#else
/// The c10d class that concrete backends (Gloo, NCCL) derive from in this libtorch line.
using Backend = c10d::ProcessGroup;
#endif

/// A pending c10d collective.
using Work = c10d::Work;

/// True when this build can create NCCL process groups (a CUDA libtorch with c10d NCCL).
bool has_nccl();

/// What c10d's Gloo backend does natively in this libtorch line; where it cannot, the Communicator falls back
/// (Note [Fallbacks] in collectives.cpp). 1.13: neither. 2.6 and later: both. No line has AVG, and no line has
/// a reduce-scatter worth calling (2.6's is an all-reduce inside).
struct GlooFeatures {
  bool bfloat16 = false;         ///< reduces and moves bfloat16 tensors
  bool flat_all_gather = false;  ///< `_allgather_base` (tensor in, flat tensor out), for CPU tensors
};

/// The Gloo features of the libtorch this was compiled against.
GlooFeatures gloo_features();

/// Creates a Gloo backend for `rank` of `size` that rendezvous through `store`.
/// @param store rendezvous store shared by the group's ranks.
/// @param rank this rank, in [0, size).
/// @param size number of ranks.
/// @param hostname the address Gloo binds to ("127.0.0.1" for one machine; empty = this host's default device).
/// @param timeout applied to every collective of the group.
c10::intrusive_ptr<Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                      std::chrono::milliseconds timeout, const std::string& hostname);

/// Creates an NCCL backend (same arguments as make_gloo). Throws std::runtime_error when `has_nccl()` is false.
c10::intrusive_ptr<Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                      std::chrono::milliseconds timeout);

/// Creates the rendezvous store of a process group: rank 0 (`is_server`) serves it at `host:port`, the others
/// connect to it. Uses the classic TCPStore backend on every line (2.x's default libuv backend is not in every
/// build: Debian's 2.6 has none).
c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host, int port, bool is_server, int workers,
                                               std::chrono::milliseconds timeout);

/// Zeroes every gradient of `optimizer` in place, keeping the tensors (1.13's `zero_grad()`; 2.x's
/// `zero_grad(false)`). shardlab's reference and tools use it so a parameter without a gradient in a step is
/// treated alike on every libtorch line: a zero gradient, not a skipped parameter.
void zero_grad(torch::optim::Optimizer& optimizer);

/// Calls `fn` every time autograd has accumulated a gradient into `param.grad()` (after accumulation, so the
/// accumulated value over micro-batches is visible). The hook lives as long as the returned node: a tensor holds
/// only a weak reference to its accumulator, so the caller must keep the result alive.
/// @pre `param` is a leaf that requires grad.
std::shared_ptr<torch::autograd::Node> add_post_accumulate_hook(const at::Tensor& param, std::function<void()> fn);

/// Queues `fn` to run once when the backward pass currently executing finishes (after every gradient hook).
/// @pre called from inside a backward pass (e.g. from a post-accumulate hook).
void queue_end_of_backward(std::function<void()> fn);

}  // namespace shardlab::compat
