#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace smfree::engine {

// A UCX endpoint to one remote worker. Not movable: UCX holds a pointer to it for the error
// callback. With `peerFailureHandling`, UCX reports a failed peer (it then uses only
// transports that can notice one, which excludes shared memory); without it, the owner
// watches the peer itself and calls peerGone().
class UcxEndpoint {
 public:
  using ErrorHandler = std::function<void(ucs_status_t)>;

  UcxEndpoint(ucp_worker_h worker, const std::vector<uint8_t>& address, bool peerFailureHandling,
              ErrorHandler onError);
  // Flushes while the peer lives; a gone peer (or UCX's failure handling) allows a forced close,
  // which completes outstanding requests with UCS_ERR_CANCELED.
  ~UcxEndpoint();
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;

  ucp_ep_h handle() const { return endpoint_; }
  // The transports UCX moves data with toward the peer, as "tcp/eth0"; none where this UCX
  // cannot tell (before 1.14) or the query fails. Ask once the lanes are settled (after the
  // first message).
  std::optional<std::vector<std::string>> transports() const;
  void peerGone() { forceClose_ = true; }

 private:
  static void onError(void* self, ucp_ep_h endpoint, ucs_status_t status);

  ucp_worker_h worker_;
  ucp_ep_h endpoint_ = nullptr;
  bool forceClose_;
  ErrorHandler onError_;
};

}  // namespace smfree::engine
