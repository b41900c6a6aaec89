#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "engine/Op.h"
#include "engine/channels/copy_engine/CollectiveLanes.h"
#include "engine/channels/copy_engine/DoneWord.h"
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
// A collective's piece uses words on both sides: either side's post may queue its copy
// (CollectiveLanes.h).
struct CopyEngineOp {
  cuda::Flag queued;  // the copy is submitted, or the op failed (set by a CPU)

  // Recv: written by the caller's stream when it reaches the op (the buffer is free).
  cuda::Flag ready;
  // Recv, and a collective's send: what user streams wait on (>= value). The word goes to
  // `value` when this side fails the op, `value + 1` (kCopied) when the copy has run, `value + 2`
  // (kSenderGaveUp) when the other side gave up before queuing it.
  cuda::Flag done;

  // Send: recorded on the caller's stream when it reaches the op (the source is produced); a
  // collective's recv: the same, when its buffer is free (a collective lane's pull waits for it).
  std::shared_ptr<cuda::Event> produced;
  // A collective's send: the same as a word of the flag segment, for a receiver that pulls.
  cuda::Flag producedWord;
  // Send: recorded on the DMA stream after the copy; user streams wait on it.
  std::shared_ptr<cuda::Event> copied;

  // Eager send: the slot of its receiver's lane that its copy, queued at the post (or held
  // until the slot is empty), fills.
  std::optional<EagerSend> eager;
  // Recv whose place in its lane is known: its wait() may queue its copy out (EagerLanes.h).
  std::shared_ptr<EagerRecv> eagerRecv;
  // A collective's piece that went by a collective lane (CollectiveLanes.h), first or second.
  std::unique_ptr<CollectivePiece> collective;
};

}  // namespace smfree::engine
