// JSON Schema to GBNF (grammar/convert.h says what is supported).
#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "grammar/convert.h"
#include "grammar/gbnf.h"

namespace pagoda::grammar {

namespace {

using nlohmann::json;

// The building blocks every JSON grammar uses; each rule is emitted only when used.
const std::map<std::string, std::string>& primitives() {
  static const std::map<std::string, std::string> p = {
      {"ws", R"(( " " | "\n" [ \t]{0,16} )?)"},
      {"json-char", R"([^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ))"},
      {"json-string", R"("\"" json-char* "\"")"},
      {"json-int", R"("-"? ( "0" | [1-9] [0-9]{0,15} ))"},
      {"json-number", R"(json-int ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?)"},
      {"json-boolean", R"("true" | "false")"},
      {"json-null", R"("null")"},
      {"json-value", R"(json-object | json-array | json-string | json-number | json-boolean | json-null)"},
      {"json-object", R"("{" ws ( json-member ( "," ws json-member )* )? "}")"},
      {"json-member", R"(json-string ws ":" ws json-value ws)"},
      {"json-array", R"("[" ws ( json-value ws ( "," ws json-value ws )* )? "]")"},
      {"json-digit2", R"([0-9] [0-9])"},
      {"json-date", R"("\"" json-date-body "\"")"},
      {"json-date-body", R"([0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [12] [0-9] | "3" [01] ))"},
      {"json-time", R"("\"" json-time-body "\"")"},
      {"json-time-body",
       R"(( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? ( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ))"},
      {"json-date-time", R"("\"" json-date-body "T" json-time-body "\"")"},
      {"json-uuid",
       R"("\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12} "\"")"},
  };
  return p;
}

// Which primitives a primitive refers to (to emit them too).
const std::map<std::string, std::vector<std::string>>& primitive_deps() {
  static const std::map<std::string, std::vector<std::string>> d = {
      {"json-string", {"json-char"}},
      {"json-number", {"json-int"}},
      {"json-value", {"json-object", "json-array", "json-string", "json-number", "json-boolean", "json-null"}},
      {"json-object", {"ws", "json-member"}},
      {"json-member", {"json-string", "ws", "json-value"}},
      {"json-array", {"ws", "json-value"}},
      {"json-date", {"json-date-body"}},
      {"json-time", {"json-time-body"}},
      {"json-date-time", {"json-date-body", "json-time-body"}},
  };
  return d;
}

const std::set<std::string>& annotations() {
  static const std::set<std::string> a = {"title",   "description", "default",    "examples",  "$schema",
                                          "$id",     "$comment",    "$defs",      "definitions", "deprecated",
                                          "readOnly", "writeOnly"};
  return a;
}

const std::set<std::string>& supported() {
  static const std::set<std::string> s = {"type",      "properties", "required",  "additionalProperties",
                                          "enum",      "const",      "items",     "minItems",
                                          "maxItems",  "anyOf",      "$ref",      "minLength",
                                          "maxLength", "pattern",    "format"};
  return s;
}

class converter {
 public:
  // Rules get `prefix` in front of their names, so several schemas' rules can share one grammar.
  explicit converter(const json& root, std::string prefix = "") : root_(root), prefix_(std::move(prefix)) {}

  result<std::string> run() {
    PAGODA_ASSIGN_OR_RETURN(std::string top, visit(root_, "#", "root"));
    std::string out = "root ::= " + top + " ws\n";
    use("ws");
    for (const auto& [name, body] : rules_) out += name + " ::= " + body + "\n";
    for (const std::string& p : used_) out += p + " ::= " + primitives().at(p) + "\n";
    return out;
  }

  // The expression matching the schema; its rules go to `rules` and the
  // building blocks it uses to `used`.
  result<std::string> run_into(std::string& rules, std::set<std::string>& used) {
    PAGODA_ASSIGN_OR_RETURN(std::string top, visit(root_, "#", "root"));
    for (const auto& [name, body] : rules_) rules += name + " ::= " + body + "\n";
    used.insert(used_.begin(), used_.end());
    return top;
  }

 private:
  status fail(const std::string& where, const std::string& what) const {
    return error(errc::invalid_argument, "json schema: at {}: {}", where, what);
  }

  void use(const std::string& primitive) {
    if (!used_.insert(primitive).second) return;
    if (const auto it = primitive_deps().find(primitive); it != primitive_deps().end())
      for (const std::string& d : it->second) use(d);
  }

  std::string prim(const std::string& p) {
    use(p);
    return p;
  }

