// Small timing helpers shared by bench/micro/*_bench.cpp (one executable each).
#pragma once

#include <time.h>

#include <algorithm>
#include <vector>

namespace pagoda::bench {

// The process's CPU time (every thread; memory stalls count), in seconds: on a
// shared machine other jobs take whole time slices from a step, which wall
// clock charges to the step and CPU time does not.
inline double process_cpu_s() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// REQUIRES: v not empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace pagoda::bench
