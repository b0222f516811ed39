#include "sched/output_processor.h"

#include "core/assert.h"

namespace pagoda {

output_processor::output_processor(const tokenizer& vocab, scheduler& sched) : vocab_(vocab), sched_(sched) {}

void output_processor::add_request(std::string id, std::vector<std::string> stop) {
  request_state r;
  r.arrival_us = now_us();
  r.stop = std::move(stop);
  requests_[std::move(id)] = std::move(r);
}

void output_processor::abort_request(const std::string& id) {
  const auto it = requests_.find(id);
  if (it == requests_.end()) return;
  sched_.output_stats().e2e_seconds.observe((now_us() - it->second.arrival_us) * 1e-6);
  requests_.erase(it);
}

void output_processor::process(std::vector<engine_event>& events, std::size_t first) {
  for (std::size_t i = first; i < events.size(); ++i) {
    const auto it = requests_.find(events[i].request_id);
    if (it != requests_.end() && !events[i].tokens.empty()) on_token(it->second, events, i);
  }
  for (std::size_t i = first; i < events.size(); ++i) {
    if (!events[i].request_finished) continue;
    const auto it = requests_.find(events[i].request_id);
    if (it == requests_.end()) continue;
    sched_.output_stats().e2e_seconds.observe((now_us() - it->second.arrival_us) * 1e-6);
    requests_.erase(it);
  }
}

void output_processor::on_token(request_state& r, std::vector<engine_event>& events, std::size_t i) {
  engine_event& e = events[i];
  PAGODA_ASSERT(e.index >= 0 && !e.tokens.empty(), "a token event of completion {} without tokens", e.index);
  const auto index = static_cast<std::size_t>(e.index);
  if (r.completions.size() <= index) r.completions.resize(index + 1);
  if (!r.completions[index]) r.completions[index] = std::make_unique<completion>(vocab_, r.stop);
  completion& c = *r.completions[index];

  // One observation per event: a verification step's tokens arrive together (a chunk, as vLLM counts them).
  const std::int64_t now = now_us();
  if (!r.first_token_seen) {
    r.first_token_seen = true;
    sched_.output_stats().ttft_seconds.observe((now - r.arrival_us) * 1e-6);
  } else if (c.last_token_us > 0) {
    sched_.output_stats().itl_seconds.observe((now - c.last_token_us) * 1e-6);
  }
  c.last_token_us = now;

  // update() finished it by "stop" only for an EOS or stop token (the
  // event's last), whose text is not shown.
  const bool token_stop = e.finish_reason == "stop";
  const std::size_t n_shown = e.tokens.size() - (token_stop ? 1 : 0);
  e.text.clear();
  for (std::size_t j = 0; j < n_shown; ++j) {
    e.text += c.stops.push(c.decoder.push(e.tokens[j]));
    if (!c.stops.stopped()) continue;
    // A stop string ends the completion at token j: the tokens after it were
    // never shown and do not count (usage, generated tokens).
    const auto n_dropped = static_cast<int>(e.tokens.size() - j - 1);
    e.tokens.resize(j + 1);
    if (e.logprobs.size() > j + 1) e.logprobs.resize(j + 1);
    if (e.finish_reason.empty()) {
      const bool stopped = sched_.stop_sequence(e.request_id, e.index, e, n_dropped);
      PAGODA_ASSERT(stopped, "completion {} of a token event without a finish is not running", e.index);
      if (e.request_finished) move_request_end(events, i);
    } else {
      // It reached its length (or a stop token) at or after the token that completed a stop string.
      sched_.uncount_tokens(e.request_id, n_dropped, e);
      e.finish_reason = "stop";
    }
    return;
  }
  if (token_stop) {
    e.text += c.stops.flush();
  } else if (e.finish_reason == "length") {
    e.text += c.stops.push(c.decoder.flush());
    e.text += c.stops.flush();
  }
}

void output_processor::move_request_end(std::vector<engine_event>& events, std::size_t i) {
  std::size_t last = i;
  for (std::size_t j = i + 1; j < events.size(); ++j)
    if (events[j].request_id == events[i].request_id && !events[j].finish_reason.empty()) last = j;
  if (last == i) return;
  events[last].request_finished = true;
  events[last].usage = std::move(events[i].usage);
  events[i].request_finished = false;
  events[i].usage = {};
}

}  // namespace pagoda
