#pragma once

#include "engine/channels/copy_engine/StateTable.h"

namespace smfree::engine {

// The direct protocol (DirectProtocol.h): a cleared send's copy engine writes straight into its
// receiver's buffer, mapped through CUDA IPC.
enum class DirectSendState {
  kCleared,   // entry: its clear-to-send read, nothing queued
  kQueued,    // the copy and the receiver's `done` write are on the DMA stream, `queued` set
  kUnparked,  // queued, and the receiver's `ready` forced so the copy runs whatever it does
  kLanded,    // end: `copied` reached
  kFailed,    // end: the device failed before `copied` (a sticky CUDA error)
  kGaveUp,    // end: queuing failed; the receiver's words say the sender gave up
};

inline constexpr StateTable<DirectSendState, 6, 7> kDirectSendStates{
    "direct send",
    1,
    {"cleared", "queued", "unparked", "landed", "failed", "gave up"},
    {{DirectSendState::kCleared, DirectSendState::kQueued, "its copy is queued"},
     {DirectSendState::kCleared, DirectSendState::kGaveUp, "queuing its copy threw"},
     {DirectSendState::kQueued, DirectSendState::kUnparked, "the op or its peer failed"},
     {DirectSendState::kQueued, DirectSendState::kLanded, "`copied` reached"},
     {DirectSendState::kQueued, DirectSendState::kFailed, "the device failed"},
     {DirectSendState::kUnparked, DirectSendState::kLanded, "`copied` reached"},
     {DirectSendState::kUnparked, DirectSendState::kFailed, "the device failed"}}};
static_assert(kDirectSendStates.complete());

// A rendezvous recv, from its clear-to-send until its `done` word says how the copy went.
enum class DirectRecvState {
  kArmed,         // entry: clear-to-send sent; waits for `done` and `queued`
  kStaged,        // end here: its sender staged the send; StagedProtocol copies it out
  kCopied,        // end: `done` reads kCopied
  kSenderGaveUp,  // end: `done` reads kSenderGaveUp
  kAbandoned,     // end: its sender gave up or failed, or its copy out could not be queued
};

inline constexpr StateTable<DirectRecvState, 5, 4> kDirectRecvStates{
    "direct recv",
    1,
    {"armed", "staged", "copied", "sender gave up", "abandoned"},
    {{DirectRecvState::kArmed, DirectRecvState::kStaged, "its sender's staging notice"},
     {DirectRecvState::kArmed, DirectRecvState::kCopied, "`done` and `queued` set, copied"},
     {DirectRecvState::kArmed, DirectRecvState::kSenderGaveUp,
      "`done` and `queued` set, the sender gave up"},
     {DirectRecvState::kArmed, DirectRecvState::kAbandoned,
      "its partner gave up, its peer failed, or its copy out failed to queue"}}};
static_assert(kDirectRecvStates.complete());

}  // namespace smfree::engine
