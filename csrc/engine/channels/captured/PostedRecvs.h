#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcExport.h"

namespace smfree::engine {

// What a captured recv tells its sender at its post (a ChannelNotice), so that a send posted
// after it can copy straight into the recv's buffer, one copy-engine hop, instead of through a
// slot of its own: where the buffer is, what it holds, and the receiver's two words of that
// handshake (CapturedChannel.h).
struct PostedRecv {
  uint64_t group = 0;
  int32_t tag = 0;
  uint64_t seq = 0;  // the recv's place in its captured line
  uint64_t bytes = 0;
  std::string dtype;
  cuda::Flag ready;    // 1 once the receiver's replay has reached the recv: the buffer is free
  cuda::Flag arrived;  // 1 once the sender's copy has landed
  cuda::IpcExport buffer;

  void appendTo(std::string& out) const;
  // The longest dtype name a notice may carry.
  static constexpr uint32_t kMaxDtypeBytes = 64;
  // Throws BadPeerValue (PeerValue.h) on malformed bytes or a word out of the flag segment.
  static PostedRecv read(const std::string& data);
};

// The sender's side: the captured recvs its peers have posted, kept until the send of the same
// place in the line takes one (or passes it).
class PostedRecvs {
 public:
  struct Entry {
    PostedRecv recv;
    std::shared_ptr<cuda::OwnedFd> ownerPidfd;  // to map the buffer (kShareable exports)
    std::shared_ptr<cuda::RemoteFlagSegment> words;  // the receiver's, registered with CUDA
  };

  // Notices one peer may have kept here, not yet taken by a send.
  static constexpr size_t kMaxPerPeer = size_t{1} << 16;

  // Progress thread: a notice from `peer` (its process key). Throws BadPeerValue, keeping
  // nothing, where the peer has kMaxPerPeer notices kept.
  void add(const std::string& peer, Entry entry);
  // Caller's thread, at a captured send's post: the posted recv that the send meets (its
  // group, peer and tag, its place `seq`), waiting up to `patience` for its notice. Forgets
  // the line's notices up to `seq`: a send that did not take one went through its slot.
  std::optional<Entry> take(const std::string& peer, uint64_t group, int32_t tag, uint64_t seq,
                            std::chrono::microseconds patience);
  // The peer is gone: its notices with it.
  void dropPeer(const std::string& peer);

 private:
  using Line = std::tuple<std::string, uint64_t, int32_t>;  // (peer, group, tag)

  std::mutex mutex_;
  std::condition_variable added_;
  std::map<Line, std::map<uint64_t, Entry>> lines_;
  std::map<std::string, size_t> perPeer_;  // of lines_' notices
};

}  // namespace smfree::engine
