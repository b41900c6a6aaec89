// What a process publishes in the store: it round-trips, and decode() refuses every value it
// cannot use by name, never reading out of bounds (a seeded fuzzer over mutated encodings).

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/PeerAddress.h"

#include "check.h"

using namespace smfree::engine;

namespace {

PeerAddress sample() {
  PeerAddress address;
  address.processKey = "node7/boot/4026531836/123/9876";
  address.hostKey = "node7/boot/4026531836";
  address.hostname = "node7";
  address.pid = 123;
  address.flagSegment = {"smfree-flags-123-0123456789abcdef", 17};
  address.workerAddress = {1, 2, 3, 4};
  address.receiveWorkerAddress = {5, 6, 7};
  return address;
}

// The checksum decode() expects after the fields (FNV-1a), so that a mutation reaches them.
std::vector<uint8_t> resealed(std::vector<uint8_t> bytes) {
  if (bytes.size() < sizeof(uint64_t)) return bytes;
  uint64_t hash = 0xcbf29ce484222325ull;
  const size_t end = bytes.size() - sizeof(hash);
  for (size_t i = 0; i < end; ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ull;
  std::memcpy(bytes.data() + end, &hash, sizeof(hash));
  return bytes;
}

// Where the field after the magic, the version and `strings` length-prefixed strings starts.
size_t fieldAt(const std::vector<uint8_t>& bytes, int strings) {
  size_t at = 8;
  for (int i = 0; i < strings; ++i) {
    uint32_t length = 0;
    std::memcpy(&length, bytes.data() + at, sizeof(length));
    at += sizeof(length) + length;
  }
  return at;
}

template <typename Value>
std::vector<uint8_t> with(std::vector<uint8_t> bytes, size_t at, Value value) {
  std::memcpy(bytes.data() + at, &value, sizeof(value));
  return resealed(std::move(bytes));
}

TEST(peerAddressRoundTrips, "a peer address round-trips") {
  const PeerAddress sent = sample();
  const PeerAddress got = PeerAddress::decode(sent.encode());
  CHECK(got.processKey == sent.processKey && got.hostKey == sent.hostKey);
  CHECK(got.hostname == sent.hostname && got.pid == sent.pid);
  CHECK(got.flagSegment.name == sent.flagSegment.name && got.flagSegment.fd == 17);
  CHECK(got.workerAddress == sent.workerAddress);
  CHECK(got.receiveWorkerAddress == sent.receiveWorkerAddress);
}

TEST(badPeerAddressesAreRefusedByName, "a peer address it cannot use is refused by name") {
  const std::vector<uint8_t> good = sample().encode();
  const auto refuses = [](const std::vector<uint8_t>& bytes, const std::string& why) {
    return testing::throwsError([&] { PeerAddress::decode(bytes); }, why);
  };
  CHECK(refuses({}, "the peer address is truncated at its magic (0 bytes)"));
  CHECK(refuses({'1', '2', '3', '\n'}, "the value is not an smfree peer address"));
  CHECK(refuses(with(good, 4, uint32_t{2}), "has version 2, this build reads version 1"));
  CHECK(refuses(std::vector<uint8_t>(good.begin(), good.begin() + 8),
                "the peer address's checksum does not match its 8 bytes"));
  std::vector<uint8_t> flipped = good;
  flipped[20] ^= 1;
  CHECK(refuses(flipped, "the peer address's checksum does not match"));
  CHECK(refuses(with(good, fieldAt(good, 0), uint32_t{0}), "process key has 0 bytes, outside"));
  CHECK(refuses(with(good, fieldAt(good, 2), uint32_t{1025}), "hostname has 1025 bytes, outside"));
  CHECK(refuses(with(good, fieldAt(good, 2), uint32_t{200}), "truncated in its hostname"));
  CHECK(refuses(with(good, fieldAt(good, 3), int32_t{0}), "pid is 0, not a process id"));
  CHECK(refuses(with(good, fieldAt(good, 3), int32_t{-1}), "pid is -1, not a process id"));
  const size_t fd = fieldAt(good, 3) + sizeof(int32_t);  // the segment's name, then its fd
  uint32_t nameBytes = 0;
  std::memcpy(&nameBytes, good.data() + fd, sizeof(nameBytes));
  CHECK(refuses(with(good, fd + sizeof(nameBytes) + nameBytes, int32_t{-3}),
                "flag segment fd is -3, not an fd"));
  const size_t worker = fd + sizeof(nameBytes) + nameBytes + sizeof(int32_t);
  CHECK(refuses(with(good, worker, uint32_t{0}), "worker address has 0 bytes, outside 1..65536"));
  CHECK(refuses(with(good, worker, uint32_t{1u << 20}), "worker address has 1048576 bytes"));
  std::vector<uint8_t> longer(good.begin(), good.end() - 8);
  longer.push_back(0);
  longer.resize(longer.size() + 8);
  CHECK(refuses(resealed(longer), "the peer address has 1 bytes past its fields"));
}

// Mutations that keep the checksum good, so that they reach every field's bounds: decode()
// returns or throws Error, and under AddressSanitizer reads nothing outside the bytes.
TEST(peerAddressDecodeFuzzed, "decoding mutated peer addresses only ever gives clean errors") {
  const std::vector<uint8_t> good = sample().encode();
  std::mt19937_64 random(62);
  size_t decoded = 0;
  for (long round = 0; round < testing::fuzzInputs; ++round) {
    std::vector<uint8_t> bytes = good;
    const int edits = 1 + static_cast<int>(random() % 4);
    for (int edit = 0; edit < edits; ++edit) {
      const size_t at = random() % bytes.size();
      switch (random() % 4) {
        case 0: bytes[at] = static_cast<uint8_t>(random()); break;
        case 1: bytes.resize(at); break;
        case 2: bytes.insert(bytes.begin() + at, static_cast<uint8_t>(random())); break;
        default: {  // a length or number at a random place: the fields' bounds
          const auto value = static_cast<uint32_t>(random() % 3 == 0 ? random() : random() % 2048);
          if (at + sizeof(value) <= bytes.size()) std::memcpy(bytes.data() + at, &value, 4);
        }
      }
      if (bytes.empty()) break;
    }
    if (random() % 8 != 0) bytes = resealed(std::move(bytes));
    try {
      PeerAddress::decode(bytes);
      ++decoded;
    } catch (const Error&) {
    }
  }
  // Reached only if no input read out of bounds (the sanitizers abort) or threw another type.
  std::printf("  fuzz %-28s %ld inputs, %zu accepted, 0 findings\n", "peer address",
              testing::fuzzInputs, decoded);
  CHECK(decoded > 0);  // some mutations leave a usable address (a byte inside a key)
}

}  // namespace
