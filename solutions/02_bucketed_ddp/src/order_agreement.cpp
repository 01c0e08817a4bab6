#include "shardlab/bucketed_ddp/order_agreement.h"

#include "shardlab/core/errors.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace shardlab::bucketed_ddp {

std::vector<size_t> agree_on_order(Communicator& comm, const std::vector<size_t>& order, c10::Device device) {
  for (size_t i : order)
    if (i > static_cast<size_t>(std::numeric_limits<int64_t>::max()))
      throw std::invalid_argument("agree_on_order: expected indices that fit in an int64; got " + std::to_string(i));
  std::vector<size_t> agreed;
  // BEGIN SOLUTION(02): rank 0's order, on every rank, in one broadcast of an int64 tensor on `device`
  at::Tensor host = at::empty({static_cast<int64_t>(order.size())}, at::kLong);
  int64_t* slot = host.data_ptr<int64_t>();
  for (size_t k = 0; k < order.size(); ++k) slot[k] = static_cast<int64_t>(order[k]);
  at::Tensor wire = host.to(device);
  comm.broadcast(wire, 0).wait();
  host = wire.cpu();
  slot = host.data_ptr<int64_t>();
  agreed.assign(slot, slot + host.numel());
  // END SOLUTION
  return agreed;
}

}  // namespace shardlab::bucketed_ddp
