// Plain C++ tests of the torch-free engine pieces: matching order, the wire format, buffer
// exports, flag words and descriptors. Built and run by tests/test_engine_cpp.py.

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/Error.h"
#include "engine/GroupState.h"
#include "engine/Matcher.h"
#include "engine/Wire.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcExport.h"

using namespace smfree::engine;

namespace {

int failures = 0;
int checks = 0;

#define CHECK(condition)                                                        \
  do {                                                                          \
    ++checks;                                                                   \
    if (!(condition)) {                                                         \
      ++failures;                                                               \
      std::printf("  FAILED %s:%d: %s\n", __FILE__, __LINE__, #condition);      \
    }                                                                           \
  } while (0)

uint64_t nextId = 1;

std::shared_ptr<Op> recv(int peer, int tag) {
  auto op = std::make_shared<Op>();
  op->id = nextId++;
  op->request.kind = OpKind::kRecv;
  op->request.peer = peer;
  op->request.tag = tag;
  return op;
}

ReadyToSend rts(int source, int tag, uint64_t seq, uint64_t sendId = 0) {
  ReadyToSend message;
  message.source = source;
  message.tag = tag;
  message.seq = seq;
  message.sendId = sendId;
  return message;
}

void matchesInSequenceOrder() {
  Matcher matcher;
  CHECK(matcher.announce(rts(1, 0, 0, 10)).empty());
  CHECK(matcher.announce(rts(1, 0, 1, 11)).empty());
  auto first = matcher.postRecv(recv(1, 0));
  auto second = matcher.postRecv(recv(1, 0));
  CHECK(first && first->announcement.rts.sendId == 10);
  CHECK(second && second->announcement.rts.sendId == 11);
}

void releasesOutOfOrderAnnouncementsBySequence() {
  Matcher matcher;
  auto r0 = recv(1, 0);
  auto r1 = recv(1, 0);
  CHECK(matcher.announce(rts(1, 0, 1, 11)).empty());  // early: held back
  CHECK(!matcher.postRecv(r0));
  CHECK(!matcher.postRecv(r1));
  auto released = matcher.announce(rts(1, 0, 0, 10));
  CHECK(released.size() == 2);
  CHECK(released.size() == 2 && released[0].recv == r0 && released[0].announcement.rts.sendId == 10);
  CHECK(released.size() == 2 && released[1].recv == r1 && released[1].announcement.rts.sendId == 11);
}

void tagsAreSeparateLines() {
  Matcher matcher;
  matcher.announce(rts(1, 7, 0, 70));
  matcher.announce(rts(1, 3, 0, 30));
  auto three = matcher.postRecv(recv(1, 3));
  auto seven = matcher.postRecv(recv(1, 7));
  CHECK(three && three->announcement.rts.sendId == 30);
  CHECK(seven && seven->announcement.rts.sendId == 70);
  CHECK(!matcher.postRecv(recv(2, 3)));  // another source's line is empty
}

void anySourceAndSpecificFollowPostingOrder() {
  Matcher matcher;
  auto any = recv(kAnySource, 0);
  auto specific = recv(2, 0);
  CHECK(!matcher.postRecv(any));
  CHECK(!matcher.postRecv(specific));
  auto first = matcher.announce(rts(2, 0, 0, 20));
  auto second = matcher.announce(rts(2, 0, 1, 21));
  CHECK(first.size() == 1 && first[0].recv == any);
  CHECK(second.size() == 1 && second[0].recv == specific);
}

void anySourceTakesTheOldestAnnouncement() {
  Matcher matcher;
  matcher.announce(rts(3, 0, 0, 30));
  matcher.announce(rts(1, 0, 0, 10));
  auto first = matcher.postRecv(recv(kAnySource, 0));
  auto second = matcher.postRecv(recv(kAnySource, 0));
  CHECK(first && first->announcement.rts.source == 3);
  CHECK(second && second->announcement.rts.source == 1);
  CHECK(!matcher.postRecv(recv(kAnySource, 0)));
}

void cancelledAnnouncementKeepsItsPlace() {
  Matcher matcher;
  matcher.announce(rts(1, 0, 0, 10));
  matcher.announce(rts(1, 0, 1, 11));
  CHECK(matcher.cancel(1, 0, 0, "gave up"));
  CHECK(!matcher.cancel(1, 0, 5, "unknown"));
  auto first = matcher.postRecv(recv(1, 0));
  auto second = matcher.postRecv(recv(1, 0));
  CHECK(first && first->announcement.cancelled && first->announcement.cancelReason == "gave up");
  CHECK(second && !second->announcement.cancelled && second->announcement.rts.sendId == 11);
}

void clearReturnsPostedRecvs() {
  Matcher matcher;
  matcher.postRecv(recv(1, 0));
  matcher.postRecv(recv(kAnySource, 4));
  matcher.announce(rts(2, 9, 0));
  int waiting = 0;
  matcher.forEachWaiting([&](const Announcement&) { ++waiting; });
  CHECK(waiting == 1);
  CHECK(matcher.clear().size() == 2);
  waiting = 0;
  matcher.forEachWaiting([&](const Announcement&) { ++waiting; });
  CHECK(waiting == 0);
}

void wireRoundTrips() {
  ReadyToSend ready = rts(5, -2, 99, 1234);
  ready.group = groupIdOf("pp");
  ready.desc = TensorDesc{64, "bfloat16", "cuda", {4, 8}};
  ready.channel = ChannelKind::kCopyEngine;
  ready.promised = true;
  auto decoded = std::get<ReadyToSend>(decode(encode(ready).data(), encode(ready).size()));
  CHECK(decoded.group == ready.group && decoded.source == 5 && decoded.tag == -2);
  CHECK(decoded.seq == 99 && decoded.sendId == 1234);
  CHECK(decoded.desc.bytes == 64 && decoded.desc.dtype == "bfloat16" && decoded.desc.device == "cuda");
  CHECK((decoded.desc.shape == std::vector<int64_t>{4, 8}));
  CHECK(decoded.channel == ChannelKind::kCopyEngine);
  CHECK(decoded.promised);
  ready.promised = false;
  CHECK(!std::get<ReadyToSend>(decode(encode(ready).data(), encode(ready).size())).promised);

  ClearToSend clear{7, 1, 55, 66, std::string("\0\1\2", 3)};
  auto bytes = encode(clear);
  auto clearBack = std::get<ClearToSend>(decode(bytes.data(), bytes.size()));
  CHECK(clearBack.group == 7 && clearBack.receiver == 1 && clearBack.sendId == 55);
  CHECK(clearBack.recvId == 66 && clearBack.channelData == std::string("\0\1\2", 3));

  Refusal refusal{7, 1, 55, StatusCode::kMismatch, "sizes differ"};
  bytes = encode(refusal);
  auto refusalBack = std::get<Refusal>(decode(bytes.data(), bytes.size()));
  CHECK(refusalBack.code == StatusCode::kMismatch && refusalBack.reason == "sizes differ");

  Cancellation cancellation{7, 2, 3, 4, 5, "timed out"};
  bytes = encode(cancellation);
  auto cancellationBack = std::get<Cancellation>(decode(bytes.data(), bytes.size()));
  CHECK(cancellationBack.seq == 4 && cancellationBack.recvId == 5);
  CHECK(cancellationBack.reason == "timed out");

  bytes = encode(MemoryReleased{"owner-key", {3, 1ull << 40}});
  auto releasedBack = std::get<MemoryReleased>(decode(bytes.data(), bytes.size()));
  CHECK(releasedBack.owner == "owner-key");
  CHECK((releasedBack.ids == std::vector<uint64_t>{3, 1ull << 40}));

  bytes = encode(ChannelNotice{"sender-key", std::string("\0\7", 2)});
  auto noticeBack = std::get<ChannelNotice>(decode(bytes.data(), bytes.size()));
  CHECK(noticeBack.sender == "sender-key" && noticeBack.data == std::string("\0\7", 2));
}

void wireRejectsTruncatedMessages() {
  auto bytes = encode(ClearToSend{7, 1, 55, 66, "payload"});
  bool threw = false;
  try {
    decode(bytes.data(), bytes.size() - 3);
  } catch (const Error& error) {
    threw = std::string(error.what()).find("truncated control message") != std::string::npos;
  }
  CHECK(threw);
}

void wireRejectsAnUnknownChannel() {
  auto bytes = encode(rts(0, 0, 0));
  bytes[bytes.size() - 2] = 7;  // the channel: the byte before a ready-to-send's promise
  bool threw = false;
  try {
    decode(bytes.data(), bytes.size());
  } catch (const Error& error) {
    threw = std::string(error.what()).find("unknown data channel 7") != std::string::npos;
  }
  CHECK(threw);
}

cuda::IpcExport chunkedExport() {
  cuda::IpcExport e;
  e.kind = cuda::IpcExport::Kind::kShareable;
  e.device = 1;
  e.address = (64ull << 20) + 4096;
  e.chunks = {{64ull << 20, 20ull << 20, 7, 31, 0}, {84ull << 20, 20ull << 20, 9, 32, 0}};
  return e;
}

bool readFails(const std::string& bytes, const char* expected) {
  try {
    cuda::IpcExport::read(bytes.data(), bytes.size());
  } catch (const Error& error) {
    return std::string(error.what()).find(expected) != std::string::npos;
  }
  return false;
}

void bufferExportsRoundTrip() {
  std::string bytes;
  chunkedExport().appendTo(bytes);
  const cuda::IpcExport back = cuda::IpcExport::read(bytes.data(), bytes.size());
  CHECK(back.kind == cuda::IpcExport::Kind::kShareable && back.device == 1);
  CHECK(back.address == (64ull << 20) + 4096 && back.start() == 64ull << 20);
  CHECK(back.chunks.size() == 2 && back.chunks[1].blockId == 9 && back.chunks[1].ownerFd == 32);

  cuda::IpcExport legacy;
  legacy.base = 4096;
  legacy.address = 4096 + 100;
  legacy.bufferId = 77;
  legacy.handle.reserved[0] = 'x';
  std::string legacyBytes;
  legacy.appendTo(legacyBytes);
  const cuda::IpcExport legacyBack = cuda::IpcExport::read(legacyBytes.data(), legacyBytes.size());
  CHECK(legacyBack.kind == cuda::IpcExport::Kind::kIpcHandle && legacyBack.start() == 4096);
  CHECK(legacyBack.bufferId == 77 && legacyBack.handle.reserved[0] == 'x');
  CHECK(legacyBack.chunks.empty());
}

void bufferExportsRejectMalformedBytes() {
  std::string bytes;
  chunkedExport().appendTo(bytes);
  CHECK(readFails(bytes.substr(0, 10), "shorter than its"));
  CHECK(readFails(bytes.substr(0, bytes.size() - 1), "2 chunks in"));
  cuda::IpcExport gap = chunkedExport();
  gap.chunks[1].base += 2ull << 20;
  std::string gapBytes;
  gap.appendTo(gapBytes);
  CHECK(readFails(gapBytes, "chunk 1 does not follow chunk 0"));
  cuda::IpcExport empty = chunkedExport();
  empty.chunks.clear();
  std::string emptyBytes;
  empty.appendTo(emptyBytes);
  CHECK(readFails(emptyBytes, "0 chunks"));
}

void flagValuesGrowPerWord() {
  cuda::FlagSegment segment;
  const cuda::Flag first = segment.acquire();
  const cuda::Flag other = segment.acquire();
  CHECK(first.index != other.index);
  CHECK(!segment.isSet(first));
  segment.set(first);
  CHECK(segment.isSet(first));
  segment.release(first);
  const cuda::Flag again = segment.acquire();  // the word just released comes back...
  CHECK(again.index == first.index);
  CHECK(again.value == first.value + 1);  // ...with a larger value: old waits stay satisfied
  CHECK(!segment.isSet(again));
  CHECK(segment.inUse() == 2);
}

void flagUsesOwnASpanOfValues() {
  cuda::FlagSegment segment;
  const cuda::Flag done = segment.acquire(3);
  segment.release(done);
  const cuda::Flag next = segment.acquire();
  CHECK(next.index == done.index);
  CHECK(next.value == done.value + 3);  // past every value the last use could have written
}

void settingAFlagNeverLowersItsWord() {
  cuda::FlagSegment segment;
  const cuda::Flag done = segment.acquire(3);
  segment.set(done.plus(2));  // what a GPU (or a peer) wrote first
  segment.set(done);          // a later release by this process's CPU
  CHECK(segment.wordOf(done) == done.value + 2);
  segment.set(done.plus(1));
  CHECK(segment.wordOf(done) == done.value + 2);
}

void flagWaitsFollowTheGpuComparison() {
  CHECK(cuda::reached(5, 5));
  CHECK(cuda::reached(6, 5));
  CHECK(!cuda::reached(4, 5));
  CHECK(cuda::reached(2, 0xFFFFFFFEu));   // wrapped past the top: still "greater or equal"
  CHECK(!cuda::reached(0xFFFFFFFEu, 2));
}

void flagSegmentRunsOutLoudly() {
  cuda::FlagSegment segment;
  for (uint32_t i = 0; i < cuda::FlagSegment::kWords; ++i) segment.acquire();
  bool threw = false;
  try {
    segment.acquire();
  } catch (const Error& error) {
    threw = std::string(error.what()).find("too many CUDA ops in flight") != std::string::npos;
  }
  CHECK(threw);
}

void descriptorsCompareBytesDtypeAndDevice() {
  TensorDesc a{16, "float32", "cpu", {4}};
  TensorDesc flat{16, "float32", "cpu", {2, 2}};
  TensorDesc other{16, "int32", "cpu", {4}};
  TensorDesc gpu{16, "float32", "cuda", {4}};
  CHECK(a.compatibleWith(flat));
  CHECK(!a.compatibleWith(other));
  CHECK(!a.compatibleWith(gpu));
  CHECK(a.describe() == "float32[4] (16 B)");
  CHECK(gpu.describe() == "float32[4] (16 B) on cuda");
  CHECK(groupIdOf("0") == groupIdOf("0") && groupIdOf("0") != groupIdOf("1"));
}

}  // namespace

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"matches in sequence order", matchesInSequenceOrder},
      {"releases out-of-order announcements by sequence", releasesOutOfOrderAnnouncementsBySequence},
      {"tags are separate lines", tagsAreSeparateLines},
      {"any-source and specific follow posting order", anySourceAndSpecificFollowPostingOrder},
      {"any-source takes the oldest announcement", anySourceTakesTheOldestAnnouncement},
      {"cancelled announcement keeps its place", cancelledAnnouncementKeepsItsPlace},
      {"clear returns posted recvs", clearReturnsPostedRecvs},
      {"wire round-trips", wireRoundTrips},
      {"wire rejects truncated messages", wireRejectsTruncatedMessages},
      {"wire rejects an unknown channel", wireRejectsAnUnknownChannel},
      {"buffer exports round-trip", bufferExportsRoundTrip},
      {"buffer exports reject malformed bytes", bufferExportsRejectMalformedBytes},
      {"flag values grow per word", flagValuesGrowPerWord},
      {"a flag use owns a span of values", flagUsesOwnASpanOfValues},
      {"setting a flag never lowers its word", settingAFlagNeverLowersItsWord},
      {"flag waits follow the GPU comparison", flagWaitsFollowTheGpuComparison},
      {"flag segment runs out loudly", flagSegmentRunsOutLoudly},
      {"descriptors compare bytes, dtype and device", descriptorsCompareBytesDtypeAndDevice},
  };
  int passed = 0;
  for (const auto& [name, test] : tests) {
    const int before = failures;
    test();
    std::printf("%s %s\n", failures == before ? "ok  " : "FAIL", name);
    passed += failures == before;
  }
  std::printf("%d passed, %d failed\n", passed, static_cast<int>(tests.size()) - passed);
  return passed == static_cast<int>(tests.size()) ? 0 : 1;
}
