#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "engine/Status.h"
#include "engine/TensorDesc.h"

namespace smfree::engine {

// Which data channel an op uses; both sides of a pair must agree (SMFREE_CHANNEL). Same-host
// CUDA ops posted while their stream captures a CUDA graph take the captured channel. Ops to
// the rank itself take the loopback channel, whose ops never meet a peer: it is never on the
// wire (known() refuses it there).
enum class ChannelKind : uint8_t { kUcx = 0, kCopyEngine = 1, kCaptured = 2, kLoopback = 3 };

// Control messages between engines. A send is announced to its receiver, which matches it
// in posting order and either clears it (the channel then moves the bytes) or refuses it.
//
// Each message lists its fields once, in wire order, in `fields`: Wire.cpp's one encoder and
// one decoder walk that list (a field is a fixed-size number, enum or bool, a string, a
// TensorDesc, or a vector of numbers). A message's type on the wire is its place in
// ControlMessage, from 1: new messages go at the end of the variant.
struct ReadyToSend {
  uint64_t group = 0;
  int32_t source = 0;  // sender's rank in the group
  int32_t tag = 0;
  uint64_t seq = 0;    // per (group, sender, receiver, tag), from 0
  uint64_t sendId = 0;
  TensorDesc desc;
  ChannelKind channel = ChannelKind::kUcx;
  // A staged CUDA send (CallerStaging) whose copies out are queued, and whose process moves
  // its bytes without any CUDA call on a thread that could stall: its receiver may queue its
  // copies in to wait for them on the GPU.
  bool promised = false;
  // What the sender's channel tells the receiver's with the announcement (Channel::announce):
  // the copy engines' eager slot that already holds the bytes; empty for most sends.
  std::string channelData;

  static constexpr const char* kName = "ready-to-send";
  template <class Self, class Visitor>  // Self: this message, const or not
  static void fields(Self& m, Visitor&& visit) {
    visit(m.group, m.source, m.tag, m.seq, m.sendId, m.desc, m.channel, m.promised,
          m.channelData);
  }
};

struct ClearToSend {
  uint64_t group = 0;
  int32_t receiver = 0;  // receiver's rank in the group
  uint64_t sendId = 0;
  uint64_t recvId = 0;
  std::string channelData;  // what the channel needs to reach the receive buffer

  static constexpr const char* kName = "clear-to-send";
  template <class Self, class Visitor>  // Self: this message, const or not
  static void fields(Self& m, Visitor&& visit) {
    visit(m.group, m.receiver, m.sendId, m.recvId, m.channelData);
  }
};

// The receiver will not take this send: mismatch, or its recv already failed.
struct Refusal {
  uint64_t group = 0;
  int32_t receiver = 0;
  uint64_t sendId = 0;
  StatusCode code = StatusCode::kMismatch;
  std::string reason;

  static constexpr const char* kName = "refusal";
  template <class Self, class Visitor>  // Self: this message, const or not
  static void fields(Self& m, Visitor&& visit) {
    visit(m.group, m.receiver, m.sendId, m.code, m.reason);
  }
};

// The sender gave up on a send (timeout): fail the recv that matches or matched it.
struct Cancellation {
  uint64_t group = 0;
  int32_t source = 0;
  int32_t tag = 0;
  uint64_t seq = 0;
  uint64_t recvId = 0;  // 0 while the sender has not been cleared
  std::string reason;
  ChannelKind channel = ChannelKind::kUcx;  // the send's: captured sends have lines of their own

  static constexpr const char* kName = "cancellation";
  template <class Self, class Visitor>  // Self: this message, const or not
  static void fields(Self& m, Visitor&& visit) {
    visit(m.group, m.source, m.tag, m.seq, m.recvId, m.reason, m.channel);
  }
};

// The owner freed or unmapped CUDA memory it had exported to the receiver (buffer ids of
// allocations, block ids of chunks): the receiver closes its mappings, which hold the memory.
struct MemoryReleased {
  std::string owner;  // the owner's process key
  std::vector<uint64_t> ids;

  static constexpr const char* kName = "memory-released";
  template <class Self, class Visitor>  // Self: this message, const or not
  static void fields(Self& m, Visitor&& visit) {
    visit(m.owner, m.ids);
  }
};

// What one side's data channel tells its peer's about a transfer (the copy engines: which
// staging slot a send was copied into; captured recvs: where their buffer is, before any send
// of theirs is posted). Opaque to the engine, which hands it to `channel`.
struct ChannelNotice {
  std::string sender;  // the process key of the side that sends the notice
  ChannelKind channel = ChannelKind::kCopyEngine;
  std::string data;

  static constexpr const char* kName = "channel notice";
  template <class Self, class Visitor>  // Self: this message, const or not
  static void fields(Self& m, Visitor&& visit) {
    visit(m.sender, m.channel, m.data);
  }
};

// Asks a peer on another host whether its engine is still there: ops wait on it and nothing
// has come from it for a while. The peer answers with a probe marked `answer`. An op that
// times out waiting on a peer that neither answers nor sends is reported as cut off from it
// (PeerTable::silence), not as unmatched.
struct Probe {
  std::string sender;  // the sender's process key
  bool answer = false;

  static constexpr const char* kName = "probe";
  template <class Self, class Visitor>  // Self: this message, const or not
  static void fields(Self& m, Visitor&& visit) {
    visit(m.sender, m.answer);
  }
};

using ControlMessage = std::variant<ReadyToSend, ClearToSend, Refusal, Cancellation,
                                    MemoryReleased, ChannelNotice, Probe>;

std::vector<uint8_t> encode(const ControlMessage& message);
// The one parser of control messages. Throws BadPeerValue (PeerValue.h) on a truncated or
// unknown message, bytes past its last field, an unknown enum value, a negative rank or a
// refusal that says ok.
ControlMessage decode(const void* data, size_t length);

}  // namespace smfree::engine
