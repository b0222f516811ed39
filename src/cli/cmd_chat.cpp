// pagoda chat: an interactive conversation. Each turn's prompt is the whole
// conversation rendered by the model's chat template (server/chat_template.h,
// the server's own code), so the engine's prefix cache serves the earlier
// turns' blocks and a turn computes about its own tokens only (/stats shows
// how many). With --kv-store the conversation's blocks reach the disk store
// too: /save writes the messages, /load in a later session reads them back
// and loads their KV from the store instead of recomputing it.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/chat.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "core/clock.h"
#include "policy/streaming.h"
#include "server/api_setup.h"
#include "server/chat_template.h"
#include "store/warehouse.h"

namespace pagoda::cli {
namespace {

using server::chat_message;

// Ctrl-C: during a reply it ends the reply (what came so far stays in the
// conversation); at the prompt it interrupts the read, which ends the session
// as Ctrl-D does (the engine closes normally, the store keeps every block).
// The engine's worker threads may take the signal: it is passed on to the
// thread reading stdin, so that its read is the one interrupted.
volatile std::sig_atomic_t g_interrupted = 0;
pthread_t g_reader;
void on_interrupt(int) {
  g_interrupted = 1;
  if (!pthread_equal(pthread_self(), g_reader)) pthread_kill(g_reader, SIGINT);
}

void catch_interrupt() {
  g_reader = pthread_self();
  struct sigaction sa{};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a read at the prompt returns EINTR
  sigaction(SIGINT, &sa, nullptr);
}

// What one request through the engine did.
struct turn_stats {
  int prompt_tokens = 0;
  int cached_tokens = 0;  // served from the prefix cache or loaded from the KV store
  int stored_tokens = 0;  // of those, loaded from the KV store
  int reply_tokens = 0;   // sampled, the end-of-generation token included
  double prompt_ms = 0;   // until the first reply token (or the prompt's end)
  double reply_ms = 0;    // after the first reply token
  std::string finish_reason;
  double tokens_per_s() const { return reply_tokens > 1 && reply_ms > 0 ? (reply_tokens - 1) * 1e3 / reply_ms : 0.0; }
};

struct chat_session {
  const chat_options& options;
  const llama_model& model;
  engine_stack stack;
  server::api_context api;
  int n_ctx = 0;
  std::vector<chat_message> messages;  // the system message (if any) first
  int n_tokens = 0;                    // of the conversation in the KV cache (last prompt + reply)
  bool have_turn = false;
  turn_stats last;
  int n_requests = 0;  // names the requests
};

std::vector<chat_message> initial_messages(const chat_options& o) {
  if (o.system.empty()) return {};
  return {{"system", o.system}};
}

// The conversation's prompt tokens, or a clear error when the template
// refuses it or it does not fit the context.
result<std::vector<token_id>> render(const chat_session& s, const std::vector<chat_message>& messages,
                                     bool add_generation_prompt) {
  PAGODA_ASSIGN_OR_RETURN(std::string text,
                          server::render_chat(s.api.chat, messages, s.api.chat_tokens, add_generation_prompt));
  const tokenizer& vocab = s.model.vocab();
  std::vector<token_id> tokens = vocab.encode(text, vocab.add_bos_default(), /*parse_special=*/true);
  if (tokens.empty()) return error(errc::invalid_argument, "the conversation is empty and the model has no BOS token");
  if (static_cast<int>(tokens.size()) >= s.n_ctx)
    return error(errc::out_of_range,
                 "the conversation is {} tokens but the context holds {} (--ctx); /clear starts a new one",
                 tokens.size(), s.n_ctx);
  return tokens;
}

// Runs one request to its end; with `reply` set, streams its text to stdout.
result<turn_stats> run_request(chat_session& s, std::vector<token_id> prompt, int max_tokens, std::string* reply) {
  request req;
  req.id = "chat-" + std::to_string(s.n_requests++);
  req.prompt = std::move(prompt);
  req.max_tokens = max_tokens;
  req.sampling = s.options.sampling.sampling;
  req.ignore_eos = s.options.sampling.ignore_eos;
  turn_stats t;
  t.prompt_tokens = static_cast<int>(req.prompt.size());
  const std::int64_t t0 = now_us();
  if (status st = s.stack.core->add_request(std::move(req)); !st.ok()) {
    if (st.code() == errc::resource_exhausted)
      return st.with_context("the KV pool is too small for this conversation (raise --kv-cache-size or "
                             "--max-kv-tokens, or /clear)");
    return st;
  }
  std::int64_t t1 = -1;
  std::vector<engine_event> events;
  g_interrupted = 0;
  while (s.stack.core->has_work()) {
    if (g_interrupted) {
      g_interrupted = 0;
      s.stack.core->abort_request("chat-" + std::to_string(s.n_requests - 1));
    }
    events.clear();
    s.stack.core->step(events);
    for (const engine_event& e : events) {
      if (!e.tokens.empty() && t1 < 0) t1 = now_us();
      t.reply_tokens += static_cast<int>(e.tokens.size());
      if (reply && !e.text.empty()) {
        *reply += e.text;
        std::fwrite(e.text.data(), 1, e.text.size(), stdout);
        std::fflush(stdout);
      }
      if (e.finish_reason == "error") return error(errc::internal, "{}", e.error);
      if (!e.finish_reason.empty()) t.finish_reason = e.finish_reason;
      if (e.request_finished) {
        t.cached_tokens = e.usage.cached_tokens;
        for (int n : e.usage.loaded_tokens_by_tier) t.stored_tokens += n;
      }
    }
  }
  g_interrupted = 0;  // a Ctrl-C as the reply ended stops nothing more
  // The ops the finished request left: its blocks enter the prefix cache (and
  // the store's write queue) now.
  events.clear();
  s.stack.core->flush(events);
  const std::int64_t t2 = now_us();
  if (t1 < 0) t1 = t2;
  t.prompt_ms = (t1 - t0) * 1e-3;
  t.reply_ms = (t2 - t1) * 1e-3;
  return t;
}

// The end-of-generation token's text, when the detokenizer let it through,
// is not part of the message.
void strip_end_of_generation(const chat_session& s, std::string& reply) {
  const tokenizer& vocab = s.model.vocab();
  for (token_id t : {vocab.eos(), vocab.eot()}) {
    if (t == k_no_token) continue;
    const std::string_view text = vocab.token_text(t);
    if (!text.empty() && reply.ends_with(text)) reply.resize(reply.size() - text.size());
  }
}

void user_turn(chat_session& s, const std::string& text) {
  s.messages.push_back({"user", text});
  auto prompt = render(s, s.messages, /*add_generation_prompt=*/true);
  if (!prompt.ok()) {
    s.messages.pop_back();
    fail(prompt.error());
    return;
  }
  const int room = s.n_ctx - static_cast<int>(prompt->size());
  // A streaming window (--kv-policy window:budget=N,positions=cache) lets -n
  // run past the context, as in run.
  const bool streams = streams_past_context(s.options.engine.config.kv_policy, s.n_ctx);
  const int max_tokens =
      s.options.n_predict < 0 ? room : streams ? s.options.n_predict : std::min(s.options.n_predict, room);
  std::string reply;
  auto t = run_request(s, std::move(*prompt), max_tokens, &reply);
  std::printf("\n");
  if (!t.ok()) {
    s.messages.pop_back();
    fail(t.error());
    return;
  }
  if (t->finish_reason == "abort")
    std::fprintf(stderr, "pagoda: the reply was interrupted (Ctrl-C); what came stays in the conversation\n");
  strip_end_of_generation(s, reply);
  s.messages.push_back({"assistant", reply});
  s.last = *t;
  s.have_turn = true;
  s.n_tokens = t->prompt_tokens + t->reply_tokens;
  if (t->finish_reason == "length" && max_tokens == room)
    std::fprintf(stderr, "pagoda: the reply stopped at the end of the context (%d tokens); /clear starts a new "
                 "conversation\n", s.n_ctx);
}

void print_help() {
  std::printf(
      "Type a message and press Enter; end a line with \\ to continue on the next. Commands:\n"
      "  /clear        forget the conversation (the system message stays)\n"
      "  /save FILE    write the conversation's messages to FILE (JSON); with --kv-store its KV is in the store\n"
      "  /load FILE    continue a saved conversation (its KV from the store when there, else recomputed)\n"
      "  /stats        KV blocks, cached and computed prompt tokens of the last turn, speed of the last reply\n"
      "  /help         this list\n"
      "  /exit         end the session (so does Ctrl-D)\n"
      "A message that starts with / is typed as //. Ctrl-C stops a reply; at the prompt it ends the session.\n");
}

// " (N from the KV store)" with a store attached, else "".
std::string store_note(const chat_session& s, const turn_stats& t) {
  return s.stack.warehouse ? fmt::format(" ({} from the KV store)", t.stored_tokens) : "";
}

void print_stats(const chat_session& s) {
  const kv_metrics kv = s.stack.core->kv_stats();
  std::printf("conversation: %zu message%s, %d tokens of a %d-token context\n", s.messages.size(),
              s.messages.size() == 1 ? "" : "s", s.n_tokens, s.n_ctx);
  if (s.have_turn) {
    const turn_stats& t = s.last;
    std::printf("last turn: prompt %d tokens, %d cached%s, %d computed in %.1f ms\n", t.prompt_tokens, t.cached_tokens,
                store_note(s, t).c_str(), t.prompt_tokens - t.cached_tokens, t.prompt_ms);
    std::printf("last reply: %d tokens, %.1f ms after the first, %.1f tok/s\n", t.reply_tokens, t.reply_ms,
                t.tokens_per_s());
  } else {
    std::printf("last turn: none yet\n");
  }
  std::printf("KV: %d blocks in use, %d cached, %d free of %d (%d tokens each); prefix cache: %lld of %lld prompt "
              "tokens served so far\n",
              kv.n_blocks_used, kv.n_blocks_cached, kv.n_blocks_free, kv.n_blocks_total, kv.block_size_tokens,
              static_cast<long long>(kv.n_prefix_hit_tokens), static_cast<long long>(kv.n_prefix_query_tokens));
  if (s.stack.warehouse) {
    const warehouse_counters c = s.stack.warehouse->counters();
    std::printf("KV store: %lld blocks written, %lld loaded\n", static_cast<long long>(c.written),
                static_cast<long long>(c.loads));
  }
}

status save_conversation(chat_session& s, const std::string& path) {
  nlohmann::json j;
  j["format"] = "pagoda-chat";
  j["version"] = 1;
  j["model"] = s.options.engine.config.model_path;
  j["chat_template"] = server::chat_format_name(s.api.chat);
  j["messages"] = nlohmann::json::array();
  for (const chat_message& m : s.messages) j["messages"].push_back({{"role", m.role}, {"content", m.content}});
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return error(errc::invalid_argument, "/save {}: cannot write the file", path);
  out << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  out.close();
  if (!out) return error(errc::internal, "/save {}: writing failed", path);
  std::string kv_note = " (no --kv-store: /load recomputes its KV)";
  if (s.stack.warehouse) {
    s.stack.warehouse->flush();  // every block the turns cached is on disk before we say so
    kv_note = "; its KV blocks are in the KV store";
  }
  std::printf("saved %zu messages to %s%s\n", s.messages.size(), path.c_str(), kv_note.c_str());
  return {};
}

result<std::vector<chat_message>> read_conversation(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return error(errc::not_found, "/load {}: cannot open the file", path);
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& why) {
    return error(errc::invalid_argument, "/load {}: not a conversation /save wrote ({})", path, why);
  };
  if (j.is_discarded()) return bad("not JSON");
  if (!j.is_object() || !j.contains("messages") || !j["messages"].is_array()) return bad("no \"messages\" array");
  std::vector<chat_message> messages;
  for (std::size_t i = 0; i < j["messages"].size(); ++i) {
    const nlohmann::json& m = j["messages"][i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      return bad(fmt::format("messages[{}] needs a string \"role\" and \"content\"", i));
    chat_message cm{m["role"].get<std::string>(), m["content"].get<std::string>()};
    if (cm.role != "system" && cm.role != "user" && cm.role != "assistant")
      return bad(fmt::format("messages[{}]: role '{}' is not system, user or assistant", i, cm.role));
    messages.push_back(std::move(cm));
  }
  return messages;
}

// Replaces the conversation with a saved one and brings its KV into the
// cache: loaded from the store where it has the blocks, else computed.
status load_conversation(chat_session& s, const std::string& path) {
  PAGODA_ASSIGN_OR_RETURN(std::vector<chat_message> messages, read_conversation(path));
  if (messages.empty()) {
    s.messages = std::move(messages);
    s.n_tokens = 0;
    std::printf("loaded an empty conversation from %s\n", path.c_str());
    return {};
  }
  PAGODA_ASSIGN_OR_RETURN(std::vector<token_id> prompt, render(s, messages, /*add_generation_prompt=*/false));
  PAGODA_ASSIGN_OR_RETURN(turn_stats t, run_request(s, std::move(prompt), /*max_tokens=*/0, nullptr));
  s.messages = std::move(messages);
  s.n_tokens = t.prompt_tokens;
  s.have_turn = false;
  std::printf("loaded %zu messages from %s: %d tokens, %d from the KV cache%s, %d computed\n", s.messages.size(),
              path.c_str(), t.prompt_tokens, t.cached_tokens, store_note(s, t).c_str(), t.prompt_tokens - t.cached_tokens);
  return {};
}

// The text after a command's name, trimmed; "" when none.
std::string argument(const std::string& line, std::size_t name_len) {
  const std::size_t b = line.find_first_not_of(" \t", name_len);
  if (b == std::string::npos) return "";
  return line.substr(b, line.find_last_not_of(" \t") - b + 1);
}

// Handles a line that starts with '/'; false when the session ends.
bool command(chat_session& s, const std::string& line) {
  const std::string name = line.substr(0, line.find_first_of(" \t"));
  const std::string arg = argument(line, name.size());
  if (name == "/exit" || name == "/quit") return false;
  if (name == "/help") {
    print_help();
  } else if (name == "/clear") {
    s.messages = initial_messages(s.options);
    s.n_tokens = 0;
    s.have_turn = false;
    std::printf("the conversation is cleared%s\n", s.options.system.empty() ? "" : " (the system message stays)");
  } else if (name == "/stats") {
    print_stats(s);
  } else if (name == "/save" || name == "/load") {
    if (arg.empty()) {
      fail(error(errc::invalid_argument, "{} needs a file name: {} FILE", name, name));
    } else if (status st = name == "/save" ? save_conversation(s, arg) : load_conversation(s, arg); !st.ok()) {
      fail(st);
    }
  } else {
    fail(error(errc::invalid_argument, "{}: unknown command; /help lists them (a message starting with / is typed as //)",
               name));
  }
  return true;
}

// One line of stdin, without its newline; false at the end of input or when
// Ctrl-C interrupted the read. Read with read(2), not std::cin: libstdc++'s
// file reads retry on EINTR, so Ctrl-C could not end a read.
bool read_line(std::string& line) {
  static std::string buffered;
  line.clear();
  for (;;) {
    if (const std::size_t nl = buffered.find('\n'); nl != std::string::npos) {
      line = buffered.substr(0, nl);
      buffered.erase(0, nl + 1);
      return true;
    }
    if (g_interrupted) return false;  // Ctrl-C came before the read began
    char buf[4096];
    const ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
    if (n > 0) {
      buffered.append(buf, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR && !g_interrupted) continue;
    if (n < 0 && errno == EINTR) return false;
    // The end of input: a last line without a newline still counts.
    line = std::move(buffered);
    buffered.clear();
    return !line.empty();
  }
}

// One message from stdin: a line, or several joined where a line ends with
// '\'. False at the end of input.
bool read_message(std::string& message) {
  message.clear();
  std::string line;
  while (read_line(line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.back() != '\\') {
      message += line;
      return true;
    }
    line.pop_back();
    message += line + "\n";
    std::printf("... ");
    std::fflush(stdout);
  }
  return false;
}

}  // namespace

int run_chat(chat_options o) {
  PAGODA_RETURN_IF_ERROR_CLI(finish_sampling_options(o.sampling));
  o.engine.config.max_num_seqs = 1;  // one conversation
  PAGODA_ASSIGN_OR_RETURN_CLI(std::unique_ptr<llama_model> model, load_model(o.engine.config));
  auto stack = open_engine(*model, o.engine);
  if (!stack.ok()) return fail_engine(stack.error());
  const int n_ctx = stack->core->config().max_model_len;
  server::api_options ao;
  ao.model_path = o.engine.config.model_path;
  ao.chat_template = o.chat_template;
  std::string warning;
  PAGODA_ASSIGN_OR_RETURN_CLI(server::api_context api, server::make_api_context(*model, n_ctx, ao, &warning));
  if (!warning.empty()) std::fprintf(stderr, "pagoda: warning: %s\n", warning.c_str());
  chat_session s{o, *model, std::move(*stack), std::move(api), n_ctx, initial_messages(o)};
  std::fprintf(stderr, "pagoda: chat with %s (%s chat template, %d-token context%s); /help lists the commands, "
               "/exit or Ctrl-D ends\n",
               ao.model_path.c_str(), server::chat_format_name(s.api.chat), n_ctx,
               s.stack.warehouse ? ", KV store attached" : "");
  if (!o.sampling.sampling.is_greedy())
    std::fprintf(stderr, "pagoda: seed %llu%s\n", static_cast<unsigned long long>(o.sampling.sampling.seed),
                 o.sampling.seed_given ? "" : " (drawn for this session; --seed repeats it)");
  catch_interrupt();
  std::string message;
  for (;;) {
    std::printf("> ");
    std::fflush(stdout);
    if (!read_message(message)) {
      std::printf("\n");  // Ctrl-D or Ctrl-C: the shell's prompt on a line of its own
      break;
    }
    if (message.empty()) continue;
    if (message.starts_with("//")) {
      user_turn(s, message.substr(1));
    } else if (message.front() == '/') {
      if (!command(s, message)) break;
    } else {
      user_turn(s, message);
    }
  }
  return 0;
}

void register_chat(CLI::App& app, std::function<int()>& action) {
  auto opts = std::make_shared<chat_options>();
  auto positional = std::make_shared<std::string>();  // `chat MODEL`, as `serve MODEL`
  CLI::App* cmd = app.add_subcommand("chat", "an interactive conversation with a chat model (llama.cpp's run -cnv)");
  add_engine_options(cmd, opts->engine);
  use_positional_model(cmd, *positional);
  cmd->add_option("--system,--system-prompt", opts->system, "the system message that opens the conversation");
  cmd->add_option("-n,--n-predict", opts->n_predict,
                  "tokens per reply at most (-1: until the model ends it or the context is full)")
      ->check(CLI::Range(-1, 1 << 24));
  cmd->add_option("--chat-template", opts->chat_template,
                  "the chat template family (chatml, llama3, ...; default: recognised from the model)")
      ->each(check_chat_template_name);
  add_sampling_options(cmd, opts->sampling);
  cmd->callback([opts, positional, &action] {
    resolve_positional_model(opts->engine.config.model_path, *positional);
    action = [opts] { return run_chat(*opts); };
  });
}

}  // namespace pagoda::cli
