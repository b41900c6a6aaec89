#include "engine/channels/copy_engine/CollectiveRecords.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "engine/Error.h"
#include "engine/PeerValue.h"
#include "engine/Spin.h"

namespace smfree::engine {
namespace {

constexpr uint32_t kFirstSender = 1;
constexpr uint32_t kFirstReceiver = 2;
constexpr uint32_t kTaken = 3;
constexpr uint32_t kRendezvous = 4;
constexpr uint32_t kValuesPerUse = 5;

uint32_t wayValue(uint32_t use, uint32_t state) { return kValuesPerUse * use + state; }
uint32_t firstOf(uint32_t use, bool sender) {
  return wayValue(use, sender ? kFirstSender : kFirstReceiver);
}

bool swap(CollectiveRecord& record, uint32_t seen, uint32_t next) {
  return __atomic_compare_exchange_n(&record.way, &seen, next, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE);
}

uint32_t loadWay(const CollectiveRecord& record) {
  return __atomic_load_n(&record.way, __ATOMIC_ACQUIRE);
}

// What a side reads in a record's way word for its use. kOutOfStep: an earlier use still waits
// for its second side, which the reuse rule (CollectiveRecords.h) rules out.
enum class CollectiveSeen : uint8_t { kOpen, kTheirs, kDecided, kOutOfStep };

CollectiveSeen seeWay(uint32_t word, uint32_t use, bool sender) {
  if (word < wayValue(use, kFirstSender)) {
    const uint32_t state = word % kValuesPerUse;
    if (word != 0 && (state == kFirstSender || state == kFirstReceiver)) {
      return CollectiveSeen::kOutOfStep;
    }
    return CollectiveSeen::kOpen;
  }
  if (word == firstOf(use, !sender)) return CollectiveSeen::kTheirs;
  // Rendezvous, or a word past this use (a line a closed group left behind): both sides read
  // the same word, so both go by rendezvous.
  return CollectiveSeen::kDecided;
}

constexpr const char* kHalf = "collective record";

}  // namespace

CollectiveHalf readHalf(const CollectiveHalf& shared) {
  CollectiveHalf half;
  std::memcpy(&half, &shared, sizeof(half));  // once: the peer may write it meanwhile
  if (std::memchr(half.dtype, 0, kCollectiveDtypeBytes) == nullptr) {
    badPeerValue(kHalf, "dtype", "no end within its ", kCollectiveDtypeBytes, " B");
  }
  checkBelow(kHalf, "export bytes", half.exportBytes, kCollectiveExportBytes + 1);
  checkFlag(kHalf, "signal flag index", half.signal);
  checkFlag(kHalf, "done flag index", half.done);
  return half;
}

CollectiveRole decideCollective(CollectiveRecord& record, uint32_t use, bool sender,
                                bool publishable, const CollectiveSecond& second) {
  const uint32_t rendezvous = wayValue(use, kRendezvous);
  // Each turn follows a change of the word by the other side, which makes a few at most.
  SpinDeadline deadline(std::chrono::seconds(1), "a collective lane's decision");
  for (;; deadline.check()) {
    const uint32_t seen = loadWay(record);
    switch (seeWay(seen, use, sender)) {
      case CollectiveSeen::kOpen:
        if (swap(record, seen, publishable ? firstOf(use, sender) : rendezvous)) {
          return publishable ? CollectiveRole::kFirst : CollectiveRole::kRendezvous;
        }
        continue;
      case CollectiveSeen::kTheirs: {
        // A copy: the first reuses its half only once this use is decided.
        const CollectiveHalf theirs = readHalf(sender ? record.receiver : record.sender);
        if (!second.agree(theirs)) {
          if (swap(record, seen, rendezvous)) return CollectiveRole::kRendezvous;
          continue;
        }
        if (swap(record, seen, wayValue(use, kTaken))) return CollectiveRole::kSecond;
        second.undo();  // it cancelled meanwhile
        continue;
      }
      case CollectiveSeen::kDecided:
        return CollectiveRole::kRendezvous;
      case CollectiveSeen::kOutOfStep:
        // Its own side keeps the reuse rule: a word that breaks it came from the other.
        badPeerValue(kHalf, "way word", seen, ": use ", use - 1,
                     " still waits for its second side, its line is out of step");
    }
  }
}

bool cancelCollective(CollectiveRecord& record, uint32_t use, bool sender) {
  if (swap(record, firstOf(use, sender), wayValue(use, kRendezvous))) return true;
  return loadWay(record) != wayValue(use, kTaken);
}

CollectiveRecord* CollectiveLines::line(uint64_t group, const std::string& senderKey) const {
  // By process, not rank: a group made again under its name by new processes starts afresh.
  // Never 0, the key of an empty entry.
  const uint64_t key =
      ((group * 0x9E3779B97F4A7C15ull) ^ std::hash<std::string>{}(senderKey)) | (1ull << 63);
  Table& lines = table();
  for (size_t probe = 0; probe < kTableEntries; ++probe) {
    Entry& entry = lines.entries[(key + probe) % kTableEntries];
    uint64_t seen = __atomic_load_n(&entry.key, __ATOMIC_ACQUIRE);
    uint32_t index = kNone;
    if (seen == 0 && __atomic_compare_exchange_n(&entry.key, &seen, key, false, __ATOMIC_ACQ_REL,
                                                 __ATOMIC_ACQUIRE)) {
      index = take(entry);
    } else if (seen == key) {
      index = await(entry);
    } else {
      continue;
    }
    if (index == kNone) return nullptr;
    checkBelow("collective line table", "line number", index, kLines);
    return reinterpret_cast<CollectiveRecord*>(tail_ + kTableBytes + index * kLineBytes);
  }
  return nullptr;
}

uint32_t CollectiveLines::take(Entry& entry) const {
  const uint32_t index = __atomic_fetch_add(&table().nextLine, 1, __ATOMIC_ACQ_REL);
  const uint32_t line = index < kLines ? index : kNone;
  __atomic_store_n(&entry.line, line == kNone ? kNone : line + 1, __ATOMIC_RELEASE);
  return line;
}

uint32_t CollectiveLines::await(const Entry& entry) {
  // Its maker stores the line right after it claimed the entry.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (;;) {
    const uint32_t line = __atomic_load_n(&entry.line, __ATOMIC_ACQUIRE);
    if (line == kNone) return kNone;
    if (line != 0) return line - 1;
    if (std::chrono::steady_clock::now() > deadline) {
      fail("a collective lane's record table entry was claimed and never filled (its maker died?)");
    }
    std::this_thread::yield();
  }
}

}  // namespace smfree::engine
