// What the server does with connections past its caps: the global one
// (--max-connections, nginx's worker_connections) and the one per client
// address (--max-connections-per-address, nginx's limit_conn on
// $binary_remote_addr), so that one address holding thousands of
// connections cannot take every slot from the others.
//
// A connection past a cap is not served, but its request line is read (for
// at most a second, at most 1 KiB): `GET /health` (or HEAD) is answered as
// usual, so a load balancer's health check never fails because of someone
// else's flood; anything else gets 503 and Retry-After: 1. Then the socket
// closes after a short linger that drains what the client sends (so it
// reads the answer instead of a reset).
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

namespace pagoda::server {

// The key a client's connections are counted under: its IPv4 address, or its
// IPv6 /64 prefix (one host usually holds a whole /64, so counting single
// IPv6 addresses would not limit anyone). An IPv4-mapped IPv6 address counts
// as its IPv4 address.
std::string client_address_key(const boost::asio::ip::address& a);

// Open connections per client address against a cap. Thread-safe.
class address_counter {
 public:
  explicit address_counter(int max_per_address) : max_(max_per_address) {}
  // Counts one more connection of `key`; false (nothing counted) at the cap.
  // A cap of 0 or less: no cap.
  bool take(const std::string& key);
  void give(const std::string& key);
  std::size_t n_addresses() const;

 private:
  const int max_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, int> open_;  // no entry for an address with none open
};

// The answer to a connection past a cap (see above). `health_body`: what
// GET /health answers now (with `health_status`); `refusal`: the 503's message.
class overflow_reply : public std::enable_shared_from_this<overflow_reply> {
 public:
  using tcp = boost::asio::ip::tcp;
  overflow_reply(tcp::socket s, std::atomic<int>& n_live, int health_status, std::string health_body,
                 std::string refusal);
  ~overflow_reply();
  void start();

 private:
  void read_line();
  void answer();
  void drain();

  tcp::socket socket_;
  boost::asio::steady_timer timer_;
  std::atomic<int>& n_live_;
  const int health_status_;
  const std::string health_body_, refusal_;
  std::string got_;  // the request so far (at most 1 KiB)
  std::string text_;
  char sink_[512];
};

}  // namespace pagoda::server
