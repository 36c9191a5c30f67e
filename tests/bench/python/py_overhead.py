#!/usr/bin/env python3
"""What the Python path adds to a low-latency dispatch + combine, against the C++ path, in
one run (docs/BENCHMARKS.md "Python overhead").

R rank processes (torch.multiprocessing, spawn) on one epd; each runs the same ops through
two groups of the same spec: group "-py" through the `epd` package, group "-c" through the
C ABI from a small C++ loop (ll_loop.cc, the module _epd_bench_ll, built here against the
libepdclient that epd._C loaded). Both paths run on the same torch tensors (x [T, H] bf16,
topk_idx [T, K] int64, topk_weights [T, K] f32) in the same processes, in blocks that
alternate between the paths (--order), and time the same calls:

- submit: the op call that returns with the op submitted (Python: wait=False, returning a
  PendingOp; C++: epd_low_latency_dispatch / _combine on prepared arguments);
- complete: the wait that finds the op done, with its result (Python: PendingOp.wait(0),
  which builds the result of cached views; C++: epd_op_wait(op, 0) + epd_op_ll_*_result);
  both poll every --poll-us and time only the call that succeeds, so the op's own run time
  is not in it;
- end to end: the blocking op (Python: wait=True; C++: submit + epd_op_wait(-1) + result).

Added per op = Python (submit + complete) - C++ (submit + complete), medians over every
rank's ops; the goal is <= --goal-us (5 us). The same figures follow for the same ops with
T = 0 on the same endpoints, polled without sleeping: no data moved, so what is left is the
calls' own cost (with warm caches where each rank has a core). On the host backend the op
moves the data with the CPU (~20 ms per op at the DeepSeek decode shape on a 2-core VM),
which also evicts the interpreter's working set. The run also checks that the low-latency
ops allocate no tensor per op: the result views are the same objects op after op (two
buffer sets), live torch tensors do not grow, and the Python heap does not grow per op.

    # host backend: starts its own epd --backend=host
    tests/bench/python/py_overhead.py [--iters 20] [--json out.json]
    # a running daemon (CUDA backend, CUDA tensors)
    tests/bench/python/py_overhead.py --socket /tmp/epd.sock --device cuda --launch-mode client

Exit status 0 when it ran (whatever the verdict; --check-goal makes a missed goal exit 1).
"""

import argparse
import gc
import json
import os
import queue
import statistics
import subprocess
import sys
import sysconfig
import time
import traceback
import warnings

# torch 1.13 warns about a deprecated alias when torch.distributed is imported.
warnings.filterwarnings("ignore", message="torch.distributed.reduce_op is deprecated")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
DRIVER = "_epd_bench_ll"


# ---- the C++ loop: built against the library epd._C uses ----------------------------------


def _loaded_libepdclient():
    import epd  # noqa: F401 (loads libepdclient through epd._C)

    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "/libepdclient.so" in path:
                return os.path.realpath(path)
    raise RuntimeError("epd._C is loaded but no libepdclient.so is mapped")


def _first_with(dirs, rel, what):
    for d in dirs:
        if d and os.path.exists(os.path.join(d, rel)):
            return d
    raise RuntimeError("%s not found in %s" % (rel, [d for d in dirs if d]) + (" (%s)" % what))


