#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "engine/Op.h"
#include "engine/Wire.h"

namespace smfree::engine {

// A send the receiver has heard of but not yet paired with a recv.
struct Announcement {
  ReadyToSend rts;
  uint64_t arrival = 0;  // order of release, to serve any-source recvs oldest first
  bool cancelled = false;
  std::string cancelReason;
};

// Pairs announced sends with posted recvs of one group: in posting order per (source, tag),
// any-source recvs in their posting order among the rest. Announcements may arrive out of
// order; each (source, tag) stream is released strictly by sequence number.
class Matcher {
 public:
  struct Match {
    std::shared_ptr<Op> recv;
    Announcement announcement;
  };

  // Announcements one source may have waiting (early or released, not matched): a sender
  // that posts this many sends before its receiver posts their recvs has its ops failed.
  static constexpr size_t kMaxWaitingPerSource = size_t{1} << 16;

  std::optional<Match> postRecv(std::shared_ptr<Op> recv);
  // Throws BadPeerValue, queuing nothing, for a sequence number already released or where the
  // source has kMaxWaitingPerSource announcements waiting.
  std::vector<Match> announce(ReadyToSend rts);
  // Marks a not yet matched announcement as given up by its sender; false if none is waiting.
  bool cancel(int source, int tag, uint64_t seq, const std::string& reason);

  void forEachWaiting(const std::function<void(const Announcement&)>& visit) const;
  // Drops everything; returns the recvs that were still posted.
  std::vector<std::shared_ptr<Op>> clear();

 private:
  using StreamKey = std::pair<int, int>;  // (source, tag)

  struct Stream {
    uint64_t nextSeq = 0;
    std::map<uint64_t, ReadyToSend> early;  // arrived ahead of nextSeq
    std::deque<Announcement> waiting;       // released, not matched
    std::deque<std::shared_ptr<Op>> posted; // recvs from this source, not matched
  };

  std::optional<Match> release(Stream& stream, ReadyToSend rts);

  std::map<StreamKey, Stream> streams_;
  std::map<int, std::deque<std::shared_ptr<Op>>> anySource_;  // by tag
  std::map<int, size_t> waitingFrom_;  // by source: announcements early or waiting
  uint64_t arrivals_ = 0;
};

}  // namespace smfree::engine
