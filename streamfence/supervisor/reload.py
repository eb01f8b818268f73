"""SIGHUP: the config file read again and applied, between two turns of the
supervisor's loop, without touching a running call (README.md, "Reload").

What a reload changes, for the next submit on:
- provider profiles: one added serves new calls; one changed serves new
  calls with its new settings (a worker builds a new SDK client for them:
  workers/registry.py); one removed is refused to new submits as a profile
  never configured (`unknown_provider`). A running call keeps the profile
  it was accepted with to its end, retries included;
- model groups (`[groups.NAME]`), as profiles: one added, changed or removed
  serves (or is refused to) new submits; a running group call keeps the
  group and profiles it was accepted with, its next attempts' choices
  included;
- identities and their limits (`[identities.NAME]`): the next request of
  each client is judged by its new table (its budgets too: sums already
  used count against the new budgets);
- prices (`[prices]`): the calls that end from now on are priced by them;
- the log level: at once for the supervisor's lines and every line it
  writes for its children (a level raised drops their lower lines); a
  child logs the lower lines of a level lowered once it starts again.

Every other setting (the endpoint, the state dir, auth, the pool's sizes,
`[http]`, `[cluster]` ...) needs a restart: a change to it is named in one
WARNING line and its old value stays. An invalid file changes nothing: its
problems are logged at ERROR, one a line, as `serve` would name them.
What changed is logged at INFO by name (keys, never values: no secret is
written to the log).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from streamfence.config.model import ConfigError, DaemonConfig, load_config
from streamfence.protocol.logs import set_level

if TYPE_CHECKING:
    from streamfence.supervisor.auth import ClientAuth
    from streamfence.supervisor.parts import Parts

log = logging.getLogger("streamfence.supervisor")

RELOADED = ("providers", "groups", "identities", "prices", "log_level")  # what a reload applies
NOT_KEYS = ("config_path",)  # fields of DaemonConfig that are no setting


@dataclass(slots=True)
class Changes:
    """What a new config changes, by name: per table, the entries added,
    changed (with the keys that changed) and removed; the log level; the
    settings that need a restart."""

    tables: dict[str, tuple[list[str], dict[str, list[str]], list[str]]] = field(
        default_factory=dict)
    log_level: tuple[str, str] | None = None
    need_restart: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What changed, one INFO line per table (and the log level)."""
        out = []
        for table, (added, changed, removed) in self.tables.items():
            parts = []
            if added:
                parts.append(f"added {', '.join(added)}")
            if changed:
                parts.append("changed " + ", ".join(f"{name} ({', '.join(keys)})"
                                                    for name, keys in changed.items()))
            if removed:
                parts.append(f"removed {', '.join(removed)}")
            if parts:
                out.append(f"reload: {table}: {'; '.join(parts)}")
        if self.log_level is not None:
            out.append(f"reload: log level {self.log_level[0]} -> {self.log_level[1]}")
        return out


def _entries(old: Mapping[str, Any], new: Mapping[str, Any]
             ) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """The names added, changed (each with the fields that differ) and removed."""
    changed = {name: [f.name for f in fields(new[name])
                      if getattr(old[name], f.name) != getattr(new[name], f.name)]
               for name in sorted(old.keys() & new.keys()) if old[name] != new[name]}
    return sorted(new.keys() - old.keys()), changed, sorted(old.keys() - new.keys())


def compare(old: DaemonConfig, new: DaemonConfig) -> Changes:
    """What `new` changes in `old`, by name."""
    changes = Changes()
    for table in ("providers", "groups", "identities", "prices"):
        found = _entries(getattr(old, table), getattr(new, table))
        if any(found):
            changes.tables[table] = found
    if old.log_level != new.log_level:
        changes.log_level = (old.log_level, new.log_level)
    changes.need_restart = [f.name for f in fields(DaemonConfig)
                            if f.name not in RELOADED + NOT_KEYS
                            and getattr(old, f.name) != getattr(new, f.name)]
    return changes


def applied(old: DaemonConfig, new: DaemonConfig) -> DaemonConfig:
    """`old` with what a reload applies taken from `new`."""
    return replace(old, providers=new.providers, groups=new.groups, identities=new.identities,
                   prices=new.prices, log_level=new.log_level)


def reload(current: DaemonConfig, parts: Parts, auth: ClientAuth) -> DaemonConfig:
    """Read the file `current` came from again and apply what may change
    (the loop calls it on SIGHUP, between two turns); the config to run on
    from now: `current` itself if the file cannot be used."""
    read = read_again(current)
    if read is None:
        return current
    config, changes = read
    log_changes(changes, current.config_path)
    auth.use(config.identities)
    parts.front.admission.use(config)
    parts.journal.usage.use(config.prices)
    parts.driver.router.use(config)
    if parts.driver.takeover is not None:
        parts.driver.takeover.use(config)
    if changes.log_level is not None:
        apply_log_level(config.log_level)
    added, changed, removed = changes.tables.get("providers", ([], {}, []))
    if config.http.listen is not None and (added or changed or removed
                                           or "groups" in changes.tables):
        log.info("reload: the HTTP gateway keeps the profiles, groups and routes it started "
                 "with until the daemon restarts (a restart of it would cut its open streams)")
    for name in (*added, *changed):
        env = config.providers[name].api_key_env
        if env and not os.environ.get(env):
            log.warning("reload: provider profile %r: its api_key_env %s is not set; its "
                        "calls will fail with credentials_missing", name, env)
    return config


def read_again(current: DaemonConfig,
               load: Callable[[str | None], DaemonConfig] = load_config
               ) -> tuple[DaemonConfig, Changes] | None:
    """The config to run on from now, and what changed; None (why logged)
    if the file is missing, invalid, or there is none."""
    if current.config_path is None:
        log.warning("reload: the daemon runs on the built-in defaults (no config file): "
                    "nothing to read again")
        return None
    try:
        new = load(current.config_path)
    except ConfigError as exc:
        for problem in exc.problems:
            log.error("reload refused, the running config stays: %s", problem)
        return None
    changes = compare(current, new)
    return applied(current, new), changes


def log_changes(changes: Changes, config_path: str | None) -> None:
    """The reload's log: what changed (INFO), what needs a restart (WARNING)."""
    lines = changes.lines()
    for line in lines:
        log.info("%s", line)
    if changes.need_restart:
        log.warning("reload: %s changed: needs a restart (the running value stays)",
                    ", ".join(changes.need_restart))
    if not lines:
        log.info("reload: %s read again; nothing to apply changed", config_path)


def apply_log_level(level: str) -> None:
    """This process's level, and its handlers': the children's lines it
    writes pass through them (a child filters at the level it started with)."""
    set_level(level)
    for handler in logging.getLogger().handlers:
        handler.setLevel(level)
