#include "engine/Channel.h"

#include "engine/Error.h"
#include "engine/Peer.h"

namespace smfree::engine {
namespace {

// The engine calls a member of an optional group only where its channel declared the group:
// reaching one of these is the engine's bug, not a silent no-op.
[[noreturn]] void undeclared(const char* member) {
  fail("internal error: Channel::", member, " called on a channel that does not declare it");
}

}  // namespace

bool Channel::reaches(const Peer& peer) const {
  return !declares(Capability::kSameHostOnly) || peer.sameHost;
}

PeerRoute Channel::connect(Peer&, const PeerError&) { undeclared("connect"); }
void Channel::disconnect(Peer&) { undeclared("disconnect"); }
void Channel::onNotice(const Notice&) { undeclared("onNotice"); }
Progress Channel::progress() { undeclared("progress"); }
bool Channel::busy() const { undeclared("busy"); }
void Channel::sweep() { undeclared("sweep"); }
bool Channel::admit(const std::shared_ptr<Op>&) { undeclared("admit"); }

}  // namespace smfree::engine
