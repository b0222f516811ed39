// The engine thread behind its queue: results equal the engine's own, cancels
// free blocks at once, the waiting cap answers resource_exhausted, batches are
// all or none, and stop() answers every channel.
#include "sched/engine_loop.h"

#include <atomic>
#include <new>

#include <gtest/gtest.h>

#include "common/requests.h"
#include "server/server_util.h"

namespace pagoda {
namespace {

using test::stories;

using test::greedy_request;

std::unique_ptr<engine_core> make_engine(std::int64_t n_blocks = 256, int max_seqs = 64, int ctx = 512) {
  engine_core_config cfg = test::engine_config_for(stories(), n_blocks, max_seqs);
  cfg.max_model_len = ctx;
  auto e = engine_core::create(stories(), cfg);
  EXPECT_TRUE(e.ok());
  return std::move(*e);
}

// Drains a channel until `n_requests` requests finished; returns the text per request id.
std::map<std::string, std::string> drain(request_channel& ch, std::size_t n_requests,
                                         std::map<std::string, std::string>* reasons = nullptr) {
  std::map<std::string, std::string> text;
  std::size_t done = 0;
  std::vector<engine_event> events;
  for (int guard = 0; done < n_requests && guard < 10000; ++guard) {
    events.clear();
    if (!ch.wait(events, std::chrono::milliseconds(100))) break;
    for (const engine_event& e : events) {
      text[e.request_id] += e.text;
      if (reasons && !e.finish_reason.empty()) (*reasons)[e.request_id] = e.finish_reason;
      if (e.request_finished) ++done;
    }
  }
  EXPECT_EQ(done, n_requests);
  return text;
}

TEST(engine_loop, results_match_the_engine_run_directly) {
  // Reference: the engine stepped by hand.
  auto ref = make_engine();
  ASSERT_TRUE(ref->add_request(greedy_request("a", "Once upon a time", 12)).ok());
  std::string expected;
  std::vector<engine_event> ev;
  while (ref->has_work()) {
    ev.clear();
    ref->step(ev);
    for (auto& e : ev) expected += e.text;
  }

  engine_loop loop(make_engine(), 16);
  auto ch = std::make_shared<request_channel>();
  std::vector<request> reqs;
  reqs.push_back(greedy_request("a", "Once upon a time", 12));
  reqs.push_back(greedy_request("b", "Once upon a time", 12));
  ASSERT_TRUE(loop.submit(std::move(reqs), ch).ok());
  auto text = drain(*ch, 2);
  EXPECT_EQ(text["a"], expected);
  EXPECT_EQ(text["b"], expected);
  engine_snapshot s = loop.snapshot();
  EXPECT_EQ(s.kv.n_blocks_used, 0);
  EXPECT_EQ(s.n_finished_by_reason["length"], 2);
  EXPECT_EQ(s.n_generated_tokens, 24);
  EXPECT_EQ(s.n_requests_active, 0);
}

TEST(engine_loop, cancel_frees_blocks_at_once) {
  engine_loop loop(make_engine(), 16);
  auto ch = std::make_shared<request_channel>();
  std::vector<request> reqs;
  reqs.push_back(greedy_request("long", "Once upon a time there was a little girl", 400));
  ASSERT_TRUE(loop.submit(std::move(reqs), ch).ok());
  // Wait until it generates, then cancel.
  std::vector<engine_event> events;
  while (events.empty()) ASSERT_TRUE(ch->wait(events, std::chrono::milliseconds(100)));
  EXPECT_GT(loop.snapshot().kv.n_blocks_used, 0);
  loop.cancel({"long"});
  std::map<std::string, std::string> reasons;
  drain(*ch, 1, &reasons);
  EXPECT_EQ(reasons["long"], "abort");
  engine_snapshot s = loop.snapshot();
  EXPECT_EQ(s.kv.n_blocks_used, 0);
  EXPECT_EQ(s.n_running, 0);
  EXPECT_EQ(s.n_finished_by_reason["abort"], 1);
  loop.cancel({"long", "never-existed"});  // harmless
}

TEST(engine_loop, waiting_cap_and_all_or_none) {
  // One sequence at a time: the second request waits, the third finds the queue full.
  engine_loop loop(make_engine(256, 1, 2048), 1);
  auto ch = std::make_shared<request_channel>();
  std::vector<request> first;
  first.push_back(greedy_request("r1", "Once upon a time", 2000));  // long enough for r2 and r3 to arrive while it runs
  ASSERT_TRUE(loop.submit(std::move(first), ch).ok());
  std::vector<engine_event> events;
  while (events.empty()) ASSERT_TRUE(ch->wait(events, std::chrono::milliseconds(100)));  // r1 runs
  std::vector<request> second;
  second.push_back(greedy_request("r2", "Once upon a time", 4));
  ASSERT_TRUE(loop.submit(std::move(second), ch).ok());
  std::vector<request> third;
  third.push_back(greedy_request("r3", "Once upon a time", 4));
  status st = loop.submit(std::move(third), ch);
  EXPECT_EQ(st.code(), errc::resource_exhausted) << st.message();

  // A batch with one bad request is rejected whole; the good one does not run.
  engine_loop loop2(make_engine(), 16);
  auto ch2 = std::make_shared<request_channel>();
  std::vector<request> batch;
  batch.push_back(greedy_request("good", "Once upon a time", 4));
  batch.push_back(greedy_request("bad", "Once upon a time", 100000));
  st = loop2.submit(std::move(batch), ch2);
  EXPECT_EQ(st.code(), errc::out_of_range) << st.message();
  // A request larger than the whole pool can never run: out_of_range, not "retry later".
  engine_loop loop3(make_engine(4), 16);
  std::vector<request> big;
  big.push_back(greedy_request("big", "Once upon a time", 200));
  st = loop3.submit(std::move(big), ch2);
  EXPECT_EQ(st.code(), errc::out_of_range) << st.message();
  EXPECT_EQ(loop3.snapshot().kv.n_blocks_used, 0);
  EXPECT_EQ(loop2.snapshot().kv.n_blocks_used, 0);
  loop.cancel({"r1", "r2"});
}

TEST(engine_loop, stop_answers_every_channel) {
  auto loop = std::make_unique<engine_loop>(make_engine(), 16);
  auto ch = std::make_shared<request_channel>();
  std::vector<request> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(greedy_request(fmt::format("s{}", i), "Once upon a time", 400));
  ASSERT_TRUE(loop->submit(std::move(reqs), ch).ok());
  std::thread stopper([&] { loop->stop(); });
  std::map<std::string, std::string> reasons;
  drain(*ch, 4, &reasons);
  stopper.join();
  for (auto& [id, r] : reasons) EXPECT_EQ(r, "abort") << id;
  std::vector<request> late;
  late.push_back(greedy_request("late", "x", 1));
  EXPECT_EQ(loop->submit(std::move(late), ch).code(), errc::cancelled);
  EXPECT_EQ(loop->snapshot().kv.n_blocks_used, 0);  // readable after stop
  loop.reset();
}

TEST(engine_loop, many_threads_submit_at_once) {
  engine_loop loop(make_engine(1024), 256);
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 16; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) {
        auto ch = std::make_shared<request_channel>();
        std::vector<request> reqs;
        reqs.push_back(greedy_request(fmt::format("t{}-{}", t, i), "Once upon a time", 6));
        if (!loop.submit(std::move(reqs), ch).ok()) continue;
        auto text = drain(*ch, 1);
        if (!text.begin()->second.empty()) ++ok;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok, 80);
  engine_snapshot s = loop.snapshot();
  EXPECT_EQ(s.kv.n_blocks_used, 0);
  EXPECT_EQ(s.n_finished_by_reason["length"], 80);
}

// std::bad_alloc thrown while a step runs used to end the engine thread (and
// the server): now the step's requests end with an error and the next are served.
class throwing_runner final : public runner_wrapper {
 public:
  explicit throwing_runner(std::unique_ptr<model_runner> inner) : runner_wrapper(std::move(inner)) {}
  void execute(const step_plan& plan, step_output& out) override {
    if (n_++ == 0) throw std::bad_alloc();
    inner().execute(plan, out);
  }

