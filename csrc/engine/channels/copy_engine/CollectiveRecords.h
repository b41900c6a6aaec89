#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "engine/CudaOps.h"
#include "engine/cuda/FlagSegment.h"

namespace smfree::engine {

// Collective lanes' records: how the two ranks of a collective piece decide, with no message and
// no wait, which of them queues its copy (CollectiveLanes.h says what each then does). CPU atomics
// on shared host memory only: the tail of the receiver's flag segment file.
//
// A line is one (group, sending process) of the collective line into a process; its message n
// uses record n % kCollectiveRecords, as use n / kCollectiveRecords. Each side writes its half of
// the record, then one compare-and-swap on the record's way word says what happens:
//   - the word is open for the use: this side posted first; it publishes (kFirst);
//   - the other side published: this side is second; it takes the record (kTaken) and queues
//     the copy;
//   - the word says rendezvous: both sides send the piece by rendezvous.
// The first side may cancel (its op failed) only while the word still says it published: then
// no copy will come. A word's values only grow:
//   use u open: below 5u + 1; first sender 5u + 1; first receiver 5u + 2; taken 5u + 3;
//   rendezvous 5u + 4 (so the next use opens at 5u + 5).
//
// Reuse: a side reuses a record for use u + 1 only once its use u is decided, taken or
// cancelled. Message n + kCollectiveRecords of a line is posted only after message n is: if n
// still waited for its partner, its side would hold n .. n + kCollectiveRecords - 1 in flight,
// more than SMFREE_MAX_CUDA_OPS allows (kCollectiveRecords exceeds its largest value). So a side
// that posts message n + kCollectiveRecords finds use u of its record decided.
constexpr uint32_t kCollectiveRecords = 3840;
static_assert(kCollectiveRecords >=
                  (cuda::FlagSegment::kWords - kStagingFlagWords) / kFlagsPerCudaOp,
              "a line has more records than CUDA ops a process may keep in flight");
constexpr size_t kCollectiveExportBytes = 448;  // an IpcExport of up to 10 chunks
constexpr size_t kCollectiveDtypeBytes = 24;

enum class CollectiveRole : uint8_t { kRendezvous, kFirst, kSecond };

// One side's half of a record: what the second side needs to queue the copy.
struct CollectiveHalf {
  uint64_t bytes;
  int32_t device;
  uint32_t exportBytes;
  // Sender: its `produced` word; receiver: its `ready` word. Its stream writes it at the post.
  cuda::Flag signal;
  // Raised kCopied (1) above its value by the copy; what this side's streams wait on.
  cuda::Flag done;
  char dtype[kCollectiveDtypeBytes];
  char exported[kCollectiveExportBytes];  // IpcExport::appendTo
};

struct CollectiveRecord {
  alignas(64) uint32_t way;
  CollectiveHalf sender;
  CollectiveHalf receiver;
};

// The second side's part, between reading the first's half and taking the record: `agree`
// checks the first's half against its own op and gets ready to copy (false: they differ, and
// the piece goes by rendezvous, whose match fails both); `undo` lets go of that where the first
// cancelled meanwhile.
struct CollectiveSecond {
  std::function<bool(const CollectiveHalf& theirs)> agree;
  std::function<void()> undo;
};

// The one reader of the other side's half, which that side's process writes in shared memory:
// its copy of the half, its dtype ended, its export's length and its words bounded. Throws
// BadPeerValue (PeerValue.h).
CollectiveHalf readHalf(const CollectiveHalf& shared);

// A side's decision at its post of use `use`, having written its half (`publishable`: whether
// that half is complete; if not, the side decides rendezvous where it comes first). `second`
// sees the other's half as readHalf() read it. Throws Error where the record is out of step,
// BadPeerValue where the other's half is out of bounds.
CollectiveRole decideCollective(CollectiveRecord& record, uint32_t use, bool sender,
                                bool publishable, const CollectiveSecond& second);
// The first side's op failed: true if no copy will come (cancelled now, or decided
// rendezvous), false if the other side took it (its copy comes).
bool cancelCollective(CollectiveRecord& record, uint32_t use, bool sender);

// The lines into one process: a table by (group, sending process) and the lines' records, in the
// tail of its flag segment's file (`tail`, FlagSegment::kTailBytes). Either side finds or makes
// a line, racing the other without harm.
class CollectiveLines {
 public:
  static constexpr size_t kTableEntries = 1024;
  static constexpr size_t kTableBytes = 64 << 10;
  static constexpr size_t kLineBytes = sizeof(CollectiveRecord) * kCollectiveRecords;
  static constexpr size_t kLines = (cuda::FlagSegment::kTailBytes - kTableBytes) / kLineBytes;

  explicit CollectiveLines(char* tail) : tail_(tail) {}
  // The line's records; null where every line is taken (its pieces then go by rendezvous, as
  // both sides find). Throws BadPeerValue where the table, which peers write, names a line
  // past kLines.
  CollectiveRecord* line(uint64_t group, const std::string& senderKey) const;

 private:
  struct Entry {
    uint64_t key;
    uint32_t line;  // the line's index + 1; 0 while its maker takes one; kNone: none left
    uint32_t unused;
  };
  struct Table {
    uint32_t nextLine;
    uint32_t unused;
    Entry entries[kTableEntries];
  };
  static_assert(sizeof(Table) <= kTableBytes);
  static constexpr uint32_t kNone = UINT32_MAX;

  Table& table() const { return *reinterpret_cast<Table*>(tail_); }
  uint32_t take(Entry& entry) const;          // the entry's maker: a line for it
  static uint32_t await(const Entry& entry);  // another side made it: its line once taken

  char* tail_;
};

}  // namespace smfree::engine
