#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "engine/Channel.h"
#include "engine/Config.h"
#include "engine/Failures.h"
#include "engine/Op.h"
#include "engine/PeerAddress.h"
#include "engine/Spin.h"

namespace smfree::engine {

// The engine as its groups reach it (Group), implemented by Engine: Group depends on this,
// not on Engine, which creates groups. Any thread.
class GroupEngine {
 public:
  virtual ~GroupEngine() = default;

  virtual const Config& config() const = 0;
  virtual const Spin& spin() const = 0;
  virtual const PeerAddress& localAddress() const = 0;
  virtual Failures& failures() = 0;
  // The channel of that kind, for prepare() on the caller's thread.
  virtual Channel& channel(ChannelKind kind) = 0;
  virtual uint64_t nextOpId() = 0;

  // Connects the group's `rank` at `address`; returns how CUDA ops toward it are prepared.
  virtual PeerRoute connect(uint64_t groupId, int rank, const PeerAddress& address,
                            std::chrono::milliseconds timeout) = 0;
  // Hands a prepared op to the progress thread, which starts it.
  virtual void post(std::shared_ptr<Op> op) = 0;
  // Waits, until `deadline` at most, for the ops whose wait() returned before they ended
  // (ChannelOp::outlivesWait) to finish: of one group, or of all.
  virtual void awaitReleasedOps(std::optional<uint64_t> groupId, Clock::time_point deadline) = 0;
  virtual void closeGroup(uint64_t groupId, StatusCode code, const std::string& reason) = 0;
  virtual std::string dumpPending(uint64_t groupId) = 0;
  virtual std::map<std::string, int64_t> stats() = 0;
};

}  // namespace smfree::engine
