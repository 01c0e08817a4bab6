#pragma once
// One case of stage 04's equivalence tests (FSDP against one device), shared by the tests of a model built whole
// and of one built sharded, and its name as the case's gtest suffix ("tiny_gpt_sgd_w2_m1_raf").
#include <ostream>
#include <string>

namespace shardlab::test_support {

struct FsdpCase {
  std::string model, optimizer;
  int world, micro;  // ranks, micro-batches per step
  bool raf;          // reshard after forward
};

inline std::ostream& operator<<(std::ostream& os, const FsdpCase& e) {
  return os << e.model << "_" << e.optimizer << "_w" << e.world << "_m" << e.micro << (e.raf ? "_raf" : "_keep");
}

}  // namespace shardlab::test_support
