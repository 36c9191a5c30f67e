"""The epd package on the CUDA backend (a GPU machine; CI has none, so pytest does not
collect this file):

    python3 tests/python/cuda_check.py [--epd PATH] [--iters N]

Starts `epd --backend=cuda` on a temporary socket and, for each launch mode (daemon,
client), epd_testing's R rank processes (GPU rank % device count) that run: low-latency dispatch (bf16,
FP8 with round_scale) and combine through the zero-copy input region, normal dispatch and
combine, all checked against epd_testing's torch references; ops on a torch.cuda.Stream
with wait=False and enqueued(); the view cache (same tensor objects op after op); then
the time of a low-latency dispatch + combine pair in Python. Exits non-zero on any failure.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import epd_testing as T  # noqa: E402


def scenario(w, iters):
    import epd

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    assert w.ep.info.cuda == cuda, w.ep.info
    seed = 3
    data = []
    for src in range(T.R):
        t = T.num_tokens_ll(src, seed)
        data.append((T.make_x(src, seed, t), T.make_topk_idx(src, seed, t)))
    x, idx = data[w.rank]
    wt = T.make_weights(w.rank, seed, x.shape[0])
    xd, idxd, wtd = x.to(dev), idx.to(dev), wt.to(dev)
    ref = T.ref_ll_dispatch(w.rank, data)

    # Low-latency bf16, combine through the input region.
    r = w.ep.low_latency_dispatch(xd, idxd)
    assert r.recv_x.device == dev and r.recv_x.dtype == torch.bfloat16
    ci = w.ep.low_latency_combine_input()
    assert ci.device == dev
    for le, (rows, info) in enumerate(ref):
        n = len(rows)
        assert int(r.recv_count[le]) == n
        assert r.recv_src_info[le, :n].cpu().tolist() == info
        if n:
            assert torch.equal(r.recv_x[le, :n].cpu(), torch.stack(rows))
            ci[le, :n] = T.expert_output(torch.stack(rows), w.rank * T.LOCAL + le).to(dev)
    c = w.ep.low_latency_combine(ci, idxd, wtd, r.handle)
    assert torch.equal(c.combined_x.cpu(), T.ref_ll_combine(x, idx, wt))

    # FP8 with power-of-two scales.
    r8 = w.ep.low_latency_dispatch(xd, idxd, use_fp8=True, round_scale=True)
    fp8 = getattr(torch, "float8_e4m3fn", None)
    assert fp8 is None or r8.recv_x.dtype == fp8, r8.recv_x.dtype
    for le, (rows, _) in enumerate(ref):
        n = len(rows)
        if n:
            scale = r8.recv_scales[le, :n].cpu()
            assert torch.equal(scale, torch.exp2(torch.ceil(torch.log2(scale))))
            deq = T.e4m3_to_float(r8.recv_x[le, :n].cpu()).reshape(n, T.H // 128, 128) * scale.unsqueeze(2)
            want = torch.stack(rows).float().reshape(n, T.H // 128, 128)
            assert ((deq - want).abs() <= want.abs() * 0.07 + scale.unsqueeze(2) * 2.0 ** -9).all()
    w.ep.low_latency_combine(r8.recv_x.view(torch.uint8).to(torch.bfloat16) * 0, idxd, wtd, r8.handle)

    # Normal dispatch and combine.
    nseed = 1
    ndata = []
    for src in range(T.R):
        t = T.num_tokens(src, nseed)
        ndata.append((T.make_x(src, nseed, t), T.make_topk_idx(src, nseed, t), T.make_weights(src, nseed, t)))
    nx, nidx, nwt = ndata[w.rank]
    d = w.ep.dispatch(nx.to(dev), topk_idx=nidx.to(dev), topk_weights=nwt.to(dev))
    nref = T.ref_dispatch(w.rank, nseed, ndata)
    assert d.num_recv_tokens == nref["num_recv_tokens"]
    assert torch.equal(d.recv_x.cpu(), nref["recv_x"])
    assert torch.equal(d.recv_topk_idx.cpu(), nref["recv_topk_idx"])
    cb = w.ep.combine(d.recv_x, d.handle, topk_weights=d.recv_topk_weights)
    assert cb.combined_x.shape == nx.shape

    # Stream-ordered (CUDA only): wait=False on a torch stream, enqueued() views used there.
    if cuda:
        stream_ordered(w, xd, idxd, wtd, x, ref)

    # The view cache: one object per buffer.
    ids = set()
    for _ in range(8):
        a = w.ep.low_latency_dispatch(xd, idxd)
        b = w.ep.low_latency_combine(ci, idxd, wtd, a.handle)
        ids.add(id(a.recv_x))
        ids.add(id(b.combined_x))
    assert len(ids) == 4, len(ids)

    # Timing: low-latency dispatch + combine pairs (wait=True), Python path.
    for _ in range(50):
        a = w.ep.low_latency_dispatch(xd, idxd)
        w.ep.low_latency_combine(ci, idxd, wtd, a.handle)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        a = w.ep.low_latency_dispatch(xd, idxd)
        w.ep.low_latency_combine(ci, idxd, wtd, a.handle)
    out["us_per_ll_pair"] = (time.perf_counter() - t0) / iters * 1e6
    out["launch_mode"] = w.ep.info.launch_mode
    out["torch"] = torch.__version__
    out["epd"] = epd.__version__
    return out


def stream_ordered(w, xd, idxd, wtd, x, ref):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        op = w.ep.low_latency_dispatch(xd, idxd, stream=stream, wait=False)
        rq = op.enqueued()
        counts = rq.recv_count.clone()
        op2 = w.ep.low_latency_combine(rq.recv_x, idxd, wtd, rq.handle, stream=stream.cuda_stream, wait=False)
        rc = op2.enqueued()
        combined = rc.combined_x.clone()
    stream.synchronize()
    op.wait(timeout=30)
    op2.wait(timeout=30)
    assert counts.cpu().tolist() == [len(rows) for rows, _ in ref]
    assert combined.shape == x.shape


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epd", default=None)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"],
                    help="host: a dry run of the same checks on CPU tensors (no GPU needed)")
    args = ap.parse_args()
    if args.epd:
        os.environ["EPD_BINARY"] = args.epd
    if args.backend == "cuda" and not torch.cuda.is_available():
        print("cuda_check.py: no CUDA device (--backend=host runs the checks on CPU tensors)")
        return 2
    import shutil
    import signal
    import subprocess
    import tempfile

    import epd

    d = tempfile.mkdtemp(prefix="epd_cuda_")
    sock = os.path.join(d, "epd.sock")
    log = open(os.path.join(d, "epd.log"), "w")
    proc = subprocess.Popen([T.epd_binary(), "--socket=" + sock, "--backend=" + args.backend, "--op_timeout=20s"],
                            stdout=log, stderr=subprocess.STDOUT)
    failed = False
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                epd.Client.connect(sock, timeout=1.0).close()
                break
            except epd.UnavailableError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("epd did not serve:\n" + open(log.name).read())
                time.sleep(0.1)
        for mode in ("daemon", "client") if args.backend == "cuda" else ("daemon",):
            world = T.World(sock, "cudacheck_%s_%d" % (mode, os.getpid()), launch_mode=mode,
                            cuda=args.backend == "cuda", on_device=False)
            try:
                results = world.run(scenario, args.iters, timeout=600)
                print("launch_mode=%s: PASSED; per rank: %s" % (mode, results))
            except AssertionError as e:
                failed = True
                print("launch_mode=%s: FAILED\n%s" % (mode, e))
            finally:
                world.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        if failed:
            print(open(log.name).read()[-4000:])
        shutil.rmtree(d, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
