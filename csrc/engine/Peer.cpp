#include "engine/Peer.h"

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

void putString(std::vector<uint8_t>& out, const std::string& text) {
  const auto size = static_cast<uint32_t>(text.size());
  const auto* sizeBytes = reinterpret_cast<const uint8_t*>(&size);
  out.insert(out.end(), sizeBytes, sizeBytes + sizeof(size));
  out.insert(out.end(), text.begin(), text.end());
}

std::string getString(const std::vector<uint8_t>& in, size_t& offset) {
  uint32_t size = 0;
  if (offset + sizeof(size) > in.size()) fail("truncated peer address");
  std::memcpy(&size, in.data() + offset, sizeof(size));
  offset += sizeof(size);
  if (offset + size > in.size()) fail("truncated peer address");
  std::string text(reinterpret_cast<const char*>(in.data() + offset), size);
  offset += size;
  return text;
}

}  // namespace

std::vector<uint8_t> PeerAddress::encode() const {
  std::vector<uint8_t> out;
  putString(out, processKey);
  putString(out, hostKey);
  putString(out, hostname);
  putString(out, std::to_string(pid));
  putString(out, flagSegment);
  putString(out, std::string(workerAddress.begin(), workerAddress.end()));
  putString(out, std::string(receiveWorkerAddress.begin(), receiveWorkerAddress.end()));
  return out;
}

PeerAddress PeerAddress::decode(const std::vector<uint8_t>& bytes) {
  size_t offset = 0;
  PeerAddress address;
  address.processKey = getString(bytes, offset);
  address.hostKey = getString(bytes, offset);
  address.hostname = getString(bytes, offset);
  address.pid = std::stoi(getString(bytes, offset));
  address.flagSegment = getString(bytes, offset);
  const std::string worker = getString(bytes, offset);
  address.workerAddress.assign(worker.begin(), worker.end());
  const std::string receiveWorker = getString(bytes, offset);
  address.receiveWorkerAddress.assign(receiveWorker.begin(), receiveWorker.end());
  return address;
}

PeerAddress PeerAddress::local(std::vector<uint8_t> workerAddress,
                               std::vector<uint8_t> receiveWorkerAddress,
                               std::string flagSegment) {
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

std::string Peer::describe() const {
  return concat("pid ", address.pid, " on host ", address.hostname);
}

}  // namespace smfree::engine
