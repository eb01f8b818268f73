"""The daemon's configuration: the TOML file's model and its loading
(`model`), the checks of its `[http]` and `[cluster]` tables (`sections`),
who each client identity is and may do (`identities`), how a problem is
worded (`problems`: every one of a file at once, "did you mean"), and the
STREAMFENCE_* variables it knows (`environment`). Read by the supervisor,
the gateway and the command line; imports only `protocol` and
`cluster.settings`, so every role may depend on it."""
