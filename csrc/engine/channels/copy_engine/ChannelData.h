#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "engine/PeerValue.h"
#include "engine/channels/copy_engine/StagingRing.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcExport.h"

namespace smfree::engine {

// The copy-engine channel's data in control messages (a clear-to-send's header, an eager
// announcement, a staging notice): fixed-layout structs, sent as their bytes between
// processes of one build on one host. Each kind has one reader here, which bounds every
// value in it (PeerValue.h).
template <typename T>
std::string toBytes(const T& value) {
  static_assert(std::is_trivially_copyable_v<T>);
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}

// The struct `data` holds; none if its size is not the struct's.
template <typename T>
std::optional<T> fromBytes(const std::string& data) {
  static_assert(std::is_trivially_copyable_v<T>);
  if (data.size() != sizeof(T)) return std::nullopt;
  T value;
  std::memcpy(&value, data.data(), sizeof(T));
  return value;
}

// The fixed part of the receiver's clear-to-send: its flags and op, then the sizes of the
// buffer's export, of its staging ring and of its eager ring (0 when none), which follow.
struct ClearanceHeader {
  cuda::Flag ready;
  cuda::Flag queued;
  cuda::Flag done;
  uint64_t recvId;
  uint32_t destinationBytes;
  uint32_t ringBytes;
  uint32_t eagerRingBytes;
  uint32_t unused;
};

// A clear-to-send's channel data as read: the receive buffer's export, and the receiver's
// staging and eager rings where it sent them.
struct ClearanceData {
  ClearanceHeader header;
  cuda::IpcExport destination;
  std::shared_ptr<RemoteStagingRing> ring;       // none: null
  std::shared_ptr<RemoteStagingRing> eagerRing;  // none: null
};

// An eager send's announcement data: which slot of its lane's ring holds it, and whether its
// copy was held at the post (the slot still full).
struct EagerNotice {
  int32_t ringDevice;
  uint32_t slot;
  uint32_t use;
  uint32_t held;
};

// A sender's ChannelNotice: which slot of the receiver's ring a send was copied into.
struct StagedNotice {
  uint64_t recvId;
  int32_t ringDevice;
  uint32_t slot;
  uint32_t use;
  uint32_t unused;
};

// Each throws BadPeerValue naming the field out of bounds: a size that is not the struct's (or
// the header's sum), a flag index past the flag segment, a slot past its ring's.
ClearanceData readClearance(const std::string& data);
EagerNotice readEagerNotice(const std::string& data);
StagedNotice readStagedNotice(const std::string& data);

}  // namespace smfree::engine
