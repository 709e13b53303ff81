// Test helpers shared by the grammar tests: whether a grammar accepts a whole text, and a front
// end's (GBNF, regex, JSON Schema) compiled grammar or the message of its refusal.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "simpler/grammar/grammar.h"

namespace simpler::grammar::testing {

using CompiledGrammar = absl::StatusOr<std::shared_ptr<const Grammar>>;

// True when `g` accepts the whole of `text`: the matcher advances over every byte and may end
// there.
inline bool accepts(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  GrammarMatcher m(g);
  return m.advance(text) && m.complete();
}

// The grammar a front end compiled from `source`; nullptr, failing the test, when it refused.
inline std::shared_ptr<const Grammar> compiled_or_fail(CompiledGrammar compiled,
                                                       std::string_view source) {
  EXPECT_TRUE(compiled.ok()) << source << ": " << compiled.status();
  return compiled.ok() ? *compiled : nullptr;
}

// The message of a front end's refusal of `source`, which must be INVALID_ARGUMENT; "", failing
// the test, when it compiled.
inline std::string refusal_of(const CompiledGrammar& compiled, std::string_view source) {
  EXPECT_FALSE(compiled.ok()) << source;
  if (compiled.ok()) return "";
  EXPECT_EQ(compiled.status().code(), absl::StatusCode::kInvalidArgument) << source;
  return std::string(compiled.status().message());
}

}  // namespace simpler::grammar::testing
