#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

UcxWorker::UcxWorker(const UcxContext& context, Threads threads) : context_(context) {
  ucp_worker_params_t workerParams{};
  workerParams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  workerParams.thread_mode =
      threads == Threads::kShared ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SINGLE;
  checkUcx(ucp_worker_create(context.handle(), &workerParams, &worker_), "ucp_worker_create");
  ucp_address_t* address = nullptr;
  size_t length = 0;
  ucs_status_t status = ucp_worker_get_address(worker_, &address, &length);
  if (status == UCS_OK) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(address);
    address_.assign(bytes, bytes + length);
    ucp_worker_release_address(worker_, address);
    status = ucp_worker_get_efd(worker_, &eventFd_);
  }
  if (status != UCS_OK) {
    ucp_worker_destroy(worker_);
    checkUcx(status, "worker address or event fd");
  }
  context_.workerCreated();
}

UcxWorker::~UcxWorker() {
  ucp_worker_destroy(worker_);
  context_.workerDestroyed();
}

bool UcxWorker::arm() {
  const ucs_status_t status = ucp_worker_arm(worker_);
  if (status == UCS_ERR_BUSY) {
    return false;
  }
  checkUcx(status, "ucp_worker_arm");
  return true;
}

}  // namespace smfree::engine
