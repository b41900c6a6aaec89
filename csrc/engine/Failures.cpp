#include "engine/Failures.h"

namespace smfree::engine {

std::optional<std::string> Failures::ofPeer(const std::string& processKey) {
  return find(peers_, processKey);
}

std::optional<std::string> Failures::afterWait(uint64_t groupId) {
  return find(afterWait_, groupId);
}

void Failures::recordPeer(const std::string& processKey, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  peers_[processKey] = why;
  any_.store(true, std::memory_order_release);
}

void Failures::recordAfterWait(uint64_t groupId, std::string why) {
  std::lock_guard<std::mutex> lock(mutex_);
  afterWait_.try_emplace(groupId, std::move(why));
  any_.store(true, std::memory_order_release);
}

void Failures::forgetAfterWait(uint64_t groupId) {
  std::lock_guard<std::mutex> lock(mutex_);
  afterWait_.erase(groupId);
}

template <typename Key>
std::optional<std::string> Failures::find(const std::unordered_map<Key, std::string>& failures,
                                          const Key& key) {
  if (!any()) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = failures.find(key);
  if (it == failures.end()) {
    return std::nullopt;
  }
  return it->second;
}

}  // namespace smfree::engine
