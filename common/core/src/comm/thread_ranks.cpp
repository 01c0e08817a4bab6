#include "shardlab/core/comm/thread_ranks.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <exception>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

namespace shardlab {

void run_world(int world_size, const std::function<void(World&)>& fn, const GroupOptions& options) {
  if (world_size < 1)
    throw std::invalid_argument("run_world: world_size must be >= 1; got " + std::to_string(world_size));
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world_size);
  // Every rank's groups live until every rank is done: Gloo's rendezvous is not a barrier, and a rank that finished
  // first and closed its connections made a slower rank's rendezvous fail ("Connection closed by peer").
  std::vector<std::unique_ptr<World>> worlds(world_size);
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        worlds[rank] = std::make_unique<World>(store, rank, world_size, options);
        fn(*worlds[rank]);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      } catch (...) {
        errors[rank] = "unknown exception";
      }
    });
  }
  for (auto& t : threads) t.join();
  worlds.clear();
  for (int rank = 0; rank < world_size; ++rank)
    if (!errors[rank].empty()) throw std::runtime_error("rank " + std::to_string(rank) + ": " + errors[rank]);
}

void run_ranks(int world_size, const std::function<void(Communicator&)>& fn, const GroupOptions& options) {
  run_world(
      world_size, [&](World& world) { fn(world.world()); }, options);
}

}  // namespace shardlab
