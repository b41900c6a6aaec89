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

IpcExport DeviceMemory::exportIpc() const {
  const Driver& d = driver();
  ContextGuard context(device_);
  IpcExport exported;
  exported.kind = IpcExport::Kind::kIpcHandle;
  exported.device = device_;
  exported.address = address_;
  exported.base = address_;
  check(d.cuIpcGetMemHandle(&exported.handle, address_), "cuIpcGetMemHandle");
  check(d.cuPointerGetAttribute(&exported.bufferId, CU_POINTER_ATTRIBUTE_BUFFER_ID, address_),
        "cuPointerGetAttribute(BUFFER_ID)");
  return exported;
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
