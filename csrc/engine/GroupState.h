#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/GroupConfig.h"
#include "engine/Matcher.h"

namespace smfree::engine {

struct Peer;

// A group as the progress thread sees it.
struct GroupState {
  std::shared_ptr<const GroupConfig> config;
  uint64_t id = 0;
  // Ops captured in CUDA graphs match only one another: each kind has lines of its own, so a
  // graph's messages never mix with those of ordinary ops to the same peer and tag.
  Matcher matcher;
  Matcher capturedMatcher;
  std::vector<Peer*> peers;                     // by group rank; null until connected
  bool closed = false;
  std::string closeReason;

  Matcher& matcherFor(ChannelKind channel) {
    return channel == ChannelKind::kCaptured ? capturedMatcher : matcher;
  }
};

}  // namespace smfree::engine
