#include "engine/transports/ucx/UcxControl.h"

#include <memory>

#include "engine/Log.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {
namespace {

constexpr unsigned kControlMessageId = 7;

struct PendingMessage {
  std::vector<uint8_t> bytes;
  UcxControl::FailureHandler onFailure;
};

void onSent(void* request, ucs_status_t status, void* userData) {
  std::unique_ptr<PendingMessage> message(static_cast<PendingMessage*>(userData));
  ucp_request_free(request);
  if (status == UCS_OK) return;
  // Nothing may propagate into UCX's C frames.
  try {
    message->onFailure(status);
  } catch (const std::exception& error) {
    log(LogLevel::kError, "handling a control message UCX could not send (",
        ucxStatusText(status), ") failed: ", error.what());
  }
}

}  // namespace

UcxControl::UcxControl(UcxWorker& worker, Handler onMessage)
    : worker_(worker), onMessage_(std::move(onMessage)) {
  ucp_am_handler_param_t params{};
  params.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
  params.id = kControlMessageId;
  params.cb = &UcxControl::onReceive;
  params.arg = this;
  checkUcx(ucp_worker_set_am_recv_handler(worker_.handle(), &params),
           "ucp_worker_set_am_recv_handler");
}

void UcxControl::send(UcxEndpoint& endpoint, std::vector<uint8_t> message,
                      FailureHandler onFailure) {
  auto pending = std::make_unique<PendingMessage>(PendingMessage{std::move(message), onFailure});
  ucp_request_param_t params{};
  params.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  // Eager: the whole message reaches the handler, which must not defer.
  params.flags = UCP_AM_SEND_FLAG_EAGER;
  params.cb.send = &onSent;
  params.user_data = pending.get();
  void* request = ucp_am_send_nbx(endpoint.handle(), kControlMessageId, nullptr, 0,
                                  pending->bytes.data(), pending->bytes.size(), &params);
  if (request == nullptr) {
    return;  // sent in place, as small messages usually are: no callback comes
  }
  if (UCS_PTR_IS_ERR(request)) {
    onFailure(UCS_PTR_STATUS(request));
    return;
  }
  pending.release();  // owned by the request until onSent
}

ucs_status_t UcxControl::onReceive(void* self, const void*, size_t, void* data, size_t length,
                                   const ucp_am_recv_param_t* param) {
  // Nothing may propagate into UCX's C frames: a bad message is logged and dropped.
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    log(LogLevel::kError, "dropped a control message of ", length,
        " B that arrived by rendezvous; eager was requested");
    return UCS_OK;
  }
  try {
    const auto* bytes = static_cast<const uint8_t*>(data);
    static_cast<UcxControl*>(self)->arrived_.emplace_back(bytes, bytes + length);
  } catch (const std::exception& error) {
    log(LogLevel::kError, "dropped a control message: ", error.what());
  }
  return UCS_OK;
}

bool UcxControl::deliver() {
  if (arrived_.empty()) return false;
  std::vector<std::vector<uint8_t>> arrived;
  arrived.swap(arrived_);
  for (const std::vector<uint8_t>& message : arrived) {
    try {
      onMessage_(message.data(), message.size());
    } catch (const std::exception& error) {
      log(LogLevel::kError, "dropped a control message: ", error.what());
    }
  }
  return true;
}

}  // namespace smfree::engine
