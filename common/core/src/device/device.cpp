#include "shardlab/core/device/device.h"

#include "shardlab/core/numbers.h"

#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string_view>

namespace shardlab {

c10::Device parse_device(const std::string& name) {
  const auto bad = [&] {
    return std::invalid_argument("unknown device '" + name + "'; expected cpu, cuda or cuda:N (N a GPU index)");
  };
  if (name == "cpu") return c10::Device(c10::kCPU);
  if (name == "cuda") return c10::Device(c10::kCUDA);
  const std::string prefix = "cuda:";
  if (name.rfind(prefix, 0) != 0) throw bad();
  const std::optional<int64_t> parsed = parse_integer(std::string_view(name).substr(prefix.size()), 0, 999);
  if (!parsed) throw bad();
  const int64_t index = *parsed;
  if (index > std::numeric_limits<c10::DeviceIndex>::max())  // c10 stores the index in a small integer
    throw std::invalid_argument("device '" + name + "': GPU index " + std::to_string(index) + " is out of range; " +
                                "expected at most " + std::to_string(std::numeric_limits<c10::DeviceIndex>::max()));
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

bool cuda_available() { return at::hasCUDA(); }

int cuda_device_count() { return cuda_available() ? static_cast<int>(at::getNumGPUs()) : 0; }

c10::Device device_for_rank(const c10::Device& requested, int local_rank) {
  if (requested.is_cpu()) return requested;
  if (!requested.is_cuda())
    throw std::invalid_argument("device " + requested.str() + " is not supported; expected cpu or cuda");
  const int gpus = cuda_device_count();
  if (gpus == 0)
    throw std::invalid_argument("device " + requested.str() + " requested, but " +
                                (at::Context::hasCUDART() ? std::string("no GPU is visible (CUDA_VISIBLE_DEVICES?)")
                                                          : std::string("this libtorch was built without CUDA")));
  const int index = requested.has_index() ? requested.index() : local_rank;
  if (index < 0 || index >= gpus) {
    const std::string visible = "; " + std::to_string(gpus) + " visible, cuda:0..cuda:" + std::to_string(gpus - 1);
    if (requested.has_index())
      throw std::invalid_argument("device " + requested.str() + " is not a visible GPU" + visible);
    throw std::invalid_argument("device cuda for LOCAL_RANK " + std::to_string(local_rank) +
                                " means cuda:" + std::to_string(index) + ", not a visible GPU" + visible +
                                ": launch at most one process per GPU on each machine");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

void set_current_device(const c10::Device& device) {
  if (device.is_cpu()) return;
  if (!device.has_index())
    throw std::invalid_argument("set_current_device: expected a device with an index (cuda:N); got " + device.str() +
                                " (device_for_rank gives this rank's)");
  c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
}

}  // namespace shardlab
