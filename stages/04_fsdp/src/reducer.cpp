#include "shardlab/fsdp/reducer.h"

#include <stdexcept>
#include <utility>

namespace shardlab::fsdp {
namespace {

class HookReducer final : public GradientReducer {
 public:
  explicit HookReducer(comm_hooks::CommHook hook) : hook_(std::move(hook)) {}
  Handle operator()(const at::Tensor& input, const at::Tensor& output) override {
    return hook_(input, output).then([input] {});  // input lives until the reduction is waited for
  }
  int64_t scratch_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const override {
    return comm_hooks::reduce_scatter_scratch_bytes(hook_, dtype, input_numel, device);
  }
  std::string name() const override { return hook_.name; }

 private:
  comm_hooks::CommHook hook_;
};

}  // namespace

std::shared_ptr<GradientReducer> hook_reducer(comm_hooks::CommHook hook) {
  if (!hook.state || hook.fn == nullptr)
    throw std::invalid_argument("hook_reducer: hook '" + hook.name + "' needs a state and a function; got " +
                                (hook.state ? "no function" : "no state"));
  return std::make_shared<HookReducer>(std::move(hook));
}

ReducerFactory hook_reducers(const std::string& name) {
  if (name != "reduce_scatter" && name != "fp16" && name != "bf16")
    throw std::invalid_argument("hook_reducers: hook '" + name +
                                "' cannot reduce-scatter; expected reduce_scatter, fp16 or bf16");
  return [name](const ReducerRequest& request) {
    if (request.mesh.shard == nullptr)
      throw std::invalid_argument("hook_reducers('" + name + "'): unit '" + request.unit +
                                  "' came without a shard group (ReducerRequest::mesh.shard)");
    if (request.mesh.replicas() > 1)  // one phase: the replicas would drift apart, silently
      throw std::invalid_argument("hook_reducers('" + name + "'): unit '" + request.unit + "' is on a mesh of " +
                                  std::to_string(request.mesh.replicas()) +
                                  " replicas, which a reduce-scatter in the shard group alone leaves apart; expected "
                                  "a reducer with a second phase across the replicas (hsdp::hsdp_reducers)");
    return hook_reducer(comm_hooks::make_hook(name, *request.mesh.shard));
  };
}

}  // namespace shardlab::fsdp
