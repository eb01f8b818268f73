"""streamfence's benchmark suite: `python -m scripts.bench [--quick] [--only NAME ...]
[--write-docs]`.

Every comparison runs side by side in one run (variants interleaved A B A B,
the order rotated each round), against the bundled provider emulator on
127.0.0.1, and is reported as medians (and medians of per-round ratios), so
drift of a shared 2-core machine cancels instead of deciding the result.

Sections (one module each; each returns a `common.Section`):

- `cpu`        1. CPU per delta end to end: bare openai / anthropic SDK loops vs
               the whole daemon (worker + sink + supervisor + a subscriber).
- `throughput` 2. sink throughput from 1 and 8 producer processes, beside the
               machine's ceiling (ZMQ + msgpack, + SQLite group commit).
- `latency`    3. latency added from a worker's send to a subscriber's receive
               at 20k deltas/s, sink alone and through the supervisor.
- `failover`   4. stale deadline -> fence -> kill -> retry request; replacement.
- `scale`      5. 50 / 200 / 500 concurrent paced streams: completion, latency,
               CPU, memory per worker, file descriptors.
- `startup`    6. daemon start to ready; a warm pool of N workers ready.
- `ttft`       7. time to first token of bursts of 1, 32 and 200 calls at an
               idle daemon, beside the bare openai SDK in threads and the pool
               of before issue 32 (and a repeat burst while the workers are
               still there; a burst of 32 on a daemon idle 10 minutes).
- `capacity`   8. the most concurrent paced streams served with stretch ≤ 1.1,
               streamfence vs the bare SDK in threads.
- `gateway`    9. the HTTP gateway: the openai SDK through it vs the same SDK
               straight at the emulator vs the ZeroMQ client (and LiteLLM's
               proxy, when installed), 1 and 32 paced streams: TTFT and CPU
               per delta, and one unpaced stream's deltas/s, as ratios.
- `cluster`   10. cluster mode (one host on a 3-node NATS cluster) vs single-host
               mode: TTFT and CPU per delta at 1 and 32 paced streams, deltas/s
               through the sink at 32 unpaced streams, as ratios.
- `footprint` 11. the idle daemon's whole process tree (USS, PSS, by role) at
               the default pool settings beside the old policy (32 spares).
- `console`   12. the console's list of calls (`GET /console/calls`) with
               10,000 finished calls in the journal, beside its 200 ms target.

`long_idle` holds section 7's daemon left idle 10 minutes (started before
the first section). `load` holds the process entry points shared by
sections 2, 3 and 5 (producers impersonating workers, the ceiling server, a
standalone sink); `report` renders the table and writes docs/PERFORMANCE.md.

Nothing here is imported by the product, and this package imports nothing
heavy at import time: producer processes are spawned with `scripts.bench.load`
as their module and must start fast.
"""
