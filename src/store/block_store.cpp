// block_store's defaults: a batch as one call per entry, for tiers without a
// cheaper way (the disk and Redis tiers have their own).
#include "store/block_store.h"

namespace pagoda {

result<std::vector<bool>> block_store::contains_each(std::span<const store_key> keys) {
  std::vector<bool> out;
  out.reserve(keys.size());
  for (const store_key& k : keys) {
    PAGODA_ASSIGN_OR_RETURN(std::size_t n, count_present(std::span<const store_key>(&k, 1)));
    out.push_back(n == 1);
  }
  return out;
}

status block_store::put_many(std::span<const store_entry> entries) {
  status first;
  for (const store_entry& e : entries) {
    status st = put(e.key, e.value);
    if (!st.ok() && first.ok()) first = std::move(st);
  }
  return first;
}

}  // namespace pagoda
