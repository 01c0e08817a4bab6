#include "shardlab/core/comm/comm_record.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace shardlab {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

size_t CommRecorder::begin(CollectiveRecord r) {
  std::lock_guard<std::mutex> lock(mu_);
  records_.push_back(std::move(r));
  return records_.size() - 1;
}

void CommRecorder::finish(size_t index) {
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  if (index < records_.size() && records_[index].end_ns == 0) records_[index].end_ns = t;
}

std::vector<CollectiveRecord> CommRecorder::snapshot() const { return since(0); }

std::vector<CollectiveRecord> CommRecorder::since(size_t from) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (from >= records_.size()) return {};
  return {records_.begin() + static_cast<std::ptrdiff_t>(from), records_.end()};
}

size_t CommRecorder::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_.size();
}

void CommRecorder::record_wait(std::string what, int64_t start_ns, int64_t end_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  waits_.push_back({std::move(what), start_ns, end_ns});
}

void CommRecorder::record_busy(int64_t start_ns, int64_t end_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  if (start_ns < end_ns) busy_.emplace_back(start_ns, end_ns);
}

std::vector<WaitRecord> CommRecorder::waits() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (busy_.empty()) return waits_;
  std::vector<std::pair<int64_t, int64_t>> busy = busy_;
  std::sort(busy.begin(), busy.end());
  int64_t max_busy = 0;  // the longest busy span: none starting earlier than a wait minus it can reach into the wait
  for (const auto& [a, b] : busy) max_busy = std::max(max_busy, b - a);
  std::vector<WaitRecord> out;
  for (const auto& w : waits_) {
    int64_t from = w.start_ns;
    // Busy spans sorted by start: skip those that begin before the wait can hold them, stop at the first after it.
    for (auto it = std::lower_bound(busy.begin(), busy.end(), std::make_pair(w.start_ns - max_busy, int64_t{0}));
         it != busy.end() && it->first < w.end_ns; ++it) {
      const auto [a, b] = *it;
      if (b <= from) continue;
      if (a > from) out.push_back({w.what, from, a});
      from = std::max(from, b);
    }
    if (from < w.end_ns) out.push_back({w.what, from, w.end_ns});
  }
  return out;
}

}  // namespace shardlab

namespace shardlab {
namespace {

using Intervals = std::vector<std::pair<int64_t, int64_t>>;

// Sorted, disjoint union of the given intervals clipped to [from, to).
Intervals merged(const Intervals& v, int64_t from, int64_t to) {
  Intervals clipped;
  for (auto [a, b] : v) {
    a = std::max(a, from);
    b = std::min(b, to);
    if (a < b) clipped.emplace_back(a, b);
  }
  std::sort(clipped.begin(), clipped.end());
  Intervals out;
  for (const auto& iv : clipped) {
    if (!out.empty() && iv.first <= out.back().second)
      out.back().second = std::max(out.back().second, iv.second);
    else
      out.push_back(iv);
  }
  return out;
}

int64_t length(const Intervals& v) {
  int64_t n = 0;
  for (const auto& [a, b] : v) n += b - a;
  return n;
}

}  // namespace

CommTime comm_time(const std::vector<CollectiveRecord>& records, const std::vector<WaitRecord>& waits, int64_t from_ns,
                   int64_t to_ns) {
  Intervals comm, wait;
  for (const auto& r : records)
    if (r.end_ns != 0) comm.emplace_back(r.start_ns, r.end_ns);
  for (const auto& w : waits) wait.emplace_back(w.start_ns, w.end_ns);
  const Intervals c = merged(comm, from_ns, to_ns), w = merged(wait, from_ns, to_ns);
  CommTime t;
  t.busy_ns = length(c);
  // Two sorted disjoint lists: sweep for their intersection.
  size_t i = 0, j = 0;
  while (i < c.size() && j < w.size()) {
    const int64_t a = std::max(c[i].first, w[j].first), b = std::min(c[i].second, w[j].second);
    if (a < b) t.exposed_ns += b - a;
    (c[i].second < w[j].second) ? ++i : ++j;
  }
  return t;
}

}  // namespace shardlab
