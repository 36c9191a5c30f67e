"""Shared helpers of the Python suites: a real epd daemon, a World of rank processes that
run scenario functions in lockstep, deterministic inputs and torch references of every op
(docs/CLIENT_API.md section 9 and DESIGN.md section 3.3 give the semantics).

Environment (tests/python/README.md): EPD_TEST_DEVICE=cuda runs the suites against
`epd --backend=cuda` (started here, or the daemon on $EPD_TEST_SOCKET) with CUDA tensors:
the World's ranks then use OnDevice endpoints (inputs moved to the rank's GPU, results read
back as CPU copies for the references); EPD_LAUNCH_MODE=auto|daemon|client picks the
World's launch mode (client-launched ranks sharing a GPU need MPS running)."""

import importlib
import os
import pickle
import queue
import shutil
import signal
import subprocess
import tempfile
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# "cpu" (epd --backend=host, CI) or "cuda" (epd --backend=cuda, CUDA tensors).
DEVICE = os.environ.get("EPD_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise RuntimeError("EPD_TEST_DEVICE=%r: expected cpu or cuda" % DEVICE)
CUDA = DEVICE == "cuda"
LAUNCH_MODE = os.environ.get("EPD_LAUNCH_MODE", "auto")
if LAUNCH_MODE not in ("auto", "daemon", "client"):
    raise RuntimeError("EPD_LAUNCH_MODE=%r: expected auto, daemon or client" % LAUNCH_MODE)

# The spec of the World's group (three ranks, two local experts each, FP8 allowed).
R, E, K, H, M, MLL = 3, 6, 3, 256, 16, 8
LOCAL = E // R


def epd_binary():
    if os.environ.get("EPD_BINARY"):
        return os.environ["EPD_BINARY"]
    build = os.environ.get("EPD_BUILD_DIR") or os.path.join(REPO, "build")
    return os.path.join(build, "daemon", "epd")


class Daemon:
    """A real epd on a temporary socket (stopped by stop()): --backend=host, or with
    EPD_TEST_DEVICE=cuda --backend=cuda; with $EPD_TEST_SOCKET the daemon already serving
    there (not started, not stopped)."""

    def __init__(self, extra_args=()):
        self.proc = None
        if os.environ.get("EPD_TEST_SOCKET"):
            self.socket = os.environ["EPD_TEST_SOCKET"]
            self.dir = None
            self._wait_serving()
            return
        binary = epd_binary()
        if not os.access(binary, os.X_OK):
            raise RuntimeError("epd binary %s not found (build the epd target or set EPD_BINARY)" % binary)
        self.dir = tempfile.mkdtemp(prefix="epd_py_")
        self.socket = os.path.join(self.dir, "epd.sock")
        self.log_path = os.path.join(self.dir, "epd.log")
        self._log = open(self.log_path, "w")
        self.argv = [binary, "--socket=" + self.socket, "--op_timeout=%ds" % (20 if CUDA else 5),
                     *(["--backend=cuda"] if CUDA else ["--backend=host", "--host_threads=1"]),
                     *extra_args]
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_serving()

    def kill(self):
        """SIGKILLs the daemon (a crash) and reaps it."""
        self.proc.kill()
        self.proc.wait()

    def restart(self):
        """Starts the daemon again with the same arguments (socket included), after kill(),
        and waits until it serves."""
        if self.proc.poll() is None:
            self.kill()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_serving()

    def _wait_serving(self):
        import epd

        deadline = time.monotonic() + 30
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError("epd exited (%s) before serving:\n%s" % (self.proc.returncode, self.log()))
            if os.path.exists(self.socket):
                try:
                    epd.Client.connect(self.socket, timeout=1.0).close()
                    return
                except epd.UnavailableError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("epd not serving within 30 s:\n" + self.log())
            time.sleep(0.05)

    def log(self):
        if self.proc is None:
            return "(the daemon on $EPD_TEST_SOCKET: see its own log)"
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- the World: one process per rank ----------------------------------------------------


class Rank:
    """What a scenario function gets on its rank: the client, the World's endpoint `ep`
    (group spec `spec`), `rank`, and a dict `state` kept across scenarios."""

    def __init__(self, socket, rank, group, launch_mode="auto", cuda=False, on_device=False):
        import epd

        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        self.epd = epd
        self.rank = rank
        self.client = epd.Client.connect(socket, client_name="pytest-rank%d" % rank)
        self.spec = epd.GroupSpec(group, num_ranks=R, hidden=H, num_topk=K, num_experts=E,
                                  max_tokens_per_rank=M, max_dispatch_tokens_per_rank=MLL,
                                  use_fp8=True)
        self.launch_mode = launch_mode
        self.on_device = on_device
        self.ep = self._join()
        self.base_name = group
        self.state = {}
        self.generation = 0

    def rejoin(self):
        """Leaves and joins a fresh group (after a failed scenario put the ranks out of step)."""
        self.ep.close()
        self.generation += 1
        self.spec = self.spec._replace(name="%s_g%d" % (self.base_name, self.generation))
        self.ep = self._join()

    def _join(self):
        ep = self.client.join(self.spec, self.rank, launch_mode=self.launch_mode)
        return OnDevice(ep) if self.on_device else ep


def _rank_main(socket, rank, group, inbox, outbox, launch_mode, cuda, on_device):
    torch.set_num_threads(1)
    try:
        w = Rank(socket, rank, group, launch_mode, cuda, on_device)
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))
        return
    outbox.put((rank, True, None))
    while True:
        job = inbox.get()
        if job is None:
            break
        module, name, args, kwargs = job
        if name is None:
            try:
                w.rejoin()
                outbox.put((rank, True, None))
            except BaseException:
                outbox.put((rank, False, traceback.format_exc()))
            continue
        try:
            fn = getattr(importlib.import_module(module), name)
            result = fn(w, *args, **kwargs)
            pickle.dumps(result)  # an unpicklable result would be lost in the queue's thread
            outbox.put((rank, True, result))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    w.client.close()


