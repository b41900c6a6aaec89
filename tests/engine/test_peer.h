#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <string>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace smfree::engine {

// The copy-engine tests' Peer: a process reached through a pidfd (in these tests, of this very
// process). CopyEnginePeer.h's functions of it are defined in copy_engine_protocols_tests.cpp.
struct Peer {
  std::string key;
  int pidfd = -1;
};

namespace testing {

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

}  // namespace testing
}  // namespace smfree::engine
