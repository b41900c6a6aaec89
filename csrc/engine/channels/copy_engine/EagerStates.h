#pragma once

#include "engine/channels/copy_engine/StateTable.h"

namespace smfree::engine {

// The eager protocol (EagerProtocol.h): a small send is copied at its post into a slot of its
// receiver's lane, before any receiver matched it; the receiver copies it out at the match, or
// its wait() does.
enum class EagerSendState {
  kQueued,         // entry: its copy was queued at the post
  kHeld,           // entry: its slot was still full at the post; the copy waits for it
  kHeldCleared,    // held, and its receiver cleared it
  kQueuedCleared,  // queued, and its receiver cleared it
  kUnfilled,       // the op ended (or filling threw) while held: no copy will be queued
  kLanded,         // end: `copied` reached before its clearance, which then ends the op
  kEnded,          // end: `copied` reached (or the device failed) and the op is done
  kAbandoned,      // end: the op or its peer failed before its slot was emptied
};

inline constexpr StateTable<EagerSendState, 8, 12> kEagerSendStates{
    "eager send",
    2,
    {"queued", "held", "held, cleared", "queued, cleared", "unfilled", "landed", "ended",
     "abandoned"},
    {{EagerSendState::kQueued, EagerSendState::kQueuedCleared, "its receiver cleared it"},
     {EagerSendState::kQueued, EagerSendState::kLanded, "`copied` reached, not yet cleared"},
     {EagerSendState::kQueued, EagerSendState::kEnded, "`copied` reached (or failed), op ended"},
     {EagerSendState::kHeld, EagerSendState::kHeldCleared, "its receiver cleared it"},
     {EagerSendState::kHeld, EagerSendState::kQueued, "its slot was emptied: copy queued"},
     {EagerSendState::kHeld, EagerSendState::kUnfilled, "the op ended, or filling threw"},
     {EagerSendState::kHeld, EagerSendState::kAbandoned, "the op or its peer failed"},
     {EagerSendState::kHeldCleared, EagerSendState::kQueuedCleared,
      "its slot was emptied: copy queued"},
     {EagerSendState::kHeldCleared, EagerSendState::kUnfilled, "the op ended, or filling threw"},
     {EagerSendState::kHeldCleared, EagerSendState::kAbandoned, "the op or its peer failed"},
     {EagerSendState::kQueuedCleared, EagerSendState::kEnded, "`copied` reached (or failed)"},
     {EagerSendState::kUnfilled, EagerSendState::kEnded, "ends at once: `copied` marked"}}};
static_assert(kEagerSendStates.complete());

// A recv that matched an eager send, from the match until its bytes are out of the slot.
enum class EagerRecvState {
  kCopyingOut,       // entry: its copy out is queued, `queued` set
  kHeld,             // entry: its sender's copy is not queued yet; waits for the slot's `full`
  kCallerCopiesOut,  // entry: its wait() claimed it and queues the copy out on its stream
  kGivenUp,          // no copy out will come; `done` says the sender gave up, `queued` set
  kCopied,           // end: `done` reads kCopied
  kSenderGaveUp,     // end: `done` reads kSenderGaveUp
  kCallerCopied,     // end: the wait()'s copy out ran, or the op failed before it queued one
};

inline constexpr StateTable<EagerRecvState, 7, 6> kEagerRecvStates{
    "eager recv",
    3,
    {"copying out", "held", "caller copies out", "given up", "copied", "sender gave up",
     "caller copied"},
    {{EagerRecvState::kHeld, EagerRecvState::kCopyingOut, "the slot is full: copy out queued"},
     {EagerRecvState::kHeld, EagerRecvState::kGivenUp,
      "queuing the copy out threw, or the op ended first"},
     {EagerRecvState::kCopyingOut, EagerRecvState::kCopied, "`done` reads copied"},
     {EagerRecvState::kCopyingOut, EagerRecvState::kSenderGaveUp,
      "`done` reads the sender gave up"},
     {EagerRecvState::kGivenUp, EagerRecvState::kSenderGaveUp, "`done` and `queued` read"},
     {EagerRecvState::kCallerCopiesOut, EagerRecvState::kCallerCopied,
      "its copy out reached `copied`, or was abandoned"}}};
static_assert(kEagerRecvStates.complete());

}  // namespace smfree::engine
