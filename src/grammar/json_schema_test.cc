#include "simpler/grammar/json_schema.h"

#include <random>
#include <string>
#include <vector>

#include "base/sanitizers.h"
#include "gmock/gmock.h"
#include "grammar/grammar_test_util.h"
#include "grammar/json_schema_test_util.h"
#include "gtest/gtest.h"

namespace simpler::grammar {
namespace {

using testing::accepts;
using testing::ojson;

// Sanitizer builds run 5-50x slower: the heaviest tests shrink there.
constexpr bool kSanitized = SIMPLER_SANITIZED;

std::shared_ptr<const Grammar> compile(const std::string& schema) {
  return testing::compiled_or_fail(compile_json_schema(schema), schema);
}

std::string error_of(const std::string& schema) {
  return testing::refusal_of(compile_json_schema(schema), schema);
}

// A small vocabulary of JSON pieces: single bytes and common multi-byte tokens.
const TokenIndex& small_vocab(std::vector<std::string>* out = nullptr) {
  static const std::vector<std::string> vocab = [] {
    std::vector<std::string> v;
    // Every byte is a token of its own, as in byte-level BPE: no valid prefix is a dead end.
    for (int c = 1; c < 256; ++c) v.push_back(std::string(1, static_cast<char>(c)));
    for (const char* t : {"{",
                          "}",
                          "[",
                          "]",
                          "\"",
                          ",",
                          ":",
                          "-",
                          ".",
                          "e",
                          "E",
                          "+",
                          "0",
                          "1",
                          "2",
                          "5",
                          "9",
                          "\\",
                          "\\\"",
                          "\\u00e9",
                          "\xC3\xA9",
                          "\xC3",
                          "\xBC",
                          "\xC3\x9F",
                          "7",
                          "{\"",
                          "\":",
                          "\",\"",
                          "true",
                          "false",
                          "null",
                          "]}",
                          "\"}",
                          "\"]",
                          "},{",
                          "\u00e9\":",
                          "red",
                          "gr",
                          "een",
                          "fixed",
                          "\"k\":[1,2.5,null]}",
                          "12"}) {
      v.push_back(t);
    }
    return v;
  }();
  static const TokenIndex index(vocab);
  if (out != nullptr) *out = vocab;
  return index;
}

// A random walk through the grammar's language over the small vocabulary: each step draws one
// allowed token, a multi-byte one 20 times as often as a single byte (so strings and numbers
// end); at a complete state it stops with probability 1/3. Empty when the walk did not end
// within `max_steps`.
std::string random_output(const std::shared_ptr<const Grammar>& g, std::mt19937_64& rng,
                          int max_steps) {
  std::vector<std::string> vocab;
  const TokenIndex& index = small_vocab(&vocab);
  GrammarMatcher m(g);
  std::string out;
  std::vector<uint32_t> mask(static_cast<size_t>(index.mask_words()));
  for (int step = 0; step < max_steps; ++step) {
    if (m.complete() && (!m.can_continue() || rng() % 3 == 0)) return out;
    index.fill_mask(m, mask.data());
    std::vector<int32_t> ids;
    for (int32_t t = 0; t < index.vocab_size(); ++t) {
      if ((mask[t / 32] >> (t % 32)) & 1) ids.push_back(t);
    }
    EXPECT_FALSE(ids.empty()) << "dead end after '" << out << "'";
    if (ids.empty()) return "";
    std::vector<double> weights;
    for (int32_t id : ids) weights.push_back(vocab[id].size() > 1 ? 20.0 : 1.0);
    const int32_t t = ids[std::discrete_distribution<size_t>(weights.begin(), weights.end())(rng)];
    EXPECT_TRUE(m.advance(vocab[t]));
    out += vocab[t];
  }
  return m.complete() ? out : "";
}

TEST(JsonSchemaTest, ObjectsKeepTheirPropertyOrderAndRequiredOnes) {
  const auto g = compile(R"({"type":"object","properties":{"b":{"type":"integer"},
      "a":{"type":"string"},"c":{"type":"boolean"}},"required":["a"],
      "additionalProperties":false})");
  for (const char* ok : {R"({"a":"x"})", R"({"b":-12,"a":"","c":true})", R"({"a":"\u00e9\n"})",
                         R"({"b":0,"a":"y"})", R"({"a":"z","c":false})"}) {
    EXPECT_TRUE(accepts(g, ok)) << ok;
  }
  for (const char* bad :
       {R"({})", R"({"b":1})", R"({"a":"x","b":1})", R"({"a":"x","d":1})", R"({"b":01,"a":"x"})",
        R"({"a":"x",})", R"({ "a":"x"})", R"({"a":"x","a":"y"})", R"({"b":1.5,"a":"x"})"}) {
    EXPECT_FALSE(accepts(g, bad)) << bad;
  }
}

