#pragma once
// The batch the tests of hand-built models feed them: inputs evenly spaced over [-1, 1], every target class 0.
#include "shardlab/core/model/model.h"

#include <ATen/ATen.h>

#include <cstdint>

namespace shardlab::test_support {

/// `rows` examples of `cols` features, at::linspace(-1, 1) over all rows * cols of them in row-major order; every
/// target class 0.
inline Batch spaced_batch(int64_t rows, int64_t cols) {
  Batch b;
  b.input = at::linspace(-1.0, 1.0, rows * cols).reshape({rows, cols});
  b.target = at::zeros({rows}, at::kLong);
  return b;
}

}  // namespace shardlab::test_support