 private:
  int n_ = 0;
};

// run_synced runs after the block ops of finished steps reached the runner:
// the commit hook has seen every block the request cached, whether the engine
// was idle or busy with another request.
TEST(engine_loop, run_synced_waits_until_the_commit_hook_saw_every_cached_block) {
  auto eng = make_engine();
  auto hooked = std::make_shared<std::atomic<int>>(0);  // written on the engine thread
  eng->set_commit_hook([hooked](const cached_block&) { ++*hooked; });
  engine_loop loop(std::move(eng), 16);
  const std::string prompt = "Once upon a time there was a little girl named Lily who loved to play outside";
  for (const bool busy : {false, true}) {
    auto ch = std::make_shared<request_channel>();
    auto other = std::make_shared<request_channel>();
    if (busy) {
      std::vector<request> bg;
      bg.push_back(greedy_request("bg", "The dog ran", 300));
      ASSERT_TRUE(loop.submit(std::move(bg), other).ok());
    }
    std::vector<request> reqs;
    request r = greedy_request(busy ? "b" : "a", (busy ? "Then " : "") + prompt, 0);
    const int n_full = static_cast<int>(r.prompt.size()) / 16;
    ASSERT_GE(n_full, 1);
    reqs.push_back(std::move(r));
    const int before = *hooked;
    ASSERT_TRUE(loop.submit(std::move(reqs), ch).ok());
    drain(*ch, 1);
    int seen = -1;
    std::int32_t cached = -1;
    ASSERT_TRUE(loop.run_synced([&](engine_core& e) {
                     seen = *hooked - before;
                     cached = e.kv_stats().n_blocks_cached;
                   }).ok());
    EXPECT_GE(seen, n_full) << (busy ? "busy" : "idle");
    EXPECT_GE(cached, busy ? 0 : n_full);
    if (busy) loop.cancel({"bg"});
  }
  loop.stop();
  EXPECT_EQ(loop.run_synced([](engine_core&) {}).code(), errc::cancelled);
}

// A task still queued when the thread stops runs in the final drain; its
// callback may call into the loop (a submit's `done` that cancels, as a
// server's would). The drain used to run it holding the loop's mutex, so that
// call deadlocked and stop() never returned.
TEST(engine_loop, a_callback_into_the_loop_from_the_final_drain_does_not_deadlock) {
  engine_loop loop(make_engine(), 16);
  std::atomic<bool> posted{false}, answered{false};
  status answer;
  std::thread synced([&] {
    // Runs on the engine thread, in a batch of tasks: queues a submit behind
    // it, then holds the thread until stop() is under way, so the submit is
    // left for the final drain.
    const status st = loop.run_synced([&](engine_core&) {
      std::vector<request> reqs;
      reqs.push_back(greedy_request("late", "Once upon a time", 4));
      loop.submit_async(std::move(reqs), std::make_shared<request_channel>(), [&](status s) {
        loop.cancel({"late"});  // into the loop, from the drain
        answer = std::move(s);
        answered = true;
      });
      posted = true;
      for (long spins = 0; !loop.stopped() && spins < 2'000'000'000L; ++spins) std::this_thread::yield();
    });
    EXPECT_TRUE(st.ok()) << st.message();
  });
  for (long spins = 0; !posted && spins < 2'000'000'000L; ++spins) std::this_thread::yield();
  ASSERT_TRUE(posted);
  loop.stop();  // before the fix: never returned (the test failed by its timeout)
  synced.join();
  EXPECT_TRUE(answered);
  EXPECT_EQ(answer.code(), errc::cancelled);
}

// close_tenant_async is a barrier: the tenant's running request ends with
// "abort", its submits are refused until reopen_tenant, fn runs once the ops
// before it reached the runner, and nothing of the tenant is committed after
// fn (the commit hook would hand it to the store); other tenants run on.
TEST(engine_loop, closing_a_tenant_stops_its_requests_and_refuses_new_ones) {
  auto eng = make_engine();
  auto late = std::make_shared<std::atomic<int>>(0);         // the tenant's commits after fn
  auto closed = std::make_shared<std::atomic<bool>>(false);  // fn ran
  auto committed = std::make_shared<std::atomic<int>>(0);    // the tenant's commits
  eng->set_commit_hook([late, closed, committed](const cached_block& b) {
    if (b.tenant != "t") return;
    ++*committed;
    if (*closed) ++*late;
  });
  test::step_gate gate;  // holds t mid-request while the barrier is posted
  gate.attach(*eng);
  engine_loop loop(std::move(eng), 16);
  test::thread_joiner open_at_exit{&gate};
  auto make = [](const std::string& id, const std::string& tenant, int max_tokens) {
    request r = greedy_request(id, "Once upon a time there was a little girl named Lily who loved to play", max_tokens);
    r.tenant = tenant;
    r.ignore_eos = true;
    return r;
  };
  auto submit = [&](const std::string& id, const std::string& tenant, int max_tokens) {
    auto ch = std::make_shared<request_channel>();
    std::vector<request> reqs;
    reqs.push_back(make(id, tenant, max_tokens));
    const status st = loop.submit(std::move(reqs), ch);
    return std::make_pair(st, ch);
  };
  gate.close();
  // One submit (a second would wait for the held engine to take it).
  auto ch = std::make_shared<request_channel>();
  std::vector<request> both;
  both.push_back(make("t1", "t", 400));
  both.push_back(make("u1", "u", 200));
  ASSERT_TRUE(loop.submit(std::move(both), ch).ok());
  // Step by step until t committed blocks; it is then held mid-request.
  for (int i = 0; i < 8 && *committed == 0; ++i) {
    ASSERT_TRUE(test::poll_until([&] { return gate.n_held() == 1; }));
    const std::int64_t steps = loop.snapshot().n_steps;
    gate.let_through(1);
    ASSERT_TRUE(test::poll_until([&] { return loop.snapshot().n_steps > steps; }));
  }
  ASSERT_GT(*committed, 0) << "t is running and committing blocks";
  ASSERT_TRUE(test::poll_until([&] { return gate.n_held() == 1; }));
  std::promise<status> done;
  std::int32_t evicted = -1;
  loop.close_tenant_async(
      "t",
      [&](engine_core& e) {
        evicted = e.kv().evict_cached_blocks("t");
        *closed = true;
      },
      [&](status st) { done.set_value(std::move(st)); });
  ASSERT_TRUE(test::poll_until([&] { return loop.n_queued_tasks() == 1; }));
  gate.open();
  ASSERT_TRUE(done.get_future().get().ok());
  EXPECT_GT(evicted, 0);
  const auto [refused, ch_refused] = submit("t2", "t", 4);
  EXPECT_EQ(refused.code(), errc::cancelled) << refused.message();
  std::map<std::string, std::string> reasons;
  drain(*ch, 2, &reasons);
  EXPECT_EQ(reasons["t1"], "abort");
  EXPECT_EQ(reasons["u1"], "length") << "other tenants run on";
  EXPECT_EQ(*late, 0) << "nothing of t was committed after the barrier";
  std::int32_t cached_t = -1;
  ASSERT_TRUE(loop.run_synced([&](engine_core& e) { cached_t = e.kv().evict_cached_blocks("t"); }).ok());
  EXPECT_EQ(cached_t, 0);
  loop.reopen_tenant("t");
  auto [again, ch_again] = submit("t3", "t", 4);
  EXPECT_TRUE(again.ok()) << again.message();
  drain(*ch_again, 1, &reasons);
  EXPECT_EQ(reasons["t3"], "length");
}

TEST(engine_loop, an_exception_in_a_step_fails_its_requests_and_serving_goes_on) {
  auto e = make_engine();
  e->wrap_runner([](std::unique_ptr<model_runner> inner) { return std::make_unique<throwing_runner>(std::move(inner)); });
  engine_loop loop(std::move(e), 16);
  auto ch = std::make_shared<request_channel>();
  std::vector<request> first;
  first.push_back(greedy_request("x", "Once upon a time", 8));
  ASSERT_TRUE(loop.submit(std::move(first), ch).ok());
  std::map<std::string, std::string> reasons;
  drain(*ch, 1, &reasons);
  EXPECT_EQ(reasons["x"], "error");
  auto ch2 = std::make_shared<request_channel>();
  std::vector<request> second;
  second.push_back(greedy_request("y", "Once upon a time", 8));
  ASSERT_TRUE(loop.submit(std::move(second), ch2).ok());
  std::map<std::string, std::string> reasons2;
  auto text = drain(*ch2, 1, &reasons2);
  EXPECT_EQ(reasons2["y"], "length");
  EXPECT_FALSE(text["y"].empty());
  EXPECT_EQ(loop.snapshot().kv.n_blocks_used, 0);
}

}  // namespace
}  // namespace pagoda
