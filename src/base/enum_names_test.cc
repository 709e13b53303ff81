#include "simpler/base/enum_names.h"

#include <cstdint>
#include <string_view>

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

enum class Color : uint8_t { kRed, kGreen, kBlue, kUnnamed };

constexpr EnumNames<Color> kColorNames = {
    {Color::kRed, "red"}, {Color::kGreen, "green"}, {Color::kBlue, "blue"}};

// The table is usable in constant expressions.
static_assert(kColorNames.name(Color::kGreen, "?") == "green");
static_assert(kColorNames.parse("blue") == Color::kBlue);
static_assert(std::string_view(kColorNames.c_name(Color::kRed, "?")) == "red");

TEST(EnumNames, NameReturnsTheEntryOfTheValue) {
  EXPECT_EQ(kColorNames.name(Color::kRed, "?"), "red");
  EXPECT_EQ(kColorNames.name(Color::kGreen, "?"), "green");
  EXPECT_EQ(kColorNames.name(Color::kBlue, "?"), "blue");
}

TEST(EnumNames, NameOfAValueOutsideTheTableIsTheFallback) {
  EXPECT_EQ(kColorNames.name(Color::kUnnamed, "?"), "?");
  EXPECT_EQ(kColorNames.name(Color::kUnnamed, ""), "");
  EXPECT_EQ(kColorNames.name(static_cast<Color>(200), "none"), "none");
}

TEST(EnumNames, ParseOfEachNameGivesBackItsValue) {
  for (Color c : {Color::kRed, Color::kGreen, Color::kBlue}) {
    EXPECT_EQ(kColorNames.parse(kColorNames.name(c, "?")), c) << kColorNames.name(c, "?");
  }
}

TEST(EnumNames, ParseOfAnUnknownNameIsNullopt) {
  EXPECT_EQ(kColorNames.parse("purple"), std::nullopt);
  EXPECT_EQ(kColorNames.parse(""), std::nullopt);
  EXPECT_EQ(kColorNames.parse("Red"), std::nullopt);   // case-sensitive
  EXPECT_EQ(kColorNames.parse("re"), std::nullopt);    // no prefix match
  EXPECT_EQ(kColorNames.parse("red "), std::nullopt);  // no trimming
}

TEST(EnumNames, FirstEntryWinsWhenValuesOrNamesRepeat) {
  constexpr EnumNames<Color> kRepeats = {
      {Color::kRed, "red"}, {Color::kRed, "rouge"}, {Color::kGreen, "red"}};
  EXPECT_EQ(kRepeats.name(Color::kRed, "?"), "red");
  EXPECT_EQ(kRepeats.parse("red"), Color::kRed);
  EXPECT_EQ(kRepeats.parse("rouge"), Color::kRed);
}

TEST(EnumNames, CNameIsTheNameOrTheFallbackAsACString) {
  EXPECT_STREQ(kColorNames.c_name(Color::kBlue, "?"), "blue");
  EXPECT_STREQ(kColorNames.c_name(Color::kUnnamed, "?"), "?");
  EXPECT_STREQ(kColorNames.c_name(Color::kUnnamed, ""), "");
}

}  // namespace
}  // namespace simpler::base
