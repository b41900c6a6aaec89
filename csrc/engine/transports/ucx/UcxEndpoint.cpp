#include "engine/transports/ucx/UcxEndpoint.h"

#include <chrono>
#include <utility>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {

UcxEndpoint::UcxEndpoint(ucp_worker_h worker, const std::vector<uint8_t>& address,
                         bool peerFailureHandling, std::string peerName, ErrorHandler onError)
    : worker_(worker),
      peerFailureHandling_(peerFailureHandling),
      peerName_(std::move(peerName)),
      errorTarget_(std::make_unique<ErrorTarget>(ErrorTarget{std::move(onError)})) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = peerFailureHandling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  params.err_handler.cb = &UcxEndpoint::onError;
  params.err_handler.arg = errorTarget_.get();
  checkUcx(ucp_ep_create(worker_, &params, &endpoint_), "ucp_ep_create");
}

UcxEndpoint::~UcxEndpoint() {
  if (flushing_) ucp_request_free(flushing_);
  if (close()) return;
  // UCX may still report an error on the endpoint: to a target that stays, and does nothing.
  errorTarget_->onError = nullptr;
  static_cast<void>(errorTarget_.release());
}

bool UcxEndpoint::close() {
  // UCX forces a close only where it handles peer failures, and a flush toward a gone or stuck
  // peer would wait out its bound: such an endpoint is left to the worker's destruction.
  if ((peerGone_ || flushGivenUp_) && !peerFailureHandling_) return false;
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = peerFailureHandling_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* request = ucp_ep_close_nbx(endpoint_, &params);
  if (request == nullptr) return true;
  if (UCS_PTR_IS_ERR(request)) return false;
  // The bound guards against a peer that died during a flush.
  return await(request, std::chrono::steady_clock::now() + std::chrono::seconds(5));
}

void UcxEndpoint::startFlush() {
  if (!peerFailureHandling_ || peerGone_ || flushGivenUp_ || flushing_) return;
  ucp_request_param_t params{};
  void* request = ucp_ep_flush_nbx(endpoint_, &params);
  // Nothing in flight, or an endpoint that failed: nothing to wait for.
  if (request != nullptr && !UCS_PTR_IS_ERR(request)) flushing_ = request;
}

void UcxEndpoint::finishFlush(std::chrono::steady_clock::time_point deadline) {
  if (!flushing_) return;
  void* request = std::exchange(flushing_, nullptr);
  if (!await(request, deadline)) {
    flushGivenUp_ = true;
    log(LogLevel::kWarn, "exit: ", peerName_, " had not taken every send when ",
        "SMFREE_EXIT_TIMEOUT_MS passed; closing the connection drops the rest");
  }
}

bool UcxEndpoint::await(void* request, std::chrono::steady_clock::time_point deadline) {
  while (ucp_request_check_status(request) == UCS_INPROGRESS &&
         std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker_);
  }
  const bool ended = ucp_request_check_status(request) != UCS_INPROGRESS;
  ucp_request_free(request);
  return ended;
}

std::optional<std::vector<std::string>> UcxEndpoint::transports() const {
  std::optional<std::vector<std::string>> names;
#if UCP_API_VERSION >= UCP_VERSION(1, 14)
  std::vector<ucp_transport_entry_t> entries(16);
  ucp_ep_attr_t attributes{};
  attributes.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
  attributes.transports.entries = entries.data();
  attributes.transports.num_entries = static_cast<unsigned>(entries.size());
  attributes.transports.entry_size = sizeof(ucp_transport_entry_t);
  if (ucp_ep_query(endpoint_, &attributes) == UCS_OK) {
    names.emplace();
    for (unsigned i = 0; i < attributes.transports.num_entries; ++i) {
      names->push_back(concat(entries[i].transport_name, "/", entries[i].device_name));
    }
  }
#endif
  return names;
}

void UcxEndpoint::onError(void* target, ucp_ep_h, ucs_status_t status) {
  const ErrorTarget& errorTarget = *static_cast<ErrorTarget*>(target);
  // Nothing may propagate into UCX's C frames.
  try {
    if (errorTarget.onError) errorTarget.onError(status);
  } catch (const std::exception& error) {
    log(LogLevel::kError, "handling a UCX endpoint error (", ucxStatusText(status),
        ") failed: ", error.what());
  }
}

}  // namespace smfree::engine
