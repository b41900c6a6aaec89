// Settings: the SMFREE_* variables parsed once, with defaults and refusals by name.

#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "engine/Config.h"

#include "check.h"

using namespace smfree::engine;

namespace {

// Sets the variables for one test and restores what was there before.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> settings) {
    for (const auto& [name, value] : settings) {
      const char* old = std::getenv(name);
      saved_.push_back({name, old != nullptr, old ? old : ""});
      value ? setenv(name, value, 1) : unsetenv(name);
    }
  }
  ~ScopedEnv() {
    for (const Saved& saved : saved_) {
      saved.was ? setenv(saved.name, saved.value.c_str(), 1) : unsetenv(saved.name);
    }
  }

 private:
  struct Saved {
    const char* name;
    bool was;
    std::string value;
  };
  std::vector<Saved> saved_;
};

TEST(configDefaults, "config: unset variables take their defaults") {
  ScopedEnv env{{"SMFREE_CHANNEL", nullptr}, {"SMFREE_STAGING_BYTES", nullptr},
                {"SMFREE_IPC_CACHE_SIZE", nullptr}, {"SMFREE_SPIN_US", nullptr},
                {"LOCAL_WORLD_SIZE", nullptr}, {"SMFREE_RING_MEMORY_BYTES", nullptr},
                {"SMFREE_EAGER_BYTES", nullptr}, {"SMFREE_LOCAL_COPIES", nullptr}};
  const Config config = Config::fromEnv();
  CHECK(config.cudaChannel == CudaChannel::kAuto);
  // Copies within one GPU take no SM, so nothing is staged: its copy out would be one.
  CHECK(config.localCopies == cuda::LocalCopies::kPeerGpu);
  CHECK(config.stagingBytes == 0);
  CHECK(config.eagerBytes == 16u << 20);
  CHECK(config.ringMemoryBytes == 1ull << 30);
  CHECK(config.ipcCacheSize == 1024);
  CHECK(!config.spin && !config.localRanks);  // Spin chooses
}

TEST(configReadsSpinAndLocalRanks, "config: SMFREE_SPIN_US and a LOCAL_WORLD_SIZE count are kept") {
  {
    ScopedEnv env{{"SMFREE_SPIN_US", "250"}, {"LOCAL_WORLD_SIZE", "4"}};
    const Config config = Config::fromEnv();
    CHECK(config.spin && config.spin->count() == 250);
    CHECK(config.localRanks == 4);
  }
  {
    // torchrun's variable, not ours: what is not a count is left alone, not refused.
    ScopedEnv env{{"LOCAL_WORLD_SIZE", "four"}};
    CHECK(!Config::fromEnv().localRanks);
  }
}

TEST(configStagesOnTheDriversCopies,
     "config: staging is on by default only where copies within one GPU are the driver's") {
  ScopedEnv env{{"SMFREE_STAGING_BYTES", nullptr}, {"SMFREE_LOCAL_COPIES", "driver"}};
  CHECK(Config::fromEnv().stagingBytes == 16u << 20);
  ScopedEnv host{{"SMFREE_LOCAL_COPIES", "host"}};
  CHECK(Config::fromEnv().stagingBytes == 0);
  ScopedEnv chosen{{"SMFREE_STAGING_BYTES", "8388608"}};
  CHECK(Config::fromEnv().stagingBytes == 8u << 20);
}

TEST(configReadsItsChoices, "config: each channel and size is read as given") {
  ScopedEnv env{{"SMFREE_CHANNEL", "ucx"}, {"SMFREE_STAGING_BYTES", "0"}};
  const Config config = Config::fromEnv();
  CHECK(config.cudaChannel == CudaChannel::kUcx);
  CHECK(config.stagingBytes == 0);
  ScopedEnv copyEngine{{"SMFREE_CHANNEL", "copy_engine"}};
  CHECK(Config::fromEnv().cudaChannel == CudaChannel::kCopyEngine);
}

TEST(configRefusesARenamedSettingNamingTheNewOne,
     "config: SMFREE_TRANSPORT, renamed SMFREE_CHANNEL, is refused naming SMFREE_CHANNEL") {
  ScopedEnv env{{"SMFREE_TRANSPORT", "ucx"}, {"SMFREE_CHANNEL", nullptr}};
  CHECK(testing::throwsError([] { Config::fromEnv(); },
                             "SMFREE_TRANSPORT='ucx' is no longer read: set SMFREE_CHANNEL"));
}

TEST(configRefusesTheOldRelayPieceSetting,
     "config: SMFREE_HOST_STAGING_PIECE_BYTES is refused naming SMFREE_RELAY_PIECE_BYTES") {
  ScopedEnv env{{"SMFREE_HOST_STAGING_PIECE_BYTES", "0"}};
  CHECK(testing::throwsError([] { Config::fromEnv(); },
                             "set SMFREE_RELAY_PIECE_BYTES instead"));
}

TEST(configRefusesBadValuesByName, "config: a bad value is refused naming the variable") {
  {
    ScopedEnv env{{"SMFREE_CHANNEL", "nvlink"}};
    CHECK(testing::throwsError([] { Config::fromEnv(); },
                               "SMFREE_CHANNEL='nvlink' is not one of auto, copy_engine, ucx"));
  }
  {
    ScopedEnv env{{"SMFREE_STAGING_BYTES", "4M"}};
    CHECK(testing::throwsError([] { Config::fromEnv(); },
                               "SMFREE_STAGING_BYTES='4M' is not a non-negative integer"));
  }
  {
    ScopedEnv env{{"SMFREE_IPC_CACHE_SIZE", "0"}};
    CHECK(testing::throwsError([] { Config::fromEnv(); }, "SMFREE_IPC_CACHE_SIZE must be at least 1"));
  }
  {
    ScopedEnv env{{"SMFREE_MAX_CUDA_OPS", "0"}};
    CHECK(testing::throwsError([] { Config::fromEnv(); }, "SMFREE_MAX_CUDA_OPS must be between 1 and"));
  }
}

}  // namespace
