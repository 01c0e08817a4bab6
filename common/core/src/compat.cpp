// The libtorch-version-specific half of compat.h. Keep every #if on TORCH_VERSION_* in this file pair.
#include "shardlab/core/compat.h"

#include <torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef SHARDLAB_HAS_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <stdexcept>
#include <utility>

namespace shardlab::compat {
namespace {

// Runs a callback after the AccumulateGrad node has updated `.grad()`.
class CallbackPostHook : public torch::autograd::FunctionPostHook {
 public:
  explicit CallbackPostHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

bool has_nccl() {
#ifdef SHARDLAB_HAS_NCCL
  return true;
#else
  return false;
#endif
}

GlooFeatures gloo_features() {
  GlooFeatures f;
  // Probed on 2.6 (thread ranks, CPU tensors). Older 2.x lines keep the fallbacks: correct, only slower.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
  f.bfloat16 = true;
  f.flat_all_gather = true;
#endif
  return f;
}

c10::intrusive_ptr<Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                      std::chrono::milliseconds timeout, const std::string& hostname) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(hostname.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                              : c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

c10::intrusive_ptr<Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                      std::chrono::milliseconds timeout) {
#ifdef SHARDLAB_HAS_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  throw std::runtime_error(
      "NCCL requested, but this shardlab was built against a libtorch without CUDA/NCCL; "
      "use Gloo (CPU tensors) or rebuild against a CUDA libtorch (see README)");
#endif
}

std::shared_ptr<torch::autograd::Node> add_post_accumulate_hook(const at::Tensor& param, std::function<void()> fn) {
  TORCH_CHECK(param.is_leaf() && param.requires_grad(),
              "add_post_accumulate_hook: expected a leaf tensor that requires grad");
  std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(param);
  acc->add_post_hook(std::make_unique<CallbackPostHook>(std::move(fn)));
  return acc;
}

c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host, int port, bool is_server, int workers,
                                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = is_server;
  options.numWorkers = workers;
  options.timeout = timeout;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
  options.useLibUV = false;
#endif
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

void zero_grad(torch::optim::Optimizer& optimizer) {
#if TORCH_VERSION_MAJOR >= 2
  optimizer.zero_grad(/*set_to_none=*/false);
#else
  optimizer.zero_grad();
#endif
}

void queue_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

}  // namespace shardlab::compat
