#include "engine/cuda/DeviceMemory.h"

#include "engine/Error.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {

DeviceMemory::DeviceMemory(int device, uint64_t bytes) : device_(device), bytes_(bytes) {
  ContextGuard context(device_);
  const CUresult result = driver().cuMemAlloc(&address_, bytes_);
  if (result != CUDA_SUCCESS) {
    fail("cannot allocate ", bytes_, " B on cuda:", device_, ": ", errorText(result));
  }
}

DeviceMemory::~DeviceMemory() {
  // At process exit the driver may be torn down already: the process's end frees it then.
  try {
    ContextGuard context(device_);
    driver().cuMemFree(address_);
  } catch (const Error&) {
  }
}

}  // namespace smfree::engine::cuda
