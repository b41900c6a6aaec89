#include "engine/cuda/FlagSegment.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/IpcExport.h"

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace smfree::engine::cuda {
namespace {

constexpr size_t kBytes = FlagSegment::kWords * sizeof(uint32_t);
// The words and the tail after them: one mapping per process, of which CUDA registers the words.
constexpr size_t kFileBytes = kBytes + FlagSegment::kTailBytes;
// Against shrink (SIGBUS in whoever touches a lost page) and grow; and no seal can be lifted.
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
constexpr const char* kNamePrefix = "smfree-flags-";

// Unique per segment: a taker that reached another process (a reused pid) or another fd finds
// another name there.
std::string uniqueName() {
  std::random_device random;
  const uint64_t nonce = (uint64_t{random()} << 32) | random();
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(nonce));
  return concat(kNamePrefix, getpid(), "-", hex);
}

volatile uint32_t* mapWords(int fd, const std::string& what) {
  void* address = mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (address == MAP_FAILED) {
    fail("cannot map ", what, ": ", std::strerror(errno));
  }
  return static_cast<volatile uint32_t*>(address);
}

void registerHost(volatile uint32_t* words) {
  // Portable: any context may use it; device-mapped: streams can write and wait on it.
  check(driver().cuMemHostRegister(const_cast<uint32_t*>(words), kBytes,
                                   CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
        "cuMemHostRegister of a flag segment");
}

// Atomic, so that a value a GPU writes meanwhile is not overwritten by a smaller one.
void raise(volatile uint32_t* word, uint32_t value) {
  uint32_t* plain = const_cast<uint32_t*>(word);
  uint32_t seen = __atomic_load_n(plain, __ATOMIC_ACQUIRE);
  while (!reached(seen, value) &&
         !__atomic_compare_exchange_n(plain, &seen, value, false, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE)) {
  }
}

std::string cannotTake(const std::string& owner) {
  return concat("cannot take the flag segment of its peer process (", owner, "): ");
}

std::string firstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Why pidfd_getfd gave EPERM, and the fix: it needs ptrace access to the owner.
std::string refusedBecause() {
  const std::string scope = firstLine("/proc/sys/kernel/yama/ptrace_scope");
  const std::string why =
      scope.empty()
          ? "this kernel has no Yama restriction, so the peer runs as another user, or a "
            "seccomp profile or a missing capability blocks it; fix: run the ranks as one user, "
          : concat("kernel.yama.ptrace_scope is ", scope, " here (1 allows it only over "
                   "descendants, not between sibling ranks); fix: sysctl -w "
                   "kernel.yama.ptrace_scope=0, ");
  return concat("pidfd_getfd was refused (EPERM): taking a peer's segment needs ptrace access to "
                "its process, and ", why, "or grant the ranks CAP_SYS_PTRACE (in a container: "
                "--cap-add SYS_PTRACE), or move same-host CUDA tensors over UCX "
                "(SMFREE_CHANNEL=ucx, slower)");
}

std::string kernelRelease() {
  utsname name{};
  return uname(&name) == 0 ? name.release : "unknown";
}

// The pid behind a pidfd, as the kernel reports it (never one read from the store).
int pidOf(int pidfd) {
  std::ifstream in(concat("/proc/self/fdinfo/", pidfd));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Pid:", 0) == 0) return std::atoi(line.c_str() + 4);
  }
  return -1;
}

bool exited(int pidfd) {
  pollfd watched{pidfd, POLLIN, 0};
  return poll(&watched, 1, 0) != 0;
}

// Where pidfd_getfd needs ptrace attach rights that the host withholds (Yama's ptrace_scope=1,
// Ubuntu's default, allows attaching only to descendants), /proc/<pid>/fd/<n> needs only read
// rights. The pid is the pidfd's, and the pidfd still names a live process after the open, so a
// reused pid or an altered store reaches no other file than pidfd_getfd would; the caller's
// checks of name, seals and size follow either way.
OwnedFd openThroughProc(int ownerPidfd, const FlagSegmentRef& published,
                        const std::string& owner) {
  const int pid = pidOf(ownerPidfd);
  const std::string path = concat("/proc/", pid, "/fd/", published.fd);
  const int fd = pid > 0 ? open(path.c_str(), O_RDWR | O_CLOEXEC) : -1;
  const int error = errno;
  if (fd < 0) fail(cannotTake(owner), refusedBecause(), "; opening ", path, " failed too: ",
                   std::strerror(error));
  OwnedFd taken(fd);
  if (exited(ownerPidfd)) fail(cannotTake(owner), "the process exited");
  logOnce("flag segment through /proc", "peers' flag segments are opened through "
          "/proc/<pid>/fd: pidfd_getfd is refused here (ptrace attach rights, e.g. "
          "kernel.yama.ptrace_scope=1)");
  return taken;
}

// The owner's segment, duplicated into this process through the owner's pidfd.
OwnedFd takeSegment(int ownerPidfd, const FlagSegmentRef& published, const std::string& owner) {
  if (ownerPidfd < 0) {
    fail(cannotTake(owner), "there is no pidfd for it (pidfd_open needs Linux 5.3+, this "
         "kernel is ", kernelRelease(), ", and seccomp must allow it)");
  }
  const long fd = syscall(SYS_pidfd_getfd, ownerPidfd, published.fd, 0);
  if (fd >= 0) return OwnedFd(static_cast<int>(fd));
  const int error = errno;
  switch (error) {
    case EPERM:
      return openThroughProc(ownerPidfd, published, owner);
    case ENOSYS:
      fail(cannotTake(owner), "pidfd_getfd is unavailable (ENOSYS): it needs Linux 5.6+, this "
           "kernel is ", kernelRelease(), "; same-host CUDA transfers need it (or set "
           "SMFREE_CHANNEL=ucx)");
    case ESRCH:
      fail(cannotTake(owner), "the process exited");
    case EBADF:
      fail(cannotTake(owner), "it has no fd ", published.fd, ", where it published its segment");
    default:
      fail(cannotTake(owner), "pidfd_getfd failed: ", std::strerror(error));
  }
}

// That the fd taken is the segment published: its memfd (by its unique name), sealed, whole.
void checkSegment(int fd, const FlagSegmentRef& published, const std::string& owner) {
  char link[512] = {};
  const std::string self = concat("/proc/self/fd/", fd);
  const ssize_t length = readlink(self.c_str(), link, sizeof(link) - 1);
  const std::string found = length > 0 ? std::string(link, static_cast<size_t>(length)) : "";
  const std::string expected = concat("/memfd:", published.name, " (deleted)");
  if (found != expected) {
    fail(cannotTake(owner), "its fd ", published.fd, " is '", found, "', not its flag segment '",
         expected, "' (a stale or altered address in the store, or another process at its pid)");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & kSeals) != kSeals) {
    fail(cannotTake(owner), "its segment is not sealed against shrink and grow (seals ",
         seals, ", expected ", kSeals, ")");
  }
  struct stat status {};
  if (fstat(fd, &status) != 0 || static_cast<size_t>(status.st_size) != kFileBytes) {
    fail(cannotTake(owner), "its segment holds ", status.st_size, " bytes, not ", kFileBytes);
  }
}

}  // namespace

