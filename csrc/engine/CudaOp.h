#pragma once

#include <cstddef>

#include "engine/cuda/FlagSegment.h"

namespace smfree::engine {

// The stream-side state of an op on a CUDA buffer; every flag lives in the owner's segment.
//
// The rule that keeps streams from deadlocking: no stream waits for work that has not been
// submitted to the GPU yet. Streams of one process share hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS), so a wait parked ahead of a later-submitted copy in the
// same queue holds that copy back for good. Hence `queued`: the user's stream waits on
// `done` only once `queued` says the copy that writes `done` has been submitted.
struct CudaOpState {
  cuda::Flag ready;   // the caller's stream reached the op: src produced / dst free
  cuda::Flag queued;  // the copy that writes `done` is submitted (or the op failed)
  cuda::Flag done;    // what user streams wait on: set by the copy, or by the CPU on failure
  cuda::Flag moved;   // set only by the copy, so nothing is freed while it may still run
};

// Flag words per op: the flag segment holds FlagSegment::kWords / kFlagsPerCudaOp ops.
constexpr size_t kFlagsPerCudaOp = 4;

// What a caller needs to make its stream wait for a CUDA op.
struct CudaFence {
  cuda::Flag queued;
  cuda::Flag done;
};

}  // namespace smfree::engine
