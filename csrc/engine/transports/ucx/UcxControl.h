#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/transports/ucx/UcxEndpoint.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

// Control transport: small messages between engines as UCX active messages.
class UcxControl {
 public:
  using Handler = std::function<void(const void* data, size_t length)>;
  using FailureHandler = std::function<void(ucs_status_t)>;

  UcxControl(UcxWorker& worker, Handler onMessage);
  UcxControl(const UcxControl&) = delete;
  UcxControl& operator=(const UcxControl&) = delete;

  // Delivery failure is reported to onFailure on the progress thread.
  void send(UcxEndpoint& endpoint, std::vector<uint8_t> message, FailureHandler onFailure);

 private:
  static ucs_status_t onReceive(void* self, const void* header, size_t headerLength, void* data,
                                size_t length, const ucp_am_recv_param_t* param);

  UcxWorker& worker_;
  Handler onMessage_;
};

}  // namespace smfree::engine
