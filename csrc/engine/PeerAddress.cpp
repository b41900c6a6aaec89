#include "engine/PeerAddress.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>

#include "engine/Error.h"

namespace smfree::engine {
namespace {

std::string readFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string localHostname() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// Processes may share a hostname across containers; the boot id and PID namespace tell
// whether they really share a machine (and so CUDA IPC and process liveness checks).
std::string localHostKey() {
  struct stat pidNamespace {};
  const unsigned long long nsInode =
      stat("/proc/self/ns/pid", &pidNamespace) == 0 ? pidNamespace.st_ino : 0;
  return concat(localHostname(), "/", readFirstLine("/proc/sys/kernel/random/boot_id"), "/",
                nsInode);
}

constexpr uint32_t kMagic = 0x50464d53;  // "SMFP" in memory order on little-endian hosts
// Raised whenever the encoding changes: ranks built from different sources refuse each other.
constexpr uint32_t kVersion = 1;
constexpr size_t kMaxKeyBytes = 1024;            // process and host keys, hostname
constexpr size_t kMaxWorkerAddressBytes = 1 << 16;  // a UCX worker address (a few KB at most)

// FNV-1a: catches a value damaged in the store, not one forged.
uint64_t checksum(const uint8_t* data, size_t size) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < size; ++i) hash = (hash ^ data[i]) * 0x100000001b3ull;
  return hash;
}

template <typename Value>
void put(std::vector<uint8_t>& out, Value value) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), bytes, bytes + sizeof(value));
}

void putBytes(std::vector<uint8_t>& out, const uint8_t* data, size_t size) {
  put(out, static_cast<uint32_t>(size));
  out.insert(out.end(), data, data + size);
}

void putString(std::vector<uint8_t>& out, const std::string& text) {
  putBytes(out, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

// Reads the encoding front to back; every read is bounded by what is left and by the field's
// limit, and names the field when it fails.
class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& in) : in_(in), end_(in.size()) {}

  template <typename Value>
  Value get(const char* field) {
    Value value;
    if (end_ - offset_ < sizeof(value)) {
      fail("the peer address is truncated at its ", field, " (", in_.size(), " bytes)");
    }
    std::memcpy(&value, in_.data() + offset_, sizeof(value));
    offset_ += sizeof(value);
    return value;
  }

  std::string getString(const char* field, size_t minBytes, size_t maxBytes) {
    const uint32_t size = get<uint32_t>(field);
    if (size < minBytes || size > maxBytes) {
      fail("the peer address's ", field, " has ", size, " bytes, outside ", minBytes, "..",
           maxBytes);
    }
    if (end_ - offset_ < size) {
      fail("the peer address is truncated in its ", field, " (", in_.size(), " bytes)");
    }
    std::string text(reinterpret_cast<const char*>(in_.data() + offset_), size);
    offset_ += size;
    return text;
  }

  std::vector<uint8_t> getBytes(const char* field, size_t maxBytes) {
    const std::string text = getString(field, 1, maxBytes);
    return std::vector<uint8_t>(text.begin(), text.end());
  }

  // The fields end here: the checksum follows.
  void endAt(size_t end) { end_ = end; }
  size_t left() const { return end_ - offset_; }

 private:
  const std::vector<uint8_t>& in_;
  size_t end_;
  size_t offset_ = 0;
};

}  // namespace

std::vector<uint8_t> PeerAddress::encode() const {
  std::vector<uint8_t> out;
  put(out, kMagic);
  put(out, kVersion);
  putString(out, processKey);
  putString(out, hostKey);
  putString(out, hostname);
  put(out, static_cast<int32_t>(pid));
  putString(out, flagSegment.name);
  put(out, static_cast<int32_t>(flagSegment.fd));
  putBytes(out, workerAddress.data(), workerAddress.size());
  putBytes(out, receiveWorkerAddress.data(), receiveWorkerAddress.size());
  put(out, checksum(out.data(), out.size()));
  return out;
}

PeerAddress PeerAddress::decode(const std::vector<uint8_t>& bytes) {
  Reader in(bytes);
  const auto magic = in.get<uint32_t>("magic");
  if (magic != kMagic) {
    fail("the value is not an smfree peer address (it starts with 0x", std::hex, magic,
         ", not 0x", kMagic, ")");
  }
  const auto version = in.get<uint32_t>("version");
  if (version != kVersion) {
    fail("the peer address has version ", version, ", this build reads version ", kVersion,
         ": the ranks run different smfree versions");
  }
  uint64_t stored = 0;
  const size_t fieldsEnd = bytes.size() - sizeof(stored);  // past magic and version: no wrap
  std::memcpy(&stored, bytes.data() + fieldsEnd, sizeof(stored));
  if (bytes.size() < 2 * sizeof(uint32_t) + sizeof(stored) ||
      checksum(bytes.data(), fieldsEnd) != stored) {
    fail("the peer address's checksum does not match its ", bytes.size(), " bytes (damaged or "
         "truncated in the store)");
  }
  in.endAt(fieldsEnd);
  PeerAddress address;
  address.processKey = in.getString("process key", 1, kMaxKeyBytes);
  address.hostKey = in.getString("host key", 1, kMaxKeyBytes);
  address.hostname = in.getString("hostname", 0, kMaxKeyBytes);
  address.pid = in.get<int32_t>("pid");
  if (address.pid <= 0) fail("the peer address's pid is ", address.pid, ", not a process id");
  address.flagSegment.name = in.getString("flag segment name", 1, kMaxKeyBytes);
  address.flagSegment.fd = in.get<int32_t>("flag segment fd");
  if (address.flagSegment.fd < 0) {
    fail("the peer address's flag segment fd is ", address.flagSegment.fd, ", not an fd");
  }
  address.workerAddress = in.getBytes("worker address", kMaxWorkerAddressBytes);
  address.receiveWorkerAddress = in.getBytes("receive worker address", kMaxWorkerAddressBytes);
  if (in.left() != 0) fail("the peer address has ", in.left(), " bytes past its fields");
  return address;
}

PeerAddress PeerAddress::local(std::vector<uint8_t> workerAddress,
                               std::vector<uint8_t> receiveWorkerAddress,
                               cuda::FlagSegmentRef flagSegment) {
  PeerAddress address;
  address.hostKey = localHostKey();
  address.hostname = localHostname();
  address.pid = static_cast<int>(getpid());
  std::random_device random;
  address.processKey = concat(address.hostKey, "/", address.pid, "/", random(), random());
  address.workerAddress = std::move(workerAddress);
  address.receiveWorkerAddress = std::move(receiveWorkerAddress);
  address.flagSegment = std::move(flagSegment);
  return address;
}

std::string addressKey(int rank) { return concat("smfree/peer/", rank); }

std::string PeerAddress::describe() const {
  return concat("pid ", pid, " on host ", hostname);
}

}  // namespace smfree::engine
