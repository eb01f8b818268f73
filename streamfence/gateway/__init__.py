"""The HTTP gateway: OpenAI- and Anthropic-compatible endpoints over the protocol v1 client (docs/ARCHITECTURE.md)."""
