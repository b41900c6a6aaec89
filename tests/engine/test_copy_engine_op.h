#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/channels/copy_engine/CopyEngineOp.h"

#include "check.h"

namespace smfree::engine::testing {

// An op's copy-engine part for tests that drive the protocols without the channel: it holds the
// op's CopyEngineOp, as the channel's part does. Its steps are the channel's, which these tests
// do not build: calling one is the test's bug.
class TestCopyEngineOp final : public CopyEngineOpHolder {
 public:
  explicit TestCopyEngineOp(CopyEngineOp&& state)
      : CopyEngineOpHolder(OpTraits{.callsCudaOnProgressThread = true}, std::move(state)) {}

  bool queued() override { notHere(); }
  void waitOnStream(void*, int) override { notHere(); }
  ChannelAnnouncement announce(const std::shared_ptr<Op>&, Peer&) override { notHere(); }
  std::string arm(const std::shared_ptr<Op>&, Peer&, const std::string&) override { notHere(); }
  void start(const std::shared_ptr<Op>&, Peer&, const std::string&, bool) override { notHere(); }
  void cancel(Op&, Cancel) override { notHere(); }
  void end(Op&, const Status&) override { notHere(); }
  void release(Op&) override { notHere(); }
  std::string describe(const Op&) const override { notHere(); }
  bool outlivesWait(const Op&) const override { notHere(); }

 private:
  [[noreturn]] static void notHere() {
    throw std::logic_error("a copy-engine channel step called in a protocol test");
  }
};

// The ends a protocol told (CopyEngineContext's Done), in order.
using Ends = std::vector<std::pair<std::shared_ptr<Op>, Status>>;

// How `op` ended among `ended`, once; null if it has not.
inline const Status* endOf(const Ends& ended, const Op& op) {
  const Status* found = nullptr;
  for (const auto& [end, status] : ended) {
    if (end.get() != &op) continue;
    CHECK(!found);
    found = &status;
  }
  return found;
}

}  // namespace smfree::engine::testing