def build_driver(build_dir):
    """Compiles ll_loop.cc into build_dir (when older than its source or the library) and
    returns the directory to import it from."""
    lib = _loaded_libepdclient()
    lib_dir = os.path.dirname(lib)
    out = os.path.join(build_dir, DRIVER + sysconfig.get_config_var("EXT_SUFFIX"))
    src = os.path.join(HERE, "ll_loop.cc")
    if os.path.exists(out) and os.path.getmtime(out) >= max(os.path.getmtime(src), os.path.getmtime(lib)):
        return build_dir
    prefix = os.environ.get("EPD_PREFIX")
    epd_inc = _first_with([prefix and os.path.join(prefix, "include"), os.path.join(REPO, "client", "include"),
                           os.path.join(os.path.dirname(lib_dir), "include"), "/usr/local/include"],
                          os.path.join("epd", "epd.h"), "set EPD_PREFIX")
    dl_inc = _first_with([os.environ.get("DLPACK_INCLUDE_DIR"), epd_inc, "/usr/include", "/usr/local/include"],
                         os.path.join("dlpack", "dlpack.h"), "install libdlpack-dev or set DLPACK_INCLUDE_DIR")
    try:
        import pybind11

        pb_inc = pybind11.get_include()
    except ImportError:
        pb_inc = "/usr/include"
    os.makedirs(build_dir, exist_ok=True)
    tmp = out + ".tmp%d" % os.getpid()
    cmd = [os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
           "-I" + pb_inc, "-I" + sysconfig.get_paths()["include"], "-I" + epd_inc, "-I" + dl_inc,
           src, "-o", tmp, "-L" + lib_dir, "-l:" + os.path.basename(lib), "-Wl,-rpath," + lib_dir]
    print("py_overhead: building the C++ loop: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    os.replace(tmp, out)
    return build_dir


# ---- one rank ---------------------------------------------------------------------------


def _pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _rank_inputs(torch, a, rank, device):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn((a.tokens, a.hidden), generator=g).to(torch.bfloat16)
    # Uniform routing: K distinct experts per token.
    idx = torch.empty((0, a.topk), dtype=torch.int64)
    if a.tokens > 0:
        idx = torch.stack([torch.randperm(a.experts, generator=g)[:a.topk] for _ in range(a.tokens)])
    w = torch.rand((a.tokens, a.topk), generator=g, dtype=torch.float32)
    return x.to(device), idx.to(device), w.to(device)


def _py_block(ep, x, idx, w, cin, iters, split, poll_s, stream):
    """`iters` Python dispatch + combine ops; returns per-op ns lists."""
    import epd

    t = {k: [] for k in ("dispatch_submit", "dispatch_complete", "dispatch_total",
                         "combine_submit", "combine_complete", "combine_total")}
    clock = time.perf_counter_ns

    def complete(p):
        while True:
            t0 = clock()
            try:
                r = p.wait(0)
            except epd.DeadlineExceededError:
                if poll_s > 0:
                    time.sleep(poll_s)
                else:
                    os.sched_yield()
                continue
            return r, clock() - t0

    for _ in range(iters):
        if split:
            t0 = clock()
            p = ep.low_latency_dispatch(x, idx, stream=stream, wait=False)
            t1 = clock()
            r, done = complete(p)
            t2 = clock()
        else:
            t0 = clock()
            r = ep.low_latency_dispatch(x, idx, stream=stream)
            t1 = t2 = clock()
            done = t2 - t0
        t["dispatch_submit"].append(t1 - t0)
        t["dispatch_complete"].append(done)
        t["dispatch_total"].append(t2 - t0)
        if split:
            t0 = clock()
            q = ep.low_latency_combine(cin, idx, w, r.handle, stream=stream, wait=False)
            t1 = clock()
            c, done = complete(q)
            t2 = clock()
        else:
            t0 = clock()
            c = ep.low_latency_combine(cin, idx, w, r.handle, stream=stream)
            t1 = t2 = clock()
            done = t2 - t0
        t["combine_submit"].append(t1 - t0)
        t["combine_complete"].append(done)
        t["combine_total"].append(t2 - t0)
        del r, c
    return t


def _live_tensors(torch):
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


_FIELDS = ("recv_x", "recv_count", "recv_src_info", "combined_x")


def _alloc_block(torch, ep, x, idx, w, cin, iters, stream):
    """Blocking Python dispatch + combine pairs with nothing recorded per op, after two that
    give the reference objects: `iters` pairs (free lists fill once), then windows of
    `iters` and 2 * `iters` pairs. Counts result views that are not one of the reference
    objects (two buffer sets) over all of them, the growth of live torch tensors over the
    windows, and the Python heap blocks the 2n-pair window gains beyond the n-pair one."""
    refs = {f: [] for f in _FIELDS}
    for _ in range(2):
        r = ep.low_latency_dispatch(x, idx, stream=stream)
        c = ep.low_latency_combine(cin, idx, w, r.handle, stream=stream)
        for f, v in zip(_FIELDS, (r.recv_x, r.recv_count, r.recv_src_info, c.combined_x)):
            refs[f].append(v)
    del r, c
    firsts = tuple(tuple(refs[f]) for f in _FIELDS)

    def ops(n):
        new_views = 0
        for _ in range(n):
            r = ep.low_latency_dispatch(x, idx, stream=stream)
            c = ep.low_latency_combine(cin, idx, w, r.handle, stream=stream)
            for v, (o0, o1) in zip((r.recv_x, r.recv_count, r.recv_src_info, c.combined_x), firsts):
                if v is not o0 and v is not o1:
                    new_views += 1
        return new_views

    def window(n):
        """(new views, heap blocks gained) over n ops."""
        gc.collect()
        blocks0 = sys.getallocatedblocks()
        views = ops(n)
        blocks1 = sys.getallocatedblocks()
        return views, blocks1 - blocks0

    new_views = ops(iters)
    gc.collect()
    tensors0 = _live_tensors(torch)
    # A window holds a few blocks whatever its length (the measuring's own ints, the last
    # op's garbage): the growth per op is the difference between n and 2n ops.
    views1, blocks1 = window(iters)
    views2, blocks2 = window(2 * iters)
    new_views += views1 + views2
    gc.collect()
    distinct = {f: len({id(o) for o in refs[f]}) for f in _FIELDS}
    return {"ops": 2 * (4 * iters), "new_views": new_views, "blocks_delta": blocks2 - blocks1,
            "blocks_window": [blocks1, blocks2],
            "tensors_delta": _live_tensors(torch) - tensors0, "distinct_first_two": distinct}


def _rank_main(a, socket, rank, driver_dir, barrier, outbox):
    try:
        outbox.put((rank, True, _rank_run(a, socket, rank, driver_dir, barrier)))
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))


