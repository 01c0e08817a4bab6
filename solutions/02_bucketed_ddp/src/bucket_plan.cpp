#include "shardlab/bucketed_ddp/bucket_plan.h"

#include "shardlab/core/errors.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

namespace shardlab::bucketed_ddp {

void check_caps(const char* who, BucketCaps caps) {
  if (caps.first_bytes <= 0 || caps.bytes <= 0)
    throw std::invalid_argument(std::string(who) + ": bucket caps must be positive; got first " +
                                std::to_string(caps.first_bytes) + " bytes, then " + std::to_string(caps.bytes));
}

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                                                BucketCaps caps) {
  check_caps("assign_buckets", caps);
  if (order.size() != params.size())
    throw std::invalid_argument("assign_buckets: order must list each of the " + std::to_string(params.size()) +
                                " parameters once; got " + std::to_string(order.size()) + " indices");
  std::vector<bool> seen(params.size(), false);
  for (size_t i : order) {
    if (i >= params.size() || seen[i])
      throw std::invalid_argument("assign_buckets: order must be a permutation of [0, " +
                                  std::to_string(params.size()) + "); index " + std::to_string(i) +
                                  (i >= params.size() ? " is out of range" : " appears twice"));
    seen[i] = true;
  }

  std::vector<std::vector<size_t>> buckets;
  // BEGIN SOLUTION(02): fill one open bucket per dtype, close it once it reaches its cap
  struct Open {
    std::vector<size_t> params;
    int64_t bytes = 0;
    bool first = true;  // the next bucket of this dtype is its first one
  };
  std::map<c10::ScalarType, Open> open;
  for (size_t i : order) {
    Open& b = open[params[i].scalar_type()];
    b.params.push_back(i);
    b.bytes += params[i].numel() * static_cast<int64_t>(params[i].element_size());
    if (b.bytes >= (b.first ? caps.first_bytes : caps.bytes)) {
      buckets.push_back(std::move(b.params));
      b = Open{{}, 0, false};
    }
  }
  for (auto& [dtype, b] : open)
    if (!b.params.empty()) buckets.push_back(std::move(b.params));
  // END SOLUTION

  // Sort by where each bucket starts in `order` (buckets of different dtypes interleave).
  std::vector<size_t> position(params.size());
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = k;
  std::stable_sort(buckets.begin(), buckets.end(),
                   [&](const auto& a, const auto& b) { return position[a.front()] < position[b.front()]; });
  return buckets;
}

}  // namespace shardlab::bucketed_ddp
