"""Timing helpers of DeepEP's test suite, written for epd.

bench times a function with CUDA events (wall clock on CPU). bench_kineto times the
GPU kernels whose names contain given words, as DeepEP's does; with epd those kernels
run in this process only in client-launched mode. In daemon-launched mode they run in
the epd daemon, invisible to this process's profiler: bench_kineto then returns the
end-to-end time of fn for every name (see its docstring and docs/DEEP_EP.md).
"""

import json
import os
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = ["bench", "bench_kineto", "flush_l2_cache", "suppress_stdout_stderr"]

_L2_FLUSH_BYTES = 256 * 1000 * 1000


def flush_l2_cache(enabled: bool = True) -> None:
    """Overwrites 256 MB of GPU memory so that later reads miss the L2 (CUDA only)."""
    if enabled and torch.cuda.is_available():
        torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda").zero_()


def bench(fn: Callable, num_warmups: int = 30, num_tests: int = 30,
          post_fn: Optional[Callable] = None, flush_l2: bool = True):
    """Times fn: returns (average, min, max) seconds over num_tests calls after
    num_warmups, the first timed call left out. CUDA events around each call (after an L2
    flush) with CUDA, else the wall clock."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    for _ in range(num_warmups):
        fn()
    times = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(num_tests)]
        for start, end in events:
            flush_l2_cache(flush_l2)
            start.record()
            fn()
            end.record()
            if post_fn is not None:
                post_fn()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for _ in range(num_tests):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if post_fn is not None:
                post_fn()
    times = times[1:] if len(times) > 1 else times
    return sum(times) / len(times), min(times), max(times)


class suppress_stdout_stderr:
    """Context manager sending file descriptors 1 and 2 (and sys.stdout/err) to /dev/null."""

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self._null = open(os.devnull, "w")
        self._saved = [(fd, os.dup(fd)) for fd in (1, 2)]
        for fd, _ in self._saved:
            os.dup2(self._null.fileno(), fd)
        self._streams = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self._null
        return self

    def __exit__(self, *_):
        sys.stdout, sys.stderr = self._streams
        for fd, saved in self._saved:
            os.dup2(saved, fd)
            os.close(saved)
        self._null.close()


class _NoSuppress:

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return None


def _kernel_events(profiler) -> list:
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        profiler.export_chrome_trace(tmp.name)
        with open(tmp.name) as f:
            trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e),
                  key=lambda e: e.get("ts", 0))


def _cuda_timer(fn: Callable) -> float:
    """Seconds of one call of fn between CUDA events on the current stream, the stream
    drained first (so earlier work, e.g. a prologue's sleep, is not counted)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _wall_timer(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_calls(fn: Callable, num_tests: int, prologue: Callable,
                 timer: Optional[Callable[[Callable], float]] = None) -> float:
    """Average seconds of one call of fn over num_tests calls, each run after prologue()
    (not timed) and timed by timer(fn) (default _cuda_timer)."""
    timer = timer or _cuda_timer
    total = 0.0
    for _ in range(num_tests):
        prologue()
        total += timer(fn)
    return total / num_tests


def bench_kineto(fn: Callable, kernel_names: Union[str, Sequence[str]], num_tests: int = 30,
                 suppress_kineto_output: bool = False, trace_path: Optional[str] = None,
                 flush_l2: bool = True, barrier_comm_profiling: bool = False,
                 num_kernels_per_period: int = 1, barrier: Optional[Callable] = None):
    """Average GPU time in seconds of the kernels whose names contain each of kernel_names
    (case-insensitive), over num_tests calls of fn profiled with torch.profiler.

    Returns one value per name (a tuple for a tuple of names, else a float); with
    num_kernels_per_period = n > 1, a list of n values per name: the matching kernels of
    one call taken in launch order (a call launching fewer than n gives its total first,
    then zeros).
    barrier_comm_profiling: before each call, a ~10 ms GPU sleep and a barrier (`barrier`,
    or an all_reduce on the default group), so ranks start the call together.
    When no kernel matches any name (epd daemon-launched mode: the kernels run in the
    daemon), fn is run num_tests more times, each after the same prologue (L2 flush, and
    the sleep and barrier of barrier_comm_profiling) outside the timed region, and every
    name gets the average end-to-end time of one call of fn between CUDA events: all of
    fn's work on its stream (e.g. dispatch and combine together, and whatever else fn
    runs). With n > 1 a name gets [that time, 0, ...]: the send and receive phases are not
    told apart, so element 0 is send + receive end to end. EP_USE_NVIDIA_TOOLS=1 skips
    profiling and returns 1s.
    """
    names = (kernel_names,) if isinstance(kernel_names, str) else tuple(kernel_names)
    as_tuple = not isinstance(kernel_names, str)
    period = max(1, int(num_kernels_per_period))

    def shape(values):
        return tuple(values) if as_tuple else values[0]

    if int(os.environ.get("EP_USE_NVIDIA_TOOLS", "0")):
        return shape([1 if period == 1 else [1] * period for _ in names])
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kineto needs CUDA")

    dummy = []

    def before():
        flush_l2_cache(flush_l2)
        if barrier_comm_profiling:
            torch.cuda._sleep(int(2e7))
            if barrier is not None:
                barrier()
            else:
                if not dummy:
                    dummy.append(torch.ones(1, dtype=torch.float32, device="cuda"))
                dist.all_reduce(dummy[0])

    fn()
    torch.cuda.synchronize()
    suppress = suppress_stdout_stderr if suppress_kineto_output else _NoSuppress
    with suppress():
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        with profiler:
            for _ in range(num_tests):
                before()
                fn()
            torch.cuda.synchronize()
    if trace_path is not None:
        profiler.export_chrome_trace(trace_path)
    kernels = _kernel_events(profiler)

    matched = {n: [e["dur"] / 1e6 for e in kernels if n.lower() in e.get("name", "").lower()]
               for n in names}
    if not any(matched.values()):
        e2e = _timed_calls(fn, num_tests, before)
        return shape([e2e if period == 1 else [e2e] + [0.0] * (period - 1) for _ in names])
    results = []
    for n in names:
        durations = matched[n]
        per_call = sum(durations) / num_tests
        if period == 1:
            results.append(per_call)
        elif len(durations) % (period * num_tests) == 0 and durations:
            results.append([sum(durations[j::period]) / num_tests for j in range(period)])
        else:
            results.append([per_call] + [0.0] * (period - 1))
    return shape(results)