def _rank_run(a, socket, rank, driver_dir, barrier):
    import torch
    import torch.utils.dlpack

    import epd

    sys.path.insert(0, driver_dir)
    import _epd_bench_ll

    torch.set_num_threads(1)
    device = "cpu"
    stream = None
    if a.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = "cuda"
        # Both paths submit on one side stream (torch's default stream would read as none).
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
    c_stream = stream.cuda_stream if stream is not None else 0
    x, idx, w = _rank_inputs(torch, a, rank, device)
    client = epd.Client.connect(socket, client_name="py_overhead-py")
    # The launch mode and GPU the first Python join gets, for every later join of both paths.
    joined = {}

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    class PyPath:
        """Group "<group>-py<gen>" through the epd package."""

        def __init__(self, gen):
            spec = epd.GroupSpec("%s-py%d" % (a.group, gen), num_ranks=a.ranks, hidden=a.hidden,
                                 num_topk=a.topk, num_experts=a.experts, max_tokens_per_rank=a.mll,
                                 max_dispatch_tokens_per_rank=a.mll)
            self.ep = client.join(spec, rank, launch_mode=joined.get("mode_name", a.launch_mode))
            joined.setdefault("mode_name", self.ep.info.launch_mode)
            joined.setdefault("info", self.ep.info)
            self.cin = self.ep.low_latency_combine_input()

        def run(self, iters, split, t):
            # T=0 ops are polled without sleeping (see --empty-ops).
            out = _py_block(self.ep, x[:t], idx[:t], w[:t], self.cin, iters, split,
                            a.poll_us / 1e6 if t > 0 else 0, stream)
            sync()
            return out

        def close(self):
            self.cin = None
            self.ep.close()
            gc.collect()

    class CPath:
        """Group "<group>-c<gen>" through the C ABI (ll_loop.cc), same spec and mode."""

        def __init__(self, gen):
            info = joined["info"]
            mode = {"default": 0, "daemon": 1, "client": 2}[info.launch_mode]
            self.loop = _epd_bench_ll.LlLoop(socket, "%s-c%d" % (a.group, gen), a.ranks, a.hidden, a.topk,
                                             a.experts, a.mll, a.mll, rank, info.gpu_uuid, mode)

        def run(self, iters, split, t):
            caps = [torch.utils.dlpack.to_dlpack(v[:t]) for v in (x, idx, w)]
            out = self.loop.run(*caps, iters, split, a.poll_us if t > 0 else 0, c_stream)
            sync()
            return out

        def close(self):
            self.loop.leave()
            self.loop = None

    # The op at T tokens and, with --empty-ops, the same ops at T = 0 on the same endpoints,
    # polled without sleeping (no data moved and the process kept running: the calls' own
    # cost, with warm caches when each rank has a core of its own).
    sets = [("", a.tokens)] + ([("_t0", 0)] if a.empty_ops else [])
    res = {p + suffix: [] for p in ("py_split", "c_split", "py_e2e", "c_e2e") for suffix, _ in sets}

    def warm(paths):
        for _, t in sets:
            for split in (True, False):
                for _, path in paths:
                    path.run(a.warmup, split, t)

    def block(paths):
        for suffix, t in sets:
            for split, name in ((True, "_split"), (False, "_e2e")):
                for key, path in paths:
                    res[key + name + suffix].append(path.run(a.iters, split, t))

    alloc = None
    if a.order == "interleaved":
        py, c = PyPath(0), None
        c = CPath(0)
        warm((("py", py), ("c", c)))
        for _ in range(a.blocks):
            block((("py", py), ("c", c)))
        alloc = _alloc_block(torch, py.ep, x, idx, w, py.cin, a.alloc_iters, stream)
        c.close()
        py.close()
    else:
        # One group at a time (the host backend's low-latency buffers are large): sequential
        # runs every Python block, then every C++ block; alternating joins a fresh group of
        # each path for each block, so slow drifts of the machine hit both paths alike.
        rounds = [(0, a.blocks)] if a.order == "sequential" else [(b, 1) for b in range(a.blocks)]
        for gen, n in rounds:
            py = PyPath(gen)
            warm((("py", py),))
            for _ in range(n):
                block((("py", py),))
            if alloc is None:
                alloc = _alloc_block(torch, py.ep, x, idx, w, py.cin, a.alloc_iters, stream)
            py.close()
            barrier.wait()  # every rank has left before any joins the next group
            c = CPath(gen)
            warm((("c", c),))
            for _ in range(n):
                block((("c", c),))
            c.close()
            barrier.wait()
    client.close()
    merged = {}
    for path, blocks in res.items():
        merged[path] = {k: [v for b in blocks for v in b[k]] for k in blocks[0]}
    info = joined["info"]
    return {"times": merged, "alloc": alloc, "launch_mode": info.launch_mode, "cuda": info.cuda}