class World:
    """R rank processes (torch.multiprocessing, spawn), each joined to one group; run(fn)
    calls fn(rank) on every rank at once and returns the per-rank results, raising
    AssertionError with every failing rank's traceback. cuda: the ranks use GPU
    rank % device count; on_device (default: cuda): their `ep` is an OnDevice endpoint."""

    def __init__(self, socket, group, launch_mode=LAUNCH_MODE, cuda=CUDA, on_device=None):
        on_device = cuda if on_device is None else on_device
        ctx = torch.multiprocessing.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(R)]
        self.procs = [
            ctx.Process(target=_rank_main, args=(socket, r, group, self.inboxes[r], self.outbox, launch_mode, cuda,
                                                   on_device),
                        daemon=True)
            for r in range(R)
        ]
        for p in self.procs:
            p.start()
        self._collect("start", timeout=120)

    def _collect(self, what, timeout):
        results, failures = {}, []
        deadline = time.monotonic() + timeout
        while len(results) < R:
            try:
                rank, ok, payload = self.outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise AssertionError("%s: ranks %s did not answer within %d s (dead: %s)"
                                     % (what, sorted(set(range(R)) - set(results)), timeout, dead))
            results[rank] = payload
            if not ok:
                failures.append("rank %d:\n%s" % (rank, payload))
        if failures:
            raise AssertionError("%s failed on %d rank(s):\n%s" % (what, len(failures), "\n".join(failures)))
        return [results[r] for r in range(R)]

    def run(self, fn, *args, timeout=60, **kwargs):
        for q in self.inboxes:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        try:
            return self._collect(fn.__name__, timeout)
        except AssertionError:
            # A rank that failed may have skipped ops its peers ran: every rank moves to a
            # fresh group so the next scenario starts in step.
            for q in self.inboxes:
                q.put((None, None, (), {}))
            self._collect("rejoin after " + fn.__name__, 60)
            raise

    def close(self):
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# ---- CUDA endpoints -------------------------------------------------------------------


