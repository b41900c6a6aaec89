#include "engine/Peer.h"

namespace smfree::engine {

std::string Peer::describe() const { return address.describe(); }

}  // namespace smfree::engine
