"""Helper of test_threads.py, run as a subprocess (a crash must fail one test, not the
whole session): python close_race.py SOCKET endpoint|client ITERATIONS DEVICE.

Each iteration joins a one-rank group, runs low-latency dispatches in a loop on a second
thread and closes the endpoint (or the whole client) from the main thread at a random
moment. The racing op must complete or raise FailedPreconditionError / UnavailableError;
prints "OK <exception types seen>" when every iteration did."""

import os
import random
import sys
import threading
import time

import torch

import epd

socket, mode, iterations, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
T, H, E, K = 8, 128, 4, 2
x = torch.ones((T, H), dtype=torch.bfloat16, device=device)
idx = torch.tensor([[i % E, (i + 1) % E] for i in range(T)], dtype=torch.int64, device=device)
seen, bad = set(), []
for it in range(iterations):
    client = epd.Client.connect(socket)
    spec = epd.GroupSpec("closerace_%d_%d" % (os.getpid(), it), 1, H, K, E, T,
                         max_dispatch_tokens_per_rank=T)
    ep = client.join(spec, 0)

    def loop():
        while True:
            try:
                # No view outlives the op: close() then drops the last hold on the endpoint.
                int(ep.low_latency_dispatch(x, idx).recv_count.sum())
            except (epd.FailedPreconditionError, epd.UnavailableError) as e:
                seen.add(type(e).__name__)
                return
            except BaseException as e:  # reported below
                bad.append(repr(e))
                return

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(random.random() * 0.005)
    (client.close if mode == "client" else ep.close)()
    thread.join(timeout=60)
    if thread.is_alive():
        bad.append("iteration %d: the op thread did not return" % it)
        break
    client.close()
if bad:
    print("BAD", bad[:5])
    sys.exit(1)
print("OK", sorted(seen))
