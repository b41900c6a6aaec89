// Peer values: each parser of what a peer sends accepts values on the inside of its bounds and
// refuses the first value past them with BadPeerValue, naming the field.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/PeerValue.h"
#include "engine/channels/captured/CapturedOp.h"
#include "engine/channels/captured/PostedRecvs.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CollectiveRecords.h"
#include "engine/channels/copy_engine/StagingRing.h"
#include "engine/cuda/IpcExport.h"

#include "check.h"

using namespace smfree::engine;
using smfree::engine::testing::throwsError;

namespace {

constexpr uint32_t kLastWord = cuda::FlagSegment::kWords - 1;

// The field a refusal names; empty where `call` throws no BadPeerValue.
template <typename Call>
std::string refusedField(Call&& call) {
  try {
    call();
  } catch (const BadPeerValue& error) {
    return error.field();
  }
  return "";
}

std::string exportBytes() {
  cuda::IpcExport e;
  e.base = 0x7000'0000;
  e.address = e.base;
  std::string out;
  e.appendTo(out);
  return out;
}

TEST(peerValueBounds, "peer values: a value below its bound passes, one at it is refused") {
  checkBelow("test message", "slot", 7u, 8);
  CHECK(throwsError([] { checkBelow("test message", "slot", 8u, 8); },
                    "bad slot in a test message: 8 is out of bounds (0 to 7)"));
  CHECK(throwsError([] { checkBelow("test message", "rank", -1, 4); },
                    "bad rank in a test message: -1 is out of bounds (0 to 3)"));
  checkFlag("test message", "ready flag index", cuda::Flag{kLastWord, 0});
  CHECK(refusedField([] {
          checkFlag("test message", "ready flag index", cuda::Flag{kLastWord + 1, 0});
        }) == "ready flag index");
  checkWithin("test message", "range", 8, 8, 16);
  CHECK(throwsError([] { checkWithin("test message", "range", 8, 9, 16); },
                    "bad range in a test message: 9 B at offset 8 run past the end of the 16 B"));
  // An offset and length whose sum wraps are refused, not added.
  CHECK(refusedField([] { checkWithin("test message", "range", 8, ~uint64_t{0}, 16); }) ==
        "range");
}

TEST(noticesAreBounded, "peer values: eager and staging notices bound their slot and size") {
  CHECK(readEagerNotice(toBytes(EagerNotice{0, kEagerSlots - 1, 3, 1})).slot == kEagerSlots - 1);
  CHECK(throwsError([] { readEagerNotice(toBytes(EagerNotice{0, kEagerSlots, 3, 0})); },
                    "bad slot in an eager announcement: 8 is out of bounds (0 to 7)"));
  CHECK(refusedField([] { readEagerNotice(toBytes(EagerNotice{0, 1, 3, 2})); }) == "held");
  CHECK(throwsError([] { readEagerNotice("abc"); },
                    "bad length in an eager announcement: 3 B, expected 16 B"));
  CHECK(readStagedNotice(toBytes(StagedNotice{9, 0, kStagingSlots - 1, 0, 0})).recvId == 9);
  CHECK(refusedField([] { readStagedNotice(toBytes(StagedNotice{9, 0, kStagingSlots, 0, 0})); }) ==
        "slot");
}

std::string ringBytes(uint64_t slotBytes, uint32_t slots, uint32_t wordIndex) {
  struct {
    uint64_t slotBytes;
    uint32_t slots;
    uint32_t ways;
  } header{slotBytes, slots, 0};
  std::string out(reinterpret_cast<const char*>(&header), sizeof(header));
  for (uint32_t i = 0; i < slots; ++i) {
    const cuda::Flag word{wordIndex, 0};
    out.append(reinterpret_cast<const char*>(&word), sizeof(word));
  }
  return out + exportBytes();
}

std::shared_ptr<RemoteStagingRing> readRing(const std::string& bytes) {
  return RemoteStagingRing::read(bytes.data(), bytes.size());
}

TEST(stagingRingsAreBounded, "peer values: a ring's slot count, slot size and words are bounded") {
  CHECK(readRing(ringBytes(1 << 20, RemoteStagingRing::kMaxRemoteSlots, kLastWord))->slots() ==
        RemoteStagingRing::kMaxRemoteSlots);
  CHECK(refusedField([] { readRing(ringBytes(1 << 20, 2, kLastWord + 1)); }) ==
        "slot flag index");
  CHECK(refusedField([] { readRing(ringBytes(1 << 20, 0, 1)); }) == "slot count");
  CHECK(refusedField([] { readRing(ringBytes(1 << 20, RemoteStagingRing::kMaxRemoteSlots + 1,
                                             1)); }) == "slot count");
  CHECK(refusedField([] { readRing(ringBytes(0, 2, 1)); }) == "slot bytes");
  CHECK(refusedField([] {
          readRing(ringBytes(RemoteStagingRing::kMaxRemoteSlotBytes + 1, 2, 1));
        }) == "slot bytes");
}

std::string clearance(const ClearanceHeader& base, const std::string& destination) {
  ClearanceHeader header = base;
  header.destinationBytes = static_cast<uint32_t>(destination.size());
  return toBytes(header) + destination;
}

TEST(clearancesAreBounded, "peer values: a clear-to-send's flags and section sizes are bounded") {
  const ClearanceHeader good{{1, 0}, {2, 0}, {kLastWord, 0}, 5, 0, 0, 0, 0};
  const ClearanceData read = readClearance(clearance(good, exportBytes()));
  CHECK(read.header.done.index == kLastWord && !read.ring && !read.eagerRing);
  for (int field = 0; field < 3; ++field) {
    ClearanceHeader bad = good;
    (field == 0 ? bad.ready : field == 1 ? bad.queued : bad.done).index = kLastWord + 1;
    const char* names[] = {"ready flag index", "queued flag index", "done flag index"};
    CHECK(refusedField([&] { readClearance(clearance(bad, exportBytes())); }) == names[field]);
  }
  ClearanceHeader longer = good;
  longer.ringBytes = 4;  // says a ring follows that is not there
  CHECK(throwsError([&] { readClearance(clearance(longer, exportBytes())); },
                    "bad length in a clear-to-send's channel data"));
}

TEST(capturedRecordsAreBounded, "peer values: captured announcements and recv notices bound "
                                "their flags, dtype and size") {
  CapturedAnnouncement announced;
  announced.slot.full = cuda::Flag{kLastWord, 1};
  announced.slot.empty = cuda::Flag{kLastWord + 1, 1};
  std::string bytes;
  announced.appendTo(bytes);
  CHECK(refusedField([&] { CapturedAnnouncement::read(bytes); }) == "empty flag index");

  PostedRecv recv;
  recv.dtype = "float32";
  recv.ready = cuda::Flag{kLastWord, 0};
  recv.arrived = cuda::Flag{kLastWord + 1, 0};
  std::string notice;
  recv.appendTo(notice);
  CHECK(refusedField([&] { PostedRecv::read(notice); }) == "arrived flag index");
  recv.arrived = cuda::Flag{0, 0};
  recv.dtype.assign(PostedRecv::kMaxDtypeBytes + 1, 'x');
  notice.clear();
  recv.appendTo(notice);
  CHECK(refusedField([&] { PostedRecv::read(notice); }) == "dtype length");
  recv.dtype.assign(PostedRecv::kMaxDtypeBytes, 'x');
  notice.clear();
  recv.appendTo(notice);
  CHECK(PostedRecv::read(notice).dtype.size() == PostedRecv::kMaxDtypeBytes);
}

TEST(postedRecvsAreCappedPerPeer,
     "peer values: past its cap a peer's recv notice is refused; other peers go on") {
  PostedRecvs recvs;
  PostedRecvs::Entry entry;
  entry.recv.group = 1;
  for (uint64_t seq = 0; seq < PostedRecvs::kMaxPerPeer; ++seq) {
    entry.recv.seq = seq;
    recvs.add("peer a", entry);
  }
  entry.recv.seq = PostedRecvs::kMaxPerPeer;
  CHECK(throwsError([&] { recvs.add("peer a", entry); },
                    "bad number of notices in a captured recv notice: peer a has 65536"));
  recvs.add("peer b", entry);  // another peer is unaffected
  // A send that takes one (and passes those before it) frees their places.
  CHECK(recvs.take("peer a", 1, 0, 9, std::chrono::microseconds(0)).has_value());
  recvs.add("peer a", entry);
  recvs.dropPeer("peer a");
  recvs.add("peer a", entry);
}

CollectiveHalf goodHalf() {
  CollectiveHalf half{};
  std::strcpy(half.dtype, "float32");
  half.exportBytes = kCollectiveExportBytes;
  half.signal = cuda::Flag{kLastWord, 1};
  half.done = cuda::Flag{0, 0};
  return half;
}

TEST(collectiveHalvesAreBounded, "peer values: a collective record's half bounds its export "
                                 "length, flags and dtype") {
  CHECK(readHalf(goodHalf()).exportBytes == kCollectiveExportBytes);
  CollectiveHalf half = goodHalf();
  half.exportBytes = kCollectiveExportBytes + 1;
  CHECK(throwsError([&] { readHalf(half); },
                    "bad export bytes in a collective record: 449 is out of bounds (0 to 448)"));
  half = goodHalf();
  half.signal.index = kLastWord + 1;
  CHECK(refusedField([&] { readHalf(half); }) == "signal flag index");
  half = goodHalf();
  half.done.index = ~0u;
  CHECK(refusedField([&] { readHalf(half); }) == "done flag index");
  half = goodHalf();
  std::memset(half.dtype, 'x', kCollectiveDtypeBytes);
  CHECK(refusedField([&] { readHalf(half); }) == "dtype");
}

TEST(collectiveLineNumbersAreBounded,
     "peer values: a line number in the collective table past its lines is refused") {
  std::vector<char> tail(CollectiveLines::kTableBytes, 0);
  const CollectiveLines lines(tail.data());
  CHECK(lines.line(3, "process 1") != nullptr);  // makes the entry, line 1
  // A peer rewrites the entry's line (stored + 1) to one past the last.
  for (size_t at = 8; at < CollectiveLines::kTableBytes; at += 16) {
    uint64_t key = 0;
    std::memcpy(&key, &tail[at], sizeof(key));
    if (key == 0) continue;
    const uint32_t past = static_cast<uint32_t>(CollectiveLines::kLines) + 1;
    std::memcpy(&tail[at + 8], &past, sizeof(past));
  }
  CHECK(throwsError([&] { lines.line(3, "process 1"); },
                    "bad line number in a collective line table"));
}

TEST(bufferExportChunksDoNotWrap, "peer values: an export's chunks may not wrap or be empty") {
  cuda::IpcExport e;
  e.kind = cuda::IpcExport::Kind::kShareable;
  e.chunks = {{~uint64_t{0} - 10, 100, 1, 3, 0}};
  std::string bytes;
  e.appendTo(bytes);
  CHECK(refusedField([&] { cuda::IpcExport::read(bytes.data(), bytes.size()); }) == "chunk size");
  e.chunks = {{4096, 0, 1, 3, 0}};
  bytes.clear();
  e.appendTo(bytes);
  CHECK(refusedField([&] { cuda::IpcExport::read(bytes.data(), bytes.size()); }) == "chunk size");
}

}  // namespace
