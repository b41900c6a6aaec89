#pragma once

#include <cuda.h>

namespace smfree::engine::cuda {

// A non-blocking stream of one device, created in its primary context. By default it is
// destroyed after the work queued on it has run; a stream whose work may wait on a flag that
// a dead peer will never write is released at once instead (the driver frees it once that
// work is done, or with the process).
class Stream {
 public:
  enum class OnDestroy { kDrain, kRelease };

  explicit Stream(int device, OnDestroy onDestroy = OnDestroy::kDrain);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  CUstream handle() const { return stream_; }
  int device() const { return device_; }

 private:
  int device_;
  OnDestroy onDestroy_;
  CUstream stream_ = nullptr;
};

}  // namespace smfree::engine::cuda
