#include "shardlab/prefetch/prefetch_policy.h"

#include <algorithm>
#include <set>
#include <stdexcept>

namespace shardlab::prefetch {

int in_flight_limit(const PrefetchPolicy& policy) {
  if (policy.max_in_flight > 0) return policy.max_in_flight;
  int limit = std::max({1, policy.forward_depth, policy.backward_depth});
  for (const auto* lists : {&policy.forward_lists, &policy.backward_lists})
    for (const auto& item : *lists) limit = std::max(limit, static_cast<int>(item.second.size()));
  return limit;
}

void validate(const PrefetchPolicy& policy, const std::vector<std::string>& units) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("PrefetchPolicy: " + what); };
  if (policy.forward_depth < 0) fail("forward_depth: expected 0 or more; got " + std::to_string(policy.forward_depth));
  if (policy.backward_depth < 0)
    fail("backward_depth: expected 0 or more; got " + std::to_string(policy.backward_depth));
  if (policy.max_in_flight < 0)
    fail("max_in_flight: expected 0 (as deep as asked) or more; got " + std::to_string(policy.max_in_flight));
  const std::set<std::string> known(units.begin(), units.end());
  std::string names;
  for (const auto& u : units) names += (names.empty() ? "" : ", ") + u;
  const std::pair<const char*, const std::map<std::string, std::vector<std::string>>*> fields[] = {
      {"forward_lists", &policy.forward_lists}, {"backward_lists", &policy.backward_lists}};
  for (const auto& [field, lists] : fields) {
    for (const auto& [owner, list] : *lists) {
      const std::string where = std::string(field) + "['" + owner + "']";
      if (!known.count(owner)) fail(where + ": expected a unit name (" + names + "); got '" + owner + "'");
      std::set<std::string> seen;
      for (const auto& name : list) {
        if (!known.count(name)) fail(where + ": expected unit names (" + names + "); got '" + name + "'");
        if (name == owner) fail(where + ": a unit cannot prefetch itself; got '" + name + "' in its own list");
        if (!seen.insert(name).second) fail(where + ": expected each unit once; got '" + name + "' twice");
      }
      if (policy.max_in_flight > 0 && static_cast<int>(list.size()) > policy.max_in_flight)
        fail(where + ": " + std::to_string(list.size()) + " units, more than max_in_flight (" +
             std::to_string(policy.max_in_flight) + "); raise max_in_flight or shorten the list");
    }
  }
}

}  // namespace shardlab::prefetch
