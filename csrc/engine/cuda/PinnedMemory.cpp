#include "engine/cuda/PinnedMemory.h"

#include "engine/Error.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {

PinnedMemory::PinnedMemory(int device, uint64_t bytes) : device_(device), bytes_(bytes) {
  ContextGuard context(device_);
  const CUresult result = driver().cuMemHostAlloc(&data_, bytes_, CU_MEMHOSTALLOC_PORTABLE);
  if (result != CUDA_SUCCESS) {
    fail("cannot allocate ", bytes_, " B of pinned host memory: ", errorText(result));
  }
}

PinnedMemory::~PinnedMemory() {
  // At process exit the driver may be torn down already: the process's end frees it then.
  try {
    ContextGuard context(device_);
    driver().cuMemFreeHost(data_);
  } catch (const Error&) {
  }
}

}  // namespace smfree::engine::cuda
