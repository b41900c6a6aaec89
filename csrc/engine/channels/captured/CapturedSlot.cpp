#include <cstring>

#include "engine/Error.h"
#include "engine/channels/captured/CapturedOp.h"

namespace smfree::engine {
namespace {

struct SlotHeader {
  cuda::Flag full;
  cuda::Flag empty;
};

}  // namespace

void CapturedSlot::appendTo(std::string& out) const {
  const SlotHeader header{full, empty};
  out.append(reinterpret_cast<const char*>(&header), sizeof(header));
  memory.appendTo(out);
}

CapturedSlot CapturedSlot::read(const std::string& data) {
  SlotHeader header{};
  if (data.size() <= sizeof(header)) {
    fail("malformed captured slot: ", data.size(), " B");
  }
  std::memcpy(&header, data.data(), sizeof(header));
  CapturedSlot slot{header.full, header.empty,
                    cuda::IpcExport::read(data.data() + sizeof(header), data.size() - sizeof(header))};
  if (slot.memory.kind != cuda::IpcExport::Kind::kIpcHandle) {
    fail("malformed captured slot: its memory is not exported as an IPC handle");
  }
  return slot;
}

}  // namespace smfree::engine
