#include "engine/Wire.h"

#include <cstring>
#include <type_traits>

#include "engine/Error.h"

namespace smfree::engine {
namespace {

enum class MessageType : uint8_t {
  kReadyToSend = 1,
  kClearToSend,
  kRefusal,
  kCancellation,
  kMemoryReleased,
  kChannelNotice
};

class Writer {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* bytes = reinterpret_cast<const uint8_t*>(&value);
    out_.insert(out_.end(), bytes, bytes + sizeof(T));
  }
  void put(const std::string& text) {
    put<uint32_t>(static_cast<uint32_t>(text.size()));
    out_.insert(out_.end(), text.begin(), text.end());
  }
  void put(const TensorDesc& desc) {
    put(desc.bytes);
    put(desc.dtype);
    put(desc.device);
    put<uint32_t>(static_cast<uint32_t>(desc.shape.size()));
    for (int64_t dim : desc.shape) put(dim);
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  Reader(const void* data, size_t length)
      : data_(static_cast<const uint8_t*>(data)), length_(length) {}

  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T value;
    std::memcpy(&value, data_ + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }
  std::string getString() {
    const auto size = get<uint32_t>();
    need(size);
    std::string text(reinterpret_cast<const char*>(data_ + offset_), size);
    offset_ += size;
    return text;
  }
  TensorDesc getDesc() {
    TensorDesc desc;
    desc.bytes = get<uint64_t>();
    desc.dtype = getString();
    desc.device = getString();
    const auto dims = get<uint32_t>();
    need(static_cast<size_t>(dims) * sizeof(int64_t));
    for (uint32_t i = 0; i < dims; ++i) desc.shape.push_back(get<int64_t>());
    return desc;
  }

 private:
  void need(size_t bytes) const {
    if (offset_ + bytes > length_) {
      fail("truncated control message (", length_, " B, needed ", offset_ + bytes, " B)");
    }
  }

  const uint8_t* data_;
  size_t length_;
  size_t offset_ = 0;
};

void write(Writer& w, const ReadyToSend& m) {
  w.put(MessageType::kReadyToSend);
  w.put(m.group);
  w.put(m.source);
  w.put(m.tag);
  w.put(m.seq);
  w.put(m.sendId);
  w.put(m.desc);
  w.put(m.channel);
  w.put(static_cast<uint8_t>(m.promised));
}

void write(Writer& w, const ClearToSend& m) {
  w.put(MessageType::kClearToSend);
  w.put(m.group);
  w.put(m.receiver);
  w.put(m.sendId);
  w.put(m.recvId);
  w.put(m.channelData);
}

void write(Writer& w, const Refusal& m) {
  w.put(MessageType::kRefusal);
  w.put(m.group);
  w.put(m.receiver);
  w.put(m.sendId);
  w.put(m.code);
  w.put(m.reason);
}

void write(Writer& w, const Cancellation& m) {
  w.put(MessageType::kCancellation);
  w.put(m.group);
  w.put(m.source);
  w.put(m.tag);
  w.put(m.seq);
  w.put(m.recvId);
  w.put(m.reason);
}

void write(Writer& w, const MemoryReleased& m) {
  w.put(MessageType::kMemoryReleased);
  w.put(m.owner);
  w.put<uint32_t>(static_cast<uint32_t>(m.ids.size()));
  for (uint64_t id : m.ids) w.put(id);
}

void write(Writer& w, const ChannelNotice& m) {
  w.put(MessageType::kChannelNotice);
  w.put(m.sender);
  w.put(m.data);
}

}  // namespace

std::vector<uint8_t> encode(const ControlMessage& message) {
  Writer writer;
  std::visit([&](const auto& m) { write(writer, m); }, message);
  return writer.take();
}

ControlMessage decode(const void* data, size_t length) {
  Reader r(data, length);
  switch (r.get<MessageType>()) {
    case MessageType::kReadyToSend: {
      ReadyToSend m;
      m.group = r.get<uint64_t>();
      m.source = r.get<int32_t>();
      m.tag = r.get<int32_t>();
      m.seq = r.get<uint64_t>();
      m.sendId = r.get<uint64_t>();
      m.desc = r.getDesc();
      m.channel = r.get<ChannelKind>();
      if (m.channel != ChannelKind::kUcx && m.channel != ChannelKind::kCopyEngine) {
        fail("unknown data channel ", static_cast<int>(m.channel), " in a ready-to-send");
      }
      m.promised = r.get<uint8_t>() != 0;
      return m;
    }
    case MessageType::kClearToSend: {
      ClearToSend m;
      m.group = r.get<uint64_t>();
      m.receiver = r.get<int32_t>();
      m.sendId = r.get<uint64_t>();
      m.recvId = r.get<uint64_t>();
      m.channelData = r.getString();
      return m;
    }
    case MessageType::kRefusal: {
      Refusal m;
      m.group = r.get<uint64_t>();
      m.receiver = r.get<int32_t>();
      m.sendId = r.get<uint64_t>();
      m.code = r.get<StatusCode>();
      m.reason = r.getString();
      return m;
    }
    case MessageType::kCancellation: {
      Cancellation m;
      m.group = r.get<uint64_t>();
      m.source = r.get<int32_t>();
      m.tag = r.get<int32_t>();
      m.seq = r.get<uint64_t>();
      m.recvId = r.get<uint64_t>();
      m.reason = r.getString();
      return m;
    }
    case MessageType::kMemoryReleased: {
      MemoryReleased m;
      m.owner = r.getString();
      const auto count = r.get<uint32_t>();
      for (uint32_t i = 0; i < count; ++i) m.ids.push_back(r.get<uint64_t>());
      return m;
    }
    case MessageType::kChannelNotice: {
      ChannelNotice m;
      m.sender = r.getString();
      m.data = r.getString();
      return m;
    }
  }
  fail("unknown control message type");
}

}  // namespace smfree::engine