  std::string new_name(const std::string& hint) {
    std::string base;
    for (const char c : hint)
      base += ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) ? c : '-';
    if (base.empty() || base == "root") base = "schema";
    if (base.size() > 40) base.resize(40);
    base = prefix_ + base;
    std::string name = base;
    for (int i = 2; names_.count(name) != 0 || primitives().count(name) != 0 || name == "root"; ++i)
      name = fmt::format("{}-{}", base, i);
    names_.insert(name);
    return name;
  }

  std::string add_rule(const std::string& hint, std::string body) {
    const std::string name = new_name(hint);
    rules_.emplace_back(name, std::move(body));
    return name;
  }

  // "#/a/b~1c" -> the node it names in the document.
  result<const json*> resolve(const std::string& ref, const std::string& where) const {
    if (ref.empty() || ref[0] != '#')
      return fail(where, fmt::format("$ref \"{}\": only references within the document (\"#...\") are supported", ref));
    const json* node = &root_;
    std::string_view rest = std::string_view(ref).substr(1);
    if (rest.empty()) return node;
    if (rest[0] != '/') return fail(where, fmt::format("$ref \"{}\": not a JSON pointer", ref));
    while (!rest.empty()) {
      rest.remove_prefix(1);
      const std::size_t slash = rest.find('/');
      std::string token(rest.substr(0, slash));
      rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash);
      std::string unescaped;
      for (std::size_t i = 0; i < token.size(); ++i) {
        if (token[i] == '~' && i + 1 < token.size() && (token[i + 1] == '0' || token[i + 1] == '1')) {
          unescaped += token[i + 1] == '0' ? '~' : '/';
          ++i;
        } else {
          unescaped += token[i];
        }
      }
      if (node->is_object() && node->contains(unescaped)) {
        node = &(*node)[unescaped];
      } else if (node->is_array() && !unescaped.empty() &&
                 unescaped.find_first_not_of("0123456789") == std::string::npos &&
                 std::stoul(unescaped) < node->size()) {
        node = &(*node)[std::stoul(unescaped)];
      } else {
        return fail(where, fmt::format("$ref \"{}\" names nothing in the document", ref));
      }
    }
    return node;
  }

  result<std::string> visit(const json& s, const std::string& where, const std::string& hint) {
    if (++depth_ > 64) return fail(where, "nested more than 64 levels deep");
    auto r = visit_node(s, where, hint);
    --depth_;
    return r;
  }

  result<std::string> visit_node(const json& s, const std::string& where, const std::string& hint) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) return fail(where, "the schema false allows no value");
      return prim("json-value");
    }
    if (!s.is_object()) return fail(where, "a schema must be an object or a boolean");
    for (const auto& [k, v] : s.items())
      if (annotations().count(k) == 0 && supported().count(k) == 0)
        return fail(where, fmt::format("the keyword \"{}\" is not supported", k));
    if (s.contains("$ref")) return visit_ref(s, where);
    if (s.contains("const")) return literal_of(s["const"]);
    if (s.contains("enum")) {
      const json& e = s["enum"];
      if (!e.is_array() || e.empty()) return fail(where, "enum must be a non-empty array");
      std::string out = "(";
      for (std::size_t i = 0; i < e.size(); ++i) out += (i ? " | " : "") + literal_of(e[i]);
      return out + ")";
    }
    if (s.contains("anyOf")) {
      const json& a = s["anyOf"];
      if (!a.is_array() || a.empty()) return fail(where, "anyOf must be a non-empty array");
      std::string out = "(";
      for (std::size_t i = 0; i < a.size(); ++i) {
        PAGODA_ASSIGN_OR_RETURN(std::string alt, visit(a[i], fmt::format("{}/anyOf/{}", where, i), hint));
        out += (i ? " | " : "") + alt;
      }
      return out + ")";
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const json& x : t) {
          if (!x.is_string()) return fail(where, "type must be a string or an array of strings");
          types.push_back(x.get<std::string>());
        }
      } else {
        return fail(where, "type must be a string or an array of strings");
      }
    } else if (s.contains("properties") || s.contains("additionalProperties")) {
      types.push_back("object");
    } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
      types.push_back("array");
    } else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern") || s.contains("format")) {
      types.push_back("string");
    } else {
      return prim("json-value");
    }
    std::string out = types.size() > 1 ? "(" : "";
    for (std::size_t i = 0; i < types.size(); ++i) {
      PAGODA_ASSIGN_OR_RETURN(std::string one, visit_type(s, types[i], where, hint));
      out += (i ? " | " : "") + one;
    }
    return types.size() > 1 ? out + ")" : out;
  }

  result<std::string> visit_ref(const json& s, const std::string& where) {
    if (!s["$ref"].is_string()) return fail(where, "$ref must be a string");
    const std::string ref = s["$ref"].get<std::string>();
    if (const auto it = refs_.find(ref); it != refs_.end()) return it->second;
    PAGODA_ASSIGN_OR_RETURN(const json* target, resolve(ref, where));
    std::string hint = ref.substr(ref.rfind('/') == std::string::npos ? 0 : ref.rfind('/') + 1);
    const std::string name = new_name(hint.empty() ? "ref" : hint);
    refs_[ref] = name;  // before visiting: a recursive schema refers to the rule by name
    const std::size_t slot = rules_.size();
    rules_.emplace_back(name, "");
    PAGODA_ASSIGN_OR_RETURN(std::string body, visit(*target, ref, name));
    rules_[slot].second = std::move(body);
    return name;
  }

  std::string literal_of(const json& v) { return gbnf_literal(v.dump()); }

  result<std::int64_t> count_of(const json& s, const char* key, const std::string& where, std::int64_t fallback) {
    if (!s.contains(key)) return fallback;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() > k_max_repetition)
      return fail(where, fmt::format("{} must be an integer in [0, {}]", key, k_max_repetition));
    return v.get<std::int64_t>();
  }

  // "{m,n}" for a repetition, "" for exactly once; -1 as n: unbounded.
  static std::string repeat(std::int64_t m, std::int64_t n) {
    if (n < 0) return m == 0 ? "*" : m == 1 ? "+" : fmt::format("{{{},}}", m);
    return fmt::format("{{{},{}}}", m, n);
  }

  result<std::string> visit_type(const json& s, const std::string& type, const std::string& where,
                                 const std::string& hint) {
    if (type == "null") return prim("json-null");
    if (type == "boolean") return prim("json-boolean");
    if (type == "integer") return prim("json-int");
    if (type == "number") return prim("json-number");
    if (type == "string") return visit_string(s, where);
    if (type == "array") return visit_array(s, where, hint);
    if (type == "object") return visit_object(s, where, hint);
    return fail(where, fmt::format("unknown type \"{}\"", type));
  }

  result<std::string> visit_string(const json& s, const std::string& where) {
    if (s.contains("format")) {
      const json& f = s["format"];
      const std::string name = f.is_string() ? f.get<std::string>() : "";
      if (name == "date" || name == "time" || name == "date-time" || name == "uuid") return prim("json-" + name);
      return fail(where, fmt::format("the format \"{}\" is not supported (date, time, date-time, uuid are)",
                                     f.is_string() ? name : f.dump()));
    }
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) return fail(where, "pattern must be a string");
      if (s.contains("minLength") || s.contains("maxLength"))
        return fail(where, "minLength or maxLength together with pattern is not supported");
      auto e = regex_expression(s["pattern"].get<std::string>(), true);
      if (!e.ok()) return fail(where, "pattern: " + e.error().message());
      // The string holds what the regex matches; characters JSON must escape are kept out.
      return add_rule("pattern", "\"\\\"\" " + *e + " \"\\\"\"");
    }
    PAGODA_ASSIGN_OR_RETURN(std::int64_t lo, count_of(s, "minLength", where, 0));
    PAGODA_ASSIGN_OR_RETURN(std::int64_t hi, count_of(s, "maxLength", where, -1));
    if (hi >= 0 && hi < lo) return fail(where, "maxLength is below minLength");
    if (lo == 0 && hi < 0) return prim("json-string");
    use("json-char");
    return std::string("\"\\\"\" json-char") + repeat(lo, hi) + " \"\\\"\"";
  }

  result<std::string> visit_array(const json& s, const std::string& where, const std::string& hint) {
    std::string item;
    if (s.contains("items")) {
      if (s["items"].is_array()) return fail(where, "items as an array (tuples) is not supported");
      PAGODA_ASSIGN_OR_RETURN(item, visit(s["items"], where + "/items", hint + "-item"));
    } else {
      item = prim("json-value");
    }
    PAGODA_ASSIGN_OR_RETURN(std::int64_t lo, count_of(s, "minItems", where, 0));
    PAGODA_ASSIGN_OR_RETURN(std::int64_t hi, count_of(s, "maxItems", where, -1));
    if (hi >= 0 && hi < lo) return fail(where, "maxItems is below minItems");
    use("ws");
    if (hi == 0) return std::string(R"("[" ws "]")");
    const std::string rest = "( \",\" ws " + item + " ws )";
    if (lo == 0)
      return add_rule(hint + "-array", "\"[\" ws ( " + item + " ws " + rest + repeat(0, hi < 0 ? -1 : hi - 1) + " )? \"]\"");
    return add_rule(hint + "-array", "\"[\" ws " + item + " ws " + rest + repeat(lo - 1, hi < 0 ? -1 : hi - 1) + " \"]\"");
  }

  result<std::string> visit_object(const json& s, const std::string& where, const std::string& hint) {
    use("ws");
    const json empty = json::object();
    const json& props = s.contains("properties") ? s["properties"] : empty;
    if (!props.is_object()) return fail(where, "properties must be an object");
    std::vector<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) return fail(where, "required must be an array of strings");
      for (const json& r : s["required"]) {
        if (!r.is_string()) return fail(where, "required must be an array of strings");
        required.push_back(r.get<std::string>());
      }
    }
    if (props.empty() && required.empty()) {
      if (!s.contains("additionalProperties") || s["additionalProperties"] == json(true)) return prim("json-object");
      if (s["additionalProperties"] == json(false)) return std::string(R"("{" ws "}")");
      PAGODA_ASSIGN_OR_RETURN(std::string v, visit(s["additionalProperties"], where + "/additionalProperties", hint + "-value"));
      const std::string member = add_rule(hint + "-member", prim("json-string") + " ws \":\" ws " + v + " ws");
      return add_rule(hint, "\"{\" ws ( " + member + " ( \",\" ws " + member + " )* )? \"}\"");
    }
    // Each property as `"name" ws ":" ws value ws`, required ones first.
    std::vector<std::string> req, opt;
    std::set<std::string> is_required(required.begin(), required.end());
    auto member = [&](const std::string& name, const json& schema) -> result<std::string> {
      PAGODA_ASSIGN_OR_RETURN(std::string v, visit(schema, where + "/properties/" + name, hint + "-" + name));
      return add_rule(hint + "-" + name + "-kv", gbnf_literal(json(name).dump()) + " ws \":\" ws " + v + " ws");
    };
    for (const std::string& name : required) {
      const json& schema = props.contains(name) ? props[name] : json(true);
      PAGODA_ASSIGN_OR_RETURN(std::string m, member(name, schema));
      req.push_back(std::move(m));
    }
    for (const auto& [name, schema] : props.items()) {
      if (is_required.count(name) != 0) continue;
      PAGODA_ASSIGN_OR_RETURN(std::string m, member(name, schema));
      opt.push_back(std::move(m));
    }
    std::string body = "\"{\" ws ";
    if (!req.empty()) {
      for (std::size_t i = 0; i < req.size(); ++i) body += (i ? " \",\" ws " : "") + req[i];
      for (const std::string& o : opt) body += " ( \",\" ws " + o + " )?";
    } else {
      // Any ordered subset of the optional ones: tail_i ::= p_i ( "," ws tail_(i+1) )? | tail_(i+1).
      std::string next;
      for (std::size_t i = opt.size(); i-- > 0;)
        next = add_rule(hint + "-tail", next.empty() ? opt[i] : opt[i] + " ( \",\" ws " + next + " )? | " + next);
      body += "( " + next + " )?";
    }
    return add_rule(hint, body + " \"}\"");
  }

  const json& root_;
  std::string prefix_;
  std::vector<std::pair<std::string, std::string>> rules_;
  std::set<std::string> names_;
  std::set<std::string> used_;
  std::map<std::string, std::string> refs_;
  int depth_ = 0;
};

}  // namespace

