// The engine's step time with the disk KV store on against off, in the same
// run (bench/RESULTS.md, "KV warehouse"): docs/kv-store.md's rule that the
// engine thread never waits on the store, measured. Each step is timed
// around engine_core::step on the calling thread (the engine thread),
// as pagoda serve's engine loop runs it.
//
// Loads, each run with the store off and on, alternating which goes first,
// for --rounds rounds (a fresh store directory each time; one untimed run
// first pages the model in):
// - shared: --requests requests over --groups shared prefixes of --prefix
//   tokens plus a unique tail, in a pool that holds them all: both
//   conditions compute the same tokens, and the store adds its lookups, the
//   write-back of every new block and its threads' CPU;
// - fsync: every request's prompt unique (every block is written back),
//   while a thread writes and fsyncs 1 MiB at a time to the store's file
//   system in both conditions (the store's syncs are slow, as on a busy disk);
// - evicting (only when --loads names it): the shared load in a pool of
//   --small-kv-tokens, too small for every prefix: with the store on, evicted
//   prefixes come back from disk. Loads replace prefill, so its steps are not
//   the same work; on stories260K, whose prefill costs less than a load, it
//   exercises the load path under load rather than showing what loads save
//   (bench/kv_store_ttft.py does that on a model where prefill costs).
//
//   build/release/bench/kv_store_steps_bench [--model models/stories260K.gguf] [--rounds 3]
//       [--requests 128] [--groups 16] [--prefix 256] [--tail 16] [--max-tokens 64] [--threads 1]
//       [--batch-tokens 256] [--small-kv-tokens 3072] [--loads shared,fsync] [--dir /tmp]
//
// Prints, per load and condition, the steps' p50, p99 and mean in
// microseconds over every round, the process's and the engine thread's CPU
// time, and the store-on / store-off ratios. It reports; it asserts nothing.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "sched/engine_setup.h"

