#include "pagoda/status.h"

namespace pagoda {

const char* errc_name(errc code) {
  switch (code) {
    case errc::ok: return "ok";
    case errc::invalid_argument: return "invalid_argument";
    case errc::not_found: return "not_found";
    case errc::out_of_range: return "out_of_range";
    case errc::corrupt: return "corrupt";
    case errc::unsupported: return "unsupported";
    case errc::resource_exhausted: return "resource_exhausted";
    case errc::io_error: return "io_error";
    case errc::cancelled: return "cancelled";
    case errc::unauthenticated: return "unauthenticated";
    case errc::internal: return "internal";
  }
  return "unknown";
}

}  // namespace pagoda
