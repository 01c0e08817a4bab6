#include "shardlab/bucketed_ddp/cap_tuning.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

namespace shardlab::bucketed_ddp {

LinkCost fit_link_cost(const std::vector<std::pair<int64_t, double>>& samples) {
  std::set<int64_t> sizes;
  for (const auto& s : samples) sizes.insert(s.first);
  if (sizes.size() < 2)
    throw std::invalid_argument("fit_link_cost: expected samples of at least two distinct sizes; got " +
                                std::to_string(sizes.size()));
  double mx = 0, my = 0;
  for (const auto& [x, y] : samples) {
    mx += static_cast<double>(x);
    my += y;
  }
  mx /= static_cast<double>(samples.size());
  my /= static_cast<double>(samples.size());
  double sxy = 0, sxx = 0;
  for (const auto& [x, y] : samples) {
    sxy += (static_cast<double>(x) - mx) * (y - my);
    sxx += (static_cast<double>(x) - mx) * (static_cast<double>(x) - mx);
  }
  LinkCost c;
  c.beta_ns_per_byte = std::max(0.0, sxy / sxx);
  c.alpha_ns = std::max(0.0, my - c.beta_ns_per_byte * mx);
  return c;
}

LinkCost measure_all_reduce_cost(Communicator& comm, c10::Device device, const std::vector<int64_t>& sizes_bytes,
                                 int repeats) {
  if (repeats < 1)
    throw std::invalid_argument("measure_all_reduce_cost: expected repeats >= 1; got " + std::to_string(repeats));
  std::vector<std::pair<int64_t, double>> samples;
  for (int64_t bytes : sizes_bytes) {
    if (bytes < 4)
      throw std::invalid_argument("measure_all_reduce_cost: expected sizes of at least 4 bytes; got " +
                                  std::to_string(bytes));
    at::Tensor t = at::ones({bytes / 4}, at::TensorOptions().dtype(at::kFloat).device(device));
    comm.all_reduce(t, ReduceOp::kAvg).wait();  // warm-up: connections, buffers
    std::vector<double> ns;
    for (int k = 0; k < repeats; ++k) {
      const int64_t start = now_ns();
      comm.all_reduce(t, ReduceOp::kAvg).wait();
      ns.push_back(static_cast<double>(now_ns() - start));
    }
    std::nth_element(ns.begin(), ns.begin() + static_cast<std::ptrdiff_t>(ns.size() / 2), ns.end());
    samples.emplace_back((bytes / 4) * 4, ns[ns.size() / 2]);
  }
  const LinkCost mine = fit_link_cost(samples);
  // Every rank must choose the same caps: agree on the group's average figures.
  at::Tensor both = at::tensor({mine.alpha_ns, mine.beta_ns_per_byte}, at::kDouble).to(device);
  comm.all_reduce(both, ReduceOp::kAvg).wait();
  both = both.cpu();
  return {both[0].item<double>(), both[1].item<double>()};
}

namespace {

// One backward replayed with `caps`: its modelled exposed time and how many buckets it had.
struct Replay {
  double exposed_ns = 0;
  size_t buckets = 0;
};

Replay replay(const BackwardProfile& profile, BucketCaps caps, LinkCost cost) {
  const size_t n = profile.params.size();
  if (n == 0 || profile.ready_ns.size() != n || profile.order.size() != n)
    throw std::invalid_argument("modelled_exposed_ns: expected as many ready times and order entries as parameters (" +
                                std::to_string(n) + "); got " + std::to_string(profile.ready_ns.size()) + " and " +
                                std::to_string(profile.order.size()));
  // Note [The bucket timeline model] (cap_tuning.h).
  double launch = -std::numeric_limits<double>::infinity(), end = launch;
  const auto buckets = assign_buckets(profile.params, profile.order, caps);
  for (const auto& bucket : buckets) {
    double ready = -std::numeric_limits<double>::infinity();
    int64_t bytes = 0;
    for (size_t i : bucket) {
      ready = std::max(ready, static_cast<double>(profile.ready_ns[i]));
      bytes += profile.params[i].numel() * static_cast<int64_t>(profile.params[i].element_size());
    }
    launch = std::max(ready, launch);
    end = std::max(launch, end) + cost.ns(bytes);
  }
  return {std::max(0.0, end - static_cast<double>(profile.end_ns)), buckets.size()};
}

}  // namespace

double modelled_exposed_ns(const BackwardProfile& profile, BucketCaps caps, LinkCost cost) {
  return replay(profile, caps, cost).exposed_ns;
}

BucketCaps choose_caps(const BackwardProfile& profile, LinkCost cost, std::vector<int64_t> grid,
                       std::optional<BucketCaps> in_use) {
  if (profile.params.empty()) throw std::invalid_argument("choose_caps: expected a profile with parameters; got none");
  if (grid.empty()) {
    int64_t total = 0;
    for (const auto& p : profile.params) total += p.numel() * static_cast<int64_t>(p.element_size());
    for (int64_t c = 1024;; c *= 2) {
      grid.push_back(c);
      if (c >= total) break;
    }
  }
  for (int64_t c : grid)
    if (c <= 0) throw std::invalid_argument("choose_caps: expected positive grid caps; got " + std::to_string(c));
  if (in_use) check_caps("choose_caps (the caps in use)", *in_use);
  BucketCaps best{grid.front(), grid.front()};
  std::tuple<double, size_t, int64_t, int64_t> best_key{std::numeric_limits<double>::infinity(), 0, 0, 0};
  for (int64_t first : grid)
    for (int64_t later : grid) {
      const BucketCaps caps{first, later};
      const Replay r = replay(profile, caps, cost);
      // least exposed, then fewest buckets, then the larger caps (negated: smaller key wins)
      const std::tuple<double, size_t, int64_t, int64_t> key{r.exposed_ns, r.buckets, -first, -later};
      if (key < best_key) {
        best_key = key;
        best = caps;
      }
    }
  if (in_use && replay(profile, *in_use, cost).exposed_ns <= std::get<0>(best_key)) return *in_use;
  return best;
}

}  // namespace shardlab::bucketed_ddp
