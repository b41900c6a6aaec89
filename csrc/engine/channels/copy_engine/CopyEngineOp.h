#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "engine/Channel.h"
#include "engine/Error.h"
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

// The copy engine's part of an op (Op::channelOp) holds the op's CopyEngineOp, which the
// protocols reach from the op alone (copyEngineOp()). Its steps are the channel's
// (CopyEngineChannelOp.h): the protocols build, and tests drive them, without the channel.
class CopyEngineOpHolder : public ChannelOp {
 public:
  CopyEngineOpHolder(OpTraits traits, CopyEngineOp&& state)
      : ChannelOp(traits), state_(std::move(state)) {}
  CopyEngineOp& state() { return state_; }

 private:
  CopyEngineOp state_;
};

inline CopyEngineOp& copyEngineOp(const Op& op) {
  return static_cast<CopyEngineOpHolder&>(*op.channelOp).state();
}

// How a send's copy went: nothing while it is still to run; else success, or the device's
// failure (a sticky CUDA error: the copy will not run). The DMA stream waited for `produced`
// before the copy that `copied` follows, so `produced` is reached too.
inline std::optional<Status> sendCopyOutcome(const Op& op) {
  const CopyEngineOp& state = copyEngineOp(op);
  try {
    if (!state.copied->reached()) return std::nullopt;
    state.produced->markReached();
    return Status::success();
  } catch (const Error& error) {
    return Status::failure(StatusCode::kChannel,
                           concat(op.describe(), " failed: ", reasonOf(error)));
  }
}

}  // namespace smfree::engine
