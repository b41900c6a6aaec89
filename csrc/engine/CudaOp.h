#pragma once

#include "engine/cuda/FlagSegment.h"

namespace smfree::engine {

// The stream-side state of an op on a CUDA buffer; every flag lives in the owner's segment.
struct CudaOpState {
  cuda::Flag ready;  // the caller's stream reached the op: src produced / dst free
  cuda::Flag done;   // what user streams wait on: set by the copy, or by the CPU on failure
  cuda::Flag moved;  // set only by the copy, so nothing is freed while it may still run
};

}  // namespace smfree::engine
