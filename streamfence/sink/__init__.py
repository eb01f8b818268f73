"""The sink: one process, the only writer of the transcript.

It accepts a delta only from the attempt currently authorized for its call
(the fence), persists accepted events to SQLite and forwards them to the
supervisor. Modules:

- `streamfence.sink.fence`: `FenceTable` and `check(call, attempt, seq) -> Verdict`, the
  pure single-writer rule (no I/O).
- `streamfence.sink.content`: per-attempt content and `build_response(meta)`.
- `streamfence.sink.store`: the transcript (`TranscriptStore` for the sink,
  `TranscriptReader` / `events_after` / `max_epochs` for other processes).
- `streamfence.sink.event_pieces`: the public delta event's pre-encoded pieces
  (the worker wire: `streamfence.protocol.internal.worker_wire`; control
  messages: `streamfence.protocol.internal.control`).
- `streamfence.sink.state`: control ops, finals, drop accounting, commits (no sockets).
- `streamfence.sink.peer`: the supervisor as the sink's peer (who may drive it,
  where events go, the backlog while it is away).
- `streamfence.sink.process`: `run_sink(runtime_dir, db_path, log_level)`, the process
  entry point: sockets, the loop and the per-delta hot path.
"""
