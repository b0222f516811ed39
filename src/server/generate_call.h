// POST /v1/completions and /v1/chat/completions over the event-driven
// server: one generate_call per request, alive while its exchange is.
//
//   worker pool  bounded JSON parse, validation and tokenization (parse_request),
//                then engine_loop::submit_async: no thread waits for the engine;
//                a chat body with image parts goes on to the image thread,
//                which parses it and encodes its images (image_input.h);
//   engine       admits the requests; every event it pushes on the call's
//                channel posts one drain to the connection's strand;
//   strand       drains the channel: builds the response (non-streaming) or
//                writes its server-sent events (streaming).
// A client that leaves (the exchange's on_gone) has its requests cancelled
// at once, freeing their blocks. So does a streaming client that stops
// reading once more than http_limits::max_pending_send_bytes wait for it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include <boost/asio/thread_pool.hpp>

#include "sched/engine_loop.h"
#include "server/http_connection.h"
#include "server/openai_request.h"

namespace pagoda::server {

// What every call shares; owned by the server.
struct generate_env {
  const api_context& ctx;
  engine_loop& loop;
  boost::asio::thread_pool& workers;
  const http_limits& limits;
  std::atomic<std::uint64_t> next_id{0};
  std::uint64_t id_salt = 0;
  // Where chat bodies with image parts are parsed and their images encoded
  // (server/image_input.h); null: on the workers like the rest.
  boost::asio::thread_pool* image_thread = nullptr;
};

// Starts answering `ex` (on its strand). `tenant` comes from the API key.
void start_generate(generate_env& env, const std::shared_ptr<http_exchange>& ex, api_kind kind, std::string tenant);

}  // namespace pagoda::server
