#include <cstring>

#include "engine/Error.h"
#include "engine/PeerValue.h"
#include "engine/channels/captured/CapturedOp.h"

namespace smfree::engine {
namespace {

struct AnnouncementHeader {
  CapturedWay way;
  cuda::Flag full;
  cuda::Flag empty;
};

}  // namespace

void CapturedAnnouncement::appendTo(std::string& out) const {
  const AnnouncementHeader header{way, slot.full, slot.empty};
  out.append(reinterpret_cast<const char*>(&header), sizeof(header));
  if (way == CapturedWay::kSlot) slot.memory.appendTo(out);
}

CapturedAnnouncement CapturedAnnouncement::read(const std::string& data) {
  constexpr const char* kMessage = "captured send announcement";
  AnnouncementHeader header{};
  if (data.size() < sizeof(header)) {
    badPeerValue(kMessage, "length", data.size(), " B, shorter than its ", sizeof(header),
                 " B header");
  }
  std::memcpy(&header, data.data(), sizeof(header));
  CapturedAnnouncement announced;
  announced.way = header.way;
  if (header.way == CapturedWay::kDirect && data.size() == sizeof(header)) return announced;
  if (header.way != CapturedWay::kSlot || data.size() == sizeof(header)) {
    badPeerValue(kMessage, "way", static_cast<uint32_t>(header.way), " in ", data.size(), " B");
  }
  checkFlag(kMessage, "full flag index", header.full);
  checkFlag(kMessage, "empty flag index", header.empty);
  announced.slot.full = header.full;
  announced.slot.empty = header.empty;
  announced.slot.memory =
      cuda::IpcExport::read(data.data() + sizeof(header), data.size() - sizeof(header));
  if (announced.slot.memory.kind != cuda::IpcExport::Kind::kIpcHandle) {
    badPeerValue(kMessage, "export kind", "its slot is not exported as an IPC handle");
  }
  return announced;
}

}  // namespace smfree::engine
