#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace smfree::engine {

// A UCX endpoint to one remote worker. With `peerFailureHandling`, UCX reports a failed peer
// (it then uses only transports that can notice one, which excludes shared memory); without
// it, the owner watches the peer itself and calls peerGone().
class UcxEndpoint {
 public:
  using ErrorHandler = std::function<void(ucs_status_t)>;

  // `peerName` names the peer in what the endpoint logs ("pid 123 on host node7").
  UcxEndpoint(ucp_worker_h worker, const std::vector<uint8_t>& address, bool peerFailureHandling,
              std::string peerName, ErrorHandler onError);
  // With UCX's failure handling, a forced close, which completes outstanding requests with
  // UCS_ERR_CANCELED (flush first); without, a flush while the peer lives. An endpoint left
  // open (its peer gone, or its flush given up) stays in UCX until the worker goes: its error
  // target then outlives this object and calls no one.
  ~UcxEndpoint();
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;

  ucp_ep_h handle() const { return endpoint_; }
  // The transports UCX moves data with toward the peer, as "tcp/eth0"; none where this UCX
  // cannot tell (before 1.14) or the query fails. Ask once the lanes are settled (after the
  // first message).
  std::optional<std::vector<std::string>> transports() const;
  void peerGone() { peerGone_ = true; }
  // With UCX's failure handling: asks UCX to flush the endpoint, so that the peer takes every
  // send posted here. Sends whose requests completed may still be on their way: a forced close
  // alone resets the connection under them. Without failure handling, the close flushes.
  void startFlush();
  // Progresses the worker until the flush started ends, the endpoint fails, or `deadline`
  // (process exit: what the peer has not taken then is dropped, logged naming the peer).
  void finishFlush(std::chrono::steady_clock::time_point deadline);

 private:
  // What UCX's error callback reaches: held apart from the endpoint, whose lifetime UCX does
  // not know.
  struct ErrorTarget {
    ErrorHandler onError;
  };
  static void onError(void* target, ucp_ep_h endpoint, ucs_status_t status);
  // Whether UCX has closed the endpoint when this returns.
  bool close();
  // Progresses the worker until the request ends or `deadline`; whether it ended. Frees it.
  bool await(void* request, std::chrono::steady_clock::time_point deadline);

  ucp_worker_h worker_;
  ucp_ep_h endpoint_ = nullptr;
  const bool peerFailureHandling_;
  const std::string peerName_;
  bool peerGone_ = false;
  bool flushGivenUp_ = false;
  void* flushing_ = nullptr;  // the flush's request, between startFlush and finishFlush
  std::unique_ptr<ErrorTarget> errorTarget_;
};

}  // namespace smfree::engine
