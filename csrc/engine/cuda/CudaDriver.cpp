#include "engine/cuda/CudaDriver.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <vector>

#include "engine/Error.h"

namespace smfree::engine::cuda {
namespace {

template <typename Fn>
void resolve(decltype(&::cuGetProcAddress) getProcAddress, const char* name, Fn& fn) {
  void* address = nullptr;
  CUdriverProcAddressQueryResult status{};
  const CUresult result =
      getProcAddress(name, &address, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (result != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS || !address) {
    fail("the CUDA driver has no ", name, " (driver older than CUDA ", CUDA_VERSION / 1000, "?)");
  }
  fn = reinterpret_cast<Fn>(address);
}

Driver load() {
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    fail("cannot load the CUDA driver (libcuda.so.1): ", dlerror());
  }
  auto getProcAddress =
      reinterpret_cast<decltype(&::cuGetProcAddress)>(dlsym(library, "cuGetProcAddress_v2"));
  if (!getProcAddress) {
    fail("the CUDA driver has no cuGetProcAddress_v2");
  }
  Driver d;
#define SMFREE_RESOLVE(name) resolve(getProcAddress, #name, d.name);
  SMFREE_CUDA_FUNCTIONS(SMFREE_RESOLVE)
#undef SMFREE_RESOLVE
  check(d.cuInit(0), "cuInit");
  return d;
}

thread_local bool engineThread = false;
// Relaxed for good, or found to have no CUDA that could capture.
thread_local bool modeSettled = false;

std::atomic<const Driver*>& overridden() {
  static std::atomic<const Driver*> table{nullptr};
  return table;
}

struct PrimaryContexts {
  std::mutex mutex;
  std::vector<CUcontext> contexts;
};

PrimaryContexts& primaryContexts() {
  static PrimaryContexts known;
  return known;
}

void forgetPrimaryContexts() {
  PrimaryContexts& known = primaryContexts();
  std::lock_guard<std::mutex> lock(known.mutex);
  known.contexts.clear();
}

CUcontext primaryContext(int device) {
  PrimaryContexts& known = primaryContexts();
  std::lock_guard<std::mutex> lock(known.mutex);
  auto& contexts = known.contexts;
  if (device >= static_cast<int>(contexts.size())) {
    contexts.resize(device + 1, nullptr);
  }
  if (!contexts[device]) {
    CUdevice handle = 0;
    check(driver().cuDeviceGet(&handle, device), "cuDeviceGet");
    // Retained for the life of the process, like torch's own use of it.
    check(driver().cuDevicePrimaryCtxRetain(&contexts[device], handle), "cuDevicePrimaryCtxRetain");
  }
  return contexts[device];
}

}  // namespace

const Driver& driver() {
  if (const Driver* table = overridden().load(std::memory_order_acquire)) return *table;
  static const Driver instance = load();
  return instance;
}

DriverOverride::DriverOverride(const Driver& table)
    : previous_(overridden().exchange(&table, std::memory_order_acq_rel)) {
  forgetPrimaryContexts();
}

DriverOverride::~DriverOverride() {
  overridden().store(previous_, std::memory_order_release);
  forgetPrimaryContexts();
}

std::string errorText(CUresult result) {
  const char* text = nullptr;
  if (driver().cuGetErrorString(result, &text) != CUDA_SUCCESS || !text) {
    return concat("CUDA error ", static_cast<int>(result));
  }
  return text;
}

void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) {
    fail("CUDA ", what, " failed: ", errorText(result));
  }
}

bool enablePeerAccess(int device, int peer) {
  int reachable = 0;
  CUdevice from = 0;
  CUdevice to = 0;
  check(driver().cuDeviceGet(&from, device), "cuDeviceGet");
  check(driver().cuDeviceGet(&to, peer), "cuDeviceGet");
  check(driver().cuDeviceCanAccessPeer(&reachable, from, to), "cuDeviceCanAccessPeer");
  if (!reachable) return false;
  ContextGuard context(device);
  const CUresult result = driver().cuCtxEnablePeerAccess(primaryContext(peer), 0);
  if (result != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
    check(result, "cuCtxEnablePeerAccess");
  }
  return true;
}

RelaxedCapture::RelaxedCapture() : previous_(CU_STREAM_CAPTURE_MODE_RELAXED) {
  check(driver().cuThreadExchangeStreamCaptureMode(&previous_),
        "cuThreadExchangeStreamCaptureMode");
}

RelaxedCapture::~RelaxedCapture() { driver().cuThreadExchangeStreamCaptureMode(&previous_); }

void relaxCaptureOnThisThread() {
  if (modeSettled) return;
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  check(driver().cuThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode");
  modeSettled = true;
}

void markEngineThread() { engineThread = true; }

void relaxOnceCudaIsLoaded() {
  if (modeSettled) return;
  void* loaded = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!loaded) return;
  dlclose(loaded);
  try {
    relaxCaptureOnThisThread();
  } catch (const Error&) {
    // A driver that does not start (no GPU) runs no capture: nothing to relax for.
    modeSettled = true;
  }
}

ContextGuard::ContextGuard(int device) {
  if (engineThread) relaxCaptureOnThisThread();
  check(driver().cuCtxPushCurrent(primaryContext(device)), "cuCtxPushCurrent");
}

ContextGuard::~ContextGuard() {
  CUcontext popped = nullptr;
  driver().cuCtxPopCurrent(&popped);
}

void CurrentContext::use(int device) {
  if (device == device_) return;
  guard_.reset();
  device_ = -1;
  guard_.emplace(device);
  device_ = device;
}

}  // namespace smfree::engine::cuda
