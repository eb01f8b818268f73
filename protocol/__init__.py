"""The streamfence wire protocol, shared by every process.

- `protocol.codec`: one msgpack object per ZeroMQ frame, strict limits,
  `decode_untrusted` for bytes from outside.
- `protocol.messages`: the public v1 messages (docs/PROTOCOL.md).
- `protocol.internal`: messages between the daemon's own processes.
- `protocol.client`: the client library, sync and asyncio.
"""
