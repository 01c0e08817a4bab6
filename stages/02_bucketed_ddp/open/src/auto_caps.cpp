#include "shardlab/bucketed_ddp/auto_caps.h"

#include <ATen/ATen.h>

#include <utility>

namespace shardlab::bucketed_ddp {

void AutoCaps::after_optimizer_step() {
  if (choice_ || ddp_.caps_set() || !ddp_.rebuilt()) return;
  const c10::Device device = ddp_.parameters().front().device();
  CapChoice c;
  const size_t first_record = comm_.recorder().size();
  c.cost = measure_all_reduce_cost(comm_, device);
  c.profile = ddp_.last_backward_profile();
  c.before = ddp_.caps();
  // Every rank chooses from its own profile; rank 0's choice is the one every rank takes.
  BucketCaps mine = choose_caps(c.profile, c.cost, {}, c.before);
  at::Tensor wire = at::tensor({mine.first_bytes, mine.bytes}, at::kLong).to(device);
  comm_.broadcast(wire, 0).wait();
  wire = wire.cpu();
  c.chosen = {wire[0].item<int64_t>(), wire[1].item<int64_t>()};
  ddp_.set_caps(c.chosen);
  c.setup = {first_record, comm_.recorder().size()};
  c.exposed_before_ns = modelled_exposed_ns(c.profile, c.before, c.cost);
  c.exposed_chosen_ns = modelled_exposed_ns(c.profile, c.chosen, c.cost);
  choice_ = std::move(c);
}

}  // namespace shardlab::bucketed_ddp
