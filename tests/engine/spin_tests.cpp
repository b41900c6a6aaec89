// Spin: how long the engine's threads poll, and when the host's ranks make it stop.

#include "engine/Spin.h"

#include "check.h"

using namespace smfree::engine;

namespace {

Config configOf(std::optional<std::chrono::microseconds> spin, std::optional<long> localRanks) {
  Config config{};
  config.spin = spin;
  config.localRanks = localRanks;
  return config;
}

TEST(spinCountsPeersWhereNobodyChose, "spin: counted same-host ranks stop it once they crowd the CPUs") {
  Spin spin(configOf(std::nullopt, std::nullopt), 4);
  CHECK(spin.get() == Spin::kDefault);
  spin.onRanksOnHost(2);  // 4 polling threads on 4 CPUs
  CHECK(spin.get() == Spin::kDefault);
  spin.onRanksOnHost(3);
  CHECK(spin.get().count() == 0);
  spin.onRanksOnHost(1);  // fewer known later (a peer failed): it stays stopped
  CHECK(spin.get().count() == 0);
}

TEST(spinFollowsTheLauncher, "spin: LOCAL_WORLD_SIZE decides at start, peers do not") {
  Spin crowded(configOf(std::nullopt, 3), 4);
  CHECK(crowded.get().count() == 0);
  Spin roomy(configOf(std::nullopt, 2), 4);
  CHECK(roomy.get() == Spin::kDefault);
  roomy.onRanksOnHost(8);
  CHECK(roomy.get() == Spin::kDefault);
}

TEST(spinKeepsTheUsersChoice, "spin: SMFREE_SPIN_US holds whatever shares the host") {
  Spin chosen(configOf(std::chrono::microseconds(250), 100), 2);
  CHECK(chosen.get().count() == 250);
  chosen.onRanksOnHost(100);
  CHECK(chosen.get().count() == 250);
  Spin off(configOf(std::chrono::microseconds(0), std::nullopt), 64);
  CHECK(off.get().count() == 0);
}

TEST(spinAloneOnOneCpu, "spin: a rank alone has two polling threads, too many for one CPU") {
  CHECK(Spin(configOf(std::nullopt, std::nullopt), 1).get().count() == 0);
  CHECK(Spin(configOf(std::nullopt, std::nullopt), 2).get() == Spin::kDefault);
}

TEST(spinWithoutACpuCount, "spin: where the CPUs are unknown it keeps its default") {
  Spin spin(configOf(std::nullopt, std::nullopt), 0);
  spin.onRanksOnHost(1000);
  CHECK(spin.get() == Spin::kDefault);
  CHECK(Spin::cpusOfProcess() >= 1);
}

TEST(spinDeadlineEndsAStuckWait, "spin deadline: a spin past its limit throws naming the wait") {
  SpinDeadline quick(std::chrono::milliseconds(0), "a test's wait");
  CHECK(testing::throwsError(
      [&] {
        for (;;) quick.check();
      },
      "a test's wait did not end within 0 ms: the thread or process it waits on is stuck or "
      "gone"));
  SpinDeadline patient(std::chrono::seconds(60), "a patient wait");
  for (uint32_t i = 0; i < 10 * SpinDeadline::kCallsPerClockRead; ++i) patient.check();
}

}  // namespace
