#pragma once
// The gtest name of a parameterized case whose parameter prints itself ("tiny_gpt_sgd_w2_m1"), for the last argument
// of INSTANTIATE_TEST_SUITE_P.
#include <sstream>
#include <string>

namespace shardlab::test_support {

/// A test-name generator: the name of `info` is what `info.param`'s operator<< prints.
struct StreamedName {
  template <typename Info>
  std::string operator()(const Info& info) const {
    std::ostringstream s;
    s << info.param;
    return s.str();
  }
};

}  // namespace shardlab::test_support
