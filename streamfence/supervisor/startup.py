"""What the supervisor checks and opens before its loop starts, each step
refusing a start it cannot make in one line (`StartupError`): the state dir
(its lock, the runtime dir, a live daemon's sockets, the stores' pairing),
the stores (the journal, and this start's stamp in both files), the cluster link, the
call tracer (`[tracing]`), the open-files limit; and what it warns about: the providers' credentials named
in the config, STREAMFENCE_* variables it does not read.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamfence.cluster.settings import ClusterSettings
from streamfence.config.environment import unknown_variables
from streamfence.config.model import DaemonConfig
from streamfence.supervisor import statedir, storepair
from streamfence.supervisor.calls import Call
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.recovery import recover_calls
from streamfence.supervisor.runtimedir import RuntimeDir, bound_paths, claim_sockets
from streamfence.supervisor.tracing import CallTracer, missing_sdk

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

log = logging.getLogger("streamfence.supervisor")


class StartupError(Exception):
    pass


def spawn_context() -> Any:
    """multiprocess's spawn context, without its resource tracker: a child
    process (~10 MiB USS, a tenth of an idle daemon's) that tracks named
    semaphores and shared memory, of which the daemon's children use none
    (they share pipes, sockets and an mmap'd file). Its pipe is /dev/null
    here: its liveness probe succeeds, so none is started, and a child that
    inherits the fd writes there."""
    import multiprocess
    from multiprocess import resource_tracker

    tracker = resource_tracker._resource_tracker  # private: there is no public switch
    if tracker._fd is None:
        tracker._fd = os.open(os.devnull, os.O_WRONLY)
    return multiprocess.get_context("spawn")


def claim_state_dir(config: DaemonConfig, events_endpoint: str
                    ) -> tuple[Path, statedir.StateLock, RuntimeDir, storepair.Pairing]:
    """The state dir made ready and locked, the runtime dir, and the stores'
    pairing checked; what was taken is let go if a later step refuses."""
    try:
        state_dir = statedir.prepare(config.state_dir)
        lock = statedir.StateLock(state_dir)
    except statedir.StateDirError as exc:
        raise StartupError(str(exc)) from None
    try:
        statedir.make_private(state_dir)
        # Before anything is written: a live daemon's sockets refuse the start.
        runtime = RuntimeDir(config.runtime_dir(), config.state_dir)
        claim_sockets(bound_paths(runtime.path, config.endpoint, events_endpoint),
                      str(state_dir))
    except statedir.StateDirError as exc:
        lock.release()
        raise StartupError(str(exc)) from None
    try:
        pairing = storepair.check(state_dir, cluster=config.cluster.enabled)
    except storepair.StoreError as exc:
        runtime.remove()
        lock.release()
        raise StartupError(str(exc)) from None
    return state_dir, lock, runtime, pairing


def open_stores(config: DaemonConfig, state_dir: Path, pairing: storepair.Pairing,
                transcript_path: str) -> tuple[Journal, list[Call]]:
    """The journal, this start's stamp in both files (ARCHITECTURE §4.13),
    and the calls to run again: before any child starts, so that damage
    found here stops the daemon with no child to wait for."""
    path = os.path.join(config.state_dir, storepair.JOURNAL)
    try:
        with storepair.reading(path):
            journal = Journal(path)
        storepair.stamp(state_dir, pairing)
        with storepair.reading(path):
            recovered = recover_calls(journal, config.providers, config.groups,
                                      transcript_path)
    except storepair.StoreError as exc:
        raise StartupError(str(exc)) from None
    if pairing.previous == 0:
        log.info("stores: journal.db and transcript.db are store %s from now on "
                 "(generation 1)", pairing.store_id)
    else:
        log.info("stores: store %s, generation %d", pairing.store_id, pairing.generation)
    return journal, recovered


def cluster_settings(config: DaemonConfig) -> ClusterSettings | None:
    """Cluster mode's settings for the sink and the supervisor; None: one host."""
    cfg = config.cluster
    if not cfg.enabled:
        return None
    return ClusterSettings(cfg.urls, cfg.host, cfg.replicas, cfg.timeout_s, cfg.auth, cfg.tls)


def connect_cluster(config: DaemonConfig) -> ClusterLink | None:
    """Cluster mode: the supervisor's link to the NATS cluster (its streams and
    buckets made if missing); a cluster that cannot be reached stops the start,
    in one line that names the servers (no password) and why (cluster/connect.py)."""
    cfg = config.cluster
    settings = cluster_settings(config)
    if settings is None:
        return None
    from streamfence.cluster.connect import AccessError, Unreachable, reason
    from streamfence.supervisor.clusterlink import ClusterLink  # brings nats

    try:
        link = ClusterLink(settings, cfg.lease_s, time.monotonic)
    except (AccessError, Unreachable) as exc:
        raise StartupError(str(exc)) from None
    except Exception as exc:  # connected, but JetStream did not answer (Ledger.ensure)
        raise StartupError(f"the NATS cluster at {settings.shown_urls}: {reason(exc)}") from None
    log.info("cluster: host %r, %d replica(s), NATS at %s", cfg.host, cfg.replicas,
             settings.shown_urls)
    return link


def start_tracer(config: DaemonConfig) -> CallTracer | None:
    """With `[tracing]`: the call tracer (supervisor/tracing.py); a missing
    opentelemetry SDK stops the start in one line that says what to install."""
    if not config.tracing.enabled:
        return None
    from streamfence.supervisor.status import VERSION

    problem = missing_sdk()
    if problem is not None:
        raise StartupError(problem)
    log.info("tracing: spans to %s", config.tracing.endpoint)
    return CallTracer(config.tracing, VERSION)


def warn_about_environment(config: DaemonConfig) -> None:
    """A WARNING for each profile whose api_key_env is unset, and for each
    STREAMFENCE_* variable streamfence does not read (a typo would otherwise
    do nothing, silently)."""
    for problem in unknown_variables(os.environ, config):
        log.warning("%s", problem)
    for profile in config.providers.values():
        if profile.api_key_env and not os.environ.get(profile.api_key_env):
            log.warning("provider profile %r: its api_key_env %s is not set; its calls "
                        "will fail with credentials_missing", profile.name,
                        profile.api_key_env)


def raise_fd_limit(workers_max: int) -> None:
    """Raise the soft limit on open files to the hard one (the children inherit
    it), and say what it is. The supervisor holds ~2 descriptors per worker
    (measured: 1,044 at 500 workers) and one per client connection, the sink
    one per worker and per events connection: the usual soft limit of 1,024
    runs out at scale, and a process out of descriptors cannot even accept
    the connection that would tell it so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # Linux caps NOFILE at fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s",
                        soft, target, exc)
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    log.info("open files: soft limit %s (hard %s)", soft, shown)
    want = 256 + 4 * workers_max
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("open-files limit %d is low for workers_max=%d; raise the hard limit "
                    "(systemd: LimitNOFILE)", soft, workers_max)
