#include "shardlab/core/comm/text_gather.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstring>
#include <exception>
#include <stdexcept>

namespace shardlab {

std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text) {
  if (comm.size() == 1) return {text};
  const c10::Device device =
      comm.kind() == BackendKind::kNccl ? c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice() : c10::Device(c10::kCPU);
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor lengths = at::empty({comm.size()}, i64);
  comm.all_gather(lengths, at::full({1}, static_cast<int64_t>(text.size()), i64)).wait();
  const at::Tensor sizes = lengths.cpu();
  const int64_t longest = std::max<int64_t>(1, sizes.max().item<int64_t>());
  at::Tensor mine = at::zeros({longest}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(mine.data_ptr<uint8_t>(), text.data(), text.size());
  at::Tensor all = at::empty({comm.size() * longest}, mine.options().device(device));
  comm.all_gather(all, mine.to(device)).wait();
  const at::Tensor bytes = all.cpu();
  std::vector<std::string> out;
  for (int r = 0; r < comm.size(); ++r) {
    const auto* base = reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()) + r * longest;
    out.emplace_back(base, static_cast<size_t>(sizes[r].item<int64_t>()));
  }
  return out;
}

void run_agreed(Communicator& comm, const std::string& what, const std::function<void()>& step) {
  std::exception_ptr failure;
  std::string error;  // failure's message; "" means this rank's step went through, so never empty on a failure
  try {
    step();
  } catch (const std::exception& e) {
    failure = std::current_exception();
    error = *e.what() != '\0' ? e.what() : "an exception with an empty message";
  } catch (...) {
    failure = std::current_exception();
    error = "an exception that is not a std::exception";
  }
  const std::vector<std::string> errors = all_gather_text(comm, error);
  if (failure) std::rethrow_exception(failure);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty())
      throw std::runtime_error(what + " failed on rank " + std::to_string(r) + ", so no rank goes on: " + errors[r]);
}

}  // namespace shardlab
