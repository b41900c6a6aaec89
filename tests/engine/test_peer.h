#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "engine/Peer.h"
#include "engine/ProcessWatch.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace smfree::engine::testing {

// A pidfd of this process, through which the tests' peers are reached.
struct OwnPidfd {
  int fd = static_cast<int>(syscall(SYS_pidfd_open, getpid(), 0));
  OwnPidfd() = default;
  OwnPidfd(const OwnPidfd&) = delete;
  OwnPidfd& operator=(const OwnPidfd&) = delete;
  ~OwnPidfd() {
    if (fd >= 0) close(fd);
  }
};

// The copy-engine tests' peer: this very process under `key`, watched through a pidfd of its
// own. CopyEnginePeer.h's functions of it are defined in copy_engine_protocols_tests.cpp.
inline Peer ownPeer(const std::string& key) {
  Peer peer;
  peer.address.processKey = key;
  peer.sameHost = true;
  peer.watch = std::make_unique<ProcessWatch>(getpid());
  return peer;
}

}  // namespace smfree::engine::testing
