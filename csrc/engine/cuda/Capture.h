#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace smfree::engine::cuda {

// CUDA graph capture as smfree meets it: the capture a stream takes part in, and what lives as
// long as a captured graph. A thread's capture mode is the driver's (CudaDriver.h), since a
// ContextGuard relaxes it.

// A capture sequence in progress: its id and the graph it is building.
struct Capture {
  uint64_t id = 0;
  CUgraph graph = nullptr;
};

// The capture `stream` takes part in; none if it is not capturing. Throws Error if its capture
// was invalidated, or if `stream` is the legacy default stream while a blocking stream of its
// context captures (work queued there would join that capture implicitly).
std::optional<Capture> captureOf(CUstream stream);

// Runs `onDestroy` once `graph` and every executable graph instantiated from it are destroyed
// (a CUDA user object the graph holds). It runs on a thread of the CUDA driver, which allows no
// CUDA call in it. Throws Error, having run nothing, if the graph does not take the object.
void onGraphDestroyed(CUgraph graph, std::function<void()> onDestroy);

}  // namespace smfree::engine::cuda
