// The copy-engine channel's data in control messages: a struct's bytes come back as the struct,
// and data of another size is refused rather than read past or short.

#include "engine/channels/copy_engine/ChannelData.h"

#include <cstdint>

#include "check.h"

using namespace smfree::engine;

namespace {

struct Notice {
  uint64_t id;
  int32_t device;
  uint32_t slot;
};

TEST(channelDataRoundTrips, "a struct's bytes read back as the same struct") {
  const Notice sent{0x0102030405060708ull, -1, 7};
  const std::string bytes = toBytes(sent);
  CHECK(bytes.size() == sizeof(Notice));
  const auto read = fromBytes<Notice>(bytes);
  CHECK(read.has_value());
  CHECK(read->id == sent.id && read->device == -1 && read->slot == 7);
}

TEST(channelDataOfAnotherSizeIsRefused, "data shorter or longer than the struct reads as none") {
  const std::string bytes = toBytes(Notice{1, 2, 3});
  CHECK(!fromBytes<Notice>(bytes.substr(0, bytes.size() - 1)).has_value());
  CHECK(!fromBytes<Notice>(bytes + "x").has_value());
  CHECK(!fromBytes<Notice>(std::string()).has_value());
}

}  // namespace
