#include "simpler/base/status.h"

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

absl::StatusOr<int> half(int x) {
  if (x % 2) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status use(int x, int* out) {
  SIMPLER_ASSIGN_OR_RETURN(*out, half(x));
  SIMPLER_RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

TEST(Status, MacrosPropagate) {
  int v = 0;
  EXPECT_TRUE(use(4, &v).ok());
  EXPECT_EQ(v, 2);
  EXPECT_EQ(use(3, &v), absl::InvalidArgumentError("odd"));
}

TEST(Status, UnrecoverableMarkSurvivesAnnotate) {
  absl::Status s = mark_unrecoverable(absl::InternalError("device fault"));
  EXPECT_TRUE(is_unrecoverable(s));
  absl::Status a = annotate(s, "run 3: ");
  EXPECT_TRUE(is_unrecoverable(a));
  EXPECT_EQ(a.message(), "run 3: device fault");
  EXPECT_FALSE(is_unrecoverable(absl::InternalError("kernel")));
  EXPECT_FALSE(is_unrecoverable(absl::OkStatus()));
}

}  // namespace
}  // namespace simpler::base
