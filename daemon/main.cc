// epd: the expert-parallel daemon. Thin by design: flags → config → Daemon → wait for
// SIGTERM/SIGINT → Daemon::Shutdown → exit 0 (daemon/core/daemon.h; docs/DEPLOYMENT.md §5).
// SIGHUP reloads the configuration from the same --config file and flags
// (Daemon::ReloadConfig; docs/OPERATIONS.md "Reloading the configuration").
// A fatal signal logs a stack trace before epd dies of it (daemon/core/fatal_signals.h).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/errors/reason.h"
#include "daemon/core/config.h"
#include "daemon/core/config_overrides.h"
#include "daemon/core/daemon.h"
#include "daemon/core/fatal_signals.h"
#include "daemon/core/logging.h"

int main(int argc, char** argv) {
  epd::InstallFatalSignalHandler(argv[0]);
  // SIGHUP (a reload) and SIGUSR1/2 are blocked from the start: their default action would
  // end epd when one comes before the signal thread below takes them (they stay pending
  // until then). SIGTERM/SIGINT keep theirs until then: a stop before start-up is a stop.
  {
    sigset_t early;
    sigemptyset(&early);
    sigaddset(&early, SIGHUP);
    sigaddset(&early, SIGUSR1);
    sigaddset(&early, SIGUSR2);
    pthread_sigmask(SIG_BLOCK, &early, nullptr);
  }
  absl::SetProgramUsageMessage(
      "the expert-parallel daemon (MoE dispatch/combine for every process on the "
      "node).\nUsage: epd [--config=/etc/epd/epd.textproto] [--socket=/run/epd/epd.sock] "
      "[--listen=host:port] [--backend=auto|cuda|host] ...\nEach flag sets the DaemonConfig "
      "field its help names and, when given, overrides the --config file; the defaults shown "
      "are the DaemonConfig defaults.");
  // --help lists the daemon's flags (they live in daemon/core/config.cc, not in this file);
  // --version prints epd's version.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "daemon/");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.version_string = [] { return std::string("epd ") + epd::kEpdVersion + "\n"; };
  // "Flags from daemon/core/config.cc", not the build machine's path to it.
  usage.normalize_filename = [](absl::string_view file) {
    const size_t at = file.rfind("daemon/");
    return std::string(at == absl::string_view::npos ? file : file.substr(at));
  };
  absl::SetFlagsUsageConfig(usage);
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {  // [0] is the program.
    std::fprintf(stderr,
                 "epd: unexpected argument \"%s\": epd takes flags only (a configuration "
                 "file is --config=PATH; see --help)\n",
                 positional[1]);
    return 2;
  }
  const epd::ConfigFlags flags = epd::ConfigFlagsFromCommandLine();
  absl::StatusOr<epd::ResolvedDaemonConfig> config = epd::ResolveDaemonConfigWithOverrides(flags);
  if (!config.ok()) {
    std::fprintf(stderr, "epd: bad configuration: %s\n",
                 epd::errors::StatusText(config.status()).c_str());
    return 2;
  }

  // Every thread inherits this mask: SIGTERM/SIGINT are only ever taken by the waiter below,
  // which also ends a start-up that hangs (e.g. in CUDA initialisation) instead of leaving the
  // signal pending.
  // SIGHUP asks for a config reload, which this thread (main) runs once the daemon is up
  // (several SIGHUPs before it gets to them make one reload). SIGUSR1 and SIGUSR2, whose
  // default action would kill epd without a drain or a log line, are taken too: logged and
  // otherwise ignored.
  // The waiter thread is detached and may outlive main's frame (a failed start returns at
  // once), so what it reads and writes lives in a block it shares.
  struct StopState {
    sigset_t signals;
    absl::Mutex mu;
    bool stop_requested ABSL_GUARDED_BY(mu) = false;
    uint64_t reloads_requested ABSL_GUARDED_BY(mu) = 0;
    uint64_t reloads_done ABSL_GUARDED_BY(mu) = 0;
    absl::Notification started;
    int signal_number = 0;
    /// Whether main has something to do: stop, or a reload not yet run.
    bool Pending() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return stop_requested || reloads_requested != reloads_done;
    }
  };
  auto stop = std::make_shared<StopState>();
  sigemptyset(&stop->signals);
  sigaddset(&stop->signals, SIGTERM);
  sigaddset(&stop->signals, SIGINT);
  sigaddset(&stop->signals, SIGHUP);
  sigaddset(&stop->signals, SIGUSR1);
  sigaddset(&stop->signals, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &stop->signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  std::thread([stop] {
    int signal_number = 0;
    while (true) {
      sigwait(&stop->signals, &signal_number);
      if (signal_number == SIGTERM || signal_number == SIGINT) break;
      if (signal_number == SIGHUP) {
        absl::MutexLock lock(&stop->mu);
        ++stop->reloads_requested;
        continue;
      }
      epd::GetLogger(epd::kLogDaemon)
          ->warn("received {}: ignored (SIGHUP reloads the configuration, SIGTERM stops epd)",
                 signal_number == SIGUSR1 ? "SIGUSR1" : "SIGUSR2");
    }
    stop->signal_number = signal_number;
    {
      absl::MutexLock lock(&stop->mu);
      stop->stop_requested = true;
    }
    if (!stop->started.WaitForNotificationWithTimeout(absl::Seconds(4))) {
      epd::GetLogger(epd::kLogDaemon)
          ->critical("stop signal during start-up, which did not finish within 4 s; exiting");
      _exit(1);
    }
  }).detach();

  epd::DaemonOptions options;
  options.backend_source = epd::BackendSource(config->config, flags);
  options.flag_overrides = config->overridden;
  options.config_source = [flags] { return epd::ResolveDaemonConfigWithOverrides(flags); };
  absl::StatusOr<std::unique_ptr<epd::Daemon>> daemon =
      epd::Daemon::Start(std::move(config->config), options);
  if (!daemon.ok()) {
    // Start logged the reason, unless the log level hides errors (off, critical): then
    // stderr gets it, so that a failed start is never silent.
    if (!epd::GetLogger(epd::kLogDaemon)->should_log(spdlog::level::err)) {
      std::fprintf(stderr, "epd: failed to start: %s\n",
                   epd::errors::StatusText(daemon.status()).c_str());
    }
    return 1;
  }
  stop->started.Notify();

  while (true) {
    {
      absl::MutexLock lock(&stop->mu);
      stop->mu.Await(absl::Condition(stop.get(), &StopState::Pending));
      if (stop->stop_requested) break;
      stop->reloads_done = stop->reloads_requested;
    }
    epd::GetLogger(epd::kLogDaemon)
        ->info("received SIGHUP: reloading the configuration from {}",
               flags.config_path && !flags.config_path->empty()
                   ? absl::StrCat(*flags.config_path, " and the command line")
                   : std::string("the command line (no --config file)"));
    // Logged, audited and counted by the daemon; epd runs on whatever the outcome.
    (void)(*daemon)->ReloadConfig(std::nullopt);
  }
  epd::GetLogger(epd::kLogDaemon)
      ->info("received {}: shutting down", stop->signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  // The drain is bounded (drain_grace, the GPU drain, the servers' 1 s: under 3 s); should
  // anything still hang, do not outlive kShutdownHardLimit.
  std::thread([] {
    absl::SleepFor(epd::kShutdownHardLimit);
    epd::GetLogger(epd::kLogDaemon)
        ->critical("shutdown did not finish within {}; exiting",
                   absl::FormatDuration(epd::kShutdownHardLimit));
    _exit(1);
  }).detach();
  (*daemon)->Shutdown();
  daemon->reset();
  return 0;
}
