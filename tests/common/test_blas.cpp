// Note [BLAS threads per rank]: which BLAS this process runs on, OpenBLAS's thread count, and the launcher giving
// every rank OMP_NUM_THREADS=1 unless the user chose.
#include "shardlab/course/blas.h"
#include "shardlab/course/launcher.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

namespace shardlab {
namespace {

TEST(Blas, DescribesTheBlasAndSetsOpenBlasThreads) {
  const std::string blas = blas_description();
  std::cout << "BLAS: " << blas << ", threads " << blas_threads() << "\n";
  ASSERT_FALSE(blas.empty());
  const bool openblas = blas.rfind("OpenBLAS", 0) == 0;
  if (!openblas) GTEST_SKIP() << "not OpenBLAS (" << blas << "): it has no threads to set";
  const int before = blas_threads();
  EXPECT_TRUE(set_blas_threads(2));
  EXPECT_EQ(blas_threads(), 2);
  EXPECT_TRUE(set_blas_threads(1));
  EXPECT_EQ(blas_threads(), 1);
  set_blas_threads(before);
  EXPECT_THROW(set_blas_threads(0), std::invalid_argument);
}

// Each rank prints its OMP_NUM_THREADS ("unset" when it has none).
std::map<int, std::string> omp_threads_of_ranks(const LaunchOptions& options) {
  std::map<int, std::string> seen;
  const LaunchResult r = launch(options, {"sh", "-c", "echo \"omp=${OMP_NUM_THREADS:-unset}\""},
                                [&](int rank, const std::string& line) { seen[rank] = line; });
  EXPECT_EQ(r.exit_code, 0) << r.message;
  return seen;
}

TEST(Blas, TheLauncherGivesEveryRankOneThreadUnlessTheUserChose) {
  const char* saved = std::getenv("OMP_NUM_THREADS");
  const std::string restore = saved == nullptr ? "" : saved;
  unsetenv("OMP_NUM_THREADS");
  LaunchOptions options;
  options.nproc = 2;
  options.timeout = std::chrono::seconds(60);
  for (const auto& [rank, line] : omp_threads_of_ranks(options)) EXPECT_EQ(line, "omp=1") << "rank " << rank;

  setenv("OMP_NUM_THREADS", "3", 1);  // the user's choice in the launcher's environment wins
  for (const auto& [rank, line] : omp_threads_of_ranks(options)) EXPECT_EQ(line, "omp=3") << "rank " << rank;

  options.extra_env = {{"OMP_NUM_THREADS", "5"}};  // and so does the caller's
  for (const auto& [rank, line] : omp_threads_of_ranks(options)) EXPECT_EQ(line, "omp=5") << "rank " << rank;
  EXPECT_EQ(omp_threads_of_ranks(options).size(), 2u);

  if (saved == nullptr)
    unsetenv("OMP_NUM_THREADS");
  else
    setenv("OMP_NUM_THREADS", restore.c_str(), 1);
}

}  // namespace
}  // namespace shardlab
