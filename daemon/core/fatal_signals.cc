#include "daemon/core/fatal_signals.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"

namespace epd {
namespace {

// Everything below runs inside the signal handler: no allocation, no locks, no stdio.

constexpr int kMaxFrames = 64;

/// The faulting PC, from abseil's "PC: @ 0x..." line; 0 until it was seen.
uintptr_t fault_pc = 0;
bool trace_written = false;

void WriteStderr(const char* text) {
  for (size_t left = std::strlen(text); left > 0;) {
    const ssize_t n = ::write(STDERR_FILENO, text, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

/// `value` as "0x" and 16 hex digits into `out` (19 bytes with the terminating NUL).
void FormatHex(uintptr_t value, char* out) {
  out[0] = '0';
  out[1] = 'x';
  for (int i = 0; i < 16; ++i) out[2 + i] = "0123456789abcdef"[(value >> (60 - 4 * i)) & 0xf];
  out[18] = '\0';
}

/// The address after "PC: @" in `text` (abseil's line naming the faulting PC); 0 if none.
uintptr_t ParsePc(const char* text) {
  const char* p = std::strstr(text, "PC: @");
  if (p == nullptr) return 0;
  for (p += 5; *p == ' ';) ++p;
  if (p[0] != '0' || p[1] != 'x') return 0;
  uintptr_t value = 0;
  for (p += 2;; ++p) {
    const char c = *p;
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
    if (digit < 0) return value;
    value = value * 16 + static_cast<uintptr_t>(digit);
  }
}

/// abseil's writerfn: abseil has already written each piece of its report to stderr, so
/// the pieces are only read for the faulting PC; the final call (null) writes the stack
/// trace unwound from here through the signal frame, starting at the faulting PC.
void WriteUnwoundTrace(const char* data) {
  if (data != nullptr) {
    if (fault_pc == 0) fault_pc = ParsePc(data);
    return;
  }
  if (trace_written) return;
  trace_written = true;
  void* frames[kMaxFrames];
  const int depth = ::backtrace(frames, kMaxFrames);
  int first = 0;  // Frames before the faulting PC are this handler's own.
  for (int i = 0; i < depth; ++i) {
    if (fault_pc != 0 && reinterpret_cast<uintptr_t>(frames[i]) == fault_pc) {
      first = i;
      break;
    }
  }
  WriteStderr("*** stack trace (unwind tables), innermost first:\n");
  for (int i = first; i < depth; ++i) {
    const uintptr_t pc = reinterpret_cast<uintptr_t>(frames[i]);
    // A caller's frame holds the return address, just after its call: look up the call.
    const uintptr_t lookup = i == first && pc == fault_pc ? pc : pc - 1;
    char symbol[1024];
    if (!absl::Symbolize(reinterpret_cast<void*>(lookup), symbol, sizeof(symbol))) {
      std::strcpy(symbol, "(unknown)");
    }
    char address[19];
    FormatHex(pc, address);
    WriteStderr("    @ ");
    WriteStderr(address);
    WriteStderr("  ");
    WriteStderr(symbol);
    WriteStderr("\n");
  }
}

}  // namespace

void InstallFatalSignalHandler(const char* argv0) {
  absl::InitializeSymbolizer(argv0);
  // glibc loads its unwinder (libgcc_s) at the first backtrace(), which allocates: do it
  // now, not in the handler.
  void* warm_up[1];
  (void)::backtrace(warm_up, 1);
  absl::FailureSignalHandlerOptions options;
  options.writerfn = WriteUnwoundTrace;
  absl::InstallFailureSignalHandler(options);
  // abseil takes SIGTERM too: it is epd's stop signal, not a failure.
  ::signal(SIGTERM, SIG_DFL);
}

}  // namespace epd
