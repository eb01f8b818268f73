"""Cluster mode: streamfence hosts sharing a NATS JetStream cluster (ARCHITECTURE §4.17)."""
