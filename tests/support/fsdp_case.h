#pragma once
// One case of stage 04's equivalence tests (FSDP against one device), shared by the tests of a model built whole
// and of one built sharded, and its name as the case's gtest suffix ("tiny_gpt_sgd_w2_m1_raf"); and the two ranks
// under FSDP that stage 04's schedule and memory tests look into.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"
#include "shardlab/fsdp/fsdp.h"

#include "support/group.h"
#include "support/tolerance.h"
#include "support/train_replica.h"

#include <ostream>
#include <string>
#include <vector>

namespace shardlab::test_support {

struct FsdpCase {
  std::string model, optimizer;
  int world, micro;  // ranks, micro-batches per step
  bool raf;          // reshard after forward
};

inline std::ostream& operator<<(std::ostream& os, const FsdpCase& e) {
  return os << e.model << "_" << e.optimizer << "_w" << e.world << "_m" << e.micro << (e.raf ? "_raf" : "_keep");
}

/// The case's FSDP options: resharding after forward as `e.raf` says; the edge model's `sometimes` (no gradient
/// on odd steps) allowed to go unused.
inline fsdp::Options options_of(const FsdpCase& e) {
  fsdp::Options options;
  options.reshard_after_forward = e.raf;
  options.allow_unused_parameters = e.model == "edge";
  return options;
}

/// Trains `c` on `e.world` thread ranks, each through the FullyShardedModel `wrap(comm, options_of(e))` returns,
/// with the batches on `device`, and checks every rank's final parameters against one device's (expect_ranks_match).
template <typename Wrap>
void expect_case_trains_like_one_device(const FsdpCase& e, const TrainConfig& c, const c10::Device& device, Wrap wrap) {
  const fsdp::Options options = options_of(e);
  const ReferenceResult ref = train_reference(c);
  std::vector<std::vector<at::Tensor>> finals(e.world);
  run_ranks(
      e.world,
      [&](Communicator& comm) {
        auto fsdp = wrap(comm, options);
        train_steps(comm, c, fsdp.parameters(), device, fsdp);
        finals[comm.rank()] = on_cpu(fsdp.full_parameters());
      },
      test_group());
  expect_ranks_match(finals, ref.params, e);
}

/// On 2 thread ranks, FSDP with `options` over `c`'s model (on CPU): `body(comm, fsdp, batch)`, `batch` this rank's
/// half of global batch 0 of `c`'s data.
template <typename Body>
void fsdp_on_two_ranks(const TrainConfig& c, const fsdp::Options& options, Body body) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        fsdp::FullyShardedModel fsdp(make_model(c, at::kCPU), comm, options);
        body(comm, fsdp, rank_slice(make_dataset(c.model, c.seed)->global_batch(0, c.global_batch), comm.rank(), 2));
      },
      test_group());
}

}  // namespace shardlab::test_support
