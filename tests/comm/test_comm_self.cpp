// The one-rank communicator: collectives are copies, point-to-point is refused.
#include <gtest/gtest.h>

#include <vector>

#include "comm/communicator.h"

namespace sf {
namespace {

TEST(CommSelf, CollectivesCopy) {
  auto c = comm::make_self_communicator("tp");
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->name(), "tp");
  std::vector<float> a = {1.f, -2.f, 3.5f}, b(3, -9.f);
  ASSERT_TRUE(c->all_reduce(a.data(), b.data(), 3, DType::kF32, comm::ReduceOp::kSum).is_ok());
  EXPECT_EQ(a, b);
  b.assign(3, -9.f);
  const int64_t counts[1] = {3};
  ASSERT_TRUE(c->all_gatherv(a.data(), 3, b.data(), counts, DType::kF32).is_ok());
  EXPECT_EQ(a, b);
  const int64_t wrong[1] = {2};
  EXPECT_EQ(c->all_gatherv(a.data(), 3, b.data(), wrong, DType::kF32).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(c->send(a.data(), 3, DType::kF32, 0, 0).code(), Code::kInvalidArgument);
  EXPECT_TRUE(c->barrier().is_ok());
  auto s = c->split(3, 0, "cp");
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s.value()->name(), "cp");
}

}  // namespace
}  // namespace sf
