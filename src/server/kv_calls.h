// POST /v1/kv/warm and DELETE /v1/kv over the event-driven server (the
// endpoints themselves: kv_admin.h). Like a completion (generate_call.h), no
// thread waits for the engine:
//
//   warm    worker pool: bounded JSON, parse_request, tokenize; submit_async.
//           engine: computes the prompts, pushing events on the call's
//           channel (each posts one drain to the connection's strand); then,
//           once every op is applied, the keys of the prompts' blocks.
//           store thread: waits for those blocks' write-back, counts them.
//           A client that hangs up before the prompts are computed has its
//           engine requests cancelled at once (their blocks freed).
//   DELETE  engine: the tenant's barrier (engine_loop::close_tenant_async),
//           then its cached blocks dropped from the pool.
//           store thread: waits for the write-back queue, erases the tenant
//           in every tier, reopens the tenant.
// The store thread is the server's one thread for waits on the KV store, so
// store I/O never holds an HTTP worker.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <boost/asio/thread_pool.hpp>

#include "server/generate_call.h"
#include "server/kv_admin.h"

namespace pagoda::server {

struct kv_env {
  generate_env& gen;  // the API context, the loop, the workers, ids
  kv_admin& admin;
  boost::asio::thread_pool& store_thread;
};

// Starts answering a warm call on `ex`. tenant: the caller's; admin: whether
// it presented the admin key.
void start_warm(kv_env& env, const std::shared_ptr<http_exchange>& ex, std::string tenant, bool admin);
// Starts answering DELETE /v1/kv?tenant=... (the caller presented the admin key).
void start_erase(kv_env& env, const std::shared_ptr<http_exchange>& ex, const std::optional<std::string>& tenant_arg);

}  // namespace pagoda::server
