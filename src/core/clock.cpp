#include "core/clock.h"

namespace pagoda {

namespace {
class system_clock_impl final : public clock_source {
 public:
  std::int64_t monotonic_us() const override { return now_us(); }
  std::int64_t wall_ms() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};
}  // namespace

const clock_source& system_clock_source() {
  static const system_clock_impl clock;
  return clock;
}

}  // namespace pagoda
