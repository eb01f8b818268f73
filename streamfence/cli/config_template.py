"""The config `streamfence init` writes: every key with its default and what
it does, a state dir inside the chosen directory, and one provider profile
per wire pointing at the bundled emulator.

The values come from the code, never from a second copy: the `[daemon]` keys
and their defaults from `DaemonConfig()`, the profiles' keys from
`ProviderProfile`, the emulator profiles from `emulator_profile()`. Only the
descriptions live here, and tests/test_cli_first_hour.py fails when a key of
the config has none (so a new key cannot be left out of `init`).

Keys left at their default are written commented out (`# key = value`), so a
later version's default applies until the operator sets one; uncommenting
every such line gives the same configuration (tested).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import MISSING, fields
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from streamfence.config.identities import (
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_MAX_LISTENERS,
    DEFAULT_MAX_SUBSCRIPTIONS,
    DEFAULT_SUBMIT_BYTES_PER_S,
)
from streamfence.config.model import DAEMON_KEYS, DaemonConfig, ProviderProfile
from streamfence.devtools.emulator.control import emulator_profile
from streamfence.protocol.wires import WIRES

EMULATOR_PORT = 7790  # `streamfence emulator`'s default port
EMULATOR_URL = f"http://127.0.0.1:{EMULATOR_PORT}"

DAEMON_DOCS: dict[str, str] = {
    "endpoint": "The client-facing socket: tcp://HOST:PORT or ipc://PATH. Events go out on the "
                "next port (ipc: the path + \".events\"). A host other than loopback needs "
                "auth = \"curve\".",
    "state_dir": "journal.db, transcript.db, keys/ (the admin credentials the CLI finds), run/ "
                 "(internal sockets). The daemon creates it private (0700) and refuses one "
                 "that others can read; one daemon per state dir. A relative path is relative "
                 "to the directory `serve` runs in.",
    "max_frame_bytes": "Larger client frames are refused with `too_large`.",
    "workers_max": "Worker processes at most (one per running attempt).",
    "workers_spare": "Warm idle workers kept beyond the load's recent peak (about 11 MiB "
                     "each, no CPU): a retry or the next call never waits for a fork. After "
                     "a burst the pool keeps its workers, halving every 30 s back to this.",
    "workers_refill_wait_s": "Spare forks wait, at most this long, while attempts are "
                             "starting, so a burst's first requests get the cores. 0: forked "
                             "at once.",
    "workers_peak_half_life_s": "After a burst the pool keeps its workers, their number above "
                                "workers_spare halving every this many seconds.",
    "queue_max": "Queued calls before a submit is refused with `overloaded`.",
    "in_flight_bytes_max": "Bytes of the requests of all calls not yet done; `overloaded` "
                           "beyond. 0: no limit.",
    "max_connections": "Client connections at once; new handshakes beyond are refused. "
                       "0: no cap.",
    "backoff_base_s": "Retry back-off: jittered exponential from this ...",
    "backoff_max_s": "... to this, never shorter than a provider's Retry-After.",
    "breaker_threshold": "Consecutive stale attempts of one (session, profile) that open its "
                         "circuit breaker ...",
    "breaker_cooldown_s": "... which then refuses calls this long before one probe call is "
                          "let through.",
    "stop_grace_s": "On SIGTERM or Ctrl-C, running attempts may finish this long.",
    "log_level": "DEBUG, INFO, WARNING, ERROR or CRITICAL.",
    "log_json": "JSON lines instead of text (also `serve --log-json`).",
    "log_file": "Write the log to this file instead of stderr (\"\": stderr, which systemd "
                "sends to the journal). A relative path is relative to the directory `serve` "
                "runs in.",
    "log_file_max_bytes": "Past this size the log file is renamed FILE.1 (FILE.1 to FILE.2, "
                          "...) and a new one begun. 0: never.",
    "log_file_backups": "Renamed log files kept (at least 1); the oldest goes.",
    "auth": "\"curve\": CURVE encryption, only registered keys are heard (docs/SECURITY.md). "
            "\"none\": no authentication, for ipc:// or loopback only.",
    "retention_days": "Finished calls are removed after this many days (0.5: 12 hours). "
                      "0: keep forever.",
}

PROFILE_DOCS: dict[str, str] = {
    "kind": "The wire: openai (chat completions), anthropic (messages) or bedrock (Converse). "
            "`streamfence submit` shapes its request from it.",
    "base_url": "The API's URL. OpenAI's includes /v1 (https://api.openai.com/v1, or any "
                "OpenAI-compatible server's .../v1); Anthropic's does not "
                "(https://api.anthropic.com; a trailing /v1 is dropped).",
    "api_key_env": "The environment variable that holds the API key (the key itself is never "
                   "in this file). Unset: no key is sent, which only a local server accepts.",
    "endpoint_url": "A Bedrock endpoint other than AWS's (the emulator). Unset: AWS's for the "
                    "region.",
    "region": "The AWS region. Unset: the AWS config's, else us-east-1.",
    "aws_credentials": "\"chain\" (the default): the AWS credential chain (AWS_ACCESS_KEY_ID "
                       "and AWS_SECRET_ACCESS_KEY, ~/.aws, an instance or task role). "
                       "\"dummy\": fixed fake keys, only with an endpoint_url (the emulator).",
    "aws_profile": "A named profile of the AWS config files. Unset: the chain's default.",
    "stale_timeout_s": "The longest silence between two chunks; then the attempt is fenced, "
                       "its worker killed and the call retried. Unset: 180 s (240 s above "
                       "~50k request tokens, 300 s above ~100k; 900 s for a local URL).",
    "first_chunk_timeout_s": "The same before the first chunk (reasoning models may think "
                             "long). Unset: the stale timeout.",
    "max_attempts": "Attempts per call, the first included.",
    "connect_timeout_s": "The SDK's connect timeout.",
    "read_timeout_s": "The SDK's socket read timeout; raised to the stale timeout when that is "
                      "longer.",
}

# The profile keys each kind reads besides `kind` and the common ones.
KIND_KEYS: dict[str, tuple[str, ...]] = {
    "openai": ("base_url", "api_key_env"),
    "anthropic": ("base_url", "api_key_env"),
    "bedrock": ("endpoint_url", "region", "aws_credentials", "aws_profile"),
}
COMMON_PROFILE_KEYS = ("stale_timeout_s", "first_chunk_timeout_s", "max_attempts",
                       "connect_timeout_s", "read_timeout_s")

# What a commented line shows for a key whose default is "unset".
_EXAMPLES: dict[str, dict[str, Any]] = {
    "openai": {"api_key_env": "OPENAI_API_KEY"},
    "anthropic": {"api_key_env": "ANTHROPIC_API_KEY"},
    "bedrock": {"aws_profile": "default", "region": "us-east-1"},
    "": {"stale_timeout_s": 180, "first_chunk_timeout_s": 300},
}

# How each emulator profile becomes the real provider's.
_FOR_REAL: dict[str, list[str]] = {
    "openai": ["For OpenAI itself:",
               '  base_url = "https://api.openai.com/v1"', '  api_key_env = "OPENAI_API_KEY"'],
    "anthropic": ["For Anthropic itself:", '  base_url = "https://api.anthropic.com"',
                  '  api_key_env = "ANTHROPIC_API_KEY"'],
    "bedrock": ["For AWS itself: remove endpoint_url and aws_credentials (the credentials "
                "then come from the AWS credential chain) and set your region:",
                '  region = "us-east-1"'],
}

IDENTITY_DOCS: dict[str, tuple[Any, str]] = {
    "role": ("client", "\"admin\" also sees every call and the whole status."),
    "providers": (["openai"], "The profiles it may use (default: all)."),
    "max_in_flight": (0, "Calls not yet done; `too_many_calls` beyond. 0: no limit."),
    "max_in_flight_bytes": (DEFAULT_MAX_IN_FLIGHT_BYTES, "Their requests' bytes; "
                            "`too_many_calls` beyond. 0: no limit."),
    "submits_per_s": (0, "Submits per second; `rate_limited` beyond. 0: no limit."),
    "submit_bytes_per_s": (DEFAULT_SUBMIT_BYTES_PER_S, "Request bytes per second; "
                           "`rate_limited` beyond. 0: no limit."),
    "max_tokens": (0, "Cap on a request's output-token limit (`limit_exceeded`). 0: none."),
    "n": (0, "Cap on OpenAI's `n`. 0: none."),
    "max_listeners": (DEFAULT_MAX_LISTENERS, "Events connections with a subscription; "
                      "`too_many_subscriptions` beyond. 0: no limit."),
    "max_subscriptions": (DEFAULT_MAX_SUBSCRIPTIONS, "Subscriptions (listener, call) at "
                          "once; `too_many_subscriptions` beyond. 0: no limit."),
    "tokens_per_day": (0, "Input + output tokens per UTC day; `budget_exceeded` once used. "
                       "0: no budget."),
    "tokens_per_month": (0, "The same per UTC calendar month. 0: no budget."),
    "spend_per_month": (0, "Spend per UTC month, priced by a [prices.\"MODEL\"] table "
                        "(input_per_mtok, output_per_mtok). 0: no budget."),
}

WIDTH = 79


HTTP_LISTEN = "127.0.0.1:7757"  # the [http] example (commented out: no gateway by default)
HTTP_ROUTES = {"gpt-4o-mini": "openai"}


def _value(value: Any) -> str:
    """`value` as TOML (str, bool, int, float, list of str)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        text = repr(value)
        if isinstance(value, int) and value >= 1024 * 1024 and value % (1024 * 1024) == 0:
            text += f"  # {value // (1024 * 1024)} MiB"
        return text
    return json.dumps(value)  # a TOML basic string or array of them


