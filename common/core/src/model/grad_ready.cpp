#include "shardlab/core/model/grad_ready.h"

#include "shardlab/core/comm/progress.h"
#include "shardlab/core/compat.h"

#include <stdexcept>
#include <string>

namespace shardlab {

GradientReadiness::GradientReadiness(const std::vector<at::Tensor>& params, Ready ready, EndOfBackward end)
    : ready_(std::move(ready)), end_(std::move(end)) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined() || !params[i].is_leaf() || !params[i].requires_grad())
      throw std::invalid_argument("GradientReadiness: parameter " + std::to_string(i) +
                                  " must be a leaf tensor that requires grad");
  }
  accumulators_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    std::weak_ptr<int> alive = alive_;
    accumulators_.push_back(compat::add_post_accumulate_hook(params[i], [this, alive, i] {
      if (alive.expired()) return;
      ready_(i);
      progress_point();  // Note [Yielding to communication]
    }));
  }
}

GradientReadiness::~GradientReadiness() = default;  // alive_ goes first: hooks left on the parameters turn inert

void GradientReadiness::expect_end_of_backward() {
  if (end_pending_) return;
  end_pending_ = true;
  std::weak_ptr<int> alive = alive_;
  compat::queue_end_of_backward([this, alive] {
    if (alive.expired()) return;
    end_pending_ = false;
    end_();
  });
}

bool GradientReadiness::forget_pending_end() {
  const bool was = end_pending_;
  end_pending_ = false;
  return was;
}

}  // namespace shardlab
