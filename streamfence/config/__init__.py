"""The daemon's configuration: the TOML file's model and its loading
(`model`), and who each client identity is and may do (`identities`).
Read by the supervisor, the gateway and the command line; imports only
`protocol` and `cluster.settings`, so every role may depend on it."""
