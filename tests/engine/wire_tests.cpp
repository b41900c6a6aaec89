// The control messages' wire format: every message round-trips, the bytes stay as they were,
// and malformed bytes are refused by name.

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "engine/GroupState.h"
#include "engine/PeerValue.h"
#include "engine/Wire.h"

#include "check.h"

using namespace smfree::engine;

namespace {

ReadyToSend sampleReady() {
  ReadyToSend ready;
  ready.group = 0x1122334455667788ull;
  ready.source = 5;
  ready.tag = -2;
  ready.seq = 99;
  ready.sendId = 1234;
  ready.desc = TensorDesc{64, "bfloat16", "cuda", {4, 8}};
  ready.channel = ChannelKind::kCopyEngine;
  ready.promised = true;
  ready.channelData = std::string("\5\6", 2);
  return ready;
}

// One of each message, and its bytes as the wire carries them. A change to these bytes breaks
// engines of different builds talking to each other: it must be deliberate.
struct Sample {
  ControlMessage message;
  const char* hex;
};

std::vector<Sample> samples() {
  return {
      {sampleReady(),
       "01887766554433221105000000feffffff6300000000000000d2040000000000004000000000000000080000"
       "0062666c6f61743136040000006375646102000000040000000000000008000000000000000101"
       "020000000506"},
      {ClearToSend{7, 1, 55, 66, std::string("\0\1\2", 3)},
       "020700000000000000010000003700000000000000420000000000000003000000000102"},
      {Refusal{7, 1, 55, StatusCode::kTimeout, "sizes differ"},
       "030700000000000000010000003700000000000000020000000c00000073697a657320646966666572"},
      {Cancellation{7, 2, 3, 4, 5, "timed out", ChannelKind::kCaptured},
       "0407000000000000000200000003000000040000000000000005000000000000000900000074696d6564"
       "206f757402"},
      {MemoryReleased{"owner-key", {3, 1ull << 40}},
       "05090000006f776e65722d6b65790200000003000000000000000000000000010000"},
      {ChannelNotice{"sender-key", ChannelKind::kCaptured, std::string("\0\7", 2)},
       "060a00000073656e6465722d6b657902020000000007"},
      {Probe{"peer", true}, "07040000007065657201"},
  };
}

std::string hexOf(const std::vector<uint8_t>& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string hex;
  for (uint8_t byte : bytes) {
    hex += kDigits[byte >> 4];
    hex += kDigits[byte & 15];
  }
  return hex;
}

ControlMessage roundTrip(const ControlMessage& message) {
  const std::vector<uint8_t> bytes = encode(message);
  return decode(bytes.data(), bytes.size());
}

TEST(wireKeepsItsBytes, "wire: each message encodes to the same bytes as before") {
  for (const Sample& sample : samples()) {
    const std::string hex = hexOf(encode(sample.message));
    if (hex != sample.hex) std::printf("  message %zu: %s\n", sample.message.index(), hex.c_str());
    CHECK(hex == sample.hex);
  }
}

TEST(wireRoundTripsEveryMessage, "wire: every message round-trips, field by field") {
  for (const Sample& sample : samples()) {
    const ControlMessage back = roundTrip(sample.message);
    CHECK(back.index() == sample.message.index());
    CHECK(encode(back) == encode(sample.message));
  }
  CHECK(samples().size() == std::variant_size_v<ControlMessage>);

  const auto ready = std::get<ReadyToSend>(roundTrip(sampleReady()));
  CHECK(ready.group == 0x1122334455667788ull && ready.source == 5 && ready.tag == -2);
  CHECK(ready.seq == 99 && ready.sendId == 1234);
  CHECK(ready.desc.bytes == 64 && ready.desc.dtype == "bfloat16" && ready.desc.device == "cuda");
  CHECK((ready.desc.shape == std::vector<int64_t>{4, 8}));
  CHECK(ready.channel == ChannelKind::kCopyEngine && ready.promised);
  CHECK(ready.channelData == std::string("\5\6", 2));
  ReadyToSend unpromised = sampleReady();
  unpromised.promised = false;
  unpromised.channel = ChannelKind::kUcx;
  unpromised.desc.shape = {};
  const auto unpromisedBack = std::get<ReadyToSend>(roundTrip(unpromised));
  CHECK(!unpromisedBack.promised && unpromisedBack.channel == ChannelKind::kUcx);
  CHECK(unpromisedBack.desc.shape.empty());

  const auto clear = std::get<ClearToSend>(roundTrip(ClearToSend{7, 1, 55, 66, std::string("\0\1\2", 3)}));
  CHECK(clear.group == 7 && clear.receiver == 1 && clear.sendId == 55 && clear.recvId == 66);
  CHECK(clear.channelData == std::string("\0\1\2", 3));

  const auto refusal = std::get<Refusal>(roundTrip(Refusal{7, 1, 55, StatusCode::kPeerFailure, "gone"}));
  CHECK(refusal.group == 7 && refusal.receiver == 1 && refusal.sendId == 55);
  CHECK(refusal.code == StatusCode::kPeerFailure && refusal.reason == "gone");

  const auto cancellation = std::get<Cancellation>(
      roundTrip(Cancellation{7, 2, -3, 4, 5, "timed out", ChannelKind::kCaptured}));
  CHECK(cancellation.group == 7 && cancellation.source == 2 && cancellation.tag == -3);
  CHECK(cancellation.seq == 4 && cancellation.recvId == 5 && cancellation.reason == "timed out");
  CHECK(cancellation.channel == ChannelKind::kCaptured);
  ReadyToSend captured = sampleReady();
  captured.channel = ChannelKind::kCaptured;
  CHECK(std::get<ReadyToSend>(roundTrip(captured)).channel == ChannelKind::kCaptured);

  const auto released = std::get<MemoryReleased>(roundTrip(MemoryReleased{"owner-key", {3, 1ull << 40}}));
  CHECK(released.owner == "owner-key");
  CHECK((released.ids == std::vector<uint64_t>{3, 1ull << 40}));
  CHECK(std::get<MemoryReleased>(roundTrip(MemoryReleased{"", {}})).ids.empty());

  const auto notice = std::get<ChannelNotice>(
      roundTrip(ChannelNotice{"sender-key", ChannelKind::kCaptured, std::string("\0\7", 2)}));
  CHECK(notice.sender == "sender-key" && notice.channel == ChannelKind::kCaptured &&
        notice.data == std::string("\0\7", 2));

  const auto probe = std::get<Probe>(roundTrip(Probe{"sender-key", false}));
  CHECK(probe.sender == "sender-key" && !probe.answer);
  CHECK(std::get<Probe>(roundTrip(Probe{"k", true})).answer);
}

TEST(wireRejectsTruncatedMessages, "wire: every truncation of every message is refused") {
  for (const Sample& sample : samples()) {
    const std::vector<uint8_t> bytes = encode(sample.message);
    for (size_t length = 0; length < bytes.size(); ++length) {
      const bool refused = testing::throwsError([&] { decode(bytes.data(), length); },
                                       "bad length in a ");
      if (!refused) std::printf("  message %zu cut to %zu B\n", sample.message.index(), length);
      CHECK(refused);
    }
  }
  const std::vector<uint8_t> clear = encode(ClearToSend{7, 1, 55, 66, "payload"});
  CHECK(testing::throwsError([&] { decode(clear.data(), clear.size() - 3); },
                    "bad length in a clear-to-send: truncated at 37 B, needed 40 B"));
}

TEST(wireRejectsAHugeCountWithoutAllocating, "wire: a count past the message's end is refused") {
  std::vector<uint8_t> bytes = encode(MemoryReleased{"o", {1}});
  bytes[6] = 0xff;  // the ids' count, after the type byte and the 1-byte owner: 4 billion-odd
  bytes[7] = 0xff;
  bytes[8] = 0xff;
  bytes[9] = 0xff;
  CHECK(testing::throwsError([&] { decode(bytes.data(), bytes.size()); },
                    "bad length in a memory-released: truncated"));
}

TEST(wireRejectsAnUnknownType, "wire: an unknown message type is refused") {
  for (uint8_t type : {uint8_t{0}, uint8_t{8}, uint8_t{255}}) {
    std::vector<uint8_t> bytes = encode(ChannelNotice{"a", ChannelKind::kCopyEngine, "b"});
    bytes[0] = type;
    CHECK(testing::throwsError([&] { decode(bytes.data(), bytes.size()); },
                      "bad message type in a control message: unknown type " +
                          std::to_string(type) + " (known: 1 to 7)"));
  }
}

TEST(wireRejectsAnUnknownChannel, "wire: an unknown data channel is refused") {
  auto bytes = encode(sampleReady());
  // The channel: the byte before a ready-to-send's promise, which its 2-byte channel data
  // (after a 4-byte length) follows.
  bytes[bytes.size() - 8] = 7;
  CHECK(testing::throwsError([&] { decode(bytes.data(), bytes.size()); },
                    "bad data channel in a ready-to-send: unknown value 7"));
}

TEST(wireRejectsAnUnknownStatusCode, "wire: an unknown status code is refused") {
  auto bytes = encode(Refusal{7, 1, 55, StatusCode::kMismatch, ""});
  bytes[bytes.size() - 8] = 42;  // the code: 4 bytes before the reason's 4-byte length
  CHECK(testing::throwsError([&] { decode(bytes.data(), bytes.size()); },
                    "bad status code in a refusal: unknown value 42"));
}

TEST(wireRejectsTrailingBytes, "wire: a message with bytes past its last field is refused") {
  for (const Sample& sample : samples()) {
    std::vector<uint8_t> bytes = encode(sample.message);
    bytes.push_back(0);
    CHECK(testing::throwsError([&] { decode(bytes.data(), bytes.size()); }, "bad length in a "));
  }
  const std::vector<uint8_t> probe = [] {
    auto bytes = encode(Probe{"peer", true});
    bytes.insert(bytes.end(), {1, 2, 3});
    return bytes;
  }();
  CHECK(testing::throwsError([&] { decode(probe.data(), probe.size()); },
                             "bad length in a probe: 13 B, its fields end at 10 B"));
}

TEST(wireRejectsNegativeRanksAndAnOkRefusal,
     "wire: a negative rank, or a refusal that says ok, is refused naming the field") {
  ReadyToSend ready = sampleReady();
  ready.source = -1;
  const auto rts = encode(ready);
  CHECK(testing::throwsError([&] { decode(rts.data(), rts.size()); },
                             "bad source rank in a ready-to-send: -1 is out of bounds"));
  const auto clear = encode(ClearToSend{7, -5, 55, 66, ""});
  CHECK(testing::throwsError([&] { decode(clear.data(), clear.size()); },
                             "bad receiver rank in a clear-to-send: -5"));
  const auto refusal = encode(Refusal{7, 1, 55, StatusCode::kOk, "no"});
  CHECK(testing::throwsError([&] { decode(refusal.data(), refusal.size()); },
                             "bad status code in a refusal: a refusal says ok"));
  const auto cancel = encode(Cancellation{7, -2, 3, 4, 5, "x", ChannelKind::kUcx});
  CHECK(testing::throwsError([&] { decode(cancel.data(), cancel.size()); },
                             "bad source rank in a cancellation: -2"));
  try {
    decode(clear.data(), clear.size());
  } catch (const BadPeerValue& error) {
    CHECK(error.field() == "receiver rank");
  }
}

TEST(groupIdsFollowTheirNames, "group ids on the wire are equal per name, distinct across names") {
  CHECK(groupIdOf("0") == groupIdOf("0") && groupIdOf("0") != groupIdOf("1"));
}

}  // namespace
