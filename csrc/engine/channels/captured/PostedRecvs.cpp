#include "engine/channels/captured/PostedRecvs.h"

#include <cstring>
#include <utility>

#include "engine/Error.h"

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
  Header header{};
  if (data.size() < sizeof(header)) fail("malformed captured recv notice: ", data.size(), " B");
  std::memcpy(&header, data.data(), sizeof(header));
  if (data.size() <= sizeof(header) + header.dtypeBytes) {
    fail("malformed captured recv notice: ", data.size(), " B with a dtype of ",
         header.dtypeBytes, " B");
  }
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
    const Line line{peer, entry.recv.group, entry.recv.tag};
    const uint64_t seq = entry.recv.seq;
    lines_[line].insert_or_assign(seq, std::move(entry));
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
  notices.erase(notices.begin(), notices.upper_bound(seq));
  if (notices.empty()) lines_.erase(it);
  return found;
}

void PostedRecvs::dropPeer(const std::string& peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = lines_.begin(); it != lines_.end();) {
    it = std::get<0>(it->first) == peer ? lines_.erase(it) : std::next(it);
  }
}

}  // namespace smfree::engine
