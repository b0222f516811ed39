// GBNF grammars written for these tests in the shape of llama.cpp's example
// grammars (json, arithmetic, list): the same languages, written here.
#pragma once

namespace pagoda::grammar::testing {

// Any JSON value at the top, objects and arrays nested, whitespace between tokens.
inline constexpr const char* k_json = R"gbnf(# JSON: a value, then optional whitespace
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt/] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,15})? ws

ws ::= | " " | "\n" [ \t]{0,20}
)gbnf";

// Arithmetic over integers and names, with precedence by rules.
inline constexpr const char* k_arithmetic = R"gbnf(root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
)gbnf";

// A markdown-like list: lines that start with "- ".
inline constexpr const char* k_list = R"gbnf(root ::= item+

# one item per line
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
)gbnf";

}  // namespace pagoda::grammar::testing
