#include "quant/kv_format_spec.h"

#include <cctype>
#include <charconv>
#include <string>

namespace pagoda {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool parse_int(std::string_view s, int& out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

result<kv_type> type_of_bits(std::string_view bits, std::string_view whole) {
  if (bits == "2") return kv_type::int2;
  if (bits == "4") return kv_type::int4;
  if (bits == "8") return kv_type::int8;
  if (bits == "16") return kv_type::f16;
  if (bits == "32") return kv_type::f32;
  return error(errc::invalid_argument, "KV type pair '{}': bits must be 2, 4, 8, 16 or 32", whole);
}

}  // namespace

kv_format kv_format_spec::resolve(kv_role role, bool with_static_scales) const {
  kv_format f = default_kv_format(type, role);
  if (mode) {
    f.scale_mode = *mode;
    f.group_size = *mode == kv_scale_mode::group ? group_size : 0;
  } else if (with_static_scales) {
    const kv_codec* c = get_kv_codec(type);
    if (c && c->make_static && c->check({type, role, kv_scale_mode::static_scales, 0}, {16, 32}).ok()) {
      f.scale_mode = kv_scale_mode::static_scales;
      f.group_size = 0;
    }
  }
  return f;
}

result<kv_format_spec> parse_kv_format_spec(std::string_view text) {
  text = trim(text);
  std::size_t slash = text.find('/');
  kv_format_spec spec;
  PAGODA_ASSIGN_OR_RETURN(spec.type, parse_kv_type(text.substr(0, slash)));
  if (slash == std::string_view::npos) return spec;
  std::string m = lower(text.substr(slash + 1));
  if (m == "token" || m == "tok" || m == "per_token") spec.mode = kv_scale_mode::per_token;
  else if (m == "channel" || m == "ch" || m == "per_channel") spec.mode = kv_scale_mode::per_channel;
  else if (m == "static") spec.mode = kv_scale_mode::static_scales;
  else if (m == "none") spec.mode = kv_scale_mode::none;
  else if ((m.starts_with("g") && parse_int(std::string_view(m).substr(1), spec.group_size)) ||
           (m.starts_with("group") && parse_int(std::string_view(m).substr(5), spec.group_size))) {
    if (spec.group_size <= 0)
      return error(errc::invalid_argument, "KV type '{}': the group size must be positive", text);
    spec.mode = kv_scale_mode::group;
  } else {
    return error(errc::invalid_argument,
                 "KV type '{}': unknown scale mode '{}' (token, channel, gN for groups of N channels, static, none)",
                 text, text.substr(slash + 1));
  }
  return spec;
}

result<kv_pair_spec> parse_kv_pair_spec(std::string_view text) {
  text = trim(text);
  if (std::size_t plus = text.find('+'); plus != std::string_view::npos) {
    kv_pair_spec p;
    PAGODA_ASSIGN_OR_RETURN(p.k, parse_kv_format_spec(text.substr(0, plus)));
    PAGODA_ASSIGN_OR_RETURN(p.v, parse_kv_format_spec(text.substr(plus + 1)));
    return p;
  }
  std::string l = lower(text);
  // "k8v4": only digits after k and v.
  if (l.size() >= 4 && l[0] == 'k') {
    std::size_t v = l.find('v');
    auto digits = [](std::string_view s) {
      if (s.empty()) return false;
      for (char c : s)
        if (!std::isdigit(static_cast<unsigned char>(c))) return false;
      return true;
    };
    if (v != std::string::npos && digits(std::string_view(l).substr(1, v - 1)) &&
        digits(std::string_view(l).substr(v + 1))) {
      kv_pair_spec p;
      PAGODA_ASSIGN_OR_RETURN(p.k.type, type_of_bits(std::string_view(l).substr(1, v - 1), text));
      PAGODA_ASSIGN_OR_RETURN(p.v.type, type_of_bits(std::string_view(l).substr(v + 1), text));
      return p;
    }
  }
  PAGODA_ASSIGN_OR_RETURN(kv_format_spec one, parse_kv_format_spec(text));
  return kv_pair_spec{one, one};
}

result<std::vector<kv_layer_rule>> parse_kv_layer_rules(std::string_view text) {
  std::vector<kv_layer_rule> rules;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t comma = text.find(',', start);
    std::string_view item = trim(text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    start = comma == std::string_view::npos ? text.size() + 1 : comma + 1;
    if (item.empty()) continue;
    std::size_t colon = item.find(':');
    if (colon == std::string_view::npos)
      return error(errc::invalid_argument, "--kv-layer-types '{}': expected LAYERS:TYPE, e.g. 0-1:f16,2-:int4", item);
    std::string_view range = trim(item.substr(0, colon));
    kv_layer_rule r;
    std::size_t dash = range.find('-');
    bool ok;
    if (dash == std::string_view::npos) {
      ok = parse_int(range, r.first);
      r.last = r.first;
    } else {
      std::string_view a = trim(range.substr(0, dash)), b = trim(range.substr(dash + 1));
      ok = (a.empty() || parse_int(a, r.first)) && (b.empty() || parse_int(b, r.last)) && !(a.empty() && b.empty());
      if (a.empty()) r.first = 0;
      if (b.empty()) r.last = -1;
    }
    if (!ok || r.first < 0 || (r.last >= 0 && r.last < r.first))
      return error(errc::invalid_argument, "--kv-layer-types: bad layer range '{}' (N, N-M, N- or -M)", range);
    auto pair = parse_kv_pair_spec(item.substr(colon + 1));
    if (!pair.ok()) return pair.error().with_context(fmt::format("--kv-layer-types '{}'", item));
    r.spec = *pair;
    rules.push_back(r);
  }
  if (rules.empty()) return error(errc::invalid_argument, "--kv-layer-types is empty");
  return rules;
}

}  // namespace pagoda