# ---- the parent ---------------------------------------------------------------------------


def _stats(ns):
    return {"p50_us": statistics.median(ns) / 1e3, "p99_us": _pct(ns, 0.99) / 1e3, "n": len(ns)}


def _op_rows(a, pooled, suffix, label):
    rows, verdicts = [], []
    for op in ("dispatch", "combine"):
        pair = []
        for what, key in (("submit (CPU)", op + "_submit"), ("complete (CPU, op done)", op + "_complete")):
            c, p = _stats(pooled["c_split" + suffix][key]), _stats(pooled["py_split" + suffix][key])
            pair.append({"figure": "%s %s%s" % (op, what, label), "cpp": c, "python": p,
                         "added_p50_us": p["p50_us"] - c["p50_us"]})
        added = sum(r["added_p50_us"] for r in pair)
        ok = added <= a.goal_us
        rows += pair + [{"figure": "%s: added per op%s" % (op, label), "added_p50_us": added,
                         "goal_us": a.goal_us, "verdict": "PASS" if ok else "MISS"}]
        verdicts.append(ok)
    for op in ("dispatch", "combine"):
        c, p = _stats(pooled["c_e2e" + suffix][op + "_total"]), _stats(pooled["py_e2e" + suffix][op + "_total"])
        rows.append({"figure": "%s end to end (wait)%s" % (op, label), "cpp": c, "python": p,
                     "added_p50_us": p["p50_us"] - c["p50_us"]})
    return rows, all(verdicts)


