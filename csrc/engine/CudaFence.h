#pragma once

#include <memory>

#include "engine/Wire.h"

namespace smfree::engine {

// What a caller needs to make its stream wait for a CUDA op (Group::waitOnStream): two
// questions to the op's channel, on the caller's thread.
//
// The rule that keeps streams from deadlocking: no stream waits for work that has not been
// submitted to the GPU yet. Streams of one process share hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS), so a wait queued ahead of a later-submitted copy in the
// same queue holds that copy back for good. Hence queued(): the user's stream waits for the
// copy only once queued() says the copy has been submitted. The one exception, a staged recv
// over UCX matched with a promised send, waits for bytes on the network, and only for ones
// whose path is submitted work and threads that make no CUDA call: once a caller's CPU has
// filled the command queue behind such a wait, any CUDA call may block inside the driver (a
// four-stage megatron-core run over TCP hung so when the progress thread set the words).
class CudaFence {
 public:
  virtual ~CudaFence() = default;
  // Never blocks: true once the op's copies are submitted to the GPU, or the op failed, so the
  // caller's stream may wait. Where the channel leaves the copies to the caller's thread (UCX's
  // staged recvs), queues them once the match allows.
  virtual bool queued() = 0;
  // Makes `stream` wait for the op's copies; only once queued() said so.
  virtual void waitOnStream(void* stream, int device) = 0;
};

// What Group::post hands the caller of a CUDA op, to wait for it with.
struct OpFence {
  ChannelKind channel = ChannelKind::kCopyEngine;  // whose op it is
  // A recv whose copies in only its caller's wait() (or a poll) queues: without one it never
  // ends.
  bool queuedByWait = false;
  // Posted while its stream captured a CUDA graph: its wait() must be inside that capture too.
  bool insideCapture = false;
  std::shared_ptr<CudaFence> fence;
};

}  // namespace smfree::engine
