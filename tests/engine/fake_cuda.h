// A CUDA driver for in-process tests (cuda::DriverOverride): "device" memory is host memory; a
// stream is a queue of operations (copies, event records, waits on and writes of 32-bit words)
// that run in order, each as soon as what it waits for holds, on the thread that drives the
// fake: any driver call runs what it can, and so does run(). Single-threaded.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <string>

#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::testing {

class FakeCuda {
 public:
  // Installs the fake for its scope; one at a time.
  FakeCuda();
  ~FakeCuda();
  FakeCuda(const FakeCuda&) = delete;
  FakeCuda& operator=(const FakeCuda&) = delete;

  // Runs every stream's operations as far as their waits allow; returns how many ran.
  size_t run();
  // Operations queued on any stream and not yet run.
  size_t pending() const;
  // The next call of `function` (its driver name: "cuMemcpyAsync") returns `result`.
  void failNext(const std::string& function, CUresult result = CUDA_ERROR_LAUNCH_FAILED);
  // From now on cuEventQuery reports `result`, as after a sticky error of the device.
  void failDevice(CUresult result = CUDA_ERROR_ILLEGAL_ADDRESS);
  // How many times `function` was called.
  size_t calls(const std::string& function) const;

 private:
  cuda::DriverOverride override_;
};

}  // namespace smfree::engine::testing
