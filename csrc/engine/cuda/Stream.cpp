#include "engine/cuda/Stream.h"

#include "engine/Error.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {

Stream::Stream(int device, OnDestroy onDestroy) : device_(device), onDestroy_(onDestroy) {
  ContextGuard context(device_);
  check(driver().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
}

Stream::~Stream() {
  // Its copies read or write memory that goes right after this: let them finish first. At
  // process exit the driver may be torn down already; the process's end frees the stream.
  try {
    ContextGuard context(device_);
    if (onDestroy_ == OnDestroy::kDrain) driver().cuStreamSynchronize(stream_);
    driver().cuStreamDestroy(stream_);
  } catch (const Error&) {
  }
}

}  // namespace smfree::engine::cuda
