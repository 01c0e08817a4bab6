#include "shardlab/core/comm/process_group.h"

#include "shardlab/core/numbers.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

namespace shardlab {
namespace {

// Reads integer variable `name`; `fallback` < 0 means required.
int env_int(const char* name, int fallback, int min_value) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') {
    if (fallback >= 0) return fallback;
    throw std::invalid_argument(std::string("environment variable ") + name +
                                " is not set; expected an integer (set by torchrun or shardlab-run)");
  }
  const std::optional<int64_t> v = parse_integer(raw, min_value, 1'000'000);
  if (!v)
    throw std::invalid_argument(std::string("environment variable ") + name +
                                " must be an integer >= " + std::to_string(min_value) + "; got '" + raw + "'");
  return static_cast<int>(*v);
}

}  // namespace

RankEnv RankEnv::from_environment() {
  RankEnv env;
  env.world_size = env_int("WORLD_SIZE", -1, 1);
  env.rank = env_int("RANK", -1, 0);
  if (env.rank >= env.world_size)
    throw std::invalid_argument("RANK must be in [0, WORLD_SIZE=" + std::to_string(env.world_size) + "); got " +
                                std::to_string(env.rank));
  env.local_rank = env_int("LOCAL_RANK", env.rank, 0);
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0')
    throw std::invalid_argument("environment variable MASTER_ADDR is not set; expected the host of rank 0");
  env.master_addr = addr;
  env.master_port = env_int("MASTER_PORT", -1, 1);
  if (env.master_port > 65535)
    throw std::invalid_argument("MASTER_PORT must be in [1, 65535]; got " + std::to_string(env.master_port));
  return env;
}

std::shared_ptr<Communicator> make_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                const std::string& name, const GroupOptions& options,
                                                std::shared_ptr<CommRecorder> recorder) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("make_communicator: expected 0 <= rank < size; got rank " + std::to_string(rank) +
                                ", size " + std::to_string(size));
  if (name.empty()) throw std::invalid_argument("make_communicator: the group needs a non-empty name");
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("shardlab/" + name, store);
  auto backend = options.kind == BackendKind::kNccl
                     ? compat::make_nccl(prefixed, rank, size, options.timeout)
                     : compat::make_gloo(prefixed, rank, size, options.timeout, options.hostname);
  if (options.wrap_backend) {
    backend = options.wrap_backend(std::move(backend), rank);
    if (!backend) throw std::invalid_argument("make_communicator: GroupOptions::wrap_backend returned no backend");
    if (backend->getRank() != rank || backend->getSize() != size)
      throw std::invalid_argument("make_communicator: GroupOptions::wrap_backend returned a backend of rank " +
                                  std::to_string(backend->getRank()) + " of " + std::to_string(backend->getSize()) +
                                  "; expected rank " + std::to_string(rank) + " of " + std::to_string(size));
  }
  auto comm =
      std::make_shared<Communicator>(std::move(backend), options.kind, name, options.timeout, std::move(recorder));
  const char* check = std::getenv("SHARDLAB_CHECK_COLLECTIVES");
  comm->set_check_collectives(options.check_collectives || (check != nullptr && std::string(check) == "1"));
  return comm;
}

GroupOptions reachable(const RankEnv& env, GroupOptions options) {
  if (env.master_addr != "127.0.0.1" && env.master_addr != "localhost" && options.hostname == "127.0.0.1")
    options.hostname = "";
  return options;
}

std::shared_ptr<Communicator> communicator_from_env(const GroupOptions& options) {
  const RankEnv env = RankEnv::from_environment();
  auto store = compat::make_tcp_store(env.master_addr, env.master_port, env.rank == 0, env.world_size, options.timeout);
  return make_communicator(store, env.rank, env.world_size, "world", reachable(env, options));
}

}  // namespace shardlab
