#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/ControlTransport.h"
#include "engine/transports/ucx/UcxEndpoint.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

// Control transport: small messages between engines as UCX active messages. A message that
// arrives is held, and handed to the handler by deliver(), outside UCX's progress: handling
// one sends (a clear-to-send starts the data), a send that finds its connection broken closes
// it there and then, and UCX 1.13's TCP transport asserts that no event it still holds from
// the same progress call is for a closed connection (it aborted so, handling messages inside
// its progress, when several peers died at once). It drives the engine's worker, which
// UcxChannel shares, for the progress loop.
class UcxControl final : public ControlTransport {
 public:
  using Handler = std::function<void(const void* data, size_t length)>;
  using FailureHandler = std::function<void(ucs_status_t)>;

  UcxControl(UcxWorker& worker, Handler onMessage);
  UcxControl(const UcxControl&) = delete;
  UcxControl& operator=(const UcxControl&) = delete;

  // Delivery failure is reported to onFailure on the progress thread, inside UCX's progress or
  // this call.
  void send(UcxEndpoint& endpoint, std::vector<uint8_t> message, FailureHandler onFailure);

  // ControlTransport
  unsigned progress() override { return worker_.progress(); }
  bool deliver() override;
  bool arm() override { return worker_.arm(); }
  int eventFd() const override { return worker_.eventFd(); }
  void signal() override { worker_.signal(); }

 private:
  static ucs_status_t onReceive(void* self, const void* header, size_t headerLength, void* data,
                                size_t length, const ucp_am_recv_param_t* param);

  UcxWorker& worker_;
  Handler onMessage_;
  std::vector<std::vector<uint8_t>> arrived_;  // by onReceive, on the worker's thread
};

}  // namespace smfree::engine
