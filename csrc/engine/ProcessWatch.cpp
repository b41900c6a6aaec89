#include "engine/ProcessWatch.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include "engine/Log.h"

namespace smfree::engine {

ProcessWatch::ProcessWatch(int pid) : pid_(pid) {
#ifdef SYS_pidfd_open
  fd_ = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  const int error = fd_ < 0 ? errno : 0;
#else
  const int error = ENOSYS;
#endif
  if (fd_ < 0 && error != ESRCH) {  // ESRCH: the process is gone, as kill(pid, 0) will say
    logOnce("pidfd", "pidfd_open is unavailable; peer processes are checked with kill(pid, 0)");
  }
}

ProcessWatch::~ProcessWatch() {
  if (fd_ >= 0) {
    close(fd_);
  }
}

bool ProcessWatch::alive() const {
  if (fd_ >= 0) {
    pollfd event{fd_, POLLIN, 0};
    return poll(&event, 1, 0) == 0;
  }
  return kill(pid_, 0) == 0 || errno != ESRCH;
}

}  // namespace smfree::engine
