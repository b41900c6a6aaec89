#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace smfree::engine {

// A UCX endpoint to one remote worker, with peer-failure reporting. Not movable: UCX holds
// a pointer to it for the error callback.
class UcxEndpoint {
 public:
  using ErrorHandler = std::function<void(ucs_status_t)>;

  UcxEndpoint(ucp_worker_h worker, const std::vector<uint8_t>& address, ErrorHandler onError);
  ~UcxEndpoint();  // closes forcibly: a failed peer cannot take part in a graceful close
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;

  ucp_ep_h handle() const { return endpoint_; }

 private:
  static void onError(void* self, ucp_ep_h endpoint, ucs_status_t status);

  ucp_worker_h worker_;
  ucp_ep_h endpoint_ = nullptr;
  ErrorHandler onError_;
};

}  // namespace smfree::engine
