// main() of the mpi-label tests: every rank runs the same GoogleTest binary in the same test
// order, so collectives match. A failing rank exits non-zero and mpiexec reports the job failed;
// deadlines (30 s here) keep a rank that left a test early from hanging the others.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <random>

#include "comm/mpi_communicator.h"
#include "tests/comm/mpi_test_env.h"

namespace sf::testing {
namespace {
std::unique_ptr<comm::Communicator> g_world;
uint64_t g_seed = 0;
}  // namespace
comm::Communicator& test_world() { return *g_world; }
uint64_t test_seed() { return g_seed; }
}  // namespace sf::testing

int main(int argc, char** argv) {
  const sf::Status st = sf::comm::mpi_init(&argc, &argv);
  if (!st.is_ok()) {
    std::fprintf(stderr, "error: %s\n", st.to_string().c_str());
    return 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  auto w = sf::comm::make_mpi_world();
  if (!w.is_ok()) {
    std::fprintf(stderr, "error: %s\n", w.status().to_string().c_str());
    sf::comm::mpi_abort_job(1);
  }
  sf::testing::g_world = std::move(w).value();
  sf::testing::g_world->set_timeout(std::chrono::seconds(30));
  // Rank 0's seed for every rank: SF_TEST_SEED replays a run, otherwise a fresh one.
  uint64_t seed = std::random_device{}();
  seed = (seed << 32) ^ std::random_device{}();
  if (const char* env = std::getenv("SF_TEST_SEED")) seed = std::strtoull(env, nullptr, 10);
  if (!sf::testing::g_world->bcast(&seed, 1, sf::DType::kI64, 0).is_ok())
    sf::comm::mpi_abort_job(1);
  sf::testing::g_seed = seed;
  if (sf::testing::g_world->rank() == 0)
    std::printf("seed %llu (replay with SF_TEST_SEED), %d ranks\n",
                static_cast<unsigned long long>(seed), sf::testing::g_world->size());
  const int rc = RUN_ALL_TESTS();
  // Agree on the outcome so every rank exits the same way.
  int32_t bad = rc != 0, any_bad = 0;
  const sf::Status red = sf::testing::g_world->all_reduce(&bad, &any_bad, 1, sf::DType::kI32,
                                                          sf::comm::ReduceOp::kMax);
  // Every selected test skipped on every rank (a GPU test on a host without GPUs): exit 77,
  // which ctest reports as skipped (SKIP_RETURN_CODE), never beside a failure.
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  int32_t all_skipped = u.test_to_run_count() > 0 &&
                        u.skipped_test_count() == u.test_to_run_count(),
          every_rank = 0;
  const sf::Status red2 =
      red.is_ok() ? sf::testing::g_world->all_reduce(&all_skipped, &every_rank, 1,
                                                     sf::DType::kI32, sf::comm::ReduceOp::kMin)
                  : red;
  if (!red2.is_ok() || sf::comm::mpi_any_aborted()) {
    if (!red2.is_ok()) std::fprintf(stderr, "error: %s\n", red2.to_string().c_str());
    // A test aborted a communicator on purpose or failed: finalization could block.
    if (!red2.is_ok() || any_bad) sf::comm::mpi_abort_job(1);
  }
  const int rank = sf::testing::g_world->rank();
  sf::testing::g_world.reset();
  sf::comm::mpi_finalize();
  if (any_bad || !red2.is_ok()) return 1;
  if (every_rank) {
    if (rank == 0) std::printf("every test skipped itself on every rank: exit 77 (ctest: skipped)\n");
    return 77;
  }
  return 0;
}
