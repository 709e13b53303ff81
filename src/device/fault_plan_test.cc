#include "simpler/device/fault_plan.h"

#include "gtest/gtest.h"

namespace simpler::device {
namespace {

TEST(FaultPlan, ParsesTheDocumentedSyntax) {
  auto p = FaultPlan::parse("run=3:task=7:kind=device_fault:code=507018,run=5:task=0:kind=hang");
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->faults().size(), 2u);
  auto f = p->find(3, 7);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->kind, FaultKind::kDeviceFault);
  EXPECT_EQ(f->code, 507018);
  EXPECT_EQ(p->find(5, 0)->kind, FaultKind::kHang);
  EXPECT_FALSE(p->find(3, 6).has_value());
  EXPECT_EQ(FaultPlan::parse("run=1:task=2:kind=kernel_error")->find(1, 2)->code, 1);
  EXPECT_TRUE(FaultPlan::parse("")->empty());
  EXPECT_EQ(FaultPlan::parse("run=2:task=1:kind=process_kill")->find(2, 1)->kind,
            FaultKind::kProcessKill);
  EXPECT_EQ(to_string(*FaultPlan::parse("run=2:task=1:kind=process_kill")->find(2, 1)),
            "run=2:task=1:kind=process_kill:code=1");
  EXPECT_EQ(FaultPlan::parse("run=4:task=0:kind=launch_refused")->find(4, 0)->kind,
            FaultKind::kLaunchRefused);
  EXPECT_EQ(name_of(FaultKind::kLaunchRefused), "launch_refused");
}

void expect_refused(const std::string& text, const std::string& needle) {
  auto p = FaultPlan::parse(text);
  ASSERT_FALSE(p.ok()) << text;
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find(needle), std::string_view::npos)
      << p.status().message() << " lacks " << needle;
}

TEST(FaultPlan, MalformedValuesAreRefusedWithTheReason) {
  expect_refused("run=1:task=2:kind=explode", "unknown kind 'explode'");
  expect_refused("run=1:kind=hang", "missing task=");
  expect_refused("task=1:kind=hang", "missing run=");
  expect_refused("run=1:task=1", "missing kind=");
  expect_refused("run=x:task=1:kind=hang", "run='x' is not a non-negative integer");
  expect_refused("run=-1:task=1:kind=hang", "run='-1'");
  expect_refused("run=1:task=1:kind=hang:color=red", "unknown key 'color'");
  expect_refused("run=1:task=1:kind=hang,", "fault 1");
  expect_refused("run=1:task1:kind=hang", "'task1' is not key=value");
  expect_refused("run=1:task=1:kind=hang,run=1:task=1:kind=kernel_error", "duplicate");
  expect_refused("run=1:task=2:kind=launch_refused", "task must be 0");
}

TEST(FaultPlan, ACodeAboveTheSignedRangeIsRefusedNotWrapped) {
  auto p = FaultPlan::parse("run=0:task=0:kind=device_fault:code=18446744073709551615");
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.status().message(),
            "SIMPLER_SIM_FAULTS: fault 0 ('run=0:task=0:kind=device_fault:code="
            "18446744073709551615'): code=18446744073709551615 is above the largest error code, "
            "9223372036854775807");
  EXPECT_EQ(
      FaultPlan::parse("run=0:task=0:kind=device_fault:code=9223372036854775807")->find(0, 0)->code,
      INT64_MAX);
}

TEST(FaultPlan, ListsTheEntriesThatNeverFiredAndCopiesShareTheCounts) {
  auto p = FaultPlan::parse("run=0:task=1:kind=kernel_error,run=0:task=7:kind=hang");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->unfired().size(), 2u);
  const FaultPlan copy = *p;  // a device holds a copy of the plan it was given
  EXPECT_TRUE(copy.find(0, 1).has_value());
  EXPECT_FALSE(copy.find(0, 2).has_value());
  ASSERT_EQ(p->unfired().size(), 1u);
  EXPECT_EQ(to_string(p->unfired()[0]), "run=0:task=7:kind=hang:code=1");
  EXPECT_TRUE(FaultPlan().unfired().empty());
}

}  // namespace
}  // namespace simpler::device