bool reached(uint32_t word, uint32_t value) {
  // The same test as CU_STREAM_WAIT_VALUE_GEQ, so wrap-around agrees with the GPU's.
  return static_cast<int32_t>(word - value) >= 0;
}

FlagSegment::FlagSegment() {
  ref_.name = uniqueName();
  ref_.fd = memfd_create(ref_.name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (ref_.fd < 0) fail("cannot create the flag segment: ", std::strerror(errno));
  // The tail costs no memory until a page of it is touched.
  if (ftruncate(ref_.fd, kFileBytes) != 0 || fcntl(ref_.fd, F_ADD_SEALS, kSeals) != 0) {
    const int error = errno;
    close(ref_.fd);
    fail("cannot size and seal the flag segment: ", std::strerror(error));
  }
  words_ = mapWords(ref_.fd, "the flag segment");
  free_.reserve(kWords);
  for (uint32_t i = kWords; i > 0; --i) free_.push_back(i - 1);
  generation_.assign(kWords, 0);
}

FlagSegment::~FlagSegment() {
  if (registered_) {
    driver().cuMemHostUnregister(const_cast<uint32_t*>(words_));
  }
  munmap(const_cast<uint32_t*>(words_), kFileBytes);
  close(ref_.fd);
}

Flag FlagSegment::acquire(uint32_t span) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.empty()) {
    fail("all ", kWords, " flag words are in use: too many CUDA ops in flight");
  }
  const uint32_t index = free_.back();
  free_.pop_back();
  uint32_t first = generation_[index] + 1;
  const uint32_t last = first + (span - 1);
  if (first == 0 || last < first) {
    first = 1;  // no value of a use is 0, the word's value before its first use
  }
  generation_[index] = first + (span - 1);
  return Flag{index, first};
}

void FlagSegment::release(const Flag& flag) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(flag.index);
}

size_t FlagSegment::inUse() {
  std::lock_guard<std::mutex> lock(mutex_);
  return kWords - free_.size();
}

bool FlagSegment::isSet(const Flag& flag) const { return reached(words_[flag.index], flag.value); }

void FlagSegment::set(const Flag& flag) const { raise(words_ + flag.index, flag.value); }

void FlagSegment::store(const Flag& flag, uint32_t value) const {
  __atomic_store_n(const_cast<uint32_t*>(words_ + flag.index), value, __ATOMIC_RELEASE);
}

void* FlagSegment::cudaAddress(uint32_t index) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!registered_) {
      registerHost(words_);
      registered_ = true;
    }
  }
  // Unified addressing: the host address of registered memory is valid on the device.
  return const_cast<uint32_t*>(words_ + index);
}

RemoteFlagSegment::RemoteFlagSegment(int ownerPidfd, const FlagSegmentRef& published,
                                     const std::string& owner) {
  const OwnedFd taken = takeSegment(ownerPidfd, published, owner);
  checkSegment(taken.get(), published, owner);
  words_ = mapWords(taken.get(), concat("the flag segment of ", owner));
}

RemoteFlagSegment::~RemoteFlagSegment() {
  if (registered_) {
    driver().cuMemHostUnregister(const_cast<uint32_t*>(words_));
  }
  munmap(const_cast<uint32_t*>(words_), kFileBytes);
}

bool RemoteFlagSegment::isSet(const Flag& flag) const {
  return reached(words_[flag.index], flag.value);
}

void RemoteFlagSegment::set(const Flag& flag) const { raise(words_ + flag.index, flag.value); }

void* RemoteFlagSegment::cudaAddress(uint32_t index) {
  // Read without the lock once registered: eager sends ask at every post.
  if (!registered_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!registered_.load(std::memory_order_relaxed)) {
      registerHost(words_);
      registered_.store(true, std::memory_order_release);
    }
  }
  // Unified addressing: the host address of registered memory is valid on the device.
  return const_cast<uint32_t*>(words_ + index);
}

}  // namespace smfree::engine::cuda
