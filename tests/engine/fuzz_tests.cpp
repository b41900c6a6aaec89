// A seeded mutation fuzzer over every parser of what a peer sends: the control messages'
// decoder (Wire) and the readers of what peers write in channel data and shared memory. Each
// parser gets main's --fuzz-inputs mutated inputs (bit flips, boundary integers written over
// its fields, truncations, extensions, insertions, splices of two valid inputs), and each input
// must either read to values within their bounds or be refused with BadPeerValue. Anything else
// (another exception, a value out of bounds, a read past the input under AddressSanitizer) is a
// finding. Run under ASan and UBSan by test_engine_cpp.py.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/PeerValue.h"
#include "engine/Wire.h"
#include "engine/channels/captured/CapturedOp.h"
#include "engine/channels/captured/PostedRecvs.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CollectiveRecords.h"
#include "engine/channels/copy_engine/StagingRing.h"
#include "engine/cuda/IpcExport.h"

#include "check.h"

using namespace smfree::engine;

namespace {

constexpr uint64_t kSeed = 0x5eed62;
constexpr uint32_t kWords = cuda::FlagSegment::kWords;

// Values that sit on the bounds the parsers check, and on the edges of the integer types.
const std::vector<uint64_t>& boundaryValues() {
  static const std::vector<uint64_t> values = {
      0, 1, 2, 7, 8, 63, 64, 65, kWords - 1, kWords, kWords + 1, kCollectiveExportBytes,
      kCollectiveExportBytes + 1, CollectiveLines::kLines - 1, CollectiveLines::kLines,
      CollectiveLines::kLines + 1, 0x7f, 0x80, 0xff, 0x7fff'ffff, 0x8000'0000, 0xffff'fffe,
      0xffff'ffff, uint64_t{1} << 40, (uint64_t{1} << 40) + 1, 0x7fff'ffff'ffff'ffff,
      0x8000'0000'0000'0000, ~uint64_t{0}};
  return values;
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  // A mutation of one of `seeds`: one to four edits.
  std::string mutate(const std::vector<std::string>& seeds) {
    std::string bytes = pick(seeds);
    const int edits = 1 + static_cast<int>(below(4));
    for (int i = 0; i < edits; ++i) edit(bytes, seeds);
    return bytes;
  }
  // In place only, keeping the size: for records of a fixed layout in shared memory.
  std::string overwrite(const std::vector<std::string>& seeds) {
    std::string bytes = pick(seeds);
    const int edits = 1 + static_cast<int>(below(4));
    for (int i = 0; i < edits; ++i) {
      if (below(2) == 0) {
        flip(bytes);
      } else {
        writeBoundary(bytes);
      }
    }
    return bytes;
  }
  uint64_t below(uint64_t bound) { return bound == 0 ? 0 : rng_() % bound; }

 private:
  const std::string& pick(const std::vector<std::string>& seeds) {
    return seeds[below(seeds.size())];
  }
  void flip(std::string& bytes) {
    if (bytes.empty()) return;
    bytes[below(bytes.size())] ^= static_cast<char>(1u << below(8));
  }
  void writeBoundary(std::string& bytes) {
    const size_t width = below(2) == 0 ? 4 : 8;
    if (bytes.size() < width) return flip(bytes);
    size_t at = below(bytes.size() - width + 1);
    if (below(2) == 0) at &= ~size_t{3};  // most fields are 4-aligned
    uint64_t value = boundaryValues()[below(boundaryValues().size())];
    if (below(4) == 0) value = ~value + 1;  // and their negatives
    std::memcpy(&bytes[at], &value, width);
  }
  void edit(std::string& bytes, const std::vector<std::string>& seeds) {
    switch (below(8)) {
      case 0:
      case 1:
        flip(bytes);
        return;
      case 2:
      case 3:
        writeBoundary(bytes);
        return;
      case 4:  // truncation
        bytes.resize(below(bytes.size() + 1));
        return;
      case 5: {  // extension
        const size_t extra = 1 + below(16);
        for (size_t i = 0; i < extra; ++i) bytes.push_back(static_cast<char>(rng_()));
        return;
      }
      case 6: {  // a byte inserted or removed inside
        const size_t at = below(bytes.size() + 1);
        if (below(2) == 0 || bytes.empty()) {
          bytes.insert(bytes.begin() + static_cast<long>(at), static_cast<char>(rng_()));
        } else {
          bytes.erase(std::min(at, bytes.size() - 1), 1);
        }
        return;
      }
      default: {  // splice: the head of this one, the tail of another
        const std::string& other = pick(seeds);
        const size_t head = below(bytes.size() + 1);
        const size_t tail = below(other.size() + 1);
        bytes = bytes.substr(0, head) + other.substr(tail);
        return;
      }
    }
  }

  std::mt19937_64 rng_;
};

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char byte : bytes) {
    out += digits[byte >> 4];
    out += digits[byte & 15];
  }
  return out;
}

