// Flag words: the signal words CUDA streams and progress threads wait on.

#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "engine/cuda/FlagSegment.h"

#include "check.h"

using namespace smfree::engine;

namespace {

constexpr size_t kFileBytes =
    cuda::FlagSegment::kWords * sizeof(uint32_t) + cuda::FlagSegment::kTailBytes;

// A pidfd of `pid`, closed when it goes.
struct Pidfd {
  explicit Pidfd(pid_t pid) : fd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0))) {}
  ~Pidfd() {
    if (fd >= 0) close(fd);
  }
  int fd;
};

// Runs `check` in a forked child; whether it returned true there.
template <typename Check>
bool inChild(Check check) {
  const pid_t child = fork();
  if (child == 0) _exit(check() ? 0 : 1);
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

TEST(flagValuesGrowPerWord, "flag values grow per word") {
  cuda::FlagSegment segment;
  const cuda::Flag first = segment.acquire();
  const cuda::Flag other = segment.acquire();
  CHECK(first.index != other.index);
  CHECK(!segment.isSet(first));
  segment.set(first);
  CHECK(segment.isSet(first));
  segment.release(first);
  const cuda::Flag again = segment.acquire();  // the word just released comes back...
  CHECK(again.index == first.index);
  CHECK(again.value == first.value + 1);  // ...with a larger value: old waits stay satisfied
  CHECK(!segment.isSet(again));
  CHECK(segment.inUse() == 2);
}

TEST(flagUsesOwnASpanOfValues, "a flag use owns a span of values") {
  cuda::FlagSegment segment;
  const cuda::Flag done = segment.acquire(3);
  segment.release(done);
  const cuda::Flag next = segment.acquire();
  CHECK(next.index == done.index);
  CHECK(next.value == done.value + 3);  // past every value the last use could have written
}

TEST(settingAFlagNeverLowersItsWord, "setting a flag never lowers its word") {
  cuda::FlagSegment segment;
  const cuda::Flag done = segment.acquire(3);
  segment.set(done.plus(2));  // what a GPU (or a peer) wrote first
  segment.set(done);          // a later release by this process's CPU
  CHECK(segment.wordOf(done) == done.value + 2);
  segment.set(done.plus(1));
  CHECK(segment.wordOf(done) == done.value + 2);
}

TEST(flagWaitsFollowTheGpuComparison, "flag waits follow the GPU comparison") {
  CHECK(cuda::reached(5, 5));
  CHECK(cuda::reached(6, 5));
  CHECK(!cuda::reached(4, 5));
  CHECK(cuda::reached(2, 0xFFFFFFFEu));   // wrapped past the top: still "greater or equal"
  CHECK(!cuda::reached(0xFFFFFFFEu, 2));
}

TEST(flagSegmentRunsOutLoudly, "flag segment runs out loudly") {
  cuda::FlagSegment segment;
  for (uint32_t i = 0; i < cuda::FlagSegment::kWords; ++i) segment.acquire();
  CHECK(testing::throwsError([&] { segment.acquire(); }, "too many CUDA ops in flight"));
}

TEST(flagSegmentCannotShrinkOrGrow, "a flag segment cannot be shrunk or grown") {
  cuda::FlagSegment segment;
  const cuda::Flag flag = segment.acquire();
  segment.set(flag);
  // How another process of the user reaches it: its own open file of the segment.
  const std::string path = concat("/proc/self/fd/", segment.ref().fd);
  const int other = open(path.c_str(), O_RDWR | O_CLOEXEC);
  CHECK(other >= 0);
  CHECK(ftruncate(other, 0) != 0 && errno == EPERM);
  CHECK(ftruncate(other, kFileBytes + 4096) != 0 && errno == EPERM);
  CHECK(fcntl(other, F_ADD_SEALS, F_SEAL_WRITE) != 0 && errno == EPERM);  // sealed for good
  close(other);
  CHECK(segment.isSet(flag));
  CHECK(segment.tail()[cuda::FlagSegment::kTailBytes - 1] == 0);  // its last page is there
}

TEST(flagSegmentHasAUniqueName, "a flag segment has a recognisable, unique memfd name") {
  cuda::FlagSegment one;
  cuda::FlagSegment two;
  CHECK(one.ref().name.rfind(concat("smfree-flags-", getpid(), "-"), 0) == 0);
  CHECK(one.ref().name != two.ref().name);
}

TEST(peersShareATakenSegment, "a peer takes the segment through a pidfd and shares its words") {
  cuda::FlagSegment segment;
  const Pidfd owner(getpid());
  CHECK(owner.fd >= 0);
  cuda::RemoteFlagSegment remote(owner.fd, segment.ref(), "pid 1 on host here");
  const cuda::Flag flag = segment.acquire();
  remote.set(flag);
  CHECK(segment.isSet(flag));
  segment.tail()[17] = 42;
  CHECK(remote.tail()[17] == 42);
}

TEST(aWrongSegmentIsRefused, "what is not the owner's sealed segment is refused before mapping") {
  cuda::FlagSegment segment;
  const Pidfd owner(getpid());
  const std::string who = "pid 7 on host h";
  const auto take = [&](cuda::FlagSegmentRef ref) {
    cuda::RemoteFlagSegment remote(owner.fd, ref, who);
  };
  CHECK(testing::throwsError([&] { take({"smfree-flags-0-x", segment.ref().fd}); },
                             "cannot take the flag segment of its peer process (pid 7 on host h): "
                             "its fd " + std::to_string(segment.ref().fd) + " is '/memfd:" +
                                 segment.ref().name + " (deleted)', not its flag segment"));
  const int file = open("/dev/null", O_RDWR | O_CLOEXEC);  // a path that the store could name
  CHECK(testing::throwsError([&] { take({segment.ref().name, file}); },
                             "is '/dev/null', not its flag segment"));
  close(file);
  CHECK(testing::throwsError([&] { take({segment.ref().name, 1 << 20}); },
                             "it has no fd 1048576, where it published its segment"));
  CHECK(testing::throwsError(
      [&] { cuda::RemoteFlagSegment remote(-1, segment.ref(), who); }, "there is no pidfd for it"));

  // A memfd of the right name that is not sealed, and one sealed at another size.
  const std::string name = "smfree-flags-test-unsealed";
  const int unsealed = memfd_create(name.c_str(), MFD_CLOEXEC);
  CHECK(unsealed >= 0 && ftruncate(unsealed, kFileBytes) == 0);
  CHECK(testing::throwsError([&] { take({name, unsealed}); },
                             "its segment is not sealed against shrink and grow"));
  close(unsealed);
  const int small = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(small >= 0 && ftruncate(small, 4096) == 0 &&
        fcntl(small, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0);
  CHECK(testing::throwsError([&] { take({name, small}); },
                             concat("its segment holds 4096 bytes, not ", kFileBytes)));
  close(small);
}

TEST(aSegmentOfAnExitedProcessIsRefused, "the segment of a process that exited is refused") {
  cuda::FlagSegment segment;  // the child's copy of its fd goes with the child
  const pid_t child = fork();
  if (child == 0) _exit(0);
  const Pidfd owner(child);
  CHECK(owner.fd >= 0);
  waitpid(child, nullptr, 0);
  CHECK(testing::throwsError(
      [&] { cuda::RemoteFlagSegment remote(owner.fd, segment.ref(), "pid 9 on host h"); },
      "(pid 9 on host h): the process exited"));
}

TEST(aRefusedTakeNamesTheFix, "a take that ptrace rules refuse says so and names the fix") {
  if (geteuid() != 0) {
    std::printf("  (not root: cannot become another user to be refused; not checked)\n");
    return;
  }
  cuda::FlagSegment segment;
  const pid_t parent = getpid();
  // Another user may not take a process's fds, whatever Yama says.
  CHECK(inChild([&] {
    const Pidfd owner(parent);
    if (owner.fd < 0 || setgid(65534) != 0 || setuid(65534) != 0) return false;
    return testing::throwsError(
        [&] { cuda::RemoteFlagSegment remote(owner.fd, segment.ref(), "pid 3 on host h"); },
        "pidfd_getfd was refused (EPERM): taking a peer's segment needs ptrace access to its "
        "process");
  }));
}

}  // namespace
