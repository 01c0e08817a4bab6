#pragma once
// The device the tests put their tensors on. CPU by default; `SHARDLAB_TEST_DEVICE=cuda ctest ...` runs the
// equivalence and collective tests with CUDA tensors (every thread rank on cuda:0, over Gloo, which handles CUDA
// tensors), the way the suite is run on a GPU machine.
#include "shardlab/core/compat.h"
#include "shardlab/core/device/device.h"

#include <cstdlib>
#include <string>

namespace shardlab::test_support {

/// $SHARDLAB_TEST_DEVICE, or "cpu" when it is unset or empty.
inline std::string device_name() {
  const char* raw = std::getenv("SHARDLAB_TEST_DEVICE");
  return raw == nullptr || *raw == '\0' ? std::string("cpu") : std::string(raw);
}

/// The device of device_name(), checked (a bad value or a missing GPU throws, naming what was expected).
inline c10::Device device() { return device_for_rank(parse_device(device_name()), /*local_rank=*/0); }

/// True when NCCL can run here: a CUDA libtorch with c10d NCCL and a visible GPU.
inline bool nccl_usable() { return compat::has_nccl() && cuda_available(); }

}  // namespace shardlab::test_support
