#include "grammar/gbnf.h"

#include <gtest/gtest.h>

#include "grammar/matcher.h"
#include "grammar/grammars.h"

namespace pagoda::grammar {
namespace {

rules parse_ok(const std::string& text) {
  auto g = parse_gbnf(text);
  EXPECT_TRUE(g.ok()) << g.error().message();
  return g.ok() ? std::move(*g) : rules{};
}

std::string parse_error(const std::string& text) {
  auto g = parse_gbnf(text);
  EXPECT_FALSE(g.ok()) << "parsed: " << text;
  return g.ok() ? "" : g.error().message();
}

TEST(gbnf, json_grammar_accepts_json_and_refuses_the_rest) {
  const rules g = parse_ok(testing::k_json);
  for (const char* ok : {"{}", "{\"a\": 1}", "{\"a\": [1, 2.5, -3e10, true, null], \"b\": {\"c\": \"x\\ny\"}}",
                         "{\n  \"k\": \"\\u00e9t\xc3\xa9\"\n}", "{ \"a\":{} }"})
    EXPECT_TRUE(matches(g, ok)) << ok;
  for (const char* bad : {"", "[]", "{", "{\"a\" 1}", "{\"a\": 01}", "{\"a\": tru}", "{\"a\": \"\x01\"}",
                          "{\"a\": 1,}", "{} x"})
    EXPECT_FALSE(matches(g, bad)) << bad;
}

TEST(gbnf, arithmetic_and_list_grammars) {
  const rules a = parse_ok(testing::k_arithmetic);
  EXPECT_TRUE(matches(a, "1+2=3\n"));
  EXPECT_TRUE(matches(a, "(x_1 *4)-y= z\nq=7\n"));
  EXPECT_FALSE(matches(a, "1+=3\n"));
  EXPECT_FALSE(matches(a, "1+2=3"));
  const rules l = parse_ok(testing::k_list);
  EXPECT_TRUE(matches(l, "- milk\n- eggs \xe2\x82\xac\n"));
  EXPECT_FALSE(matches(l, "- \n"));
  EXPECT_FALSE(matches(l, "milk\n"));
  EXPECT_FALSE(matches(l, "- a\xe2\x80\xa8" "b\n"));  // U+2028 is excluded
}

TEST(gbnf, repetition_counts) {
  const rules g = parse_ok("root ::= \"a\"{2,4} \"b\"{3} \"c\"{1,} \"d\"{0,1} ([x-z] \"-\"){0,2}\n");
  EXPECT_TRUE(matches(g, "aabbbc"));
  EXPECT_TRUE(matches(g, "aaaabbbcccdx-z-"));
  EXPECT_FALSE(matches(g, "abbbc"));
  EXPECT_FALSE(matches(g, "aaaaabbbc"));
  EXPECT_FALSE(matches(g, "aabbc"));
  EXPECT_FALSE(matches(g, "aabbb"));
  EXPECT_FALSE(matches(g, "aabbbcdd"));
  EXPECT_FALSE(matches(g, "aabbbcx-y-z-"));
  const rules star = parse_ok("root ::= (\"ab\" | \"c\")* \"!\"? [0-9]+\n");
  EXPECT_TRUE(matches(star, "7"));
  EXPECT_TRUE(matches(star, "abcab!42"));
  EXPECT_FALSE(matches(star, "aab1"));
  EXPECT_FALSE(matches(star, "ab!"));
}

TEST(gbnf, classes_escapes_and_any) {
  const rules g = parse_ok(R"(root ::= [^a-c\]] [\x41-\x43] "\t\"\\" . [\u00e9] "\U0001F600"
)");
  EXPECT_TRUE(matches(g, "zA\t\"\\\n\xc3\xa9\xf0\x9f\x98\x80"));
  EXPECT_FALSE(matches(g, "bA\t\"\\\n\xc3\xa9\xf0\x9f\x98\x80"));
  EXPECT_FALSE(matches(g, "]A\t\"\\\n\xc3\xa9\xf0\x9f\x98\x80"));
  EXPECT_FALSE(matches(g, "zD\t\"\\\n\xc3\xa9\xf0\x9f\x98\x80"));
  EXPECT_FALSE(matches(g, "zA\t\"\\\n\xc3\xa8\xf0\x9f\x98\x80"));
}

TEST(gbnf, partial_utf8_keeps_only_stacks_that_can_complete) {
  const rules g = parse_ok("root ::= [\\u00e0-\\u00ff] | \"x\"\n");
  match_state s = initial_state(g), next;
  ASSERT_TRUE(advance_byte(g, s, 0xC3, next));  // U+00C0..U+00FF start with C3
  EXPECT_EQ(next.n_partial, 1);
  EXPECT_FALSE(next.accepts());
  match_state done;
  EXPECT_TRUE(advance_byte(g, next, 0xA9, done));   // é
  EXPECT_TRUE(done.accepts());
  EXPECT_FALSE(advance_byte(g, next, 0x80, done));  // U+00C0: below the range
  EXPECT_FALSE(advance_byte(g, s, 0xC4, next));     // U+0100..: nothing can complete
  EXPECT_FALSE(advance_byte(g, s, 0x80, next));     // a continuation byte first
  EXPECT_FALSE(advance_byte(g, s, 0xFF, next));     // never in UTF-8
  // "x" spelt in more bytes than it needs is not "x" (a decoder shows U+FFFD for each byte).
  const rules any = parse_ok("root ::= .\n");
  EXPECT_TRUE(matches(any, "x"));
  EXPECT_FALSE(matches(any, "\xC1\xB8"));
  EXPECT_FALSE(matches(any, "\xE0\x81\xB8"));
  EXPECT_FALSE(matches(any, "\xF0\x80\x81\xB8"));
  EXPECT_FALSE(matches(any, "\xED\xA0\x80"));      // a surrogate
  EXPECT_FALSE(matches(any, "\xF4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_TRUE(matches(any, "\xF4\x8F\xBF\xBF"));
  EXPECT_TRUE(matches(any, "\xE0\xA0\x80"));
  // A lead byte stands for characters of its length only: F0 starts none below U+10000.
  const rules brace = parse_ok("root ::= [{-\\u07FF]\n");
  const match_state b = initial_state(brace);
  EXPECT_FALSE(advance_byte(brace, b, 0xF0, next));
  EXPECT_FALSE(advance_byte(brace, b, 0xE0, next));
  EXPECT_TRUE(advance_byte(brace, b, 0xDF, next));
}

TEST(gbnf, right_recursion_keeps_stacks_short) {
  const rules g = parse_ok("root ::= \"[\" [a-z]* \"]\"\n");
  match_state s = initial_state(g);
  ASSERT_TRUE(advance(g, s, "["));
  const std::size_t depth = s.data.size();
  ASSERT_TRUE(advance(g, s, std::string(5000, 'q')));
  EXPECT_EQ(s.data.size(), depth);
  EXPECT_EQ(s.key(), [&] {
    match_state t = initial_state(g);
    EXPECT_TRUE(advance(g, t, "[q"));
    return t.key();
  }());
  EXPECT_TRUE(advance(g, s, "]"));
  EXPECT_TRUE(s.accepts());
}

TEST(gbnf, comments_newlines_and_continuations) {
  const rules g = parse_ok("# leading comment\n\nroot ::= a |\n  b  # trailing\na ::= \"a\" (\n \"1\"\n | \"2\" )\nb ::= \"b\"\n");
  EXPECT_TRUE(matches(g, "a1"));
  EXPECT_TRUE(matches(g, "a2"));
  EXPECT_TRUE(matches(g, "b"));
  EXPECT_FALSE(matches(g, "a"));
}

TEST(gbnf, errors_name_the_problem) {
  EXPECT_NE(parse_error("root ::= foo\n").find("'foo' is used but not defined"), std::string::npos);
  EXPECT_NE(parse_error("main ::= \"a\"\n").find("no 'root'"), std::string::npos);
  EXPECT_NE(parse_error("root ::= root \"a\" | \"b\"\n").find("left recursion"), std::string::npos);
  EXPECT_NE(parse_error("root ::= a\na ::= [x]? root\n").find("left recursion"), std::string::npos);
  EXPECT_NE(parse_error("root ::= \"abc\n").find("line 1"), std::string::npos);
  EXPECT_NE(parse_error("root ::= \"a\"\nroot ::= \"b\"\n").find("defined twice"), std::string::npos);
  EXPECT_NE(parse_error("root ::= \"\\q\"\n").find("unknown escape"), std::string::npos);
  EXPECT_NE(parse_error("root ::= [z-a]\n").find("before its start"), std::string::npos);
  EXPECT_NE(parse_error("root ::= \"a\"{3,2}\n").find("below the minimum"), std::string::npos);
  EXPECT_NE(parse_error("root ::= * \"a\"\n").find("nothing before it"), std::string::npos);
  EXPECT_NE(parse_error("root ::= (\"a\"\n").find("expected ')'"), std::string::npos);
  EXPECT_NE(parse_error("root = \"a\"\n").find("'::='"), std::string::npos);
  EXPECT_NE(parse_error("root ::= \"a\"{99999}\n").find("repetition count"), std::string::npos);
  std::string big;
  for (int i = 0; i < 25; ++i) big += "r" + std::to_string(i) + " ::= \"a\"{10000}\n";
  EXPECT_NE(parse_error("root ::= r0\n" + big).find("more than"), std::string::npos);
  EXPECT_NE(parse_error(std::string(k_max_grammar_bytes + 1, ' ')).find("limit"), std::string::npos);
}

}  // namespace
}  // namespace pagoda::grammar
