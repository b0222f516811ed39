// Helpers for tests that rewrite GGUF files.
#pragma once

#include <string>

#include "model/gguf.h"
#include "model/gguf_writer.h"

namespace pagoda::test {

// Adds metadata value v under `key` to w, keeping its type (arrays verbatim).
void copy_value(gguf::writer& w, const std::string& key, const gguf::value& v);

}  // namespace pagoda::test
