#include "cli/hub.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/common.h"
#include "cli/http_client.h"
#include "cli/hub_download.h"

namespace pagoda::cli {
namespace fs = std::filesystem;
namespace {

std::string env_or(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? std::string(v) : fallback;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// huggingface_hub's order: HF_TOKEN, then the file `huggingface-cli login` wrote.
std::string token_from_env() {
  if (std::string t = env_or("HF_TOKEN"); !t.empty()) return t;
  std::string path = env_or("HF_TOKEN_PATH");
  if (path.empty()) {
    const std::string home = env_or("HOME");
    const std::string hf_home = env_or("HF_HOME", home.empty() ? "" : home + "/.cache/huggingface");
    if (hf_home.empty()) return "";
    path = hf_home + "/token";
  }
  std::ifstream in(path);
  std::string token;
  std::getline(in, token);
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  return token;
}

bool name_chars_ok(const std::string& s) {
  return !s.empty() && s != "." && s != ".." &&
         std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isalnum(c) || c == '-' || c == '_' || c == '.'; });
}

// A path the hub listed, safe to put under the cache folder: relative, no
// "..", no empty parts.
bool safe_relative_path(const std::string& p) {
  if (p.empty() || p.front() == '/' || p.find('\\') != std::string::npos || p.find('\0') != std::string::npos) return false;
  std::stringstream ss(p);
  for (std::string part; std::getline(ss, part, '/');)
    if (part.empty() || part == "." || part == "..") return false;
  return p.back() != '/';
}

// A repository path in a URL: '/' kept, everything but unreserved characters %-escaped.
std::string url_path(const std::string& p) {
  std::string out;
  for (unsigned char c : p) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' || c == '/') out += static_cast<char>(c);
    else out += fmt::format("%{:02X}", c);
  }
  return out;
}

std::string base_name(const std::string& p) { return p.substr(p.rfind('/') + 1); }

bool is_model_gguf(const std::string& path) {
  const std::string name = lower(base_name(path));
  return name.ends_with(".gguf") && name.find("mmproj") == std::string::npos &&
         name.find("imatrix") == std::string::npos;
}

// "name-00002-of-00003.gguf" -> {2, 3}; {0, 0} when not a split file.
std::pair<int, int> split_of(const std::string& path) {
  const std::string name = lower(base_name(path));
  constexpr std::string_view tail = "-00000-of-00000.gguf";
  if (name.size() < tail.size()) return {0, 0};
  const std::string t = name.substr(name.size() - tail.size());
  for (std::size_t i = 0; i < tail.size(); ++i) {
    const bool digit = tail[i] == '0';
    if (digit != (std::isdigit(static_cast<unsigned char>(t[i])) != 0) || (!digit && t[i] != tail[i])) return {0, 0};
  }
  return {std::atoi(t.substr(1, 5).c_str()), std::atoi(t.substr(10, 5).c_str())};
}

// QUANT as a word of the name: not inside a longer word ("Q4_K" is not in
// "Q4_K_M", "Q4_XS" is not in "IQ4_XS"), case-insensitively.
bool names_quant(const std::string& path, const std::string& quant) {
  const std::string name = lower(path), q = lower(quant);
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (std::size_t at = name.find(q); at != std::string::npos; at = name.find(q, at + 1)) {
    const bool start = at == 0 || !std::isalnum(static_cast<unsigned char>(name[at - 1]));
    const bool end = at + q.size() == name.size() || !word(name[at + q.size()]);
    if (start && end) return true;
  }
  return false;
}