def _comment(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent="# " + indent,
                         subsequent_indent="# " + indent, break_on_hyphens=False)


def _key(key: str, value: Any, active: bool, doc: str | None) -> list[str]:
    """A documented key is a paragraph of its own; a repeated one is a line."""
    line = f"{'' if active else '# '}{key} = {_value(value)}"
    return ["", *_comment(doc), line] if doc else [line]


def _defaults(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
    return out


def _version() -> str:
    try:
        return version("streamfence")
    except PackageNotFoundError:
        return "unknown"


def render(state_dir: str, emulator_url: str = EMULATOR_URL, config_name: str = "",
           endpoint: str | None = None, cluster: tuple[str, list[str]] | None = None) -> str:
    """The commented config text; `state_dir` should be absolute. `endpoint`
    sets `[daemon] endpoint`; `cluster`, (this host's name, the NATS URLs),
    writes a `[cluster]` table."""
    daemon = DaemonConfig()
    chosen = {"state_dir": state_dir, "endpoint": endpoint}
    where = config_name or "streamfence.toml"
    out = [f"# streamfence configuration, written by `streamfence init` (streamfence "
           f"{_version()}).", "#"]
    out += _comment(
        f"The three profiles below talk to the bundled provider emulator at {emulator_url}. "
        f"Start it in another terminal first (`streamfence emulator`), then the daemon "
        f"(`streamfence serve --config {where}`), then ask each wire "
        f"(`streamfence submit --config {where} --provider anthropic \"Hello\"`; in this "
        f"directory `--config` may be left out). README.md, \"Run it for real\", says how to "
        f"point the profiles at the real providers.")
    out.append("#")
    out += _comment("Every key is listed with what it does. A key written `# key = value` "
                    "is at its default (value); remove the `# ` to set it. Environment "
                    "variables override [daemon] keys: STREAMFENCE_<KEY>, e.g. "
                    "STREAMFENCE_ENDPOINT=tcp://127.0.0.1:7800.")
    out += ["", "[daemon]"]  # each key's paragraph starts with a blank line
    for f in fields(DaemonConfig):
        if f.name not in DAEMON_KEYS:  # a table of its own, or not a key
            continue
        value = chosen.get(f.name)
        out += _key(f.name, getattr(daemon, f.name) if value is None else value,
                    value is not None, DAEMON_DOCS[f.name])
    documented: set[str] = set()
    profile_defaults = _defaults(ProviderProfile)
    for wire in WIRES:
        table = emulator_profile(wire, emulator_url)
        out += ["", "", *_comment(f"A provider profile: clients name it in `provider` "
                                  f"(`streamfence submit --provider {wire}`).")]
        out += _comment(_FOR_REAL[wire][0])
        out += [f"# {line}" for line in _FOR_REAL[wire][1:]]
        out.append(f"[providers.{wire}]")
        last_documented = False
        for key in ("kind", *KIND_KEYS[wire], *COMMON_PROFILE_KEYS):
            doc = None if key in documented else PROFILE_DOCS[key]
            documented.add(key)
            if doc is None and last_documented:
                out.append("")  # the keys documented above, after a paragraph
            last_documented = doc is not None
            if key in table:
                out += _key(key, table[key], True, doc)
                continue
            default = profile_defaults[key]
            if default is None:
                default = _EXAMPLES[wire].get(key, _EXAMPLES[""].get(key))
            out += _key(key, default, False, doc)
    out += ["", "", *_comment(
        "A model group: a name a client (or the gateway's model) uses where a profile goes, "
        "served by deployments of one provider kind, a (profile, model) each, chosen per "
        "attempt: ordered (the first usable), weighted (weight = N each) or least_in_flight; "
        "a retry moves to the next, an open breaker's is skipped (README, \"Model groups\"). "
        "max_attempts: unset, its profiles' largest, at least one per deployment."),
        "#", "#   [groups.smart]", '#   strategy = "ordered"', "#   # max_attempts = 3",
        '#   deployments = [{profile = "openai", model = "gpt-4o"},',
        '#                  {profile = "openai", model = "gpt-4o-mini"}]']
    out += ["", "", *_comment(
        "The HTTP gateway: OpenAI- and Anthropic-compatible endpoints (/v1/chat/completions, "
        "/v1/messages), so an app using the official SDKs only changes its base_url and key "
        "(README, \"Use it from an existing app\"). Off unless `listen` is set; loopback "
        "only. `routes` maps a model name to the profile that serves it (else the model is "
        "written PROFILE/MODEL, or the X-Streamfence-Profile header names it); a profile "
        "of another kind than the endpoint's gets the request translated."), "#", "#   [http]",
        f"#   listen = {_value(HTTP_LISTEN)}",
        "#   routes = { " + ", ".join(f"{_value(m)} = {_value(p)}"
                                      for m, p in HTTP_ROUTES.items()) + " }"]
    out += ["", "", *_comment(
        "Cluster mode: hosts sharing a NATS JetStream cluster, so a host's accepted calls "
        "survive it and any host serves any call (docs/ARCHITECTURE.md §4.17; nats-server "
        "2.10 or later). Off unless `urls` is set. `host` names this host, unique in the "
        "cluster; `replicas` is JetStream's replication of every stream and bucket; a host "
        "silent for `lease_s` seconds loses its calls to the others; `timeout_s` bounds each "
        "JetStream request, and the first connect: a start that cannot reach the cluster "
        "stops within it, in one line. `[cluster.auth]`: one of `creds` (a .creds file), "
        "`nkey_seed` (a file holding an nkey seed), or `user` with `password_env` (the "
        "variable holding the password). `[cluster.tls]`: `ca` (the servers' CA), `cert` "
        "and `key` (this host's, for servers that verify clients), `verify` (the servers' "
        "certificates; default true), `server_name` (the name in their certificates, if not "
        "the URL's host); a tls:// URL alone uses the system's CAs.")]
    if cluster is None:
        out += ["#", "#   [cluster]",
                '#   urls = ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222", '
                '"nats://10.0.0.3:4222"]',
                '#   host = "host-a"', "#   replicas = 3", "#   lease_s = 5.0",
                "#   timeout_s = 5.0"]
    else:
        host, urls = cluster
        out += ["[cluster]", f"urls = {_value(urls)}", f"host = {_value(host)}",
                f"replicas = {min(len(urls), 3)}", "# lease_s = 5.0", "# timeout_s = 5.0"]
    out += ["#   [cluster.auth]",
            '#   creds = "/etc/streamfence/nats.creds"',
            '#   # nkey_seed = "/etc/streamfence/nats.nk"',
            '#   # user = "streamfence"', '#   # password_env = "STREAMFENCE_NATS_PASSWORD"',
            "#   [cluster.tls]", '#   ca = "/etc/streamfence/nats-ca.pem"',
            '#   # cert = "/etc/streamfence/host-a.pem"', '#   # key = "/etc/streamfence/host-a.key"',
            "#   # verify = true", '#   # server_name = "nats.internal"']
    out += ["", "", *_comment("A client registered with `streamfence keys new alice` may be "
                          "limited by a table of its name (values: the defaults, but "
                          "`providers`):"),
            "#", "#   [identities.alice]"]
    for key, (value, doc) in IDENTITY_DOCS.items():
        out += [*_comment(doc, "  # "), f"#   {key} = {_value(value)}"]
    out += ["", *_comment("What a model's tokens cost, per million, for spend_per_month and "
                          "`streamfence usage` (\"PROFILE/MODEL\" for one profile only):"),
            "#", '#   [prices."gpt-4o"]', "#   input_per_mtok = 2.5", "#   output_per_mtok = 10"]
    return "\n".join(out) + "\n"
