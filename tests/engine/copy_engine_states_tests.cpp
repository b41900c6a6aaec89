// The copy-engine protocols' state tables (channels/copy_engine/*States.h): every transition
// listed is taken, every other is refused with the op named, every state is reachable and can
// end; and what cancellation and failure do at each state is in the table.

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/channels/copy_engine/CollectiveStates.h"
#include "engine/channels/copy_engine/DirectStates.h"
#include "engine/channels/copy_engine/EagerStates.h"
#include "engine/channels/copy_engine/StagedStates.h"

#include "check.h"

using namespace smfree::engine;
using testing::throwsError;

namespace {

const std::string kOp = "send on rank 0 to rank 1 (group 'g', tag 3, 64 B)";

template <typename Table>
using StateOf = decltype(Table::transitions[0].from);

template <typename Table>
bool hasExit(const Table& table, StateOf<Table> state) {
  for (const auto& step : table.transitions) {
    if (step.from == state) return true;
  }
  return false;
}

// Every listed step is taken; every other pair is refused, naming the op, the machine and both
// states, and leaves the state as it was.
template <typename Table>
void checkSteps(const Table& table) {
  using State = StateOf<Table>;
  for (const auto& step : table.transitions) {
    State state = step.from;
    table.advance(state, step.to, [] { return kOp; });
    CHECK(state == step.to);
    CHECK(step.from != step.to);
  }
  for (size_t from = 0; from < Table::kStates; ++from) {
    for (size_t to = 0; to < Table::kStates; ++to) {
      if (table.allows(State(from), State(to))) continue;
      State state = State(from);
      CHECK(throwsError([&] { table.advance(state, State(to), [] { return kOp; }); },
                        concat(kOp, ": its ", table.machine, " cannot go from ",
                               table.name(State(from)), " to ", table.name(State(to)))));
      CHECK(state == State(from));
    }
  }
}

// No step twice, no two states of one name; every state reachable from an entry, and every
// state that is not an end can reach one.
template <typename Table>
void checkShape(const Table& table) {
  using State = StateOf<Table>;
  std::set<std::pair<size_t, size_t>> steps;
  for (const auto& step : table.transitions) {
    CHECK(steps.insert({size_t(step.from), size_t(step.to)}).second);
  }
  std::set<std::string> names(std::begin(table.names), std::end(table.names));
  CHECK(names.size() == Table::kStates);
  CHECK(table.entries >= 1 && table.entries < Table::kStates);
  std::vector<bool> reached(Table::kStates, false);
  for (size_t entry = 0; entry < table.entries; ++entry) reached[entry] = true;
  for (bool grew = true; grew;) {
    grew = false;
    for (const auto& step : table.transitions) {
      if (reached[size_t(step.from)] && !reached[size_t(step.to)]) {
        reached[size_t(step.to)] = grew = true;
      }
    }
  }
  for (size_t state = 0; state < Table::kStates; ++state) {
    if (!reached[state]) std::printf("  %s: %s unreachable\n", table.machine, table.names[state]);
    CHECK(reached[state]);
  }
  std::vector<bool> ends(Table::kStates, false);
  for (size_t state = 0; state < Table::kStates; ++state) {
    ends[state] = !hasExit(table, State(state));
  }
  for (bool grew = true; grew;) {
    grew = false;
    for (const auto& step : table.transitions) {
      if (ends[size_t(step.to)] && !ends[size_t(step.from)]) ends[size_t(step.from)] = grew = true;
    }
  }
  for (size_t state = 0; state < Table::kStates; ++state) CHECK(ends[state]);
  // An entry is never an end: a transfer that starts has something to wait for.
  for (size_t entry = 0; entry < table.entries; ++entry) CHECK(hasExit(table, State(entry)));
}

template <typename Table>
void checkTable(const Table& table) {
  checkSteps(table);
  checkShape(table);
}

// What an event does to a transfer in a state: where the table must let it go (`to`), or
// `stays` (the protocol leaves it where it is: a queued copy cannot be taken back).
template <typename State>
struct Outcome {
  State from;
  const char* event;
  State to;
  bool stays;
};

template <typename Table>
void checkOutcomes(const Table& table, const std::vector<Outcome<StateOf<Table>>>& outcomes) {
  for (const auto& outcome : outcomes) {
    const bool allowed = table.allows(outcome.from, outcome.to);
    if (outcome.stays) {
      CHECK(hasExit(table, outcome.from));  // it still ends some other way
    } else if (!allowed) {
      std::printf("  %s: %s at %s may not go to %s\n", table.machine, outcome.event,
                  table.name(outcome.from), table.name(outcome.to));
    }
    CHECK(outcome.stays || allowed);
  }
}

TEST(directSendStates, "copy engine states: a direct send's table") {
  checkTable(kDirectSendStates);
  using S = DirectSendState;
  checkOutcomes(kDirectSendStates,
                {{S::kCleared, "queuing fails", S::kGaveUp, false},
                 {S::kQueued, "cancel", S::kUnparked, false},
                 {S::kQueued, "peer failed", S::kUnparked, false},
                 {S::kQueued, "device failed", S::kFailed, false},
                 {S::kUnparked, "cancel", S::kUnparked, true},
                 {S::kUnparked, "peer failed", S::kUnparked, true},
                 {S::kUnparked, "device failed", S::kFailed, false},
                 {S::kUnparked, "copied", S::kLanded, false}});
  // Nothing lands that was never queued.
  CHECK(!kDirectSendStates.allows(S::kCleared, S::kLanded));
}

TEST(directRecvStates, "copy engine states: a direct recv's table") {
  checkTable(kDirectRecvStates);
  using S = DirectRecvState;
  checkOutcomes(kDirectRecvStates, {{S::kArmed, "cancel", S::kArmed, true},
                                    {S::kArmed, "sender gave up", S::kAbandoned, false},
                                    {S::kArmed, "peer failed", S::kAbandoned, false},
                                    {S::kArmed, "staging notice", S::kStaged, false},
                                    {S::kArmed, "copy out fails", S::kAbandoned, false}});
}

TEST(stagedSendStates, "copy engine states: a staged send's table") {
  checkTable(kStagedSendStates);
  using S = StagedSendState;
  checkOutcomes(kStagedSendStates, {{S::kHeld, "cancel", S::kCancelled, false},
                                    {S::kHeld, "peer failed", S::kPeerFailed, false},
                                    {S::kHeld, "queuing fails", S::kFailed, false},
                                    {S::kHeld, "receiver ready", S::kDirect, false},
                                    {S::kQueued, "cancel", S::kQueued, true},
                                    {S::kQueued, "peer failed", S::kQueued, true},
                                    {S::kQueued, "device failed", S::kFailed, false}});
  // Once handed to the direct protocol it is that protocol's.
  CHECK(!hasExit(kStagedSendStates, S::kDirect));
}

TEST(stagedRecvStates, "copy engine states: a staged recv's table") {
  checkTable(kStagedRecvStates);
  using S = StagedRecvState;
  checkOutcomes(kStagedRecvStates, {{S::kCopyingOut, "cancel", S::kCopyingOut, true},
                                    {S::kCopyingOut, "sender gave up", S::kCopyingOut, true},
                                    {S::kCopyingOut, "peer failed", S::kCopyingOut, true}});
}

TEST(eagerSendStates, "copy engine states: an eager send's table") {
  checkTable(kEagerSendStates);
  using S = EagerSendState;
  checkOutcomes(kEagerSendStates,
                {{S::kHeld, "cancel", S::kAbandoned, false},
                 {S::kHeld, "peer failed", S::kAbandoned, false},
                 {S::kHeld, "op ended or filling fails", S::kUnfilled, false},
                 {S::kHeldCleared, "cancel", S::kAbandoned, false},
                 {S::kHeldCleared, "peer failed", S::kAbandoned, false},
                 {S::kHeldCleared, "op ended or filling fails", S::kUnfilled, false},
                 {S::kHeldCleared, "slot emptied", S::kQueuedCleared, false},
                 {S::kQueued, "cancel", S::kQueued, true},
                 {S::kQueued, "peer failed", S::kQueued, true},
                 {S::kQueued, "device failed", S::kEnded, false},
                 {S::kQueuedCleared, "cancel", S::kQueuedCleared, true},
                 {S::kQueuedCleared, "device failed", S::kEnded, false}});
  // A clearance never un-clears, and a cleared send does not wait for another.
  CHECK(!kEagerSendStates.allows(S::kQueuedCleared, S::kQueued));
  CHECK(!kEagerSendStates.allows(S::kQueuedCleared, S::kLanded));
  CHECK(!kEagerSendStates.allows(S::kHeldCleared, S::kQueued));
}

TEST(eagerRecvStates, "copy engine states: an eager recv's table") {
  checkTable(kEagerRecvStates);
  using S = EagerRecvState;
  checkOutcomes(kEagerRecvStates,
                {{S::kHeld, "op ended before the slot filled", S::kGivenUp, false},
                 {S::kHeld, "copy out fails", S::kGivenUp, false},
                 {S::kHeld, "cancel", S::kHeld, true},
                 {S::kCopyingOut, "cancel", S::kCopyingOut, true},
                 {S::kCallerCopiesOut, "op failed first", S::kCallerCopied, false}});
  // Given up, its `done` word can only say so.
  CHECK(!kEagerRecvStates.allows(S::kGivenUp, S::kCopied));
}

TEST(collectiveStates, "copy engine states: a collective lane piece's table") {
  checkTable(kCollectiveStates);
  using S = CollectiveState;
  checkOutcomes(kCollectiveStates,
                {{S::kMoving, "partner failed, posted first", S::kAbandoned, false},
                 {S::kMoving, "partner failed, posted second", S::kReleased, false},
                 {S::kMoving, "cancel", S::kMoving, true},
                 {S::kReleased, "partner failed again", S::kReleased, true}});
  CHECK(!kCollectiveStates.allows(S::kReleased, S::kAbandoned));
}

}  // namespace
