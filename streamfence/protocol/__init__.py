"""The streamfence wire protocol, shared by every process.

- `streamfence.protocol.codec`: one msgpack object per ZeroMQ frame, strict limits,
  `decode_untrusted` for bytes from outside.
- `streamfence.protocol.messages`: the public v1 messages (docs/PROTOCOL.md).
- `streamfence.protocol.internal`: messages between the daemon's own processes.
- `streamfence.protocol.client`: the client library, sync and asyncio.
"""
