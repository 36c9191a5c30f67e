// What epd leaves in its log when it dies of a fatal signal.
#pragma once

namespace epd {

/// Installs abseil's failure signal handler for SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL and
/// SIGTRAP: the signal's name, the faulting PC and a symbolized stack trace of the thread
/// that took it are written to stderr (epd's log, see logging.h) with async-signal-safe
/// calls, then the signal is raised again with its default action, so epd still dies of it
/// (a core dump where enabled; systemd and the kubelet see the crash and restart epd).
/// The trace is unwound through the signal frame with the unwind tables (glibc
/// backtrace()), since abseil's own frame-pointer walk stops at the first frame of Debian's
/// libraries. SIGTERM keeps its default action (it is epd's stop signal, taken by main's
/// waiter). `argv0` is the program's path, for the symbolizer. Call once, first thing in
/// main, before any thread starts.
void InstallFatalSignalHandler(const char* argv0);

}  // namespace epd
