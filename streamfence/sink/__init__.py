"""The sink: one process, the only writer of the transcript.

It accepts a delta only from the attempt currently authorized for its call
(the fence), persists accepted events to SQLite and sends each, after the
commit that stores it, to the call's subscribers (the supervisor hears only
how attempts ended). Modules:

- `streamfence.sink.process`: `run_sink(runtime_dir, db_path, ...)`, the process
  entry point: sockets, signals and the loop.
- `streamfence.sink.intake`: the worker wire's doors and the per-delta hot path.
- `streamfence.sink.fence`: `FenceTable` and `check(call, attempt, seq) -> Verdict`, the
  pure single-writer rule (no I/O).
- `streamfence.sink.state`: `SinkState`, which holds one owner per job and
  dispatches control ops to them: `calls` (the fence table and the calls'
  runtime state), `counters`, `commits` (group commits), `retention`,
  `fencing` (authorize, fence, finish, finals), `rebinds` (after a restart),
  `replays`, `replica` (cluster mode, with `cluster_log`).
- `streamfence.sink.content`: per-attempt content and `build_response(meta)`.
- `streamfence.sink.transcript`: the transcript's format and every read of it;
  other packages reach the transcript through it alone (`TranscriptReader`,
  `answer_so_far`, `stored_done`, `prune_transcript`, ...).
- `streamfence.sink.store`: `TranscriptStore`, the writer (group commits, storage
  faults waited out); `checkpoints` its WAL checkpoint thread.
- `streamfence.sink.event_pieces`: the public delta event's pre-encoded pieces
  (the worker wire: `streamfence.protocol.internal.worker_wire`; control
  messages: `streamfence.protocol.internal.control`).
- `streamfence.sink.streams`, `routers`, `subscribers`, `peer`: the sockets (worker
  streams, the ROUTERs, the events socket, the supervisor as the sink's peer).
"""
