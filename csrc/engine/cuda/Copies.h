#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>

#include "engine/cuda/Bounce.h"
#include "engine/cuda/LocalCopies.h"

namespace smfree::engine::cuda {

// The one place smfree queues copies of bytes (every channel, ops to the rank itself). A copy
// between two GPUs' memory, or between a GPU's and pinned host memory, is one cuMemcpyAsync,
// which the driver gives a copy engine. A copy within one GPU, which the CUDA 13.0 driver runs
// as a kernel on SMs, goes in two copy-engine hops through a Bounce on a peer GPU
// (SMFREE_LOCAL_COPIES=peer_gpu, the default) or in host memory, in chunks of kChunkBytes. An
// uncaptured copy past one chunk alternates its chunks between two streams a hop apart, the
// caller's stream and a side stream kept beside it, so one stream's hop in overlaps the other's
// hop out; the caller's stream waits for the side stream before anything queued after the copy.
// The side stream waits for nothing but the caller's stream, so a copy adds no wait on any
// other stream.
// SMFREE_LOCAL_COPIES=driver leaves it to the driver.

constexpr int kHostMemory = -1;

// One end of a copy: an address valid in every context of the process (unified addressing),
// and the GPU whose memory it is, or kHostMemory.
struct Place {
  CUdeviceptr address = 0;
  int device = kHostMemory;

  static Place of(const void* pointer, int device) {
    return {reinterpret_cast<CUdeviceptr>(pointer), device};
  }
};

// Whether a copy between the two passes through a bounce: both in one GPU's memory, and
// local copies bounce.
bool bounced(const Place& to, const Place& from);

// Queues the copy of `bytes` bytes from `from` to `to` on `stream`, a stream of
// `streamDevice`; a copy within one GPU passes through a bounce that the process keeps for the
// stream. Not for a stream that captures a graph: its replays would share that bounce with
// later work (queueCopyThrough). Throws Error naming `what`.
void queueCopy(CUstream stream, int streamDevice, const Place& to, const Place& from,
               uint64_t bytes, const char* what);

// The same, a copy within one GPU passing through `through`, leased here on first need: for
// copies a graph captures, whose replays use it as long as the graph, which its holder outlives.
void queueCopyThrough(CUstream stream, int streamDevice, const Place& to, const Place& from,
                      uint64_t bytes, std::unique_ptr<BounceLease>& through, const char* what);

// Keeps `lease` until `graph` and its executable graphs are destroyed. Throws Error as
// onGraphDestroyed() does; the lease then never ends (the graph's nodes use the bounce).
void keepWithGraph(CUgraph graph, std::unique_ptr<BounceLease> lease);

}  // namespace smfree::engine::cuda
