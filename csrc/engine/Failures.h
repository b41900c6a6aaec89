#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace smfree::engine {

// Why peers and groups failed, as every thread may ask: a peer's process (by process key),
// and a group whose op failed after its wait() had returned. Thread-safe.
class Failures {
 public:
  // Cheap while nothing failed: lets the post path skip the lookups.
  bool any() const { return any_.load(std::memory_order_acquire); }
  std::optional<std::string> ofPeer(const std::string& processKey);
  // Why the group's calls are refused: an op of it failed after its wait() had returned.
  std::optional<std::string> afterWait(uint64_t groupId);

  void recordPeer(const std::string& processKey, const std::string& why);
  // The first such failure of the group is kept; later ones add nothing the caller can act on.
  void recordAfterWait(uint64_t groupId, std::string why);
  // A group of the same name opens again.
  void forgetAfterWait(uint64_t groupId);

 private:
  template <typename Key>
  std::optional<std::string> find(const std::unordered_map<Key, std::string>& failures,
                                  const Key& key);

  std::atomic<bool> any_{false};
  std::mutex mutex_;
  std::unordered_map<std::string, std::string> peers_;   // processKey -> why
  std::unordered_map<uint64_t, std::string> afterWait_;  // group id -> why
};

}  // namespace smfree::engine
