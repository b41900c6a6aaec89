#include "engine/channels/copy_engine/ChannelData.h"

namespace smfree::engine {
namespace {

template <typename T>
T readStruct(const std::string& data, const char* message) {
  const std::optional<T> value = fromBytes<T>(data);
  if (!value) badPeerValue(message, "length", data.size(), " B, expected ", sizeof(T), " B");
  return *value;
}

}  // namespace

ClearanceData readClearance(const std::string& data) {
  constexpr const char* kMessage = "clear-to-send's channel data";
  ClearanceData clearance;
  if (data.size() < sizeof(ClearanceHeader)) {
    badPeerValue(kMessage, "length", data.size(), " B, shorter than its ",
                 sizeof(ClearanceHeader), " B header");
  }
  std::memcpy(&clearance.header, data.data(), sizeof(ClearanceHeader));
  const ClearanceHeader& header = clearance.header;
  const size_t expected = sizeof(ClearanceHeader) + size_t{header.destinationBytes} +
                          size_t{header.ringBytes} + size_t{header.eagerRingBytes};
  if (data.size() != expected) {
    badPeerValue(kMessage, "length", data.size(), " B, its header says ", expected, " B");
  }
  checkFlag(kMessage, "ready flag index", header.ready);
  checkFlag(kMessage, "queued flag index", header.queued);
  checkFlag(kMessage, "done flag index", header.done);
  const char* at = data.data() + sizeof(ClearanceHeader);
  clearance.destination = cuda::IpcExport::read(at, header.destinationBytes);
  at += header.destinationBytes;
  if (header.ringBytes != 0) clearance.ring = RemoteStagingRing::read(at, header.ringBytes);
  at += header.ringBytes;
  if (header.eagerRingBytes != 0) {
    clearance.eagerRing = RemoteStagingRing::read(at, header.eagerRingBytes);
  }
  return clearance;
}

EagerNotice readEagerNotice(const std::string& data) {
  constexpr const char* kMessage = "eager announcement";
  const auto notice = readStruct<EagerNotice>(data, kMessage);
  checkBelow(kMessage, "slot", notice.slot, kEagerSlots);
  checkBelow(kMessage, "held", notice.held, 2);
  return notice;
}

StagedNotice readStagedNotice(const std::string& data) {
  constexpr const char* kMessage = "staging notice";
  const auto notice = readStruct<StagedNotice>(data, kMessage);
  checkBelow(kMessage, "slot", notice.slot, kStagingSlots);
  return notice;
}

}  // namespace smfree::engine