TEST(JsonSchemaTest, ArraysHonourItemsMinItemsAndMaxItems) {
  const auto g = compile(R"({"type":"array","items":{"type":"null"},"minItems":1,"maxItems":3})");
  EXPECT_FALSE(accepts(g, "[]"));
  EXPECT_TRUE(accepts(g, "[null]"));
  EXPECT_TRUE(accepts(g, "[null,null,null]"));
  EXPECT_FALSE(accepts(g, "[null,null,null,null]"));
  EXPECT_FALSE(accepts(g, "[1]"));
  const auto any = compile(R"({"type":"array"})");
  EXPECT_TRUE(accepts(any, "[]"));
  EXPECT_TRUE(accepts(any, R"([1,"a",{"b":[true]},null,-2.5E+3])"));
  const auto none = compile(R"({"type":"array","maxItems":0})");
  EXPECT_TRUE(accepts(none, "[]"));
  EXPECT_FALSE(accepts(none, "[1]"));
}

TEST(JsonSchemaTest, EnumConstAnyOfAndTypeListsAreAlternatives) {
  const auto e = compile(R"({"type":"string","enum":["red","gr\"een",7]})");
  EXPECT_TRUE(accepts(e, R"("red")"));
  EXPECT_TRUE(accepts(e, R"("gr\"een")"));
  EXPECT_FALSE(accepts(e, "7"));  // not a string
  EXPECT_FALSE(accepts(e, R"("blue")"));
  const auto c = compile(R"({"const":{"k":[1,null]}})");
  EXPECT_TRUE(accepts(c, R"({"k":[1,null]})"));
  EXPECT_FALSE(accepts(c, R"({"k":[1]})"));
  const auto a = compile(R"({"anyOf":[{"type":"integer"},{"type":"string","enum":["x"]}]})");
  EXPECT_TRUE(accepts(a, "-3"));
  EXPECT_TRUE(accepts(a, R"("x")"));
  EXPECT_FALSE(accepts(a, "true"));
  const auto t = compile(R"({"type":["number","null","boolean"]})");
  for (const char* ok : {"null", "0.25", "-1e9", "false"}) EXPECT_TRUE(accepts(t, ok)) << ok;
  EXPECT_FALSE(accepts(t, "1."));
  EXPECT_FALSE(accepts(t, "\"1\""));
}

TEST(JsonSchemaTest, UnsupportedKeywordsAreRefusedNamingThemAndWhereTheyAre) {
  EXPECT_EQ(error_of(R"({"type":"string","pattern":"^a$"})"),
            "unsupported JSON Schema keyword 'pattern' at #");
  EXPECT_EQ(error_of(R"({"type":"object","properties":{"n":{"type":"integer","minimum":3}}})"),
            "unsupported JSON Schema keyword 'minimum' at #/properties/n");
  EXPECT_EQ(error_of(R"({"oneOf":[{"type":"null"}]})"),
            "unsupported JSON Schema keyword 'oneOf' at #");
  EXPECT_EQ(error_of(R"({"type":"strin"})"),
            "JSON Schema keyword 'type' at # must be one of the seven JSON types or a list of "
            "them");
  EXPECT_EQ(error_of(R"({"type":"array","minItems":-1})"),
            "JSON Schema keyword 'minItems' at # must be a non-negative integer");
  EXPECT_EQ(error_of(R"({"type":"array","maxItems":5000})"),
            "JSON Schema keyword 'maxItems' at # must be minItems + 1024 or less");
  EXPECT_EQ(error_of(R"({"$ref":"http://example.com/s.json"})"),
            "$ref 'http://example.com/s.json' at # does not point into this document");
  EXPECT_EQ(error_of(R"({"$ref":"#/$defs/missing"})"),
            "$ref '#/$defs/missing' at # does not point into this document");
  EXPECT_EQ(error_of(R"({"properties":{"a":{}},"additionalProperties":true})"),
            "additionalProperties at # must be false when properties are given");
  EXPECT_THAT(error_of("{"), ::testing::StartsWith("the schema is not valid JSON: "));
  EXPECT_EQ(error_of("3"), "JSON Schema keyword 'schema' at # must be an object or a boolean");
}

TEST(JsonSchemaTest, SchemasNoValueSatisfiesAreAnEmptyLanguage) {
  const std::string empty = "the grammar's language is empty: rule '#' derives no finite string";
  EXPECT_EQ(error_of("false"), empty);
  EXPECT_EQ(error_of(R"({"type":"array","minItems":3,"maxItems":2})"), empty);
  EXPECT_EQ(error_of(R"({"type":"object","properties":{"a":false},"required":["a"]})"), empty);
  EXPECT_EQ(error_of(R"({"type":"object","properties":{"a":{}},"required":["b"]})"), empty);
  EXPECT_EQ(error_of(R"({"type":"string","enum":[1,2]})"), empty);
  // Required recursion without a base case: {"next": {"next": ...}} never ends.
  EXPECT_EQ(error_of(R"({"$ref":"#/$defs/n","$defs":{"n":{"type":"object",
      "properties":{"next":{"$ref":"#/$defs/n"}},"required":["next"]}}})"),
            empty);
}