std::string list_names(const std::vector<hub_file>& files) {
  std::string out;
  const std::size_t shown = std::min<std::size_t>(files.size(), 12);
  for (std::size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + files[i].path;
  if (files.size() > shown) out += fmt::format(" and {} more", files.size() - shown);
  return out;
}

struct choice {
  hub_file file;
  std::string why;  // "" : named exactly
};

result<choice> choose_file(const std::vector<hub_file>& files, const hub_request& req) {
  std::vector<hub_file> models;
  for (const hub_file& f : files)
    if (is_model_gguf(f.path) && split_of(f.path).first <= 1) models.push_back(f);
  if (!req.file.empty()) {
    for (const hub_file& f : files)
      if (f.path == req.file || base_name(f.path) == req.file) return choice{f, ""};
    return error(errc::not_found, "{} has no file {}; its GGUF files: {}", req.repo, req.file,
                 models.empty() ? "none" : list_names(models));
  }
  if (models.empty()) {
    std::vector<hub_file> any(files.begin(), files.end());
    return error(errc::not_found,
                 "{} holds no GGUF model ({} files{}{}); Pagoda loads GGUF files: look for a -GGUF repository of "
                 "the model",
                 req.repo, files.size(), files.empty() ? "" : ": ", files.empty() ? "" : list_names(any));
  }
  const std::string quant = req.quant.empty() ? "Q4_K_M" : req.quant;
  std::vector<hub_file> words, contains;
  for (const hub_file& f : models) {
    if (names_quant(f.path, quant)) words.push_back(f);
    else if (lower(f.path).find(lower(quant)) != std::string::npos) contains.push_back(f);
  }
  const std::string others = models.size() > 1 ? fmt::format("; {} GGUF files, pick one with {}:QUANT", models.size(), req.repo) : "";
  if (!words.empty()) return choice{words.front(), req.quant.empty() ? "Q4_K_M, the default" + others : ""};
  if (contains.size() == 1) return choice{contains.front(), ""};
  if (contains.size() > 1)
    return error(errc::invalid_argument, "{} matches {} files of {}: {}; name one more exactly", quant,
                 contains.size(), req.repo, list_names(contains));
  if (!req.quant.empty())
    return error(errc::not_found, "{} has no GGUF file named {}; it has: {}", req.repo, req.quant, list_names(models));
  return choice{models.front(), models.size() == 1 ? "the only GGUF file" : "no Q4_K_M; the first" + others};
}

// A split GGUF (name-00001-of-00003.gguf) is several files Pagoda would have to read as one.
status refuse_split(const std::string& repo, const hub_file& f) {
  const auto [index, count] = split_of(f.path);
  if (count <= 1) return ok_status();
  return error(errc::unsupported,
               "{}: {} is part {} of a GGUF split into {} files; Pagoda loads single-file GGUFs (merge them with "
               "llama-gguf-split --merge, or pick a quant that fits in one file)",
               repo, f.path, index, count);
}

std::string repo_dir(const hub_settings& s, const std::string& repo) {
  std::string folder = repo;
  folder.replace(folder.find('/'), 1, "__");
  return s.cache_dir + "/" + folder;
}

status api_status_error(const hub_settings& s, const std::string& repo, const http_response& r) {
  const std::string why = r.error_header.empty() ? "" : fmt::format(": {}", r.error_header);
  switch (r.status) {
    case 401:
      return error(errc::not_found,
                   "{}: no such repository, or it is private or gated (HTTP 401 from {}{}); {}", repo, s.endpoint, why,
                   s.token.empty() ? "check the name, or set HF_TOKEN to a token that can read it"
                                   : "check the name, and that HF_TOKEN can read it");
    case 403:
      return error(errc::not_found, "{}: access refused (HTTP 403{}); for a gated model accept its terms at {}/{} with "
                   "the account of HF_TOKEN", repo, why, s.endpoint, repo);
    case 404:
      return error(errc::not_found, "{}: no such repository at {} (HTTP 404{})", repo, s.endpoint, why);
    default:
      return error(errc::io_error, "{}: HTTP {} from {}{}", repo, r.status, s.endpoint, why);
  }
}

std::vector<std::string> auth_headers(const hub_settings& s) {
  if (s.token.empty()) return {};
  return {"Authorization: Bearer " + s.token};
}

result<std::vector<hub_file>> parse_tree(const std::string& body, const std::string& repo) {
  nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  if (!j.is_array()) return error(errc::corrupt, "{}: the hub's file list is not a JSON array", repo);
  std::vector<hub_file> files;
  for (const nlohmann::json& item : j) {
    if (!item.is_object() || item.value("type", "") != "file" || !item.contains("path") || !item["path"].is_string())
      continue;
    hub_file f;
    f.path = item["path"].get<std::string>();
    if (!safe_relative_path(f.path)) continue;  // never written outside the cache folder
    if (item.contains("size") && item["size"].is_number_integer()) f.size = item["size"].get<std::int64_t>();
    if (item.contains("lfs") && item["lfs"].is_object()) {
      const nlohmann::json& lfs = item["lfs"];
      if (lfs.contains("oid") && lfs["oid"].is_string()) f.sha256 = lower(lfs["oid"].get<std::string>());
      if (lfs.contains("size") && lfs["size"].is_number_integer()) f.size = lfs["size"].get<std::int64_t>();
    }
    if (f.sha256.size() != 64 || !std::all_of(f.sha256.begin(), f.sha256.end(), ::isxdigit)) f.sha256.clear();
    files.push_back(std::move(f));
  }
  return files;
}

result<std::vector<hub_file>> list_remote(const hub_settings& s, const std::string& repo) {
  std::vector<hub_file> files;
  std::string url = s.endpoint + "/api/models/" + repo + "/tree/main?recursive=true";
  for (int page = 0; !url.empty() && page < 100; ++page) {
    PAGODA_ASSIGN_OR_RETURN(http_response r, http_get({url, auth_headers(s), 0}));
    if (r.status != 200) return api_status_error(s, repo, r);
    PAGODA_ASSIGN_OR_RETURN(std::vector<hub_file> more, parse_tree(r.body, repo));
    files.insert(files.end(), more.begin(), more.end());
    url = r.next_link;
  }
  return files;
}

std::string read_sidecar(const std::string& local) {
  std::ifstream in(local + ".sha256");
  std::string hex;
  in >> hex;
  return lower(hex);
}

// The GGUF files already pulled from `repo`, with the hashes they were verified against.
std::vector<hub_file> list_cached(const hub_settings& s, const std::string& repo) {
  std::vector<hub_file> files;
  const std::string dir = repo_dir(s, repo);
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_regular_file() || it->path().extension() != ".gguf") continue;
    hub_file f;
    f.path = fs::relative(it->path(), dir).string();
    f.size = static_cast<std::int64_t>(it->file_size());
    f.sha256 = read_sidecar(it->path().string());
    files.push_back(std::move(f));
  }
  std::sort(files.begin(), files.end(), [](const hub_file& a, const hub_file& b) { return a.path < b.path; });
  return files;
}

