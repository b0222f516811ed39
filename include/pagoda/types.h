// Small vocabulary types shared across modules.
#pragma once

#include <compare>
#include <cstdint>
#include <functional>

namespace pagoda {

using token_id = std::int32_t;
inline constexpr token_id k_no_token = -1;

// Strong ids where mix-ups are likely: a block id is not a sequence id.
template <typename Tag, typename Rep = std::int32_t>
struct strong_id {
  Rep value = -1;
  constexpr strong_id() = default;
  constexpr explicit strong_id(Rep v) : value(v) {}
  constexpr bool valid() const { return value >= 0; }
  constexpr auto operator<=>(const strong_id&) const = default;
};

struct block_id_tag {};
struct seq_id_tag {};
using block_id = strong_id<block_id_tag, std::int32_t>;
using seq_id = strong_id<seq_id_tag, std::int64_t>;

}  // namespace pagoda

template <typename Tag, typename Rep>
struct std::hash<pagoda::strong_id<Tag, Rep>> {
  std::size_t operator()(const pagoda::strong_id<Tag, Rep>& id) const noexcept { return std::hash<Rep>()(id.value); }
};
