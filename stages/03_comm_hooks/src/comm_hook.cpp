#include "shardlab/comm_hooks/comm_hook.h"

#include "shardlab/core/errors.h"

#include <ATen/ATen.h>

#include <sstream>
#include <stdexcept>
#include <utility>

// Note [Pre- and post-division]
// The average over W ranks is sum(g_r) / W. Dividing after the sum lets the sum overflow (fp16 tops out at 65504:
// 64 ranks with gradients of 2000 already overflow); dividing before lets small gradients underflow (g / 64 loses
// bits or flushes to zero in fp16). FSDP splits the division: g / pre before the sum, sum / post after it, with
// pre * post == W and pre about sqrt(W), so both risks shrink. The factor is a power of two, so g / pre and every
// partial sum of the g / pre are exact scalings of the plain ones (barring underflow), and the post-division rounds
// exactly the real number sum / W, once: in f32 the hook gives stage 02's all_reduce(AVG) bit for bit at any W,
// even W = 3 (post 1.5). In fp16 the split is what keeps the sum and the quotients in range.
// A factor of 1 is skipped: it would only cost a pass over the gradient.
//
// Note [Hooks never block]
// Hooks run on the backward thread as buckets become ready; waiting there would serialize communication with the
// rest of backward (stage 02's overlap). Everything after the collective (post-division, cast back, copy into the
// output) is chained with Handle::then and runs in the caller's wait(), i.e. at the end of backward.

namespace shardlab::comm_hooks {
namespace {

[[noreturn]] void fail(const char* hook, const std::string& what) {
  throw std::invalid_argument(std::string(hook) + ": " + what);
}

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << c10::toString(t.scalar_type()) << " tensor of " << t.numel() << " elements on " << t.device();
  return s.str();
}

// Checks what every hook needs; `form` says which of the two forms the caller wants ("any" accepts both).
enum class Form { kAllReduce, kReduceScatter, kAny };

void check_args(const char* hook, const DefaultState& state, const at::Tensor& grad, const at::Tensor& output,
                Form form) {
  if (state.comm == nullptr) fail(hook, "the state has no Communicator");
  if (!grad.defined()) fail(hook, "expected a gradient tensor; got an undefined tensor");
  if (!c10::isFloatingType(grad.scalar_type()))
    fail(hook, "expected a floating-point gradient; got a " + describe(grad));
  if (!grad.is_contiguous())
    fail(hook, "expected a contiguous gradient; got sizes " + c10::str(grad.sizes()) + " strides " +
                   c10::str(grad.strides()));
  if (form == Form::kAllReduce && output.defined())
    fail(hook, "all-reduce form: expected no output (the average is left in grad); got an output " + describe(output) +
                   ". Use reduce_scatter_hook for a sharded output");
  if (form == Form::kReduceScatter && !output.defined())
    fail(hook, "reduce-scatter form: expected an output of grad.numel() / world_size = " +
                   std::to_string(grad.numel()) + " / " + std::to_string(state.world_size) +
                   " elements; got no output. Use allreduce_hook to average grad in place");
  if (!output.defined()) return;
  if (grad.numel() != state.world_size * output.numel()) {
    const std::string world = std::to_string(state.world_size);
    if (grad.numel() % state.world_size == 0)
      fail(hook, "reduce-scatter form: expected an output of grad.numel() / world_size = " +
                     std::to_string(grad.numel()) + " / " + world + " = " +
                     std::to_string(grad.numel() / state.world_size) + " elements; got output " + describe(output));
    fail(hook, "reduce-scatter form: grad.numel() must be world_size * output.numel() = " + world + " * " +
                   std::to_string(output.numel()) + " = " + std::to_string(state.world_size * output.numel()) +
                   "; got grad " + describe(grad) + " (not a multiple of world_size " + world + ")");
  }
  if (output.scalar_type() != grad.scalar_type() || output.device() != grad.device())
    fail(hook, "reduce-scatter form: output must have grad's dtype and device (the parameter's); got grad " +
                   describe(grad) + " and output " + describe(output));
  if (!output.is_contiguous()) fail(hook, "reduce-scatter form: expected a contiguous output");
}

}  // namespace

double gradient_predivide_factor(int world_size) {
  if (world_size < 1)
    throw std::invalid_argument("gradient_predivide_factor: expected a world size >= 1; got " +
                                std::to_string(world_size));
  // TODO(stage03): FSDP's pre-divide rule (see Note [Pre- and post-division])
  throw ::shardlab::NotImplemented("03", "FSDP's pre-divide rule (see Note [Pre- and post-division])");
}

DefaultState::DefaultState(Communicator& c)
    : comm(&c),
      world_size(c.size()),
      gradient_predivide_factor(comm_hooks::gradient_predivide_factor(c.size())),
      gradient_postdivide_factor(c.size() / gradient_predivide_factor) {}

