// The disk KV store end to end through the CLI: a batch fills it, a second
// process hits it (same greedy tokens, prompt tokens counted as cached), and
// `pagoda kv` lists, counts, verifies, exports, imports and prunes it.
#include <cstring>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "cli/store_client.h"
#include "store/block_record.h"
#include "store/block_store.h"

namespace pagoda::test {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// A prompt long enough for several full blocks of 16 tokens.
std::string long_prompt() {
  return "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. "
         "One day, she saw a big red ball in the park. She ran to the ball and kicked it very high. "
         "The ball flew over the trees and";
}

std::string batch_file(const fs::path& dir, const std::string& tenant_field) {
  const fs::path p = dir / "in.jsonl";
  fs::create_directories(dir);
  json line = {{"id", "a"}, {"prompt", long_prompt()}, {"max_tokens", 12}, {"temperature", 0}};
  if (!tenant_field.empty()) line["cache_salt"] = tenant_field;
  std::ofstream(p) << line.dump() << "\n";
  return p.string();
}

json first_line(const std::string& out) { return json::parse(out.substr(0, out.find('\n'))); }

// Alice's block i: two tokens, n_bytes of KV.
block_record alice_record(int i, std::size_t n_bytes) {
  block_record r;
  r.key = make_store_key({3, 4}, "alice", static_cast<block_key>(i));
  r.chain = static_cast<block_key>(i);
  r.tenant = "alice";
  r.tokens = {i, i + 1};
  r.bytes.assign(n_bytes, static_cast<std::byte>(i));
  return r;
}

TEST(cli_kv_store, a_second_process_hits_the_disk_store_and_kv_tools_manage_it) {
  temp_dir dir("store");
  temp_dir work("work");
  const std::string store = (dir.path / "kv").string();
  const std::string in = batch_file(work.path, "");
  const std::string common = "batch -m " + model_path() + " -i " + in + " --block-size 16 --kv-store " + store;

  auto cold = run_cli(common);
  ASSERT_EQ(cold.exit_code, 0) << cold.err;
  const json a = first_line(cold.out);
  EXPECT_EQ(a["usage"]["cached_tokens"], 0);
  const int prompt_tokens = a["usage"]["prompt_tokens"];
  ASSERT_GE(prompt_tokens, 48);

  // A new process has an empty pool: the prefix comes from the disk store.
  auto warm = run_cli(common);
  ASSERT_EQ(warm.exit_code, 0) << warm.err;
  const json b = first_line(warm.out);
  EXPECT_EQ(b["completions"][0]["token_ids"], a["completions"][0]["token_ids"]);
  // Every full block of the prompt except one that holds the last token.
  EXPECT_EQ(b["usage"]["cached_tokens"], (prompt_tokens - 1) / 16 * 16) << b;
  EXPECT_EQ(b["usage"]["cached_tokens_by_tier"]["disk"], b["usage"]["cached_tokens"]) << b;
  EXPECT_EQ(b["usage"]["cached_tokens_by_tier"]["memory"], 0) << b;

  auto ls = run_cli("kv ls --store " + store);
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  // Header + one line per stored block: the prompt's and the completion's full blocks.
  const auto n_lines = std::count(ls.out.begin(), ls.out.end(), '\n');
  EXPECT_GE(n_lines, 1 + (prompt_tokens - 1) / 16) << ls.out;

  auto stats = run_cli("kv stats --store " + store);
  ASSERT_EQ(stats.exit_code, 0) << stats.err;
  EXPECT_NE(stats.out.find("total"), std::string::npos) << stats.out;
  EXPECT_NE(stats.out.find("0 unreadable"), std::string::npos) << stats.out;

  auto verify = run_cli("kv verify --store " + store);
  EXPECT_EQ(verify.exit_code, 0) << verify.out << verify.err;
  EXPECT_NE(verify.out.find(" 0 failed"), std::string::npos) << verify.out;

  // Export, import into a new store, and a new process hits that one too.
  const std::string exported = (work.path / "kv.pgkx").string();
  auto ex = run_cli("kv export --store " + store + " -o " + exported);
  ASSERT_EQ(ex.exit_code, 0) << ex.err;
  const std::string store2 = (dir.path / "kv2").string();
  auto im = run_cli("kv import --store " + store2 + " -i " + exported);
  ASSERT_EQ(im.exit_code, 0) << im.out << im.err;
  auto verify2 = run_cli("kv verify --store " + store2);
  EXPECT_EQ(verify2.exit_code, 0) << verify2.out;
  auto from_import = run_cli("batch -m " + model_path() + " -i " + in + " --block-size 16 --kv-store " + store2);
  ASSERT_EQ(from_import.exit_code, 0) << from_import.err;
  EXPECT_EQ(first_line(from_import.out)["usage"]["cached_tokens"], b["usage"]["cached_tokens"]);

  // A damaged export is refused whole.
  {
    std::fstream f(exported, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x5a');
  }
  auto bad = run_cli("kv import --store " + (dir.path / "kv3").string() + " -i " + exported);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("checksum"), std::string::npos) << bad.err;

  // Prune everything: the next process computes the prompt again.
  auto prune = run_cli("kv prune --store " + store + " --all");
  ASSERT_EQ(prune.exit_code, 0) << prune.err;
  auto after = run_cli(common);
  ASSERT_EQ(after.exit_code, 0);
  EXPECT_EQ(first_line(after.out)["usage"]["cached_tokens"], 0);
}

TEST(cli_kv_store, a_flipped_byte_on_disk_is_found_by_verify_and_never_served) {
  temp_dir dir("corrupt");
  const std::string store = (dir.path / "kv").string();
  const std::string in = batch_file(dir.path / "w", "");
  const std::string common = "batch -m " + model_path() + " -i " + in + " --block-size 16 --kv-store " + store;
  auto cold = run_cli(common);
  ASSERT_EQ(cold.exit_code, 0) << cold.err;
  const json a = first_line(cold.out);

  // Flip one byte in every stored value: LMDB keeps values in its data file,
  // so a byte pattern unique to record payloads (the "PGKB" magic) locates them.
  const fs::path data = fs::path(store) / "data.mdb";
  std::string bytes;
  {
    std::ifstream f(data, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  int flipped = 0;
  for (std::size_t p = bytes.find("PGKB"); p != std::string::npos; p = bytes.find("PGKB", p + 4)) {
    bytes[p + 40] = static_cast<char>(bytes[p + 40] ^ 0x01);  // inside the record, past the magic
    ++flipped;
  }
  ASSERT_GT(flipped, 0);
  std::ofstream(data, std::ios::binary | std::ios::trunc) << bytes;

  auto verify = run_cli("kv verify --store " + store);
  EXPECT_EQ(verify.exit_code, 1) << verify.out;
  EXPECT_NE(verify.out.find("failed"), std::string::npos);

  // Served requests never see the damaged blocks: recomputed, same tokens.
  auto again = run_cli(common);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  const json b = first_line(again.out);
  EXPECT_EQ(b["usage"]["cached_tokens"], 0);
  EXPECT_EQ(b["completions"][0]["token_ids"], a["completions"][0]["token_ids"]);

  auto repair = run_cli("kv verify --store " + store + " --delete-corrupt");
  EXPECT_EQ(repair.exit_code, 0) << repair.out;
  auto clean = run_cli("kv verify --store " + store);
  EXPECT_EQ(clean.exit_code, 0) << clean.out;
}

// Defect: `kv verify` crashed on a store with a damaged B-tree page or a
// truncated file, or said "0 failed" about a store that crash-looped the
// server. It now walks the file itself: damage is counted, exit 1, no crash;
// the other commands name the damage instead of reading through it.
TEST(cli_kv_store, verify_reports_damaged_pages_and_truncation_without_crashing) {
  temp_dir dir("damaged");
  const std::string store = (dir.path / "kv").string();
  {
    auto s = make_disk_store({store, 64 << 20, 0});
    ASSERT_TRUE(s.ok()) << s.error().message();
    for (int i = 0; i < 120; ++i) {
      const block_record r = alice_record(i, i % 2 ? 500 : 9000);
      ASSERT_TRUE((*s)->put(r.key, encode_block_record(r, false)).ok());
    }
  }
  auto clean = run_cli("kv verify --store " + store);
  EXPECT_EQ(clean.exit_code, 0) << clean.out << clean.err;
  EXPECT_NE(clean.out.find("120 blocks verified, 0 failed"), std::string::npos) << clean.out;

  const fs::path data = fs::path(store) / "data.mdb";
  std::string good;
  {
    std::ifstream f(data, std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  // The main database's root page (named by the newer meta page: LMDB 0.9
  // keeps the txn id at byte 144 and the root at 128): its node offsets.
  std::string bytes = good;
  std::uint64_t txn[2], root[2];
  for (int m = 0; m < 2; ++m) {
    std::memcpy(&txn[m], bytes.data() + m * 4096 + 144, 8);
    std::memcpy(&root[m], bytes.data() + m * 4096 + 128, 8);
  }
  std::memset(bytes.data() + (txn[1] > txn[0] ? root[1] : root[0]) * 4096 + 16, 0xff, 4);
  std::ofstream(data, std::ios::binary | std::ios::trunc) << bytes;
  auto damaged = run_cli("kv verify --store " + store);
  EXPECT_EQ(damaged.exit_code, 1) << damaged.out << damaged.err;
  EXPECT_NE(damaged.out.find("damaged store"), std::string::npos) << damaged.out;
  auto ls = run_cli("kv ls --store " + store);
  EXPECT_EQ(ls.exit_code, 1) << ls.out << ls.err;
  EXPECT_NE(ls.err.find("damaged"), std::string::npos) << ls.err;

  std::ofstream(data, std::ios::binary | std::ios::trunc) << good.substr(0, good.size() / 2);
  auto truncated = run_cli("kv verify --store " + store);
  EXPECT_EQ(truncated.exit_code, 1) << truncated.out << truncated.err;
  EXPECT_NE(truncated.out.find("truncated"), std::string::npos) << truncated.out;
  EXPECT_EQ(truncated.out.find(" 0 failed\n"), std::string::npos) << truncated.out;
  EXPECT_TRUE(fs::exists(data)) << "a tool never moves a store";
}

// `kv verify --kv-store-secret-file` checks every record's MAC: a record
// rebuilt with a recomputed checksum (no MAC, or another secret's) is reported
// as forged, and erased with --delete-corrupt; without the secret, MACed
// records cannot be checked and all fail.
TEST(cli_kv_store, verify_with_the_secret_reports_forged_records) {
  temp_dir dir("forged");
  fs::create_directories(dir.path);
  const std::string store = (dir.path / "kv").string();
  const std::string secret_file = (dir.path / "secret").string();
  std::ofstream(secret_file) << "0123456789abcdef0123456789abcdef\n";
  fs::permissions(secret_file, fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::replace);
  const record_secret secret("0123456789abcdef0123456789abcdef");
  const record_secret attackers("not-the-servers-secret-at-all");
  {
    auto s = make_disk_store({store, 64 << 20, 0});
    ASSERT_TRUE(s.ok()) << s.error().message();
    for (int i = 0; i < 6; ++i) {
      const block_record r = alice_record(i, 700);
      // Blocks 4 and 5 forged: rebuilt without a MAC, and under another secret.
      const record_secret* with = i == 4 ? nullptr : i == 5 ? &attackers : &secret;
      ASSERT_TRUE((*s)->put(r.key, encode_block_record(r, true, with)).ok());
    }
  }
  const std::string with_secret = "kv verify --store " + store + " --kv-store-secret-file " + secret_file;
  auto v = run_cli(with_secret);
  EXPECT_EQ(v.exit_code, 1) << v.out << v.err;
  EXPECT_NE(v.out.find("4 blocks verified, 2 failed, 2 of them forged"), std::string::npos) << v.out;
  EXPECT_NE(v.out.find("forged: stored block"), std::string::npos) << v.out;
  auto blind = run_cli("kv verify --store " + store);
  EXPECT_EQ(blind.exit_code, 1);
  EXPECT_NE(blind.out.find("1 blocks verified, 5 failed, 5 of them forged"), std::string::npos) << blind.out;
  auto repair = run_cli(with_secret + " --delete-corrupt");
  EXPECT_EQ(repair.exit_code, 0) << repair.out << repair.err;
  auto clean = run_cli(with_secret);
  EXPECT_EQ(clean.exit_code, 0) << clean.out << clean.err;
  EXPECT_NE(clean.out.find("4 blocks verified, 0 failed"), std::string::npos) << clean.out;
  // A secret file others can read is refused, naming it.
  fs::permissions(secret_file, fs::perms::group_read, fs::perm_options::add);
  auto open = run_cli(with_secret);
  EXPECT_EQ(open.exit_code, 1);
  EXPECT_NE(open.err.find(secret_file), std::string::npos) << open.err;
}

TEST(cli_kv_store, bad_store_arguments_are_one_line_errors) {
  auto missing = run_cli("kv ls --store /nonexistent/pagoda-kv");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("no KV store"), std::string::npos) << missing.err;
  auto prune = run_cli("kv prune --store /tmp");
  EXPECT_NE(prune.exit_code, 0);
  auto size = run_cli("batch -m " + model_path() + " -i /dev/null --kv-store /tmp/x,size=-1");
  EXPECT_NE(size.exit_code, 0);
  EXPECT_NE(size.err.find("size"), std::string::npos) << size.err;
}

}  // namespace
}  // namespace pagoda::test
