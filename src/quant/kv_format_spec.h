// KV type specifications as users write them on the command line:
//
//   SPEC   := TYPE [ "/" MODE ]            int8, int4/channel, int4/g32, fp8/static, q8_0
//   MODE   := token | channel | gN | static | none
//   PAIR   := SPEC                         the same type for K and V
//           | "k" BITS "v" BITS            k8v4: int8 keys, int4 values (BITS: 2 4 8 16 32)
//           | SPEC "+" SPEC                int8/token+int4/token: keys + values
//   LAYERS := RULE { "," RULE }            0-1:f16,2-:int4   (engine setup: one rule a layer)
//   RULE   := RANGE ":" PAIR ;  RANGE := N | N "-" M | N "-" | "-" M
//
// A SPEC without a mode takes the type's default for the role (default_kv_format),
// or static scales when a calibration file is given and the codec has a static mode.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include "pagoda/status.h"
#include "quant/kv_codec.h"

namespace pagoda {

struct kv_format_spec {
  kv_type type = kv_type::f16;
  std::optional<kv_scale_mode> mode;  // empty: the default for the role
  int group_size = 0;

  // The format for a role; with_static_scales turns a default mode into static_scales.
  kv_format resolve(kv_role role, bool with_static_scales) const;
};

struct kv_pair_spec {
  kv_format_spec k;
  kv_format_spec v;
};

struct kv_layer_rule {
  int first = 0;
  int last = -1;  // inclusive; -1: to the last layer
  kv_pair_spec spec;
};

result<kv_format_spec> parse_kv_format_spec(std::string_view text);
result<kv_pair_spec> parse_kv_pair_spec(std::string_view text);
result<std::vector<kv_layer_rule>> parse_kv_layer_rules(std::string_view text);

}  // namespace pagoda
