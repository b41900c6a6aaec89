#pragma once

#include <memory>

#include "engine/Wire.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"

namespace smfree::engine {

struct CallerStaging;
struct CapturedOp;
struct EagerRecv;
struct LoopbackOp;

// What a caller needs to make its stream wait for a CUDA op (Group::waitOnStream): a recv's
// `done` flag, or a send's `copied` event, once `queued` says the copy is submitted.
//
// The rule that keeps streams from deadlocking: no stream waits for work that has not been
// submitted to the GPU yet. Streams of one process share hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS), so a wait queued ahead of a later-submitted copy in the
// same queue holds that copy back for good. Hence `queued`: the user's stream waits for the
// copy only once `queued` says the copy has been submitted. The one exception, a staged recv
// matched with a promised send (CallerStaging), waits for bytes on the network, and only for
// ones whose path is submitted work and threads that make no CUDA call: once a caller's CPU
// has filled the command queue behind such a wait, any CUDA call may block inside the driver
// (a four-stage megatron-core run over TCP hung so when the progress thread set the words).
struct CudaFence {
  ChannelKind channel = ChannelKind::kCopyEngine;  // whose fence it is
  cuda::Flag queued;
  cuda::Flag done;
  std::shared_ptr<cuda::Event> copied;
  std::shared_ptr<CallerStaging> stagedRecv;  // its wait() queues its copies in
  std::shared_ptr<EagerRecv> eagerRecv;        // its wait() may queue its copy out of a slot
  // An op captured in a CUDA graph: its wait() joins the graph's chain (a recv queues its nodes
  // there first), see CapturedChannel.h.
  std::shared_ptr<CapturedOp> captured;
  // An op to the rank itself (LoopbackChannel.h), and whether it was posted inside a CUDA graph
  // capture: its wait() must then be inside that capture too.
  std::shared_ptr<LoopbackOp> loopback;
  bool insideCapture = false;
};

}  // namespace smfree::engine