def _to_device(value, device):
    """A CPU torch tensor as a copy on `device` with the same strides (a non-contiguous
    argument stays non-contiguous); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        out = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=device)
        out.copy_(value)
        return out
    return value


class _OnHostResult:
    """A result whose GPU tensors read as CPU copies (made once, at the first access);
    raw(self) is the result itself. Unpacks and indexes as the result."""

    def __init__(self, result):
        self._raw = result
        self._host = {}

    def _host_copy(self, key, get):
        if key not in self._host:
            value = get()
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                torch.cuda.synchronize(value.device)
                value = value.cpu()
            self._host[key] = value
        return self._host[key]

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return self._host_copy(name, lambda: getattr(self._raw, name))

    def __iter__(self):
        return iter([self[i] for i in range(len(self._raw))])

    def __getitem__(self, i):
        return self._host_copy(i, lambda: self._raw[i])

    def __len__(self):
        return len(self._raw)


class _OnHostPending:
    def __init__(self, op):
        self._raw = op

    def wait(self, timeout=None):
        return _OnHostResult(self._raw.wait(timeout))

    def enqueued(self):
        return _OnHostResult(self._raw.enqueued())

    def __getattr__(self, name):
        return getattr(self._raw, name)


class OnDevice:
    """An epd.Endpoint on the CUDA backend as the suites' scenarios use it: CPU torch tensor
    arguments are moved to the endpoint's GPU, results read back as CPU copies (raw(r) is
    epd's result of views). Everything else is the Endpoint's."""

    _OPS = ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch",
            "low_latency_combine")

    def __init__(self, ep):
        self._ep = ep
        self._device = torch.device("cuda", torch.cuda.current_device())

    def __getattr__(self, name):
        value = getattr(self._ep, name)
        if name not in self._OPS:
            return value

        def op(*args, **kwargs):
            args = [_to_device(a, self._device) for a in args]
            kwargs = {k: _to_device(v, self._device) for k, v in kwargs.items()}
            r = value(*args, **kwargs)
            return _OnHostPending(r) if kwargs.get("wait", True) is False else _OnHostResult(r)

        return op


def raw(x):
    """epd's own object behind an OnDevice result, pending op or endpoint (else x)."""
    return getattr(x, "_raw", None) or getattr(x, "_ep", None) or x


# ---- inputs -----------------------------------------------------------------------------


def num_tokens(rank, seed):
    """T of `rank` in scenario `seed`: varies per rank, M at most."""
    return [5, 9, 16, 0, 3][(rank + seed) % 5] if seed % 7 != 3 else 0


def num_tokens_ll(rank, seed):
    return [5, 8, 1, 0][(rank + seed) % 4]


def make_topk_idx(rank, seed, t):
    """[t, K] int64 over E experts with -1 entries, a repeated expert and an all -1 row."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    idx = torch.randint(0, E, (t, K), generator=g, dtype=torch.int64)
    if t > 0:
        drop = torch.rand((t, K), generator=g) < 0.2
        idx[drop] = -1
        idx[0, 1] = idx[0, 0]  # a repeated expert
        if t > 2:
            idx[2] = -1  # a token sent nowhere
    return idx


def make_x(rank, seed, t):
    g = torch.Generator().manual_seed(1000 * seed + rank + 500)
    return torch.randn((t, H), generator=g).to(torch.bfloat16)


def make_weights(rank, seed, t):
    g = torch.Generator().manual_seed(1000 * seed + rank + 700)
    return torch.rand((t, K), generator=g, dtype=torch.float32)


def make_fp8(rank, seed, t):
    """FP8 x as e4m3 bits (uint8, no NaN pattern) and its scales [t, H/128] f32."""
    g = torch.Generator().manual_seed(1000 * seed + rank + 900)
    bits = torch.randint(0, 0x7F, (t, H), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (t, H), generator=g, dtype=torch.int64) * 0x80
    scales = torch.rand((t, H // 128), generator=g, dtype=torch.float32) + 0.5
    return (bits | sign).to(torch.uint8), scales


def rank_of(expert):
    return expert // LOCAL


def unique_spec(name, num_ranks=1, **kw):
    """A small GroupSpec (H 128, K 2, E 4, M 8, Mll 4; kw overrides) under a name no other
    test uses."""
    import epd

    fields = dict(num_ranks=num_ranks, hidden=128, num_topk=2, num_experts=4,
                  max_tokens_per_rank=8, max_dispatch_tokens_per_rank=4)
    fields.update(kw)
    return epd.GroupSpec("%s_%d" % (name, time.monotonic_ns()), **fields)


def small_inputs():
    """x [8, 128] bfloat16 ones and topk_idx [8, 2] (token i to experts i % 4, (i + 1) % 4),
    on the test device, for unique_spec groups."""
    import torch

    device = "cuda" if CUDA else "cpu"
    x = torch.ones((8, 128), dtype=torch.bfloat16, device=device)
    idx = torch.tensor([[i % 4, (i + 1) % 4] for i in range(8)], dtype=torch.int64, device=device)
    return x, idx


def expected_recv(idx, rank, num_ranks, num_experts=4):
    """N of a normal dispatch on `rank` when every rank of the group sends topk_idx `idx`:
    the tokens with an expert on `rank`, from each of the num_ranks ranks."""
    local = num_experts // num_ranks
    rows = idx.cpu().tolist()
    return num_ranks * sum(any(e >= 0 and e // local == rank for e in row) for row in rows)


def as_bits(t):
    """An FP8 tensor (torch float8 on torch >= 2.1, uint8 bits otherwise) as uint8 bits."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


