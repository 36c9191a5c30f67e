// FuzzInput: reads a fuzz input as a sequence of choices and byte strings, so a target can
// drive a series of calls from one input (the same with the g++ driver, fuzz_main.cc, and
// with libFuzzer). Every read past the end yields zeros / empty strings.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "daemon/core/logging.h"
#include "google/protobuf/message.h"
#include "google/protobuf/stubs/logging.h"
#include "spdlog/spdlog.h"

namespace epd::fuzz {

/// Silences epd's loggers and protobuf's (a fuzz run would print a line per refused call).
inline void Quiet() {
  spdlog::set_level(spdlog::level::off);
  (void)SetLogLevel("off");
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
}

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool Bool() { return (Byte() & 1) != 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | Byte();
    return v;
  }
  /// A length-prefixed string (one length byte, at most 255 bytes).
  std::string Bytes() { return Take(Byte()); }
  /// The next `n` bytes (fewer at the end).
  std::string Take(size_t n) {
    n = std::min(n, size_ - std::min(pos_, size_));
    std::string out(reinterpret_cast<const char*>(data_) + pos_, n);
    pos_ += n;
    return out;
  }
  /// Merges a length-prefixed chunk (two length bytes) into `message` as protobuf wire
  /// bytes: a valid template keeps most fields and the chunk overrides some. A chunk that
  /// does not parse leaves what was merged before its error.
  void MergeInto(google::protobuf::Message* message) {
    const size_t n = (size_t{Byte()} << 8) | Byte();
    const std::string chunk = Take(n);
    (void)message->MergeFromString(chunk);
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace epd::fuzz
