// Tells a request handler that its client went away, so the engine can drop
// the request and free its blocks at once instead of finishing it for nobody.
//
// cpp-httplib (0.11, the Debian version) gives a handler no way to see its
// socket, and writes to a closed peer only fail some time after the close
// (and a non-streaming handler writes nothing until the end). The probe finds
// the connection's socket among the process's descriptors by its address
// pair (local and remote address and port are unique among live TCP
// connections) and asks the kernel whether the peer has hung up (POLLRDHUP).
// The descriptor stays the handler's while it runs: httplib closes it only
// after the handler returns. Linux-only, like the rest of Pagoda.
#pragma once

#include <string>

namespace pagoda::server {

class connection_probe {
 public:
  connection_probe() = default;  // an inert probe: never reports a hang-up

  // The probe of the connection with these endpoints (numeric addresses, as
  // httplib reports them); inert when no such socket is found.
  static connection_probe find(const std::string& local_addr, int local_port, const std::string& remote_addr,
                               int remote_port);

  bool valid() const { return fd_ >= 0; }
  // True once the peer closed or reset the connection. Never blocks.
  bool peer_gone() const;

 private:
  explicit connection_probe(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace pagoda::server
