// Matching: sequence order per (source, tag) line, any-source, cancellations.

#include <memory>

#include "engine/Matcher.h"
#include "engine/PeerValue.h"

#include "check.h"

using namespace smfree::engine;

namespace {

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

TEST(matchesInSequenceOrder, "matches in sequence order") {
  Matcher matcher;
  CHECK(matcher.announce(rts(1, 0, 0, 10)).empty());
  CHECK(matcher.announce(rts(1, 0, 1, 11)).empty());
  auto first = matcher.postRecv(recv(1, 0));
  auto second = matcher.postRecv(recv(1, 0));
  CHECK(first && first->announcement.rts.sendId == 10);
  CHECK(second && second->announcement.rts.sendId == 11);
}

TEST(releasesOutOfOrderAnnouncementsBySequence, "releases out-of-order announcements by sequence") {
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

TEST(tagsAreSeparateLines, "tags are separate lines") {
  Matcher matcher;
  matcher.announce(rts(1, 7, 0, 70));
  matcher.announce(rts(1, 3, 0, 30));
  auto three = matcher.postRecv(recv(1, 3));
  auto seven = matcher.postRecv(recv(1, 7));
  CHECK(three && three->announcement.rts.sendId == 30);
  CHECK(seven && seven->announcement.rts.sendId == 70);
  CHECK(!matcher.postRecv(recv(2, 3)));  // another source's line is empty
}

TEST(anySourceAndSpecificFollowPostingOrder, "any-source and specific follow posting order") {
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

TEST(anySourceTakesTheOldestAnnouncement, "any-source takes the oldest announcement") {
  Matcher matcher;
  matcher.announce(rts(3, 0, 0, 30));
  matcher.announce(rts(1, 0, 0, 10));
  auto first = matcher.postRecv(recv(kAnySource, 0));
  auto second = matcher.postRecv(recv(kAnySource, 0));
  CHECK(first && first->announcement.rts.source == 3);
  CHECK(second && second->announcement.rts.source == 1);
  CHECK(!matcher.postRecv(recv(kAnySource, 0)));
}

TEST(cancelledAnnouncementKeepsItsPlace, "cancelled announcement keeps its place") {
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

TEST(clearReturnsPostedRecvs, "clear returns posted recvs") {
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

TEST(matcherCapsWhatOneSourceHasWaiting,
     "matcher: past its cap a source's announcement is refused; other sources go on") {
  Matcher matcher;
  for (uint64_t seq = 0; seq < Matcher::kMaxWaitingPerSource; ++seq) {
    matcher.announce(rts(1, static_cast<int>(seq % 3), seq / 3));
  }
  CHECK(testing::throwsError([&] { matcher.announce(rts(1, 0, 1u << 20)); },
                             "bad number of waiting announcements in a ready-to-send: rank 1 "
                             "has 65536 sends announced"));
  CHECK(matcher.announce(rts(2, 0, 0)).empty());  // another source is unaffected
  CHECK(matcher.postRecv(recv(1, 0)).has_value());  // a match frees a place
  const uint64_t next = (Matcher::kMaxWaitingPerSource + 2) / 3;
  CHECK(matcher.announce(rts(1, 0, next)).empty());
  matcher.clear();
  CHECK(matcher.announce(rts(1, 0, 0)).empty());
}

TEST(matcherRefusesASequenceNumberSeenBefore,
     "matcher: a sequence number already released or already waiting early is refused") {
  Matcher matcher;
  CHECK(matcher.announce(rts(1, 0, 0)).empty());
  CHECK(testing::throwsError([&] { matcher.announce(rts(1, 0, 0)); },
                             "bad sequence number in a ready-to-send: 0 of rank 1 tag 0 was "
                             "announced before (next expected: 1)"));
  CHECK(matcher.announce(rts(1, 0, 5)).empty());
  CHECK(testing::throwsError([&] { matcher.announce(rts(1, 0, 5)); }, "bad sequence number"));
  try {
    matcher.announce(rts(1, 0, 5));
  } catch (const BadPeerValue& error) {
    CHECK(error.field() == "sequence number");
  }
  // Neither refusal disturbed the line: 1 to 4 still release 5 after them.
  for (uint64_t seq = 1; seq < 5; ++seq) matcher.announce(rts(1, 0, seq));
  int matched = 0;
  while (matcher.postRecv(recv(1, 0))) ++matched;
  CHECK(matched == 6);
}

}  // namespace