def summarize(a, results):
    pooled = {}
    for r in results:
        for path, figs in r["times"].items():
            for k, v in figs.items():
                pooled.setdefault(path, {}).setdefault(k, []).extend(v)
    rows, ok = _op_rows(a, pooled, "", "")
    empty = None
    if "py_split_t0" in pooled:
        rows_t0, ok_t0 = _op_rows(a, pooled, "_t0", ", T=0")
        empty = {"rows": rows_t0, "verdict": "PASS" if ok_t0 else "MISS"}
    ops = sum(r["alloc"]["ops"] for r in results)
    alloc = {
        "ops": ops,
        "new_view_objects": sum(r["alloc"]["new_views"] for r in results),
        "live_tensors_delta": sum(r["alloc"]["tensors_delta"] for r in results),
        # Heap blocks gained by 2n ops minus those gained by n ops: per-op growth times n.
        "allocated_blocks_delta": sum(r["alloc"]["blocks_delta"] for r in results),
        # (each rank: n iterations of 2 ops, the difference of its two windows)
        "allocated_blocks_per_op": sum(r["alloc"]["blocks_delta"] for r in results)
        / max(1, sum(r["alloc"]["ops"] for r in results) / 4),
        "distinct_objects_of_first_two_ops": results[0]["alloc"]["distinct_first_two"],
    }
    # Every op returns one of the objects of the first two (double-buffered results), and
    # neither the heap nor the live tensors grow.
    no_alloc = (alloc["new_view_objects"] == 0 and alloc["live_tensors_delta"] == 0
                and alloc["allocated_blocks_delta"] <= 0)
    alloc["verdict"] = "PASS" if no_alloc else "MISS"
    return rows, empty, alloc, ok and no_alloc


def _print_rows(rows):
    for r in rows:
        if "cpp" in r:
            print("%-44s %9.1f %9.1f %9.1f %9.1f %10.1f" % (
                r["figure"], r["cpp"]["p50_us"], r["cpp"]["p99_us"], r["python"]["p50_us"], r["python"]["p99_us"],
                r["added_p50_us"]))
        else:
            print("%-44s %9s %9s %9s %9s %10.1f %6.1f %8s" % (
                r["figure"], "", "", "", "", r["added_p50_us"], r["goal_us"], r["verdict"]))


