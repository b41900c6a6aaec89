#include "engine/Matcher.h"

#include "engine/PeerValue.h"

namespace smfree::engine {

std::optional<Matcher::Match> Matcher::postRecv(std::shared_ptr<Op> recv) {
  const int tag = recv->request.tag;
  if (recv->request.peer != kAnySource) {
    Stream& stream = streams_[{recv->request.peer, tag}];
    if (!stream.waiting.empty()) {
      Match match{std::move(recv), std::move(stream.waiting.front())};
      stream.waiting.pop_front();
      --waitingFrom_[match.announcement.rts.source];
      return match;
    }
    stream.posted.push_back(std::move(recv));
    return std::nullopt;
  }
  // Any source: the oldest waiting announcement with this tag, from whichever source.
  Stream* oldest = nullptr;
  for (auto& [key, stream] : streams_) {
    if (key.second == tag && !stream.waiting.empty() &&
        (!oldest || stream.waiting.front().arrival < oldest->waiting.front().arrival)) {
      oldest = &stream;
    }
  }
  if (oldest) {
    Match match{std::move(recv), std::move(oldest->waiting.front())};
    oldest->waiting.pop_front();
    --waitingFrom_[match.announcement.rts.source];
    return match;
  }
  anySource_[tag].push_back(std::move(recv));
  return std::nullopt;
}

std::vector<Matcher::Match> Matcher::announce(ReadyToSend rts) {
  size_t& waiting = waitingFrom_[rts.source];
  if (waiting >= kMaxWaitingPerSource) {
    badPeerValue(rts.kName, "number of waiting announcements", "rank ", rts.source, " has ",
                 waiting, " sends announced that no recv has matched, the most one source may");
  }
  Stream& stream = streams_[{rts.source, rts.tag}];
  std::vector<Match> matches;
  if (rts.seq < stream.nextSeq || stream.early.count(rts.seq) != 0) {
    badPeerValue(rts.kName, "sequence number", rts.seq, " of rank ", rts.source, " tag ", rts.tag,
                 " was announced before (next expected: ", stream.nextSeq, ")");
  }
  if (rts.seq != stream.nextSeq) {
    stream.early.emplace(rts.seq, std::move(rts));
    ++waiting;
    return matches;
  }
  if (auto match = release(stream, std::move(rts))) {
    matches.push_back(std::move(*match));
  }
  for (auto next = stream.early.find(stream.nextSeq); next != stream.early.end();
       next = stream.early.find(stream.nextSeq)) {
    ReadyToSend ready = std::move(next->second);
    stream.early.erase(next);
    --waitingFrom_[ready.source];
    if (auto match = release(stream, std::move(ready))) {
      matches.push_back(std::move(*match));
    }
  }
  return matches;
}

std::optional<Matcher::Match> Matcher::release(Stream& stream, ReadyToSend rts) {
  ++stream.nextSeq;
  Announcement announcement;
  announcement.rts = std::move(rts);
  announcement.arrival = arrivals_++;
  auto any = anySource_.find(announcement.rts.tag);
  const bool haveSpecific = !stream.posted.empty();
  const bool haveAny = any != anySource_.end() && !any->second.empty();
  // Of the two candidate recvs, the one posted first wins (op ids grow with posting order).
  if (haveSpecific && (!haveAny || stream.posted.front()->id < any->second.front()->id)) {
    Match match{std::move(stream.posted.front()), std::move(announcement)};
    stream.posted.pop_front();
    return match;
  }
  if (haveAny) {
    Match match{std::move(any->second.front()), std::move(announcement)};
    any->second.pop_front();
    return match;
  }
  ++waitingFrom_[announcement.rts.source];
  stream.waiting.push_back(std::move(announcement));
  return std::nullopt;
}

bool Matcher::cancel(int source, int tag, uint64_t seq, const std::string& reason) {
  auto it = streams_.find({source, tag});
  if (it == streams_.end()) {
    return false;
  }
  for (Announcement& announcement : it->second.waiting) {
    if (announcement.rts.seq == seq) {
      announcement.cancelled = true;
      announcement.cancelReason = reason;
      return true;
    }
  }
  return false;
}

void Matcher::forEachWaiting(const std::function<void(const Announcement&)>& visit) const {
  for (const auto& [key, stream] : streams_) {
    for (const Announcement& announcement : stream.waiting) visit(announcement);
  }
}

std::vector<std::shared_ptr<Op>> Matcher::clear() {
  std::vector<std::shared_ptr<Op>> recvs;
  for (auto& [key, stream] : streams_) {
    for (auto& op : stream.posted) recvs.push_back(std::move(op));
  }
  for (auto& [tag, queue] : anySource_) {
    for (auto& op : queue) recvs.push_back(std::move(op));
  }
  streams_.clear();
  anySource_.clear();
  waitingFrom_.clear();
  return recvs;
}

}  // namespace smfree::engine
