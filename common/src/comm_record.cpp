#include "shardlab/common/comm_record.h"

#include <chrono>

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

void CommRecorder::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  records_.clear();
}

}  // namespace shardlab
