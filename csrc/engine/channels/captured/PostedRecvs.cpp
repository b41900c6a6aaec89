#include "engine/channels/captured/PostedRecvs.h"

#include <cstring>
#include <utility>

#include "engine/Error.h"
#include "engine/PeerValue.h"

namespace smfree::engine {
namespace {

// The fixed part of a posted recv's notice; its dtype's name, then its buffer's export, follow.
struct Header {
  uint64_t group;
  int32_t tag;
  uint32_t dtypeBytes;
  uint64_t seq;
  uint64_t bytes;
  cuda::Flag ready;
  cuda::Flag arrived;
};

}  // namespace

void PostedRecv::appendTo(std::string& out) const {
  const Header header{group, tag, static_cast<uint32_t>(dtype.size()), seq, bytes, ready,
                      arrived};
  out.append(reinterpret_cast<const char*>(&header), sizeof(header));
  out.append(dtype);
  buffer.appendTo(out);
}

PostedRecv PostedRecv::read(const std::string& data) {
  constexpr const char* kMessage = "captured recv notice";
  Header header{};
  if (data.size() < sizeof(header)) {
    badPeerValue(kMessage, "length", data.size(), " B, shorter than its ", sizeof(header),
                 " B header");
  }
  std::memcpy(&header, data.data(), sizeof(header));
  checkBelow(kMessage, "dtype length", header.dtypeBytes, kMaxDtypeBytes + 1);
  if (data.size() <= sizeof(header) + header.dtypeBytes) {
    badPeerValue(kMessage, "length", data.size(), " B with a dtype of ", header.dtypeBytes,
                 " B and no buffer export");
  }
  checkFlag(kMessage, "ready flag index", header.ready);
  checkFlag(kMessage, "arrived flag index", header.arrived);
  const char* at = data.data() + sizeof(header);
  PostedRecv recv;
  recv.group = header.group;
  recv.tag = header.tag;
  recv.seq = header.seq;
  recv.bytes = header.bytes;
  recv.dtype.assign(at, header.dtypeBytes);
  recv.ready = header.ready;
  recv.arrived = header.arrived;
  recv.buffer = cuda::IpcExport::read(at + header.dtypeBytes,
                                      data.size() - sizeof(header) - header.dtypeBytes);
  return recv;
}

void PostedRecvs::add(const std::string& peer, Entry entry) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t& kept = perPeer_[peer];
    if (kept >= kMaxPerPeer) {
      badPeerValue("captured recv notice", "number of notices", peer, " has ", kept,
                   " captured recv notices no send has taken, the most one peer may");
    }
    const Line line{peer, entry.recv.group, entry.recv.tag};
    const uint64_t seq = entry.recv.seq;
    kept += lines_[line].insert_or_assign(seq, std::move(entry)).second ? 1 : 0;
  }
  added_.notify_all();
}

std::optional<PostedRecvs::Entry> PostedRecvs::take(const std::string& peer, uint64_t group,
                                                    int32_t tag, uint64_t seq,
                                                    std::chrono::microseconds patience) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  const Line line{peer, group, tag};
  std::unique_lock<std::mutex> lock(mutex_);
  std::optional<Entry> found;
  added_.wait_until(lock, deadline, [&] {
    const auto it = lines_.find(line);
    return it != lines_.end() && it->second.count(seq) != 0;
  });
  const auto it = lines_.find(line);
  if (it == lines_.end()) return found;
  auto& notices = it->second;
  if (const auto mine = notices.find(seq); mine != notices.end()) found = std::move(mine->second);
  const auto past = notices.upper_bound(seq);
  perPeer_[peer] -= static_cast<size_t>(std::distance(notices.begin(), past));
  notices.erase(notices.begin(), past);
  if (notices.empty()) lines_.erase(it);
  return found;
}

void PostedRecvs::dropPeer(const std::string& peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = lines_.begin(); it != lines_.end();) {
    it = std::get<0>(it->first) == peer ? lines_.erase(it) : std::next(it);
  }
  perPeer_.erase(peer);
}

}  // namespace smfree::engine
