#pragma once

#include <cuda.h>

namespace smfree::engine::cuda {

// A non-blocking stream of one device, created in its primary context and destroyed after
// the work queued on it has run.
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  CUstream handle() const { return stream_; }
  int device() const { return device_; }

 private:
  int device_;
  CUstream stream_ = nullptr;
};

}  // namespace smfree::engine::cuda
