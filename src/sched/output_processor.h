// The output step (vLLM v1's OutputProcessor): after scheduler::update has
// committed a step's tokens, this turns its events into what callers read.
// Per completion it detokenizes the sampled tokens (stream_decoder, which
// holds back an unfinished UTF-8 character) and applies the request's stop
// strings (stop_matcher, which holds back what could start one); a stop
// string ends the completion through the scheduler (scheduler::stop_sequence:
// as an abort, with finish reason "stop" and the text cut before it). It also
// observes the latency histograms (TTFT, inter-token, end to end) with the
// scheduler's clock. One engine thread owns it, beside the scheduler.
//
//   plan = scheduler.schedule(); runner.execute(plan, out);
//   scheduler.update(plan, out, events); output.process(events, first);
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/tokenizer.h"
#include "model/tokenizer_stream.h"
#include "pagoda/events.h"
#include "sched/scheduler.h"
#include "sched/stop_matcher.h"

namespace pagoda {

class output_processor {
 public:
  // REQUIRES: vocab and sched outlive the processor.
  output_processor(const tokenizer& vocab, scheduler& sched);

  // A request the scheduler accepted (its arrival is now). Replaces any state
  // kept under the same id.
  void add_request(std::string id, std::vector<std::string> stop);
  // The scheduler aborted the request (scheduler::abort_request returned
  // true): it ends now. Its abort events need nothing from here.
  void abort_request(const std::string& id);

  // Fills in events[first ..] in order: the text each sampled token
  // releases, finishes by stop strings, and, on the event that ends a
  // request, the end-to-end latency. Events of requests it does not know
  // pass unchanged.
  void process(std::vector<engine_event>& events, std::size_t first = 0);

  std::size_t n_requests() const { return requests_.size(); }

 private:
  struct completion {
    completion(const tokenizer& vocab, const std::vector<std::string>& stop)
        : decoder(vocab, /*at_text_start=*/false), stops(stop) {}
    stream_decoder decoder;
    stop_matcher stops;
    std::int64_t last_token_us = 0;
  };
  struct request_state {
    std::int64_t arrival_us = 0;
    bool first_token_seen = false;
    std::vector<std::string> stop;
    std::vector<std::unique_ptr<completion>> completions;  // [completion index], made at its first token
  };

  void on_token(request_state& r, std::vector<engine_event>& events, std::size_t i);
  // request_finished (and usage) belong on the request's last finishing
  // event: a stop string that ends the request may come before it.
  static void move_request_end(std::vector<engine_event>& events, std::size_t i);
  std::int64_t now_us() const { return sched_.clock().monotonic_us(); }

  const tokenizer& vocab_;
  scheduler& sched_;
  std::unordered_map<std::string, request_state> requests_;
};

}  // namespace pagoda
