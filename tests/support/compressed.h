#pragma once
// The compressed reductions the FSDP and HSDP tests train with (stage 03's fp16 and bf16 on the wire), and how close
// to the f32 single device they must end.
#include "shardlab/course/reference.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::test_support {

/// The compressed reductions by name ("fp16", "bf16"), each with the dtype it reduces in.
inline std::vector<std::pair<std::string, c10::ScalarType>> compressed_reductions() {
  return {{"fp16", at::kHalf}, {"bf16", at::kBFloat16}};
}

/// Checks that `finals`, trained with the compressed reduction `name`, ends within 2e-3 of the f32 reference `want`
/// and not bit-identical to it (a half-size reduction cannot be); prints the difference after `label`.
inline void expect_close_to_f32(const std::vector<at::Tensor>& finals, const std::vector<at::Tensor>& want,
                                const std::string& name, const std::string& label) {
  const double diff = max_abs_diff(finals, want);
  std::cout << label << ": max |param diff| = " << diff << "\n";
  EXPECT_LT(diff, 2e-3) << name;
  EXPECT_GT(diff, 0) << name << ": a half-size reduction cannot be bit-identical to f32";
}

}  // namespace shardlab::test_support
