#pragma once
/// @file world.h
/// The world (every rank, one rendezvous store) and the process groups made from it: named sub-groups, and the 2-D
/// mesh of HSDP (replicate × shard). Ranks may be processes (torchrun's environment) or threads (thread_ranks.h).

#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/comm/process_group.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

/// `role` and the global ranks of a group, as its canonical name: "shard(0,1)", "replicate(1,3)". Groups made by
/// Mesh are named this way, so records and traces say which ranks each collective ran among.
std::string group_name(const std::string& role, const std::vector<int>& ranks);

/// One rank's view of all ranks: the rendezvous store, this rank, the world size, the options every group gets,
/// and the recorder every group of this rank writes to (each record names its group and that group's size).
/// It makes the world group and named sub-groups over the one store. Every rank must make the groups it belongs to
/// in the same order as the other members (the members of a group rendezvous under its name). Not thread-safe: one
/// rank, one thread.
class World {
 public:
  /// @param store the rendezvous store every rank shares (a TCPStore for processes, one HashStore for threads).
  /// @param rank this rank, in [0, size).
  /// @param size the number of ranks.
  /// @param options what every group is made with (backend, timeout, address, backend wrapper).
  /// @throws std::invalid_argument unless 0 <= rank < size.
  World(c10::intrusive_ptr<c10d::Store> store, int rank, int size, GroupOptions options = {});
  /// The world of a process launched by torchrun or shardlab-run: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  /// (RankEnv::from_environment); rank 0 serves a TCPStore there. Across machines (MASTER_ADDR not this host's
  /// loopback) Gloo binds to this host's default device unless options.hostname says otherwise.
  static std::shared_ptr<World> from_environment(GroupOptions options = {});
  /// Closes every group of this rank (the world group last).
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  /// This rank's global index.
  int rank() const { return rank_; }
  /// The number of ranks.
  int size() const { return size_; }
  /// What every group is made with.
  const GroupOptions& options() const { return options_; }
  /// The log every group of this rank writes to.
  CommRecorder& recorder() { return *recorder_; }

  /// The group of every rank, named "world"; made by the first call (a collective rendezvous of every rank).
  Communicator& world();
  /// The group of `ranks` (global ranks, strictly ascending, this rank among them) named `name`. The first call
  /// with a name makes the group: every member must make it, under the same name and ranks, in the same order
  /// among its other groups. Later calls return it. A group of one rank needs no other.
  /// @throws std::invalid_argument naming the name and what is wrong: an empty name or "world", empty, unsorted or
  ///         out-of-range ranks, this rank not among them, or a name already used for other ranks.
  Communicator& group(const std::string& name, const std::vector<int>& ranks);
  /// The global ranks of the group named `name` made so far ("world": every rank).
  /// @throws std::invalid_argument when this rank has made no group of that name.
  const std::vector<int>& ranks_of(const std::string& name) const;

 private:
  struct Group {
    std::vector<int> ranks;
    std::shared_ptr<Communicator> comm;
  };
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  GroupOptions options_;
  std::shared_ptr<CommRecorder> recorder_ = std::make_shared<CommRecorder>();
  std::vector<int> all_ranks_;
  std::shared_ptr<Communicator> world_;
  std::map<std::string, Group> groups_;
  std::vector<std::string> made_;  // sub-group names in the order they were made (closed in reverse)
};

/// A 2-D mesh of the world: `replicate` rows × `shard` columns, rank = row · shard + column, as FSDP2's DeviceMesh
/// with dim 0 = replicate and dim 1 = shard. A rank's shard group is its row (contiguous ranks, which a launcher puts
/// on one machine, so that the all-gathers and reduce-scatters stay inside it); its replicate group is its column
/// (one rank per row, the same shard of every parameter, across machines).
class Mesh {
 public:
  /// Checks the shape, then makes this rank's shard group and then its replicate group (the same order on every
  /// rank), named group_name("shard", row) and group_name("replicate", column).
  /// @throws std::invalid_argument before any group is made, when replicate or shard < 1 or replicate · shard is
  ///         not world.size(): the message names the mesh, its product and the world size.
  Mesh(World& world, int replicate, int shard);

  /// Parses the tool's "RxS" (e.g. "2x2").
  /// @throws std::invalid_argument naming the text and the expected form.
  static std::pair<int, int> parse(const std::string& text);

  /// R: the number of replicas (rows).
  int replicate_size() const { return replicate_; }
  /// S: the number of shards (columns).
  int shard_size() const { return shard_; }
  /// This rank's row: which replica it belongs to.
  int replica_index() const { return row_; }
  /// This rank's column: which shard it holds, its rank in the shard group.
  int shard_index() const { return column_; }
  /// The ranks of this rank's row, among which parameters are sharded.
  Communicator& shard_group() { return *shard_group_; }
  /// The ranks of this rank's column, among which the shards are replicated.
  Communicator& replicate_group() { return *replicate_group_; }
  /// The world the mesh was made of.
  World& world() { return world_; }
  /// "RxS".
  std::string to_string() const;

 private:
  World& world_;
  int replicate_;
  int shard_;
  int row_;
  int column_;
  Communicator* shard_group_ = nullptr;
  Communicator* replicate_group_ = nullptr;
};

}  // namespace shardlab
