#include "simpler/base/status.h"

#include <stdexcept>

#include "base/quarantine.h"
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

TEST(Status, AnExceptionBecomesAnInternalStatusNamingItsTypeAndMessage) {
  absl::Status s;
  try {
    throw std::out_of_range("index 7");
  } catch (...) {
    s = status_from_current_exception("kernel");
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "kernel threw std::out_of_range: index 7");
  EXPECT_FALSE(is_unrecoverable(s));
  try {
    throw 42;
  } catch (...) {
    s = status_from_current_exception("orchestration");
  }
  EXPECT_EQ(s.message(), "orchestration threw an exception of type int");
  EXPECT_EQ(status_from_current_exception("x").code(), absl::StatusCode::kInternal);
}

TEST(Status, ThePoisoningRunSurvivesAnnotate) {
  absl::Status s = mark_poisoned_by(absl::FailedPreconditionError("lane poisoned by run 3"), 3);
  EXPECT_EQ(poisoned_by(annotate(s, "submit: ")), std::optional<uint64_t>(3));
  EXPECT_EQ(poisoned_by(absl::InternalError("x")), std::nullopt);
  EXPECT_TRUE(mark_poisoned_by(absl::OkStatus(), 1).ok());
}

TEST(Status, RequirePositiveNamesTheFirstFieldNotAboveZero) {
  EXPECT_TRUE(require_positive({}).ok());
  EXPECT_TRUE(require_positive({{"a", 1}, {"b", INT64_MAX}}).ok());
  const absl::Status s = require_positive({{"a", 1}, {"b", 0}, {"c", -3}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "b 0 must be positive");
  EXPECT_EQ(require_positive({{"c", -3}}).message(), "c -3 must be positive");
}

TEST(Quarantine, KeptObjectsStayAliveAndAbandonedThreadsAreCounted) {
  auto kept = std::make_shared<int>(5);
  std::weak_ptr<int> watch = kept;
  keep_until_exit(kept);
  kept.reset();
  EXPECT_FALSE(watch.expired());
  const int64_t before = abandoned_threads();
  note_abandoned_thread("test thread");
  EXPECT_EQ(abandoned_threads(), before + 1);
  EXPECT_EQ(abandoned_thread_descriptions().back(), "test thread");
}

}  // namespace
}  // namespace simpler::base