result<std::string> from_cache(const hub_settings& s, const hub_request& req, const std::string& why_offline) {
  const std::vector<hub_file> cached = list_cached(s, req.repo);
  if (cached.empty())
    return error(errc::io_error, "{}; {} is not in the cache ({}) either", why_offline, req.repo, repo_dir(s, req.repo));
  auto chosen = choose_file(cached, req);
  if (!chosen.ok()) return chosen.error().with_context(fmt::format("{}; in the cache", why_offline));
  const std::string local = repo_dir(s, req.repo) + "/" + chosen->file.path;
  std::fprintf(stderr, "pagoda: %s; using the cached %s\n", why_offline.c_str(), local.c_str());
  return local;
}

// The local copy is the published file: its recorded hash is the published one
// (or, with none published, its size is).
bool already_pulled(const std::string& local, const hub_file& f) {
  std::error_code ec;
  if (!fs::is_regular_file(local, ec)) return false;
  if (f.size >= 0 && static_cast<std::int64_t>(fs::file_size(local, ec)) != f.size) return false;
  if (f.sha256.empty()) return true;
  return read_sidecar(local) == f.sha256;
}

}  // namespace

result<hub_settings> hub_settings_from_env() {
  hub_settings s;
  s.endpoint = env_or("HF_ENDPOINT", "https://huggingface.co");
  while (s.endpoint.ends_with('/')) s.endpoint.pop_back();
  if (!s.endpoint.starts_with("http://") && !s.endpoint.starts_with("https://"))
    return error(errc::invalid_argument, "HF_ENDPOINT={} is not an http:// or https:// URL", s.endpoint);
  s.token = token_from_env();
  const std::string offline = lower(env_or("HF_HUB_OFFLINE"));
  s.offline = offline == "1" || offline == "true" || offline == "yes" || offline == "on";
  s.cache_dir = env_or("PAGODA_MODELS");
  if (s.cache_dir.empty()) {
    const std::string xdg = env_or("XDG_CACHE_HOME"), home = env_or("HOME");
    if (!xdg.empty()) s.cache_dir = xdg + "/pagoda/models";
    else if (!home.empty()) s.cache_dir = home + "/.cache/pagoda/models";
    else return error(errc::invalid_argument, "no folder for models: set PAGODA_MODELS (or HOME)");
  }
  return s;
}

