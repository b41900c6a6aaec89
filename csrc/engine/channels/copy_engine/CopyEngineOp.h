#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "engine/Op.h"
#include "engine/channels/copy_engine/EagerLanes.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"

namespace smfree::engine {

// The stream-side state of an op on the copy engines (see CudaFence.h for the rule that
// keeps streams from deadlocking).
//
// What a signal costs decides its form. On the DMA stream every memory write after a copy
// costs about 3 µs (measured on H200: 4 writes made a 16 MiB copy 27 % slower), an event
// record nothing. So a send, whose signals stay inside its process, uses events; a recv,
// signalled by the sender's process, uses words of its flag segment, and the copy writes one.
struct CopyEngineOp final : OpChannelState {
  cuda::Flag queued;  // the copy is submitted, or the op failed (set by a CPU)

  // Recv: written by the caller's stream when it reaches the op (the buffer is free).
  cuda::Flag ready;
  // Recv: what user streams wait on (>= value). The word goes to `value` when the receiver
  // fails the op, `value + 1` (kCopied) when the copy has written the buffer, `value + 2`
  // (kSenderGaveUp) when the sender's CPU gave up before submitting it.
  cuda::Flag done;

  // Send: recorded on the caller's stream when it reaches the op (the source is produced).
  std::shared_ptr<cuda::Event> produced;
  // Send: recorded on the DMA stream after the copy; user streams wait on it.
  std::shared_ptr<cuda::Event> copied;

  // Eager send: the slot of its receiver's lane that its copy, queued at the post (or held
  // until the slot is empty), fills.
  std::optional<EagerSend> eager;
  // Recv whose place in its lane is known: its wait() may queue its copy out (EagerLanes.h).
  std::shared_ptr<EagerRecv> eagerRecv;
};

inline CopyEngineOp& copyEngineOp(const Op& op) {
  return static_cast<CopyEngineOp&>(*op.channelState);
}

// Values of a recv's `done` word above the flag's own.
constexpr uint32_t kCopied = 1;
constexpr uint32_t kSenderGaveUp = 2;
constexpr uint32_t kDoneSpan = 3;

}  // namespace smfree::engine
