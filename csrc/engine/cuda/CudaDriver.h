#pragma once

#include <cuda.h>

#include <optional>
#include <string>

namespace smfree::engine::cuda {

// The CUDA driver API, resolved at run time so the extension loads where there is no GPU.
// Every driver function smfree calls, resolved once by cuGetProcAddress.
#define SMFREE_CUDA_FUNCTIONS(X) \
  X(cuGetErrorString)\
  X(cuInit)\
  X(cuDeviceGet)\
  X(cuDeviceGetCount)\
  X(cuDeviceGetName)\
  X(cuDeviceGetAttribute)\
  X(cuDeviceCanAccessPeer)\
  X(cuDevicePrimaryCtxRetain)\
  X(cuCtxPushCurrent)\
  X(cuCtxPopCurrent)\
  X(cuCtxEnablePeerAccess)\
  X(cuStreamCreate)\
  X(cuStreamDestroy)\
  X(cuStreamSynchronize)\
  X(cuStreamGetId)\
  X(cuStreamWaitValue32)\
  X(cuStreamWriteValue32)\
  X(cuStreamBatchMemOp)\
  X(cuStreamGetCaptureInfo)\
  X(cuThreadExchangeStreamCaptureMode)\
  X(cuUserObjectCreate)\
  X(cuUserObjectRelease)\
  X(cuGraphRetainUserObject)\
  X(cuStreamWaitEvent)\
  X(cuEventCreate)\
  X(cuEventDestroy)\
  X(cuEventRecord)\
  X(cuEventQuery)\
  X(cuMemcpyAsync)\
  X(cuMemAlloc)\
  X(cuMemFree)\
  X(cuMemHostAlloc)\
  X(cuMemFreeHost)\
  X(cuMemHostRegister)\
  X(cuMemHostUnregister)\
  X(cuMemGetAddressRange)\
  X(cuPointerGetAttribute)\
  X(cuIpcGetMemHandle)\
  X(cuIpcOpenMemHandle)\
  X(cuIpcCloseMemHandle)\
  X(cuMemRetainAllocationHandle)\
  X(cuMemExportToShareableHandle)\
  X(cuMemImportFromShareableHandle)\
  X(cuMemRelease)\
  X(cuMemAddressReserve)\
  X(cuMemAddressFree)\
  X(cuMemMap)\
  X(cuMemUnmap)\
  X(cuMemSetAccess)

struct Driver {
#define SMFREE_CUDA_MEMBER(name) decltype(&::name) name = nullptr;
  SMFREE_CUDA_FUNCTIONS(SMFREE_CUDA_MEMBER)
#undef SMFREE_CUDA_MEMBER
};

// The process's driver table; throws Error when no CUDA driver can be loaded. Within a
// DriverOverride's scope, the table that it installed.
const Driver& driver();

// Installs another driver table for its scope and restores the one before at its end: how
// tests run the CUDA paths in-process against a fake (tests/engine/fake_cuda.h). Install it
// before any thread calls driver() and end it after they stopped; `table` must outlive it.
// Primary contexts are looked up again on either side of the scope; other per-device caches
// (an attribute read once, the event pool) keep what the fake said, so a process that used a
// fake uses no real device after.
class DriverOverride {
 public:
  explicit DriverOverride(const Driver& table);
  ~DriverOverride();
  DriverOverride(const DriverOverride&) = delete;
  DriverOverride& operator=(const DriverOverride&) = delete;

 private:
  const Driver* previous_;
};

std::string errorText(CUresult result);
// Throws Error("smfree: CUDA <what> failed: <driver message>") unless result is CUDA_SUCCESS.
void check(CUresult result, const char* what);

// Lets `device`'s primary context reach `peer`'s memory (cuMemAlloc'd there) directly over
// NVLink; false where the two devices cannot reach each other.
bool enablePeerAccess(int device, int peer);

// A thread's capture mode, which its first context on an engine thread relaxes.
// Relaxed capture mode on this thread for a scope: a graph capture in progress (on this thread
// or, in "global" mode, on any) then neither refuses this thread's unsafe calls (an event
// query, an allocation, a host registration) nor is invalidated by them.
class RelaxedCapture {
 public:
  RelaxedCapture();
  ~RelaxedCapture();
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  CUstreamCaptureMode previous_;
};

// The same for the rest of this thread's life, once; for threads of smfree's own that make
// CUDA calls while users capture (torch.cuda.graph's default "global" mode would otherwise
// turn their event queries into failures and invalidate the user's capture).
void relaxCaptureOnThisThread();

// Marks this thread as one of the engine's: its first CUDA context (ContextGuard) relaxes its
// capture mode, so its CUDA calls never meet a user's capture.
void markEngineThread();
// For an engine thread's loop: relaxes the thread once the process has loaded the CUDA driver
// (torch or smfree), since a library such as UCX may call CUDA on it outside any ContextGuard
// (UCX's CUDA transports, as an endpoint is made) and a capture can begin only from then on.
void relaxOnceCudaIsLoaded();


// Makes a device's primary context (the one torch uses) current for a scope; on an engine
// thread, its first relaxes the thread's capture mode.
class ContextGuard {
 public:
  explicit ContextGuard(int device);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;
};

// Keeps one device's primary context current on the owning thread until another device is
// asked for or the object goes; create and destroy it on the same thread.
class CurrentContext {
 public:
  void use(int device);

 private:
  std::optional<ContextGuard> guard_;
  int device_ = -1;
};

}  // namespace smfree::engine::cuda
