#include "quant/kv_format_spec.h"

#include <gtest/gtest.h>

namespace pagoda {
namespace {

TEST(kv_format_spec, types_and_modes) {
  auto s = *parse_kv_format_spec("int4/channel");
  EXPECT_EQ(s.type, kv_type::int4);
  EXPECT_EQ(*s.mode, kv_scale_mode::per_channel);
  s = *parse_kv_format_spec("INT8/g32");
  EXPECT_EQ(*s.mode, kv_scale_mode::group);
  EXPECT_EQ(s.group_size, 32);
  s = *parse_kv_format_spec("fp8");
  EXPECT_EQ(s.type, kv_type::fp8_e4m3);
  EXPECT_FALSE(s.mode.has_value());
  EXPECT_EQ(parse_kv_format_spec("int4/tok")->mode, kv_scale_mode::per_token);
  EXPECT_EQ(parse_kv_format_spec("fp8_e5m2/static")->mode, kv_scale_mode::static_scales);
  EXPECT_FALSE(parse_kv_format_spec("int4/diagonal").ok());
  EXPECT_FALSE(parse_kv_format_spec("int4/g0").ok());
  EXPECT_FALSE(parse_kv_format_spec("int3").ok());
}

TEST(kv_format_spec, defaults_follow_the_role_and_static_scales) {
  auto s = *parse_kv_format_spec("int4");
  EXPECT_EQ(s.resolve(kv_role::key, false).scale_mode, kv_scale_mode::per_channel);  // KIVI
  EXPECT_EQ(s.resolve(kv_role::value, false).scale_mode, kv_scale_mode::per_token);
  EXPECT_EQ(s.resolve(kv_role::key, true).scale_mode, kv_scale_mode::static_scales);
  // An explicit mode wins over a calibration file; float types never turn static.
  EXPECT_EQ(parse_kv_format_spec("int4/token")->resolve(kv_role::key, true).scale_mode, kv_scale_mode::per_token);
  EXPECT_EQ(parse_kv_format_spec("f16")->resolve(kv_role::key, true).scale_mode, kv_scale_mode::none);
  EXPECT_EQ(parse_kv_format_spec("q8_0")->resolve(kv_role::key, true).scale_mode, kv_scale_mode::group);
}

TEST(kv_format_spec, pairs) {
  auto p = *parse_kv_pair_spec("k8v4");
  EXPECT_EQ(p.k.type, kv_type::int8);
  EXPECT_EQ(p.v.type, kv_type::int4);
  p = *parse_kv_pair_spec("K16V2");
  EXPECT_EQ(p.k.type, kv_type::f16);
  EXPECT_EQ(p.v.type, kv_type::int2);
  p = *parse_kv_pair_spec("int4/token+fp8");
  EXPECT_EQ(p.k.type, kv_type::int4);
  EXPECT_EQ(*p.k.mode, kv_scale_mode::per_token);
  EXPECT_EQ(p.v.type, kv_type::fp8_e4m3);
  p = *parse_kv_pair_spec("q8_0");
  EXPECT_EQ(p.k.type, kv_type::q8_0);
  EXPECT_EQ(p.v.type, kv_type::q8_0);
  auto bad = parse_kv_pair_spec("k3v4");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("bits"), std::string::npos);
}

TEST(kv_format_spec, layer_rules) {
  auto rules = *parse_kv_layer_rules("0-1:f16, 2-:int4,4:k8v4");
  ASSERT_EQ(rules.size(), 3u);
  EXPECT_EQ(rules[0].first, 0);
  EXPECT_EQ(rules[0].last, 1);
  EXPECT_EQ(rules[1].first, 2);
  EXPECT_EQ(rules[1].last, -1);
  EXPECT_EQ(rules[2].first, 4);
  EXPECT_EQ(rules[2].last, 4);
  EXPECT_EQ(rules[2].spec.v.type, kv_type::int4);
  auto upto = *parse_kv_layer_rules("-2:int8");
  EXPECT_EQ(upto[0].first, 0);
  EXPECT_EQ(upto[0].last, 2);
  for (const char* bad : {"", "f16", "3-1:f16", "a:f16", "0:int3", "-:f16"}) {
    auto r = parse_kv_layer_rules(bad);
    EXPECT_FALSE(r.ok()) << bad;
  }
}

}  // namespace
}  // namespace pagoda
