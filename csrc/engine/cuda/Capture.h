#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace smfree::engine::cuda {

// CUDA graph capture as smfree meets it: the capture a stream takes part in, the capture mode
// of a thread, and what lives as long as a captured graph.

// A capture sequence in progress: its id and the graph it is building.
struct Capture {
  uint64_t id = 0;
  CUgraph graph = nullptr;
};

// The capture `stream` takes part in; none if it is not capturing. Throws Error if its capture
// was invalidated, or if `stream` is the legacy default stream while a blocking stream of its
// context captures (work queued there would join that capture implicitly).
std::optional<Capture> captureOf(CUstream stream);

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
// What ContextGuard does first: relaxes an engine thread, once.
void relaxIfEngineThread();
// For an engine thread's loop: relaxes the thread once the process has loaded the CUDA driver
// (torch or smfree), since a library such as UCX may call CUDA on it outside any ContextGuard
// (UCX's CUDA transports, as an endpoint is made) and a capture can begin only from then on.
void relaxOnceCudaIsLoaded();

// Runs `onDestroy` once `graph` and every executable graph instantiated from it are destroyed
// (a CUDA user object the graph holds). It runs on a thread of the CUDA driver, which allows no
// CUDA call in it. Throws Error, having run nothing, if the graph does not take the object.
void onGraphDestroyed(CUgraph graph, std::function<void()> onDestroy);

}  // namespace smfree::engine::cuda
