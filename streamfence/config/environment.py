"""Every `STREAMFENCE_*` environment variable streamfence reads, in one
place, so that one it does not know (a typo, as STREAMFENCE_WORKER_MAX) is
named at the daemon's start instead of silently doing nothing.

The [daemon] keys' overrides (model.py, ENV_PREFIX + KEY) and the variables
read elsewhere (`OTHERS`, each by the constant its reader uses); a variable
the config itself names (a profile's `api_key_env`, `[cluster.auth]`'s
`password_env`) is known too. tests/test_config_problems.py checks that
every `STREAMFENCE_*` name in the code is one of these.
"""

from __future__ import annotations

from collections.abc import Mapping

from streamfence.config.model import DAEMON_KEYS, ENV_PREFIX, DaemonConfig
from streamfence.config.problems import closest
from streamfence.protocol.credentials import ENV_CREDENTIALS
from streamfence.protocol.failpoints import DIR_ENV as FAILPOINTS_DIR_ENV
from streamfence.protocol.failpoints import ENV as FAILPOINTS_ENV
from streamfence.protocol.lifecycle import TITLE_ENV

ENV_CONFIG = ENV_PREFIX + "CONFIG"  # the CLI's config file (cli/common.py)
OTHERS = (ENV_CONFIG, ENV_CREDENTIALS, FAILPOINTS_ENV, FAILPOINTS_DIR_ENV, TITLE_ENV)


def known_variables(config: DaemonConfig) -> set[str]:
    """The STREAMFENCE_* variables that mean something to this daemon."""
    named = {p.api_key_env for p in config.providers.values() if p.api_key_env}
    if config.cluster.auth.password_env:
        named.add(config.cluster.auth.password_env)
    return {ENV_PREFIX + key.upper() for key in DAEMON_KEYS} | set(OTHERS) | named


def unknown_variables(env: Mapping[str, str], config: DaemonConfig) -> list[str]:
    """A sentence for each STREAMFENCE_* variable in `env` that streamfence
    does not read, naming the known one it resembles, if any."""
    known = known_variables(config)
    # Compared without the prefix they share, which would make every name "close".
    tails = {k.removeprefix(ENV_PREFIX) for k in known if k.startswith(ENV_PREFIX)}
    out = []
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known:
            match = closest(name.removeprefix(ENV_PREFIX), tails)
            hint = f" (did you mean {ENV_PREFIX}{match}?)" if match else ""
            out.append(f"environment {name}: streamfence reads no such variable{hint}; "
                       f"it is ignored")
    return out
