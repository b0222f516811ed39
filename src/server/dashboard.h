// GET /dashboard: a live view of the KV pool in the browser (docs/dashboard.md).
//
// The page (src/server/dashboard/dashboard.html, embedded at build time) is
// plain HTML, CSS and JS; it polls once a second what the server already
// answers (/metrics, /slots, /health) and one endpoint of its own:
//
// GET /dashboard/blocks (the admin key when API keys are set) answers the
// pool as the engine published it after a step (engine_loop's block map,
// taken while a dashboard asks for it; so it agrees with /metrics of the
// same step), "pending": true until the first one is taken:
//   {"object": "kv.blocks", "block_size_tokens": 16, "step": 1234,
//    "kv_policy": "h2o:budget=0.25",      the engine's default KV policy ("" none)
//    "tenants": ["", "acme"],             names of the owners below
//    "classes": ["f16", "int4"],          KV types of the block classes
//    "groups": [{"kind": "full", "first_block": 0, "n_blocks": 256,
//                "states": "..c1122.",    one character per block (below)
//                "owners": [0, 1, ...],   per block, an index into "tenants" (-1: free)
//                "class": "0011..."}],    per block, its class (one digit; omitted with one class)
//    "counts": {"free": n, "cached": n, "used": n, "shared": n}}
// A block's state character: '.' free, 'c' cached (in the prefix cache, no
// sequence holds it), '1'..'8' held by that many sequences, '9' by 9 or more.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv/kv_block_map.h"

namespace pagoda::server {

// The answer above. class_types: the KV type of each block class
// (engine_snapshot::kv_class_types).
nlohmann::json kv_blocks_json(const kv_block_map& map, const std::vector<std::string>& class_types,
                              const std::string& kv_policy);

// The dashboard page (HTML with its CSS and JS inline).
std::string_view dashboard_page();

}  // namespace pagoda::server
