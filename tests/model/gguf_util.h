// Helpers for tests that rewrite GGUF files.
#pragma once

#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_writer.h"

namespace pagoda::test {

// Adds metadata value v under `key` to w, keeping its type (arrays verbatim).
void copy_value(gguf::writer& w, const std::string& key, const gguf::value& v);

// The bytes of a copy of `src`: its metadata without the keys in `drop` (and
// general.alignment), then whatever `add` writes, then its tensors verbatim
// but those named in `drop`.
std::vector<std::byte> rewrite_gguf(const gguf::file& src, std::initializer_list<std::string_view> drop,
                                    const std::function<void(gguf::writer&)>& add);

}  // namespace pagoda::test
