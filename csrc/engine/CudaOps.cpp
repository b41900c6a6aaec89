#include "engine/CudaOps.h"

#include <algorithm>

#include "engine/Error.h"
#include "engine/Op.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

void CudaOps::admit(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(inFlightMutex_);
  if (!inFlightFreed_.wait_for(lock, timeout, [this] { return inFlight_ < maxInFlight_; })) {
    fail(maxInFlight_, " CUDA ops stayed in flight for ", timeout.count(),
         " ms (SMFREE_MAX_CUDA_OPS): are their partners posted?");
  }
  ++inFlight_;
}

void CudaOps::retire() {
  {
    std::lock_guard<std::mutex> lock(inFlightMutex_);
    --inFlight_;
  }
  inFlightFreed_.notify_one();
}

void CudaOps::writeFromStream(const Op& op, const cuda::Flag& flag) {
  cuda::ContextGuard context(op.request.buffer.device);
  cuda::writeWord(static_cast<CUstream>(op.request.stream), flags_.cudaAddress(flag.index),
                  flag.value, "cuStreamWriteValue32 (ready)");
}

void CudaOps::releaseOnceWritten(const cuda::Flag& flag) {
  if (flags_.isSet(flag)) {
    flags_.release(flag);
  } else {
    unwritten_.push_back(flag);
  }
}

void CudaOps::recycle() {
  auto unwritten = std::partition(unwritten_.begin(), unwritten_.end(),
                                  [this](const cuda::Flag& flag) { return !flags_.isSet(flag); });
  for (auto it = unwritten; it != unwritten_.end(); ++it) flags_.release(*it);
  unwritten_.erase(unwritten, unwritten_.end());
}

}  // namespace smfree::engine