_E4M3 = None


def e4m3_to_float(bits):
    """Decodes float8_e4m3fn bits (uint8) to float32."""
    global _E4M3
    if _E4M3 is None:
        values = []
        for b in range(256):
            sign = -1.0 if b & 0x80 else 1.0
            exp, mant = (b >> 3) & 0xF, b & 0x7
            if exp == 0xF and mant == 0x7:
                values.append(float("nan"))
            elif exp == 0:
                values.append(sign * mant / 8.0 * 2.0 ** -6)
            else:
                values.append(sign * (1.0 + mant / 8.0) * 2.0 ** (exp - 7))
        _E4M3 = torch.tensor(values, dtype=torch.float32)
    return _E4M3[as_bits(bits).long()]


# ---- references ---------------------------------------------------------------------------


def ref_layout(idx):
    """(num_tokens_per_rank [R], num_tokens_per_expert [E], is_token_in_rank [T, R])."""
    t = idx.shape[0]
    in_expert = torch.zeros((t, E), dtype=torch.bool)
    for e in range(E):
        in_expert[:, e] = (idx == e).any(dim=1)
    in_rank = torch.stack([in_expert[:, r * LOCAL:(r + 1) * LOCAL].any(dim=1) for r in range(R)], dim=1) \
        if t > 0 else torch.zeros((0, R), dtype=torch.bool)
    return in_rank.sum(0).int(), in_expert.sum(0).int(), in_rank.to(torch.uint8)


def ref_dispatch(rank, seed, inputs, alignment=1):
    """The normal dispatch rank `rank` receives: rows by source rank, then token.
    inputs[src] = (x, topk_idx, topk_weights or None)."""
    rows, idx_rows, w_rows, src_info = [], [], [], []
    counts = torch.zeros(LOCAL, dtype=torch.int64)
    for src in range(R):
        x, idx, w = inputs[src]
        for t in range(idx.shape[0]):
            local = torch.where(rank_of(idx[t]) == rank, idx[t] - rank * LOCAL, torch.full_like(idx[t], -1))
            local[idx[t] < 0] = -1
            if (local >= 0).any():
                rows.append(x[t])
                idx_rows.append(local)
                w_rows.append(torch.where(local >= 0, w[t], torch.zeros_like(w[t])) if w is not None
                              else torch.zeros(K, dtype=torch.float32))
                src_info.append(src * M + t)
                for le in set(local[local >= 0].tolist()):
                    counts[le] += 1
    n = len(rows)
    counts = (counts + alignment - 1) // alignment * alignment
    stack = lambda xs, shape, dtype: torch.stack(xs) if xs else torch.zeros(shape, dtype=dtype)
    return dict(
        recv_x=stack(rows, (0, H), inputs[0][0].dtype),
        recv_topk_idx=stack(idx_rows, (0, K), torch.int64),
        recv_topk_weights=stack(w_rows, (0, K), torch.float32),
        recv_src_info=torch.tensor(src_info, dtype=torch.int32),
        num_recv_tokens_per_expert=counts.int(),
        num_recv_tokens=n,
    )


def ref_ll_dispatch(rank, inputs):
    """Per local expert: the rows (x, src_info) it receives, packed by source rank, then
    token. inputs[src] = (x, topk_idx)."""
    out = []
    for le in range(LOCAL):
        e = rank * LOCAL + le
        xs, info = [], []
        for src in range(R):
            x, idx = inputs[src]
            for t in range(idx.shape[0]):
                if (idx[t] == e).any():
                    xs.append(x[t])
                    info.append(src * MLL + t)
        out.append((xs, info))
    return out


def expert_output(x_rows, expert):
    """What the tests' expert `expert` makes of its rows: bf16(x * (expert + 1))."""
    return (x_rows.float() * (expert + 1)).to(torch.bfloat16)


def ref_ll_combine(x, idx, w):
    """combined_x [T, H] bf16: sum over k with idx >= 0 of w[t,k] * y_{e_k}(t), f32 from +0
    in ascending k, rounded once."""
    acc = torch.zeros((idx.shape[0], H), dtype=torch.float32)
    for k in range(K):
        for t in range(idx.shape[0]):
            e = int(idx[t, k])
            if e >= 0:
                acc[t] = acc[t] + w[t, k] * expert_output(x[t:t + 1], e)[0].float()
    return acc.to(torch.bfloat16)
