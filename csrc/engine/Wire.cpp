#include "engine/Wire.h"

#include <cstring>
#include <type_traits>
#include <utility>

#include "engine/Error.h"
#include "engine/PeerValue.h"

namespace smfree::engine {
namespace {

// The first byte of every message: its place in ControlMessage, from 1.
using MessageType = uint8_t;

// Enums read off the wire must name one of their values.
bool known(ChannelKind kind) {
  return kind == ChannelKind::kUcx || kind == ChannelKind::kCopyEngine ||
         kind == ChannelKind::kCaptured;
}
bool known(StatusCode code) {
  return static_cast<int>(code) >= static_cast<int>(StatusCode::kOk) &&
         static_cast<int>(code) <= static_cast<int>(StatusCode::kChannel);
}
const char* enumName(ChannelKind) { return "data channel"; }
const char* enumName(StatusCode) { return "status code"; }

// Numbers and enums as their bytes; bool as one byte, 0 or 1; strings and vectors as a uint32 count
// and their contents; a TensorDesc as its fields.
class Writer {
 public:
  template <typename... Fields>
  void operator()(const Fields&... fields) {
    (put(fields), ...);
  }
  std::vector<uint8_t> take() { return std::move(out_); }

  template <typename T>
  void put(const T& value) {
    static_assert(std::is_arithmetic_v<T> || std::is_enum_v<T>, "no wire encoding for this type");
    if constexpr (std::is_same_v<T, bool>) {
      put(static_cast<uint8_t>(value));
    } else {
      const auto* bytes = reinterpret_cast<const uint8_t*>(&value);
      out_.insert(out_.end(), bytes, bytes + sizeof(T));
    }
  }
  void put(const std::string& text) {
    putCount(text.size());
    out_.insert(out_.end(), text.begin(), text.end());
  }
  template <typename T>
  void put(const std::vector<T>& items) {
    putCount(items.size());
    for (const T& item : items) put(item);
  }
  void put(const TensorDesc& desc) { (*this)(desc.bytes, desc.dtype, desc.device, desc.shape); }

 private:
  void putCount(size_t count) { put(static_cast<uint32_t>(count)); }

  std::vector<uint8_t> out_;
};

class Reader {
 public:
  Reader(const void* data, size_t length, const char* message)
      : data_(static_cast<const uint8_t*>(data)), length_(length), message_(message) {}

  template <typename... Fields>
  void operator()(Fields&... fields) {
    (get(fields), ...);  // a fold over the comma operator: in the listed order
  }
  void setMessage(const char* message) { message_ = message; }

  template <typename T>
  void get(T& value) {
    static_assert(std::is_arithmetic_v<T> || std::is_enum_v<T>, "no wire decoding for this type");
    if constexpr (std::is_same_v<T, bool>) {
      uint8_t byte = 0;
      get(byte);
      if (byte > 1) {
        badPeerValue(message_, "bool", "byte ", static_cast<int>(byte), " is not 0 or 1");
      }
      value = byte != 0;
    } else {
      need(sizeof(T));
      std::memcpy(&value, data_ + offset_, sizeof(T));
      offset_ += sizeof(T);
      if constexpr (std::is_enum_v<T>) {
        if (!known(value)) {
          badPeerValue(message_, enumName(value), "unknown value ",
                       static_cast<long long>(value));
        }
      }
    }
  }
  void get(std::string& text) {
    const uint32_t size = getCount(1);
    text.assign(reinterpret_cast<const char*>(data_ + offset_), size);
    offset_ += size;
  }
  template <typename T>
  void get(std::vector<T>& items) {
    static_assert(std::is_arithmetic_v<T>, "vectors on the wire hold numbers");
    items.resize(getCount(sizeof(T)));
    for (T& item : items) get(item);
  }
  void get(TensorDesc& desc) { (*this)(desc.bytes, desc.dtype, desc.device, desc.shape); }
  // A message is exactly its fields: bytes past them are refused, not ignored.
  void finish() const {
    if (offset_ != length_) {
      badPeerValue(message_, "length", length_, " B, its fields end at ", offset_, " B");
    }
  }

 private:
  // A count, checked against the bytes left before anything is allocated for it.
  uint32_t getCount(size_t itemBytes) {
    uint32_t count = 0;
    get(count);
    need(static_cast<size_t>(count) * itemBytes);
    return count;
  }
  void need(size_t bytes) const {
    if (bytes > length_ - offset_) {
      badPeerValue(message_, "length", "truncated at ", length_, " B, needed ",
                   offset_ + bytes, " B");
    }
  }

  const uint8_t* data_;
  size_t length_;
  size_t offset_ = 0;
  const char* message_;
};

// What a field's type leaves open, and needs no group to check: ranks are not negative, a
// refusal refuses. Ranks against their group's size, op ids against their kind and partner:
// OpControl, which knows both.
constexpr uint64_t kRanks = uint64_t{1} << 31;
void checkFields(const ReadyToSend& m) { checkBelow(m.kName, "source rank", m.source, kRanks); }
void checkFields(const ClearToSend& m) {
  checkBelow(m.kName, "receiver rank", m.receiver, kRanks);
}
void checkFields(const Refusal& m) {
  checkBelow(m.kName, "receiver rank", m.receiver, kRanks);
  if (m.code == StatusCode::kOk) badPeerValue(m.kName, "status code", "a refusal says ok");
}
void checkFields(const Cancellation& m) { checkBelow(m.kName, "source rank", m.source, kRanks); }
void checkFields(const MemoryReleased&) {}
void checkFields(const ChannelNotice&) {}
void checkFields(const Probe&) {}

template <size_t Index>
ControlMessage decodeAs(Reader& reader) {
  using Message = std::variant_alternative_t<Index, ControlMessage>;
  Message message;
  reader.setMessage(Message::kName);
  Message::fields(message, reader);
  reader.finish();
  checkFields(message);
  return message;
}

template <size_t... Index>
ControlMessage decodeByType(MessageType type, Reader& reader, std::index_sequence<Index...>) {
  using Decode = ControlMessage (*)(Reader&);
  static constexpr Decode kDecoders[] = {&decodeAs<Index>...};
  if (type == 0 || type > sizeof...(Index)) {
    badPeerValue("control message", "message type", "unknown type ", static_cast<int>(type),
                 " (known: 1 to ", sizeof...(Index), ")");
  }
  return kDecoders[type - 1](reader);
}

}  // namespace

std::vector<uint8_t> encode(const ControlMessage& message) {
  Writer writer;
  writer.put(static_cast<MessageType>(message.index() + 1));
  std::visit([&](const auto& m) { std::decay_t<decltype(m)>::fields(m, writer); }, message);
  return writer.take();
}

ControlMessage decode(const void* data, size_t length) {
  Reader reader(data, length, "control message");
  MessageType type = 0;
  reader.get(type);
  return decodeByType(type, reader,
                      std::make_index_sequence<std::variant_size_v<ControlMessage>>());
}

}  // namespace smfree::engine
