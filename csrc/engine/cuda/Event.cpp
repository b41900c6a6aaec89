#include "engine/cuda/Event.h"

#include "engine/Error.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {

Event::Event(int device) : device_(device) {
  ContextGuard context(device_);
  check(driver().cuEventCreate(&event_, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
}

Event::~Event() {
  // A record or wait still queued keeps what it needs: the driver frees the event after it.
  // At process exit the driver may be gone already; then there is nothing left to free.
  try {
    ContextGuard context(device_);
    driver().cuEventDestroy(event_);
  } catch (const Error&) {
  }
}

void Event::record(CUstream stream) {
  ContextGuard context(device_);
  check(driver().cuEventRecord(event_, stream), "cuEventRecord");
}

void Event::waitOn(CUstream stream) const {
  ContextGuard context(device_);
  check(driver().cuStreamWaitEvent(stream, event_, CU_EVENT_WAIT_DEFAULT), "cuStreamWaitEvent");
}

bool Event::reached() const {
  ContextGuard context(device_);
  const CUresult result = driver().cuEventQuery(event_);
  if (result == CUDA_ERROR_NOT_READY) {
    return false;
  }
  check(result, "cuEventQuery");
  return true;
}

}  // namespace smfree::engine::cuda
