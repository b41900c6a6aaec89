#pragma once

#include <cstddef>

#include "engine/Error.h"

namespace smfree::engine {

// One step of a copy-engine protocol's state machine; `when` says what takes it.
template <typename State>
struct Transition {
  State from;
  State to;
  const char* when;
};

// A protocol's transfer states and every transition between them, in one table (the model is
// tensorpipe's channel boilerplate). A transfer starts in one of the first `entries` states; a
// state with no transition out is where it ends. A step not in the table is a bug in the
// protocol: advance() throws rather than take it.
template <typename State, size_t States, size_t Transitions>
struct StateTable {
  const char* machine;  // the protocol's transfer, for errors: "direct send"
  size_t entries;
  const char* names[States];
  Transition<State> transitions[Transitions];

  static constexpr size_t kStates = States;

  constexpr bool allows(State from, State to) const {
    for (const Transition<State>& step : transitions) {
      if (step.from == from && step.to == to) return true;
    }
    return false;
  }
  const char* name(State state) const { return names[static_cast<size_t>(state)]; }

  // Takes `state` to `to`. `describe()` names the op, and is only called for the error.
  template <typename Describe>
  void advance(State& state, State to, const Describe& describe) const {
    if (!allows(state, to)) {
      fail(describe(), ": its ", machine, " cannot go from ", name(state), " to ", name(to),
           " (not in the protocol's state table)");
    }
    state = to;
  }

  // Every entry filled in: a table whose size overstates its entries fails to compile.
  constexpr bool complete() const {
    for (const char* text : names) {
      if (text == nullptr) return false;
    }
    for (const Transition<State>& step : transitions) {
      if (step.when == nullptr) return false;
    }
    return true;
  }
};

}  // namespace smfree::engine