TEST(JsonSchemaTest, RecursiveRefsDescribeTrees) {
  const auto g = compile(R"({"$ref":"#/$defs/node","$defs":{"node":{"type":"object",
      "properties":{"v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},
      "required":["v"],"additionalProperties":false}}})");
  EXPECT_TRUE(accepts(g, R"({"v":1})"));
  EXPECT_TRUE(accepts(g, R"({"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4}]}]})"));
  EXPECT_FALSE(accepts(g, R"({"v":1,"kids":[{}]})"));
  const auto root = compile(R"({"type":"array","items":{"anyOf":[{"type":"null"},{"$ref":"#"}]}})");
  EXPECT_TRUE(accepts(root, "[null,[],[[null]]]"));
}

TEST(JsonSchemaTest, ARefCycleThatConsumesNothingIsRefusedNamingTheDefinition) {
  EXPECT_EQ(error_of(R"({"$ref":"#/$defs/a","$defs":{"a":{"anyOf":[{"type":"null"},
      {"$ref":"#/$defs/a"}]}}})"),
            "rule '#/$defs/a' is left-recursive");
}

TEST(JsonSchemaTest, AHugeEnumCompilesAndMatchesOnlyItsValues) {
  ojson values = ojson::array();
  for (int i = 0; i < 20000; ++i) values.push_back("value-" + std::to_string(i));
  const auto g = compile(ojson{{"enum", values}}.dump());
  EXPECT_TRUE(accepts(g, "\"value-0\""));
  EXPECT_TRUE(accepts(g, "\"value-19999\""));
  EXPECT_FALSE(accepts(g, "\"value-20000\""));
  GrammarMatcher m(g);
  ASSERT_TRUE(m.advance("\"value-1999"));
  EXPECT_FALSE(m.complete());
  EXPECT_TRUE(m.advance("9\""));
  EXPECT_TRUE(m.complete());
}

TEST(JsonSchemaTest, TenThousandPropertiesCompileAndParse) {
  const int n = kSanitized ? 2000 : 10000;
  ojson props = ojson::object();
  ojson required = ojson::array();
  for (int i = 0; i < n; ++i) {
    props["p" + std::to_string(i)] = ojson{{"type", "integer"}};
    if (i % 1000 == 0) required.push_back("p" + std::to_string(i));
  }
  const auto g =
      compile(ojson{{"type", "object"}, {"properties", props}, {"required", required}}.dump());
  std::string ok = "{";
  for (int i = 0; i < n; i += 500) ok += (i ? ",\"p" : "\"p") + std::to_string(i) + "\":1";
  ok += "}";
  EXPECT_TRUE(accepts(g, ok));
  EXPECT_FALSE(accepts(g, R"({"p0":1})"));  // p1000, p2000, ... are required
}

TEST(JsonSchemaTest, JsonObjectAndChoiceGrammars) {
  const auto obj = json_object_grammar();
  EXPECT_TRUE(accepts(obj, R"({"a":[1,{"b":null}],"c":"d"})"));
  EXPECT_FALSE(accepts(obj, "[1]"));
  EXPECT_FALSE(accepts(obj, "\"s\""));
  const auto choice = *choice_grammar({"yes", "no", "maybe so"});
  EXPECT_TRUE(accepts(choice, "maybe so"));
  EXPECT_FALSE(accepts(choice, "maybe"));
  EXPECT_EQ(choice_grammar({}).status().message(), "guided_choice must hold at least one choice");
  EXPECT_EQ(choice_grammar({"a", ""}).status().message(), "guided_choice[1] is empty");
}

// Random schemas x random walks over the vocabulary's mask: every finished output parses and
// validates against its schema with the validator written from the spec.
TEST(JsonSchemaTest, RandomSchemasOnlyEverProduceOutputsThatValidate) {
  int finished = 0;
  const int kSchemas = kSanitized ? 40 : 200;
  for (int i = 0; i < kSchemas; ++i) {
    std::mt19937_64 rng(1000 + i);
    ojson defs = ojson::object();
    ojson schema = testing::random_schema(rng, 3, defs);
    if (!defs.empty()) schema["$defs"] = defs;
    const auto g = compile_json_schema(schema.dump());
    if (!g.ok()) {
      // Only an unsatisfiable schema may fail to compile (e.g. a required property whose schema
      // is empty).
      ASSERT_THAT(std::string(g.status().message()), ::testing::HasSubstr("language is empty"))
          << schema.dump();
      continue;
    }
    for (int seed = 0; seed < 3; ++seed) {
      const std::string out = random_output(*g, rng, 400);
      if (out.empty()) continue;  // did not end in time
      ++finished;
      ojson value;
      ASSERT_NO_THROW(value = testing::parse_output(out)) << out << "\nschema " << schema.dump();
      EXPECT_TRUE(testing::validate(value, schema, schema)) << out << "\nschema " << schema.dump();
    }
  }
  EXPECT_GT(finished, kSchemas * 3 / 2);  // most walks end: the test is not vacuous
}

}  // namespace
}  // namespace simpler::grammar