// Runs `parse` on testing::fuzzInputs mutations of `seeds` (and on the seeds, which must be
// accepted). `parse` returns whether the values it read are within their bounds, or throws
// BadPeerValue. Prints the parser's counts; counts a finding as a failure, printing its input.
void fuzz(const char* name, const std::vector<std::string>& seeds,
          const std::function<std::string(Mutator&, const std::vector<std::string>&)>& mutate,
          const std::function<bool(const std::string&)>& parse) {
  for (const std::string& seed : seeds) CHECK(parse(seed));
  Mutator mutator(kSeed ^ std::hash<std::string>{}(name));
  long accepted = 0;
  long findings = 0;
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < testing::fuzzInputs; ++i) {
    const std::string input = mutate(mutator, seeds);
    std::string finding;
    try {
      if (parse(input)) {
        ++accepted;
      } else {
        finding = "read a value out of bounds";
      }
    } catch (const BadPeerValue&) {
      // refused by name: what a bad input should get
    } catch (const std::exception& error) {
      finding = std::string("threw something other than BadPeerValue: ") + error.what();
    }
    if (!finding.empty() && ++findings <= 3) {
      std::printf("  %s, input %ld: %s\n    %s\n", name, i, finding.c_str(), hex(input).c_str());
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("  fuzz %-28s %ld inputs, %ld accepted, %ld findings, %.1f s\n", name,
              testing::fuzzInputs, accepted, findings, seconds);
  CHECK(findings == 0);
}

std::string anyEdit(Mutator& m, const std::vector<std::string>& seeds) { return m.mutate(seeds); }
std::string inPlace(Mutator& m, const std::vector<std::string>& seeds) {
  return m.overwrite(seeds);
}

bool flagInBounds(const cuda::Flag& flag) { return flag.index < kWords; }

// --- seeds: valid inputs of each kind ---

cuda::IpcExport handleExport() {
  cuda::IpcExport e;
  e.device = 0;
  e.base = 0x7000'0000;
  e.address = e.base + 256;
  e.bufferId = 12;
  return e;
}

cuda::IpcExport chunkExport() {
  cuda::IpcExport e;
  e.kind = cuda::IpcExport::Kind::kShareable;
  e.device = 1;
  e.address = (64ull << 20) + 4096;
  e.chunks = {{64ull << 20, 2ull << 20, 7, 31, 0}, {66ull << 20, 2ull << 20, 9, 32, 0}};
  return e;
}

std::string bytesOf(const cuda::IpcExport& e) {
  std::string out;
  e.appendTo(out);
  return out;
}

// A ring as StagingRing::appendTo writes it.
std::string ringBytes(uint32_t slots, bool ways) {
  struct {
    uint64_t slotBytes;
    uint32_t slots;
    uint32_t ways;
  } header{1 << 20, slots, ways ? 1u : 0u};
  std::string out(reinterpret_cast<const char*>(&header), sizeof(header));
  for (uint32_t i = 0; i < slots * (ways ? 2 : 1); ++i) {
    const cuda::Flag word{100 + i, 3};
    out.append(reinterpret_cast<const char*>(&word), sizeof(word));
  }
  return out + bytesOf(handleExport());
}

std::string clearanceBytes(bool rings) {
  const std::string destination = bytesOf(handleExport());
  const std::string ring = rings ? ringBytes(2, false) : "";
  const std::string eager = rings ? ringBytes(8, true) : "";
  const ClearanceHeader header{{1, 0}, {2, 0}, {3, 5}, 77,
                               static_cast<uint32_t>(destination.size()),
                               static_cast<uint32_t>(ring.size()),
                               static_cast<uint32_t>(eager.size()), 0};
  return toBytes(header) + destination + ring + eager;
}

std::vector<std::string> wireSeeds() {
  const TensorDesc desc{64, "bfloat16", "cuda", {4, 8}};
  std::vector<std::string> seeds;
  for (const ControlMessage& message : std::vector<ControlMessage>{
           ReadyToSend{7, 1, -2, 9, 1234, desc, ChannelKind::kCopyEngine, true, "\5\6"},
           ReadyToSend{7, 0, 3, 0, 1, TensorDesc{0, "float32", "cpu", {}}, ChannelKind::kUcx,
                       false, ""},
           ClearToSend{7, 1, 55, 66, clearanceBytes(true)},
           Refusal{7, 1, 55, StatusCode::kTimeout, "sizes differ"},
           Cancellation{7, 2, 3, 4, 5, "timed out", ChannelKind::kCaptured},
           MemoryReleased{"owner-key", {3, 1ull << 40}},
           ChannelNotice{"sender-key", ChannelKind::kCaptured, "\0\7"}, Probe{"peer", true}}) {
    const std::vector<uint8_t> bytes = encode(message);
    seeds.emplace_back(bytes.begin(), bytes.end());
  }
  return seeds;
}

bool rankInBounds(int32_t rank) { return rank >= 0; }

TEST(fuzzWire, "fuzz: control messages decode within bounds or are refused by name") {
  fuzz("wire decode", wireSeeds(), anyEdit, [](const std::string& input) {
    const ControlMessage message = decode(input.data(), input.size());
    // Exactly its fields: encoding it again gives the input back, byte for byte.
    const std::vector<uint8_t> again = encode(message);
    if (std::string(again.begin(), again.end()) != input) return false;
    if (const auto* m = std::get_if<ReadyToSend>(&message)) return rankInBounds(m->source);
    if (const auto* m = std::get_if<ClearToSend>(&message)) return rankInBounds(m->receiver);
    if (const auto* m = std::get_if<Refusal>(&message)) {
      return rankInBounds(m->receiver) && m->code != StatusCode::kOk;
    }
    if (const auto* m = std::get_if<Cancellation>(&message)) return rankInBounds(m->source);
    return true;
  });
}

bool exportInBounds(const cuda::IpcExport& e) {
  for (size_t i = 0; i < e.chunks.size(); ++i) {
    const cuda::IpcChunk& chunk = e.chunks[i];
    if (chunk.size == 0 || chunk.base + chunk.size < chunk.base) return false;
    if (i > 0 && chunk.base != e.chunks[i - 1].base + e.chunks[i - 1].size) return false;
  }
  return (e.kind == cuda::IpcExport::Kind::kShareable) == !e.chunks.empty();
}

TEST(fuzzBufferExports, "fuzz: buffer exports read within bounds or are refused by name") {
  fuzz("buffer export", {bytesOf(handleExport()), bytesOf(chunkExport())}, anyEdit,
       [](const std::string& input) {
         return exportInBounds(cuda::IpcExport::read(input.data(), input.size()));
       });
}

bool ringInBounds(const RemoteStagingRing& ring) {
  if (ring.slots() == 0 || ring.slots() > RemoteStagingRing::kMaxRemoteSlots) return false;
  if (ring.slotBytes() == 0 || ring.slotBytes() > RemoteStagingRing::kMaxRemoteSlotBytes) {
    return false;
  }
  for (uint32_t slot = 0; slot < ring.slots(); ++slot) {
    if (!flagInBounds(ring.wordOf(slot))) return false;
    if (ring.hasWays() && !flagInBounds(ring.wayOf(slot))) return false;
  }
  return true;
}

TEST(fuzzStagingRings, "fuzz: staging and eager rings read within bounds or are refused by name") {
  fuzz("staging ring", {ringBytes(2, false), ringBytes(8, true), ringBytes(1, false)}, anyEdit,
       [](const std::string& input) {
         return ringInBounds(*RemoteStagingRing::read(input.data(), input.size()));
       });
}

TEST(fuzzClearances, "fuzz: a clear-to-send's channel data reads within bounds or is refused") {
  fuzz("clear-to-send data", {clearanceBytes(true), clearanceBytes(false)}, anyEdit,
       [](const std::string& input) {
         const ClearanceData read = readClearance(input);
         const ClearanceHeader& header = read.header;
         return flagInBounds(header.ready) && flagInBounds(header.queued) &&
                flagInBounds(header.done) && exportInBounds(read.destination) &&
                (!read.ring || ringInBounds(*read.ring)) &&
                (!read.eagerRing || ringInBounds(*read.eagerRing));
       });
}

TEST(fuzzNotices, "fuzz: eager and staging notices read within bounds or are refused by name") {
  fuzz("eager announcement", {toBytes(EagerNotice{0, 3, 9, 1}), toBytes(EagerNotice{1, 7, 0, 0})},
       anyEdit, [](const std::string& input) {
         const EagerNotice notice = readEagerNotice(input);
         return notice.slot < kEagerSlots && notice.held <= 1;
       });
  fuzz("staging notice", {toBytes(StagedNotice{77, 0, 1, 4, 0})}, anyEdit,
       [](const std::string& input) { return readStagedNotice(input).slot < kStagingSlots; });
}

std::string announcementBytes(CapturedWay way) {
  CapturedAnnouncement announced;
  announced.way = way;
  announced.slot.full = cuda::Flag{3, 1};
  announced.slot.empty = cuda::Flag{4, 1};
  announced.slot.memory = handleExport();
  std::string out;
  announced.appendTo(out);
  return out;
}

std::string postedRecvBytes(uint64_t seq, const cuda::IpcExport& buffer) {
  PostedRecv recv;
  recv.group = 5;
  recv.tag = -3;
  recv.seq = seq;
  recv.bytes = 1 << 20;
  recv.dtype = "float32";
  recv.ready = cuda::Flag{11, 0};
  recv.arrived = cuda::Flag{12, 0};
  recv.buffer = buffer;
  std::string out;
  recv.appendTo(out);
  return out;
}

TEST(fuzzCapturedRecords, "fuzz: captured announcements and posted-recv notices read within "
                          "bounds or are refused by name") {
  fuzz("captured announcement",
       {announcementBytes(CapturedWay::kSlot), announcementBytes(CapturedWay::kDirect)}, anyEdit,
       [](const std::string& input) {
         const CapturedAnnouncement read = CapturedAnnouncement::read(input);
         if (read.way == CapturedWay::kDirect) return true;
         return read.way == CapturedWay::kSlot && flagInBounds(read.slot.full) &&
                flagInBounds(read.slot.empty) &&
                read.slot.memory.kind == cuda::IpcExport::Kind::kIpcHandle;
       });
  fuzz("posted-recv notice",
       {postedRecvBytes(6, handleExport()), postedRecvBytes(0, chunkExport())}, anyEdit, [](const std::string& input) {
         const PostedRecv read = PostedRecv::read(input);
         return flagInBounds(read.ready) && flagInBounds(read.arrived) &&
                read.dtype.size() <= PostedRecv::kMaxDtypeBytes && exportInBounds(read.buffer);
       });
}

// A record with the first side's half published for use `use`: what the second side reads.
std::string recordBytes(bool senderFirst, uint32_t use) {
  CollectiveRecord record{};
  CollectiveHalf& half = senderFirst ? record.sender : record.receiver;
  half.bytes = 4096;
  half.device = 0;
  half.signal = cuda::Flag{20, 1};
  half.done = cuda::Flag{21, 0};
  std::strcpy(half.dtype, "float32");
  std::string exported;
  handleExport().appendTo(exported);
  half.exportBytes = static_cast<uint32_t>(exported.size());
  std::memcpy(half.exported, exported.data(), exported.size());
  record.way = 5 * use + (senderFirst ? 1 : 2);
  return std::string(reinterpret_cast<const char*>(&record), sizeof(record));
}

TEST(fuzzCollectiveRecords, "fuzz: a collective record's half and way word are read within "
                            "bounds or refused by name") {
  const std::vector<std::string> seeds = {recordBytes(true, 0), recordBytes(false, 0),
                                          recordBytes(true, 3), recordBytes(false, 7)};
  fuzz("collective record", seeds, inPlace, [](const std::string& input) {
    CollectiveRecord record;
    std::memcpy(&record, input.data(), sizeof(record));
    bool inBounds = true;
    // The second side's part, as CollectiveLanes does it: map the first's export.
    const CollectiveSecond second{
        [&](const CollectiveHalf& theirs) {
          inBounds = theirs.exportBytes <= kCollectiveExportBytes && flagInBounds(theirs.signal) &&
                     flagInBounds(theirs.done) &&
                     std::memchr(theirs.dtype, 0, kCollectiveDtypeBytes) != nullptr;
          cuda::IpcExport::read(theirs.exported, theirs.exportBytes);
          return true;
        },
        [] {}};
    const uint32_t use = record.way / 5;
    for (const bool sender : {true, false}) {
      CollectiveRecord copy = record;
      try {
        decideCollective(copy, use, sender, true, second);
      } catch (const BadPeerValue&) {
        // Refused, by readHalf or by the export's reader inside agree: the half that agree
        // saw must still have been in bounds.
        if (!inBounds) return false;
        throw;
      }
    }
    return inBounds;
  });
}

TEST(fuzzCollectiveLineTable, "fuzz: a line number in the collective table that peers write is "
                              "within the lines or refused by name") {
  std::vector<char> tail(CollectiveLines::kTableBytes, 0);
  const CollectiveLines lines(tail.data());
  const uint64_t group = 42;
  const std::string sender = "process 1";
  // Where line() looks first for this (group, sender), as it hashes them.
  const uint64_t key =
      ((group * 0x9E3779B97F4A7C15ull) ^ std::hash<std::string>{}(sender)) | (1ull << 63);
  struct Entry {
    uint64_t key;
    uint32_t line;
    uint32_t unused;
  };
  const size_t entryAt = 8 + (key % CollectiveLines::kTableEntries) * sizeof(Entry);
  // An entry as its maker leaves it: line 1 (index 0), and one of the last line.
  const auto entryBytes = [&](uint32_t line) {
    const Entry entry{key, line, 0};
    return std::string(reinterpret_cast<const char*>(&entry), sizeof(entry));
  };
  const std::vector<std::string> seeds = {entryBytes(1),
                                          entryBytes(CollectiveLines::kLines)};
  const char* linesStart = tail.data() + CollectiveLines::kTableBytes;
  fuzz("collective line table", seeds, inPlace, [&](const std::string& input) {
    std::memcpy(&tail[entryAt], input.data(), sizeof(Entry));
    Entry entry;
    std::memcpy(&entry, input.data(), sizeof(entry));
    if (entry.key == key && entry.line == 0) return true;  // its maker still takes one: waits 1 s
    const CollectiveRecord* line = lines.line(group, sender);
    const auto offset = reinterpret_cast<const char*>(line) - linesStart;
    return line == nullptr ||
           (offset >= 0 && static_cast<size_t>(offset) % CollectiveLines::kLineBytes == 0 &&
            static_cast<size_t>(offset) / CollectiveLines::kLineBytes < CollectiveLines::kLines);
  });
}

}  // namespace
