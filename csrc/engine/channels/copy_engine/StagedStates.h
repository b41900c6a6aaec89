#pragma once

#include "engine/channels/copy_engine/StateTable.h"

namespace smfree::engine {

// The staged protocol (StagedProtocol.h): a cleared send whose receiver is not ready goes to a
// slot of the receiver's staging ring, which the receiver's copy engine empties into the buffer.
enum class StagedSendState {
  kHeld,        // entry: cleared; waits for the receiver's `ready` or a free slot
  kDirect,      // end here: `ready` came first; DirectProtocol copies it
  kQueued,      // its copy into the slot is queued, the receiver told (a notice)
  kLanded,      // end: `copied` reached
  kFailed,      // end: queuing either copy threw, or the device failed
  kCancelled,   // end: the op failed while held; the receiver's words say the sender gave up
  kPeerFailed,  // end: its receiver failed while it was held
};

inline constexpr StateTable<StagedSendState, 7, 7> kStagedSendStates{
    "staged send",
    1,
    {"held", "direct", "queued", "landed", "failed", "cancelled", "peer failed"},
    {{StagedSendState::kHeld, StagedSendState::kDirect, "the receiver's `ready` is set"},
     {StagedSendState::kHeld, StagedSendState::kQueued, "a slot is free: its copy is queued"},
     {StagedSendState::kHeld, StagedSendState::kFailed, "queuing its copy threw"},
     {StagedSendState::kHeld, StagedSendState::kCancelled, "the op failed"},
     {StagedSendState::kHeld, StagedSendState::kPeerFailed, "its peer failed"},
     {StagedSendState::kQueued, StagedSendState::kLanded, "`copied` reached"},
     {StagedSendState::kQueued, StagedSendState::kFailed, "the device failed"}}};
static_assert(kStagedSendStates.complete());

// A recv whose sender staged its send: from the notice naming the slot until `done`.
enum class StagedRecvState {
  kCopyingOut,    // entry: its copy out of the slot is queued, `queued` set
  kCopied,        // end: `done` reads kCopied
  kSenderGaveUp,  // end: `done` reads kSenderGaveUp
};

inline constexpr StateTable<StagedRecvState, 3, 2> kStagedRecvStates{
    "staged recv",
    1,
    {"copying out", "copied", "sender gave up"},
    {{StagedRecvState::kCopyingOut, StagedRecvState::kCopied, "`done` reads copied"},
     {StagedRecvState::kCopyingOut, StagedRecvState::kSenderGaveUp,
      "`done` reads the sender gave up"}}};
static_assert(kStagedRecvStates.complete());

}  // namespace smfree::engine