Handle allreduce_hook(DefaultState& state, const at::Tensor& grad, const at::Tensor& output) {
  check_args("allreduce_hook", state, grad, output, Form::kAllReduce);
  // TODO(stage03): grad holds the group's average once the handle's wait() returns; the hook never blocks
  throw ::shardlab::NotImplemented("03", "grad holds the group's average once the handle's wait() returns; the hook never blocks");
}

Handle reduce_scatter_hook(DefaultState& state, const at::Tensor& grad, const at::Tensor& output) {
  check_args("reduce_scatter_hook", state, grad, output, Form::kReduceScatter);
  // TODO(stage03): output holds this rank's chunk of the average once wait() returns; never block
  throw ::shardlab::NotImplemented("03", "output holds this rank's chunk of the average once wait() returns; never block");
}

namespace {

// The seed's _low_precision_hook: communicate a `prec` copy of the gradient, cast the average back.
Handle low_precision_hook(const char* hook, c10::ScalarType prec, DefaultState& state, const at::Tensor& grad,
                          const at::Tensor& output) {
  check_args(hook, state, grad, output, Form::kAny);
  // TODO(stage03): the average computed in `prec`, every division included; the result in grad's or output's dtype
  throw ::shardlab::NotImplemented("03", "the average computed in `prec`, every division included; the result in grad's or output's dtype");
}

}  // namespace

Handle fp16_compress_hook(DefaultState& state, const at::Tensor& grad, const at::Tensor& output) {
  return low_precision_hook("fp16_compress_hook", at::kHalf, state, grad, output);
}

Handle bf16_compress_hook(DefaultState& state, const at::Tensor& grad, const at::Tensor& output) {
  return low_precision_hook("bf16_compress_hook", at::kBFloat16, state, grad, output);
}

Handle CommHook::operator()(const at::Tensor& grad, const at::Tensor& output) const {
  if (!state || !fn)
    throw std::invalid_argument("CommHook '" + name + "': expected a state and a function; got " +
                                (state ? "" : "no state") + (!state && !fn ? " and " : "") + (fn ? "" : "no function"));
  return fn(*state, grad, output);
}

int64_t reduce_scatter_scratch_bytes(const CommHook& hook, c10::ScalarType dtype, int64_t grad_numel,
                                     c10::Device device) {
  SHARDLAB_INTERNAL_ASSERT(hook.state && hook.state->comm, "reduce_scatter_scratch_bytes: hook '" + hook.name +
                                                               "' has no state bound to a Communicator");
  const Communicator& comm = *hook.state->comm;
  const bool compresses = hook.fn == &fp16_compress_hook || hook.fn == &bf16_compress_hook;
  const c10::ScalarType wire = hook.fn == &fp16_compress_hook   ? at::kHalf
                               : hook.fn == &bf16_compress_hook ? at::kBFloat16
                                                                : dtype;
  const auto elem = static_cast<int64_t>(c10::elementSize(wire));
  // The compressing hooks: the cast of the gradient (none when it already has the wire dtype; it is freed once the
  // reduce-scatter has its own copy, counted here for the whole flight: an upper bound) and the reduced chunk.
  const int64_t copies = compresses ? (wire == dtype ? 0 : grad_numel * elem) + grad_numel / comm.size() * elem : 0;
  return copies + comm.reduce_scatter_scratch_bytes(wire, grad_numel, device);
}

const std::vector<std::string>& hook_names() {
  static const std::vector<std::string> names{"allreduce", "reduce_scatter", "fp16", "bf16"};
  return names;
}

CommHook make_hook(const std::string& name, Communicator& comm) {
  HookFn fn = nullptr;
  if (name == "allreduce")
    fn = &allreduce_hook;
  else if (name == "reduce_scatter")
    fn = &reduce_scatter_hook;
  else if (name == "fp16")
    fn = &fp16_compress_hook;
  else if (name == "bf16")
    fn = &bf16_compress_hook;
  if (fn == nullptr) {
    std::string list;
    for (const auto& n : hook_names()) list += (list.empty() ? "" : ", ") + n;
    throw std::invalid_argument("make_hook: unknown communication hook '" + name + "'; expected one of: " + list);
  }
  return CommHook{name, std::make_shared<DefaultState>(comm), fn};
}

bucketed_ddp::BucketReducer as_bucket_reducer(CommHook hook) {
  if (!hook.state || !hook.fn)
    throw std::invalid_argument("as_bucket_reducer: hook '" + hook.name + "' has no state or no function");
  if (hook.fn == &reduce_scatter_hook)
    throw std::invalid_argument("as_bucket_reducer: hook '" + hook.name +
                                "' is reduce-scatter only, but a DDP bucket is averaged whole (no output shard); "
                                "use allreduce, fp16 or bf16");
  return [hook = std::move(hook)](Communicator& comm, const at::Tensor& bucket) {
    if (&comm != hook.state->comm)
      throw std::invalid_argument("as_bucket_reducer: hook '" + hook.name + "' is bound to group '" +
                                  hook.state->comm->name() + "' but the bucket is reduced on group '" + comm.name() +
                                  "'; make the hook with the Communicator given to BucketedDDP");
    return hook(bucket);
  };
}

}  // namespace shardlab::comm_hooks
