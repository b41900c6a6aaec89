#pragma once

#include <algorithm>
#include <array>
#include <memory>

#include "engine/Channel.h"

namespace smfree::engine {

// The engine's data channels, by kind. Iterated in the order the progress loop drives them:
// the copy engines, the captured ops, UCX, then the ops to the rank itself. Members of an
// optional group reach only the channels that declare it.
class Channels {
 public:
  Channels(std::unique_ptr<Channel> copyEngine, std::unique_ptr<Channel> captured,
           std::unique_ptr<Channel> ucx, std::unique_ptr<Channel> loopback)
      : all_{std::move(copyEngine), std::move(captured), std::move(ucx), std::move(loopback)} {}

  Channel& of(ChannelKind kind) { return *all_[index(kind)]; }
  Channel& of(const Op& op) { return of(op.channel); }

  template <typename Visit>
  void forEach(Visit visit) {
    for (auto& channel : all_) visit(*channel);
  }
  // Over the channels that declare `group`.
  template <typename Visit>
  void forEach(Capability group, Visit visit) {
    for (auto& channel : all_) {
      if (channel->declares(group)) visit(*channel);
    }
  }
  // The admission hooks (Capability::kAdmission): false where one holds the op back.
  bool admit(const std::shared_ptr<Op>& op) {
    return std::all_of(all_.begin(), all_.end(), [&](const auto& c) {
      return !c->declares(Capability::kAdmission) || c->admit(op);
    });
  }
  bool busy() const {
    return std::any_of(all_.begin(), all_.end(), [](const auto& c) {
      return c->declares(Capability::kProgress) && c->busy();
    });
  }
  // To the channel of that kind, if it takes notices.
  void notify(ChannelKind kind, const Notice& notice) {
    Channel& channel = of(kind);
    if (channel.declares(Capability::kNotices)) channel.onNotice(notice);
  }
  // Destroys them in reverse: UCX before the copy engines, its receive worker after its
  // endpoints' flushes.
  void reset() {
    for (auto it = all_.rbegin(); it != all_.rend(); ++it) it->reset();
  }

 private:
  static size_t index(ChannelKind kind) {
    switch (kind) {
      case ChannelKind::kCopyEngine:
        return 0;
      case ChannelKind::kCaptured:
        return 1;
      case ChannelKind::kLoopback:
        return 3;
      case ChannelKind::kUcx:
        break;
    }
    return 2;
  }

  std::array<std::unique_ptr<Channel>, 4> all_;
};

}  // namespace smfree::engine
