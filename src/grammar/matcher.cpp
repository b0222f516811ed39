#include "grammar/matcher.h"

#include <algorithm>
#include <cstring>

namespace pagoda::grammar {

namespace {

// Appends to `out` every stack that `stack` expands to: the top reference
// replaced by each alternative of its rule until every top is a character
// element (or the stack is empty). Terminates because parse_gbnf refuses
// left recursion.
void expand(const rules& g, std::vector<std::uint32_t>& stack, match_state& out) {
  if (stack.empty() || g.elements[stack.back()].kind == element::chr) {
    out.data.insert(out.data.end(), stack.begin(), stack.end());
    out.ends.push_back(static_cast<std::uint32_t>(out.data.size()));
    return;
  }
  const std::uint32_t top = stack.back();
  const element& e = g.elements[top];
  stack.pop_back();
  const bool more = g.elements[top + 1].kind != element::end;
  if (more) stack.push_back(top + 1);
  for (const std::uint32_t alt : g.alternatives[e.value]) {
    if (g.elements[alt].kind == element::end) {
      expand(g, stack, out);
    } else {
      stack.push_back(alt);
      expand(g, stack, out);
      stack.pop_back();
    }
  }
  if (more) stack.pop_back();
  stack.push_back(top);
}

// Sorts the stacks and drops duplicates (ambiguous grammars make them).
void normalise(match_state& s) {
  if (s.ends.size() < 2) return;
  struct span {
    std::uint32_t b, e;
  };
  std::vector<span> spans;
  spans.reserve(s.ends.size());
  std::uint32_t b = 0;
  for (const std::uint32_t e : s.ends) {
    spans.push_back({b, e});
    b = e;
  }
  const std::uint32_t* d = s.data.data();
  auto less = [d](const span& x, const span& y) {
    return std::lexicographical_compare(d + x.b, d + x.e, d + y.b, d + y.e);
  };
  auto same = [d](const span& x, const span& y) { return std::equal(d + x.b, d + x.e, d + y.b, d + y.e); };
  if (std::is_sorted(spans.begin(), spans.end(), less) &&
      std::adjacent_find(spans.begin(), spans.end(), same) == spans.end())
    return;
  std::sort(spans.begin(), spans.end(), less);
  spans.erase(std::unique(spans.begin(), spans.end(), same), spans.end());
  std::vector<std::uint32_t> data;
  std::vector<std::uint32_t> ends;
  for (const span& x : spans) {
    data.insert(data.end(), d + x.b, d + x.e);
    ends.push_back(static_cast<std::uint32_t>(data.size()));
  }
  s.data = std::move(data);
  s.ends = std::move(ends);
}

thread_local std::vector<std::uint32_t> scratch;

}  // namespace

bool match_state::accepts() const {
  if (n_partial != 0) return false;
  std::uint32_t b = 0;
  for (const std::uint32_t e : ends) {
    if (e == b) return true;
    b = e;
  }
  return false;
}

std::string match_state::key() const {
  std::string k;
  k.resize((data.size() + ends.size() + 1) * sizeof(std::uint32_t) + 1);
  char* p = k.data();
  // (An empty vector's data() may be null, which memcpy must not be given.)
  auto put = [&p](const std::vector<std::uint32_t>& v) {
    if (!v.empty()) std::memcpy(p, v.data(), v.size() * sizeof(std::uint32_t));
    p += v.size() * sizeof(std::uint32_t);
  };
  put(data);
  put(ends);
  std::memcpy(p, &partial, sizeof(partial));
  p[sizeof(partial)] = static_cast<char>(n_partial);
  return k;
}

match_state initial_state(const rules& g) {
  match_state s;
  for (const std::uint32_t alt : g.alternatives[g.root]) {
    scratch.clear();
    if (g.elements[alt].kind != element::end) scratch.push_back(alt);
    expand(g, scratch, s);
  }
  normalise(s);
  return s;
}

bool advance_byte(const rules& g, const match_state& in, std::uint8_t byte, match_state& out) {
  out.data.clear();
  out.ends.clear();
  std::uint32_t cp = 0;
  int rest = 0;  // continuation bytes still needed after this one
  if (in.n_partial == 0) {
    if (byte < 0x80) {
      cp = byte;
    } else if ((byte & 0xE0) == 0xC0 && byte >= 0xC2) {
      cp = byte & 0x1F, rest = 1;
    } else if ((byte & 0xF0) == 0xE0) {
      cp = byte & 0x0F, rest = 2;
    } else if ((byte & 0xF8) == 0xF0 && byte <= 0xF4) {
      cp = byte & 0x07, rest = 3;
    } else {
      return false;  // a continuation byte or an invalid lead byte
    }
  } else {
    if ((byte & 0xC0) != 0x80) return false;
    // Only the shortest form of a character, no surrogates, nothing past
    // U+10FFFF: what the second byte of E0, ED, F0 and F4 may be.
    if (in.n_partial == 2 && ((in.partial == 0x0 && byte < 0xA0) || (in.partial == 0xD && byte > 0x9F))) return false;
    if (in.n_partial == 3 && ((in.partial == 0x0 && byte < 0x90) || (in.partial == 0x4 && byte > 0x8F))) return false;
    cp = (in.partial << 6) | (byte & 0x3F);
    rest = in.n_partial - 1;
  }
  const std::uint32_t* d = in.data.data();
  std::uint32_t b = 0;
  if (rest > 0) {
    // A partial character: keep the stacks that some completion could take.
    std::uint32_t lo = cp << (6 * rest);
    std::uint32_t hi = lo | ((1u << (6 * rest)) - 1);
    if (in.n_partial == 0) {  // a lead byte: the shortest forms of its length only
      lo = std::max(lo, rest == 1 ? 0x80u : rest == 2 ? 0x800u : 0x10000u);
      hi = std::min(hi, 0x10FFFFu);
    }
    for (const std::uint32_t e : in.ends) {
      if (e > b && g.classes[g.elements[d[e - 1]].value].intersects(lo, hi)) {
        out.data.insert(out.data.end(), d + b, d + e);
        out.ends.push_back(static_cast<std::uint32_t>(out.data.size()));
      }
      b = e;
    }
    out.partial = cp;
    out.n_partial = static_cast<std::uint8_t>(rest);
    return !out.ends.empty();
  }
  out.partial = 0;
  out.n_partial = 0;
  for (const std::uint32_t e : in.ends) {
    if (e > b) {
      const std::uint32_t top = d[e - 1];
      if (g.classes[g.elements[top].value].contains(cp)) {
        scratch.assign(d + b, d + e - 1);
        if (g.elements[top + 1].kind != element::end) scratch.push_back(top + 1);
        expand(g, scratch, out);
      }
    }
    b = e;
  }
  normalise(out);
  return !out.ends.empty();
}

bool advance(const rules& g, match_state& s, std::string_view text) {
  match_state next;
  for (const char c : text) {
    if (!advance_byte(g, s, static_cast<std::uint8_t>(c), next)) return false;
    std::swap(s, next);
  }
  return true;
}

bool matches(const rules& g, std::string_view text) {
  match_state s = initial_state(g);
  return advance(g, s, text) && s.accepts();
}

}  // namespace pagoda::grammar