def print_table(a, rows, empty, alloc, info):
    print()
    print("py_overhead: low-latency dispatch + combine, Python (epd package) vs C++ (C ABI loop) in one run")
    print("shape: R=%d T=%d H=%d K=%d E=%d Mll=%d; %s backend, %s tensors, launch mode %s; %d blocks x %d ops "
          "per path per rank (+%d warm-up), %s, completion polled %s, all ranks pooled; times in us"
          % (a.ranks, a.tokens, a.hidden, a.topk, a.experts, a.mll, info["backend"], a.device,
             info["launch_mode"], a.blocks, a.iters, a.warmup, a.order,
             "every %d us" % a.poll_us if a.poll_us > 0 else "spinning"))
    print("%-44s %9s %9s %9s %9s %10s %6s %8s" % ("figure", "C++ p50", "C++ p99", "Py p50", "Py p99",
                                                "added p50", "goal", "verdict"))
    _print_rows(rows)
    if empty is not None:
        print("the same ops with T=0 on the same endpoints, completion polled without sleeping (no data moved: "
              "the calls' own cost, warm caches when each rank has a core):")
        _print_rows(empty["rows"])
    print("%-44s %d over %d ops (each result view is one of the first two ops' objects)"
          % ("new tensor objects (low-latency results)", alloc["new_view_objects"], alloc["ops"]))
    print("%-44s live torch tensors %+d; Python heap blocks per op %+.2f (2n ops vs n) %8s" % (
        "", alloc["live_tensors_delta"], alloc["allocated_blocks_per_op"], alloc["verdict"]))
    print("(C++ = the bound: the same ops through the C ABI from C++, same processes, same tensors, same daemon.)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--mll", type=int, default=128, help="max_dispatch_tokens_per_rank (>= --tokens)")
    p.add_argument("--iters", type=int, default=20, help="timed ops per block")
    p.add_argument("--blocks", type=int, default=2, help="interleaved blocks per path")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--alloc-iters", type=int, default=10, help="ops of the allocation check")
    p.add_argument("--empty-ops", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the same ops with T=0 on the same endpoints")
    p.add_argument("--poll-us", type=int, default=1000, help="sleep between completion polls of the T-token ops (0: spin with sched_yield; "
                   "the T=0 ops always spin)")
    p.add_argument("--order", choices=("auto", "interleaved", "alternating", "sequential"), default="auto",
                   help="interleaved: both groups joined, blocks alternate; alternating: a fresh group "
                   "per block, Python then C++ (one group's buffers at a time); sequential: every "
                   "Python block, then every C++ block; auto: alternating on the host backend, else "
                   "interleaved")
    p.add_argument("--goal-us", type=float, default=5.0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--launch-mode", default="auto", choices=("auto", "daemon", "client"))
    p.add_argument("--socket", help="a running epd (default: start epd --backend=host)")
    p.add_argument("--epd", help="the epd binary (default: $EPD_BINARY, else BUILD/daemon/epd)")
    p.add_argument("--build-dir", help="where the C++ loop is built (default: BUILD/tests/bench/python)")
    p.add_argument("--group", default="pybench%d" % os.getpid())
    p.add_argument("--json", help="write the figures as JSON to this file ('-': stdout)")
    p.add_argument("--check-goal", action="store_true", help="exit 1 when a verdict is MISS")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    a = p.parse_args()
    if a.tokens > a.mll:
        p.error("--tokens %d > --mll %d" % (a.tokens, a.mll))

    import torch

    build = os.environ.get("EPD_BUILD_DIR") or os.path.join(REPO, "build")
    driver_dir = build_driver(a.build_dir or os.path.join(build, "tests", "bench", "python"))
    daemon = None
    socket = a.socket
    if socket is None:
        # tests/python's Daemon: epd --backend=host on a temporary socket.
        sys.path.insert(0, os.path.join(REPO, "tests", "python"))
        import epd_testing

        os.environ["EPD_BUILD_DIR"] = build
        if a.epd:
            os.environ["EPD_BINARY"] = a.epd
        daemon = epd_testing.Daemon(extra_args=("--op_timeout=60s", "--host_threads=0"))
        socket = daemon.socket
    try:
        import epd

        backend = epd.Client.connect(socket).stats_summary()["backend"]
        if a.order == "auto":
            a.order = "alternating" if backend == "host" else "interleaved"
        ctx = torch.multiprocessing.get_context("spawn")
        outbox = ctx.Queue()
        barrier = ctx.Barrier(a.ranks, timeout=a.timeout)
        procs = [ctx.Process(target=_rank_main, args=(a, socket, r, driver_dir, barrier, outbox), daemon=True)
                 for r in range(a.ranks)]
        for pr in procs:
            pr.start()
        results, failures = {}, []
        deadline = time.monotonic() + a.timeout
        while len(results) + len(failures) < a.ranks:
            try:
                rank, ok, payload = outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit("py_overhead: ranks %s did not finish within %d s"
                                 % (sorted(set(range(a.ranks)) - set(results)), a.timeout))
            if ok:
                results[rank] = payload
            else:
                failures.append("rank %d:\n%s" % (rank, payload))
                break
        for pr in procs:
            pr.join(timeout=5)
            if pr.is_alive():
                pr.kill()
        if failures:
            raise SystemExit("py_overhead failed:\n" + "\n".join(failures))
    finally:
        if daemon is not None:
            daemon.stop()

    ordered = [results[r] for r in range(a.ranks)]
    rows, empty, alloc, ok = summarize(a, ordered)
    info = {"backend": backend, "launch_mode": ordered[0]["launch_mode"]}
    print_table(a, rows, empty, alloc, info)
    if a.json:
        doc = {"shape": {"R": a.ranks, "T": a.tokens, "H": a.hidden, "K": a.topk, "E": a.experts, "Mll": a.mll},
               "backend": backend, "device": a.device, "launch_mode": info["launch_mode"],
               "iters": a.iters, "blocks": a.blocks, "order": a.order, "poll_us": a.poll_us, "warmup": a.warmup, "goal_us": a.goal_us,
               "rows": rows, "empty_ops": empty, "allocation": alloc, "verdict": "PASS" if ok else "MISS",
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        text = json.dumps(doc, indent=1)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
    return 0 if ok or not a.check_goal else 1


if __name__ == "__main__":
    sys.exit(main())