result<std::string> json_schema_to_gbnf(const json& schema) {
  PAGODA_ASSIGN_OR_RETURN(std::string text, converter(schema).run());
  // The grammar checks what the schema alone does not show: a $ref or anyOf
  // cycle that takes no text (left recursion) and the size limits.
  if (auto g = parse_gbnf(text); !g.ok()) {
    const std::string& m = g.error().message();
    if (m.find("left recursion") != std::string::npos)
      return error(errc::invalid_argument, "json schema: a $ref cycle that takes no text in between ({})", m);
    return error(errc::invalid_argument, "json schema: {}", m);
  }
  return text;
}

result<schema_set_gbnf> json_schemas_to_gbnf(std::span<const json> schemas, std::span<const std::string> prefixes) {
  schema_set_gbnf out;
  std::set<std::string> used = {"ws"};
  for (std::size_t i = 0; i < schemas.size(); ++i) {
    std::string top;
    PAGODA_ASSIGN_OR_RETURN(top, converter(schemas[i], prefixes[i]).run_into(out.rules, used));
    out.tops.push_back(std::move(top));
  }
  for (const std::string& p : used) out.rules += p + " ::= " + primitives().at(p) + "\n";
  return out;
}

std::string json_object_gbnf() { return "root ::= json-object ws\n" + [] {
  std::string out;
  for (const char* p : {"ws", "json-object", "json-member", "json-string", "json-char", "json-value", "json-array",
                        "json-number", "json-int", "json-boolean", "json-null"})
    out += std::string(p) + " ::= " + primitives().at(p) + "\n";
  return out;
}(); }

}  // namespace pagoda::grammar
