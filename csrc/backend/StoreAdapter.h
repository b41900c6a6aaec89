#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "engine/Store.h"

namespace smfree {

// The group's c10d Store as the engine's bootstrap store.
class StoreAdapter final : public engine::KeyValueStore {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    store_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override { return store_->get(key); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace smfree
