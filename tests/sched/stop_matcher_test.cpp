#include "sched/stop_matcher.h"

#include <gtest/gtest.h>

namespace pagoda {
namespace {

TEST(stop_matcher, releases_text_that_cannot_start_a_stop) {
  stop_matcher m({"END"});
  EXPECT_EQ(m.push("hello "), "hello ");
  EXPECT_EQ(m.push("wor"), "wor");
  EXPECT_EQ(m.push("ld E"), "ld ");  // "E" might begin "END": held
  EXPECT_EQ(m.push("N"), "");
  EXPECT_EQ(m.push("D and more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "END");
  EXPECT_EQ(m.flush(), "");
}

TEST(stop_matcher, held_text_comes_back_when_no_stop_follows) {
  stop_matcher m({"END"});
  EXPECT_EQ(m.push("a story E"), "a story ");
  EXPECT_EQ(m.push("lse"), "Else");
  EXPECT_EQ(m.push("EN"), "");
  EXPECT_EQ(m.flush(), "EN");
  EXPECT_FALSE(m.stopped());
}

TEST(stop_matcher, earliest_of_several_stops_wins) {
  stop_matcher m({"cat", "at the"});
  EXPECT_EQ(m.push("look at the cat"), "look ");
  EXPECT_EQ(m.matched(), "at the");
}

TEST(stop_matcher, no_stops_pass_everything) {
  stop_matcher m;
  EXPECT_EQ(m.push("abc"), "abc");
  stop_matcher e({""});
  EXPECT_EQ(e.push("abc"), "abc");
}

}  // namespace
}  // namespace pagoda