namespace {

using namespace pagoda;
namespace fs = std::filesystem;

struct options {
  std::string model = std::string(PAGODA_SOURCE_DIR) + "/models/stories260K.gguf";
  int rounds = 3, requests = 128, groups = 16, prefix = 256, tail = 16, max_tokens = 64, threads = 1;
  int batch_tokens = 256;
  std::vector<std::string> loads = {"shared", "fsync"};
  std::int64_t small_kv_tokens = 3072;
  std::string dir = fs::temp_directory_path().string();
};

struct run_stats {
  std::vector<double> step_us;  // every step that planned work
  std::int64_t loaded_tokens = 0, computed_tokens = 0, written = 0, batches = 0;
  double seconds = 0;
  double cpu_seconds = 0;  // the process's, every thread's (the store's threads included)
  double engine_cpu_seconds = 0;  // the engine thread's
};

double process_cpu_seconds(int who = RUSAGE_SELF) {
  rusage u{};
  ::getrusage(who, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// Writes and fsyncs 1 MiB at a time to a file in dir until stopped: other
// I/O on the store's disk, which makes the store's own syncs slow.
class fsync_hog {
 public:
  explicit fsync_hog(const std::string& dir) : path_(dir + "/fsync_hog.bin") {
    thread_ = std::thread([this] {
      const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd < 0) return;
      std::vector<char> buf(1 << 20, 'x');
      for (int i = 0; !stop_.load(); ++i) {
        const auto at = static_cast<off_t>(i % 64) * static_cast<off_t>(buf.size());
        if (::pwrite(fd, buf.data(), buf.size(), at) < 0) break;
        ::fsync(fd);
      }
      ::close(fd);
    });
  }
  ~fsync_hog() {
    stop_ = true;
    thread_.join();
    fs::remove(path_);
  }

 private:
  std::string path_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::vector<request> make_requests(const options& o, const llama_model& model, bool shared, unsigned seed) {
  std::mt19937 rng(seed);
  const int n_vocab = model.vocab().n_vocab();
  auto random_tokens = [&](int n) {
    std::vector<token_id> t(static_cast<std::size_t>(n));
    for (token_id& x : t) x = static_cast<token_id>(3 + rng() % static_cast<unsigned>(n_vocab - 3));
    return t;
  };
  std::vector<std::vector<token_id>> prefixes;
  for (int g = 0; g < o.groups; ++g) prefixes.push_back(random_tokens(o.prefix));
  std::vector<request> out;
  for (int i = 0; i < o.requests; ++i) {
    request r;
    r.id = fmt::format("r{}", i);
    r.prompt = shared ? prefixes[rng() % prefixes.size()] : random_tokens(o.prefix);
    const auto tail = random_tokens(o.tail);
    r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
    r.max_tokens = o.max_tokens;
    r.sampling = sampling_params::greedy();
    r.ignore_eos = true;
    out.push_back(std::move(r));
  }
  return out;
}

run_stats run_once(const options& o, const llama_model& model, const std::vector<request>& reqs,
                   const std::string& store, std::int64_t kv_tokens) {
  engine_config c;
  c.model_path = o.model;
  c.n_threads = o.threads;
  c.kv_cache_dtype = "f32";
  c.max_num_seqs = 16;
  c.max_num_batched_tokens = o.batch_tokens;
  c.max_kv_tokens = kv_tokens;
  c.n_ctx = o.prefix + o.tail + o.max_tokens + 16;
  c.kv_store_path = store;
  c.kv_store_size_gib = 1;
  auto cc = make_engine_core_config(model, c);
  if (!cc.ok()) {
    fmt::print(stderr, "{}\n", cc.error().message());
    std::exit(1);
  }
  std::unique_ptr<kv_warehouse> w;
  if (!store.empty()) {
    auto made = make_warehouse(c, model);
    if (!made.ok()) {
      fmt::print(stderr, "{}\n", made.error().message());
      std::exit(1);
    }
    w = std::move(*made);
  }
  auto core = std::move(*engine_core::create(model, *cc));
  if (w) attach_warehouse(*core, *w);
  for (const request& r : reqs) (void)core->add_request(r);
  run_stats s;
  std::vector<engine_event> ev;
  const double cpu0 = process_cpu_seconds();
  const double engine_cpu0 = process_cpu_seconds(RUSAGE_THREAD);
  const auto t0 = std::chrono::steady_clock::now();
  while (core->has_work()) {
    ev.clear();
    const auto a = std::chrono::steady_clock::now();
    const bool worked = core->step(ev);
    const auto b = std::chrono::steady_clock::now();
    if (worked) s.step_us.push_back(std::chrono::duration<double, std::micro>(b - a).count());
  }
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s.engine_cpu_seconds = process_cpu_seconds(RUSAGE_THREAD) - engine_cpu0;
  s.loaded_tokens = core->stats().n_loaded_tokens;
  s.computed_tokens = core->stats().n_computed_prompt_tokens;
  core.reset();
  if (w) {
    w->close();  // the write-back's last batch counts too
    s.written = w->counters().written;
    s.batches = w->counters().write_batches;
  }
  s.cpu_seconds = process_cpu_seconds() - cpu0;
  return s;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (const double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") o.model = v;
    else if (k == "--rounds") o.rounds = std::stoi(v);
    else if (k == "--requests") o.requests = std::stoi(v);
    else if (k == "--groups") o.groups = std::stoi(v);
    else if (k == "--prefix") o.prefix = std::stoi(v);
    else if (k == "--tail") o.tail = std::stoi(v);
    else if (k == "--max-tokens") o.max_tokens = std::stoi(v);
    else if (k == "--threads") o.threads = std::stoi(v);
    else if (k == "--batch-tokens") o.batch_tokens = std::stoi(v);
    else if (k == "--loads") {
      o.loads.clear();
      for (std::size_t a = 0, b; a <= v.size(); a = b + 1) {
        b = std::min(v.find(',', a), v.size());
        o.loads.push_back(v.substr(a, b - a));
      }
    }
    else if (k == "--small-kv-tokens") o.small_kv_tokens = std::stoll(v);
    else if (k == "--dir") o.dir = v;
    else {
      fmt::print(stderr, "unknown option {}\n", k);
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  auto model = llama_model::load(o.model);
  if (!model.ok()) {
    fmt::print(stderr, "{}\n", model.error().message());
    return 1;
  }
  const std::string base = o.dir + "/pagoda_kv_steps_" + std::to_string(::getpid());
  fs::create_directories(base);
  // A pool for every sequence's whole context at once: nothing is evicted.
  const std::int64_t big_kv_tokens = static_cast<std::int64_t>(16 + o.groups) * (o.prefix + o.tail + o.max_tokens + 16);
  (void)run_once(o, **model, make_requests(o, **model, true, 7), "", big_kv_tokens);  // pages the model in
  const std::vector<std::string>& loads = o.loads;
  std::map<std::string, run_stats> all;  // "load/condition" -> every round's steps
  for (int round = 0; round < o.rounds; ++round) {
    for (const std::string& load : loads) {
      const bool shared = load != "fsync";
      const auto reqs = make_requests(o, **model, shared, static_cast<unsigned>(1000 * round + shared));
      std::unique_ptr<fsync_hog> hog;
      if (load == "fsync") hog = std::make_unique<fsync_hog>(base);
      const std::int64_t kv_tokens = load == "evicting" ? o.small_kv_tokens : big_kv_tokens;
      // Alternate which condition goes first, so drift in the machine's load does not favour one.
      for (int k = 0; k < 2; ++k) {
        const bool on = (k + round) % 2 == 1;
        const std::string store = on ? fmt::format("{}/store_{}_{}", base, load, round) : "";
        const run_stats s = run_once(o, **model, reqs, store, kv_tokens);
        run_stats& acc = all[load + (on ? "/disk" : "/off")];
        acc.step_us.insert(acc.step_us.end(), s.step_us.begin(), s.step_us.end());
        acc.loaded_tokens += s.loaded_tokens;
        acc.computed_tokens += s.computed_tokens;
        acc.written += s.written;
        acc.batches += s.batches;
        acc.seconds += s.seconds;
        acc.cpu_seconds += s.cpu_seconds;
        acc.engine_cpu_seconds += s.engine_cpu_seconds;
        if (on) fs::remove_all(store);
      }
    }
  }
  fs::remove_all(base);
  fmt::print("| load | store | steps | p50 us | p99 us | mean us | run s | CPU s | engine CPU s | prompt tokens computed "
             "| loaded | blocks written | write batches |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& [name, s] : all)
    fmt::print("| {} | {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.2f} | {:.2f} | {:.2f} | {} | {} | {} | {} |\n",
               name.substr(0, name.find('/')), name.substr(name.find('/') + 1), s.step_us.size(),
               percentile(s.step_us, 0.5), percentile(s.step_us, 0.99), mean(s.step_us), s.seconds, s.cpu_seconds,
               s.engine_cpu_seconds, s.computed_tokens, s.loaded_tokens, s.written, s.batches);
  fmt::print("\n| load | p50 disk/off | p99 disk/off | mean disk/off | run time disk/off | CPU disk/off |\n");
  fmt::print("|---|---|---|---|---|---|\n");
  for (const std::string& load : loads) {
    const run_stats& on = all[load + "/disk"];
    const run_stats& off = all[load + "/off"];
    fmt::print("| {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} |\n", load,
               percentile(on.step_us, 0.5) / percentile(off.step_us, 0.5),
               percentile(on.step_us, 0.99) / percentile(off.step_us, 0.99), mean(on.step_us) / mean(off.step_us),
               on.seconds / off.seconds, on.cpu_seconds / off.cpu_seconds);
  }
  return 0;
}
