#pragma once

namespace smfree::engine {

// Tells whether a process on this host is still alive. A pidfd turns readable when the process
// exits, so the progress thread can sleep on it; without pidfd_open (old kernels, seccomp) it
// falls back to kill(pid, 0).
class ProcessWatch {
 public:
  explicit ProcessWatch(int pid);
  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  bool alive() const;
  int fd() const { return fd_; }  // -1 when there is nothing to poll

 private:
  int pid_;
  int fd_ = -1;
};

}  // namespace smfree::engine
