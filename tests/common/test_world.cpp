// The World and the Mesh: named groups over one store, with threads and with processes; each mesh group reduces
// over exactly its row or column; every record names its group and that group's size; a bad mesh or group is a
// clear error before any group is made.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/course/launcher.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {
namespace {

using test_support::test_group;

// The checks every rank of a mesh runs, threads or processes: the three groups reduce over the world, the row and
// the column, and each record says which group and how large. Returns "" or what went wrong.
std::string check_mesh(World& world, int replicate, int shard) {
  Communicator& all = world.world();
  Mesh mesh(world, replicate, shard);
  const int rank = world.rank();
  std::ostringstream bad;
  auto sum_of = [](const std::vector<int>& ranks) {
    double s = 0;
    for (int r : ranks) s += r;
    return s;
  };
  std::vector<int> row, column;
  for (int s = 0; s < shard; ++s) row.push_back(mesh.replica_index() * shard + s);
  for (int r = 0; r < replicate; ++r) column.push_back(r * shard + mesh.shard_index());
  if (mesh.replica_index() != rank / shard || mesh.shard_index() != rank % shard)
    bad << "rank " << rank << " placed at (" << mesh.replica_index() << ", " << mesh.shard_index() << ")\n";
  if (mesh.shard_group().rank() != mesh.shard_index() || mesh.shard_group().size() != shard)
    bad << "shard group rank/size " << mesh.shard_group().rank() << "/" << mesh.shard_group().size() << "\n";
  if (mesh.replicate_group().rank() != mesh.replica_index() || mesh.replicate_group().size() != replicate)
    bad << "replicate group rank/size " << mesh.replicate_group().rank() << "/" << mesh.replicate_group().size()
        << "\n";
  const size_t mark = world.recorder().size();
  at::Tensor in_world = at::full({3}, static_cast<double>(rank), at::kDouble);
  at::Tensor in_row = in_world.clone(), in_column = in_world.clone();
  all.all_reduce(in_world).wait();
  mesh.shard_group().all_reduce(in_row).wait();
  mesh.replicate_group().all_reduce(in_column).wait();
  std::vector<int> everyone(static_cast<size_t>(world.size()));
  for (int r = 0; r < world.size(); ++r) everyone[static_cast<size_t>(r)] = r;
  const std::pair<const char*, std::pair<at::Tensor, double>> sums[] = {
      {"world", {in_world, sum_of(everyone)}},
      {"shard (row)", {in_row, sum_of(row)}},
      {"replicate (column)", {in_column, sum_of(column)}}};
  for (const auto& [what, got] : sums)
    if (!got.first.equal(at::full({3}, got.second, at::kDouble)))
      bad << what << " sum " << got.first[0].item<double>() << ", expected " << got.second << "\n";
  // Every record of this rank, from all three groups, names its group and its size.
  const auto records = world.recorder().since(mark);
  const std::vector<std::pair<std::string, int>> expected = {
      {"world", world.size()}, {group_name("shard", row), shard}, {group_name("replicate", column), replicate}};
  if (records.size() != expected.size()) bad << records.size() << " records, expected 3\n";
  for (size_t i = 0; i < records.size() && i < expected.size(); ++i)
    if (records[i].group != expected[i].first || records[i].group_size != expected[i].second)
      bad << "record " << i << ": group '" << records[i].group << "' of " << records[i].group_size << ", expected '"
          << expected[i].first << "' of " << expected[i].second << "\n";
  if (world.ranks_of(group_name("shard", row)) != row) bad << "ranks_of(shard) differs\n";
  return bad.str();
}

class MeshOfThreads : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(MeshOfThreads, EachGroupReducesOverItsRowOrColumnAndTheRecordsSayWhich) {
  const auto [replicate, shard] = GetParam();
  std::vector<std::string> problems(static_cast<size_t>(replicate * shard));
  run_world(
      replicate * shard,
      [&](World& world) { problems[static_cast<size_t>(world.rank())] = check_mesh(world, replicate, shard); },
      test_group());
  for (size_t r = 0; r < problems.size(); ++r) EXPECT_EQ(problems[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Common, MeshOfThreads,
                         ::testing::Values(std::make_pair(2, 2), std::make_pair(2, 3), std::make_pair(3, 2),
                                           std::make_pair(1, 4), std::make_pair(4, 1)),
                         [](const ::testing::TestParamInfo<std::pair<int, int>>& info) {
                           return std::to_string(info.param.first) + "x" + std::to_string(info.param.second);
                         });

// Processes: the same checks in 4 processes over one TCPStore (World::from_environment), launched as torchrun
// would. The test binary is its own rank program: with SHARDLAB_TEST_WORLD_RANK set it runs one rank's checks.
TEST(MeshOfProcesses, TwoByTwoOverOneTcpStore) {
  if (std::getenv("SHARDLAB_TEST_WORLD_RANK") != nullptr) {
    auto world = World::from_environment(test_group());
    const std::string problems = check_mesh(*world, 2, 2);
    const RankEnv env = RankEnv::from_environment();
    const char* node = std::getenv("GROUP_RANK");
    std::cout << (problems.empty() ? "mesh ok" : "mesh bad: " + problems) << " (node " << (node ? node : "?")
              << ", local rank " << env.local_rank << ")" << std::endl;
    world->world().barrier();  // nobody closes its groups while another still uses them
    if (!problems.empty()) std::exit(3);
    return;
  }
  LaunchOptions options;
  options.nproc = 4;
  options.timeout = std::chrono::milliseconds(90'000);
  options.extra_env = {{"SHARDLAB_TEST_WORLD_RANK", "1"}};
  std::map<int, std::vector<std::string>> lines;
  const LaunchResult r = launch(options, {"/proc/self/exe", "--gtest_filter=MeshOfProcesses.TwoByTwoOverOneTcpStore"},
                                [&](int rank, const std::string& line) {
                                  std::cout << "  [rank " << rank << "] " << line << "\n";
                                  lines[rank].push_back(line);
                                });
  EXPECT_EQ(r.exit_code, 0) << r.message;
  for (int rank = 0; rank < 4; ++rank) {
    const auto& said = lines[rank];
    const std::string ok = "mesh ok (node 0, local rank " + std::to_string(rank) + ")";
    EXPECT_NE(std::find(said.begin(), said.end(), ok), said.end()) << "rank " << rank << " did not say: " << ok;
  }
}

TEST(MeshChecks, ABadMeshIsAClearErrorBeforeAnyGroupIsMade) {
  run_world(
      4,
      [](World& world) {
        for (auto [replicate, shard] : {std::make_pair(3, 2), std::make_pair(1, 3), std::make_pair(0, 4)}) {
          try {
            Mesh mesh(world, replicate, shard);
            ADD_FAILURE() << "mesh " << replicate << "x" << shard << " accepted on a world of 4";
          } catch (const std::invalid_argument& e) {
            const std::string what = e.what();
            if (world.rank() == 0) std::cout << what << "\n";
            const std::string shape = std::to_string(replicate) + "x" + std::to_string(shard);
            EXPECT_NE(what.find("mesh " + shape), std::string::npos) << what;
            if (replicate > 0) {
              EXPECT_NE(what.find("has " + std::to_string(replicate * shard) + " ranks"), std::string::npos) << what;
              EXPECT_NE(what.find("the world has 4"), std::string::npos) << what;
            }
          }
        }
        EXPECT_EQ(world.recorder().size(), 0u) << "no collective before the error";
        EXPECT_THROW(world.ranks_of(group_name("shard", {0, 1})), std::invalid_argument) << "no group was made";
      },
      test_group());
}

TEST(MeshChecks, ParseTakesRxSAndNamesWhatItGot) {
  EXPECT_EQ(Mesh::parse("2x3"), std::make_pair(2, 3));
  EXPECT_EQ(Mesh::parse("1x8"), std::make_pair(1, 8));
  for (const char* bad : {"", "2", "2x", "x2", "0x4", "2x0", "2*2", "-1x4", "ax2", "2x2x2"}) {
    try {
      Mesh::parse(bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("RxS"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::string("got '") + bad + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(WorldChecks, AGroupNeedsAFreshNameAscendingRanksAndThisRank) {
  run_world(
      2,
      [](World& world) {
        auto expect_error = [&](const std::string& name, const std::vector<int>& ranks, const std::string& part) {
          try {
            world.group(name, ranks);
            ADD_FAILURE() << "group '" << name << "' accepted";
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
          }
        };
        const int me = world.rank(), other = 1 - me;
        expect_error("world", {0, 1}, "other than");
        expect_error("g", {1, 0}, "ascending");
        expect_error("g", {me, 2}, "outside the world");
        expect_error("g", {other}, "not among them");
        expect_error("g", {}, "at least one");
        Communicator& solo = world.group("solo" + std::to_string(me), {me});  // a group of one needs no other rank
        EXPECT_EQ(solo.size(), 1);
        EXPECT_EQ(&world.group("solo" + std::to_string(me), {me}), &solo) << "a later call returns the same group";
        expect_error("solo" + std::to_string(me), {0, 1}, "already used");
        EXPECT_EQ(world.recorder().size(), 0u);
      },
      test_group());
}

}  // namespace
}  // namespace shardlab