result<hub_request> parse_hub_spec(const std::string& spec, const std::string& file) {
  hub_request r;
  r.file = file;
  r.repo = spec;
  if (const std::size_t colon = spec.rfind(':'); colon != std::string::npos) {
    r.repo = spec.substr(0, colon);
    r.quant = spec.substr(colon + 1);
    if (!name_chars_ok(r.quant))
      return error(errc::invalid_argument, "'{}': the quant after ':' must be letters, digits, '-', '_' or '.' (e.g. Q4_K_M)", spec);
  }
  const std::size_t slash = r.repo.find('/');
  if (slash == std::string::npos || r.repo.find('/', slash + 1) != std::string::npos ||
      !name_chars_ok(r.repo.substr(0, slash)) || !name_chars_ok(r.repo.substr(slash + 1)))
    return error(errc::invalid_argument,
                 "'{}' is not a Hugging Face repository: OWNER/NAME[:QUANT], e.g. bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
                 spec);
  if (!file.empty() && !safe_relative_path(file))
    return error(errc::invalid_argument, "--hf-file {}: a file name in the repository, with no '..'", file);
  return r;
}

result<std::string> hub_pull(const hub_settings& s, const hub_request& req) {
  if (s.offline) return from_cache(s, req, "HF_HUB_OFFLINE is set");
  auto listed = list_remote(s, req.repo);
  if (!listed.ok()) {
    if (listed.error().message().starts_with(k_unreachable_prefix))
      return from_cache(s, req, listed.error().message());
    return listed.error();
  }
  PAGODA_ASSIGN_OR_RETURN(choice chosen, choose_file(*listed, req));
  PAGODA_RETURN_IF_ERROR(refuse_split(req.repo, chosen.file));
  const hub_file& f = chosen.file;
  const std::string local = repo_dir(s, req.repo) + "/" + f.path;
  std::fprintf(stderr, "pagoda: %s: %s (%s)%s\n", req.repo.c_str(), f.path.c_str(),
               f.size >= 0 ? human_bytes(static_cast<double>(f.size)).c_str() : "size unknown",
               chosen.why.empty() ? "" : fmt::format(" [{}]", chosen.why).c_str());
  if (already_pulled(local, f)) {
    std::fprintf(stderr, "pagoda: already pulled: %s\n", local.c_str());
    return local;
  }
  download_target target{s.endpoint + "/" + req.repo + "/resolve/main/" + url_path(f.path), auth_headers(s), local, f.size,
                         f.sha256};
  PAGODA_RETURN_IF_ERROR(download_verified(target));
  return local;
}

}  // namespace pagoda::cli
