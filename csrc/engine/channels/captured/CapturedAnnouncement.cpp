#include <cstring>

#include "engine/Error.h"
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
  AnnouncementHeader header{};
  if (data.size() < sizeof(header)) {
    fail("malformed captured send announcement: ", data.size(), " B");
  }
  std::memcpy(&header, data.data(), sizeof(header));
  CapturedAnnouncement announced;
  announced.way = header.way;
  if (header.way == CapturedWay::kDirect && data.size() == sizeof(header)) return announced;
  if (header.way != CapturedWay::kSlot || data.size() == sizeof(header)) {
    fail("malformed captured send announcement: way ", static_cast<uint32_t>(header.way), ", ",
         data.size(), " B");
  }
  announced.slot.full = header.full;
  announced.slot.empty = header.empty;
  announced.slot.memory =
      cuda::IpcExport::read(data.data() + sizeof(header), data.size() - sizeof(header));
  if (announced.slot.memory.kind != cuda::IpcExport::Kind::kIpcHandle) {
    fail("malformed captured slot: its memory is not exported as an IPC handle");
  }
  return announced;
}

}  // namespace smfree::engine
