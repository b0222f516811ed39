#include "cli/simple_kv.h"

#include <algorithm>

namespace pagoda::cli {

simple_kv::simple_kv(const kv_storage& storage) : block_size_(storage.layout().block_size) {
  for (std::int64_t i = storage.n_blocks() - 1; i >= 0; --i) free_.push_back(block_id(static_cast<std::int32_t>(i)));
}

bool simple_kv::reserve(int seq, int n_tokens) {
  std::vector<block_id>& t = tables_[seq];
  std::size_t need = (static_cast<std::size_t>(n_tokens) + block_size_ - 1) / block_size_;
  if (need <= t.size()) return true;
  if (need - t.size() > free_.size()) return false;
  while (t.size() < need) {
    t.push_back(free_.back());
    free_.pop_back();
    ++used_;
  }
  peak_ = std::max(peak_, used_);
  return true;
}

std::span<const block_id> simple_kv::table(int seq) const {
  auto it = tables_.find(seq);
  if (it == tables_.end()) return {};
  return it->second;
}

void simple_kv::release(int seq) {
  auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) free_.push_back(*b);
  used_ -= it->second.size();
  tables_.erase(it);
}

}  // namespace pagoda::cli
