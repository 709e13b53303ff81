// libFuzzer target: regular expressions (compile_regex) and GBNF (compile_gbnf), the two
// grammar front ends that read user text from a request.
// Input: one selector byte (even: a regex, odd: GBNF), then the text.
// Checks: no crash/UB (no deep recursion: PCRE2 bounds regex nesting, the GBNF parser its own);
// an accepted grammar has no dead end: from its start, a walk that takes at each step the
// first allowed byte (in an order the selector rotates) only meets states that are complete or
// can continue, and a state that can continue allows some byte.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "base/fuzz_check.h"
#include "simpler/grammar/gbnf.h"
#include "simpler/grammar/regex.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using simpler::fuzz::check;
  namespace g = simpler::grammar;
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  auto grammar = (data[0] & 1) != 0 ? g::compile_gbnf(text) : g::compile_regex(text);
  if (!grammar.ok()) return 0;
  g::GrammarMatcher m(*grammar);
  for (int step = 0; step < 64; ++step) {
    check(m.complete() || m.can_continue(), "an accepted prefix is a dead end");
    if (!m.can_continue()) break;
    bool moved = false;
    for (int k = 0; k < 256 && !moved; ++k) {
      const char b = static_cast<char>((k + data[0] + step) & 0xFF);
      moved = m.advance(std::string_view(&b, 1));
    }
    check(moved, "a state that can continue allows no byte");
  }
  return 0;
}
