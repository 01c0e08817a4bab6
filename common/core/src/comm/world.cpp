#include "shardlab/core/comm/world.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace shardlab {

std::string group_name(const std::string& role, const std::vector<int>& ranks) {
  std::ostringstream os;
  os << role << "(";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? "," : "") << ranks[i];
  os << ")";
  return os.str();
}

World::World(c10::intrusive_ptr<c10d::Store> store, int rank, int size, GroupOptions options)
    : store_(std::move(store)), rank_(rank), size_(size), options_(std::move(options)) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("World: expected 0 <= rank < size; got rank " + std::to_string(rank) + ", size " +
                                std::to_string(size));
  if (!store_) throw std::invalid_argument("World: the rendezvous store is null");
  all_ranks_.resize(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) all_ranks_[static_cast<size_t>(r)] = r;
}

std::shared_ptr<World> World::from_environment(GroupOptions options) {
  const RankEnv env = RankEnv::from_environment();
  auto store = compat::make_tcp_store(env.master_addr, env.master_port, env.rank == 0, env.world_size, options.timeout);
  return std::make_shared<World>(std::move(store), env.rank, env.world_size, reachable(env, std::move(options)));
}

World::~World() {
  // Sub-groups first, newest first; the world group last.
  for (auto it = made_.rbegin(); it != made_.rend(); ++it) groups_.erase(*it);
  world_.reset();
}

Communicator& World::world() {
  if (!world_) world_ = make_communicator(store_, rank_, size_, "world", options_, recorder_);
  return *world_;
}

Communicator& World::group(const std::string& name, const std::vector<int>& ranks) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument("World::group '" + name + "' (" + group_name("ranks", ranks) + ") on rank " +
                                std::to_string(rank_) + " of " + std::to_string(size_) + ": " + why);
  };
  if (name.empty() || name == "world") fail("expected a name other than '' and 'world'");
  auto found = groups_.find(name);
  if (found != groups_.end()) {
    if (found->second.ranks != ranks)
      fail("the name is already used for the group " + group_name("ranks", found->second.ranks));
    return *found->second.comm;
  }
  if (ranks.empty()) fail("expected at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size_) fail("rank " + std::to_string(ranks[i]) + " is outside the world");
    if (i > 0 && ranks[i] <= ranks[i - 1]) fail("expected strictly ascending ranks");
  }
  const auto at = std::find(ranks.begin(), ranks.end(), rank_);
  if (at == ranks.end()) fail("this rank is not among them; only members make a group");
  const int group_rank = static_cast<int>(at - ranks.begin());
  auto comm = make_communicator(store_, group_rank, static_cast<int>(ranks.size()), name, options_, recorder_);
  groups_[name] = Group{ranks, comm};
  made_.push_back(name);
  return *comm;
}

const std::vector<int>& World::ranks_of(const std::string& name) const {
  if (name == "world") return all_ranks_;
  auto found = groups_.find(name);
  if (found == groups_.end())
    throw std::invalid_argument("World::ranks_of: rank " + std::to_string(rank_) + " has made no group named '" + name +
                                "'");
  return found->second.ranks;
}

Mesh::Mesh(World& world, int replicate, int shard) : world_(world), replicate_(replicate), shard_(shard) {
  const std::string shape = std::to_string(replicate) + "x" + std::to_string(shard);
  if (replicate < 1 || shard < 1)
    throw std::invalid_argument("mesh " + shape + ": expected replicate >= 1 and shard >= 1 (RxS)");
  if (static_cast<int64_t>(replicate) * shard != world.size())
    throw std::invalid_argument("mesh " + shape + " has " + std::to_string(static_cast<int64_t>(replicate) * shard) +
                                " ranks (replicate x shard), but the world has " + std::to_string(world.size()) +
                                ": expected replicate x shard = world size");
  row_ = world.rank() / shard;
  column_ = world.rank() % shard;
  std::vector<int> row, column;
  for (int s = 0; s < shard; ++s) row.push_back(row_ * shard + s);
  for (int r = 0; r < replicate; ++r) column.push_back(r * shard + column_);
  shard_group_ = &world.group(group_name("shard", row), row);
  replicate_group_ = &world.group(group_name("replicate", column), column);
}

std::pair<int, int> Mesh::parse(const std::string& text) {
  const auto x = text.find('x');
  auto number = [&](const std::string& part) {
    if (part.empty() || part.size() > 6 ||
        !std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return -1;
    return std::atoi(part.c_str());
  };
  const int r = x == std::string::npos ? -1 : number(text.substr(0, x));
  const int s = x == std::string::npos ? -1 : number(text.substr(x + 1));
  if (r < 1 || s < 1)
    throw std::invalid_argument("mesh: expected RxS with R, S >= 1 (replicate x shard, e.g. 2x2); got '" + text + "'");
  return {r, s};
}

std::string Mesh::to_string() const { return std::to_string(replicate_) + "x" + std::to_string(shard_); }

}  // namespace shardlab
