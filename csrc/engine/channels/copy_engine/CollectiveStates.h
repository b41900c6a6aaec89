#pragma once

#include "engine/channels/copy_engine/StateTable.h"

namespace smfree::engine {

// The collective protocol (CollectiveProtocol.h): a collective's piece is copied at the post of
// whichever of its two ranks posts second; the op moves from its match (or clearance, or its
// failure) until its `done` word says how the copy went.
enum class CollectiveState {
  kMoving,          // entry: waits for `done`
  kReleased,        // posted second and its partner failed: its queued copy let run
  kCopied,          // end: `done` reads kCopied
  kPartnerGaveUp,   // end: `done` says its partner could not queue the copy
  kAbandoned,       // end: posted first and its partner failed: the copy never comes
};

inline constexpr StateTable<CollectiveState, 5, 6> kCollectiveStates{
    "collective lane piece",
    1,
    {"moving", "released", "copied", "partner gave up", "abandoned"},
    {{CollectiveState::kMoving, CollectiveState::kReleased, "its partner failed (posted second)"},
     {CollectiveState::kMoving, CollectiveState::kCopied, "`done` reads copied"},
     {CollectiveState::kMoving, CollectiveState::kPartnerGaveUp, "`done` reads gave up"},
     {CollectiveState::kMoving, CollectiveState::kAbandoned, "its partner failed (posted first)"},
     {CollectiveState::kReleased, CollectiveState::kCopied, "`done` reads copied"},
     {CollectiveState::kReleased, CollectiveState::kPartnerGaveUp, "`done` reads gave up"}}};
static_assert(kCollectiveStates.complete());

}  // namespace smfree::engine
