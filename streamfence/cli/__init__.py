"""The `streamfence` command: init, emulator, serve, reload, stop, submit,
cancel, result, status, usage, keys, prune, check, demo, cluster.

Client commands find the daemon and their identity without flags on the
daemon's own machine: `--credentials`, else $STREAMFENCE_CREDENTIALS, else the
admin credentials the daemon wrote in the state dir of `--config` (default
$STREAMFENCE_CONFIG, else ./streamfence.toml if it exists; docs/SECURITY.md).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

from streamfence.cli.calls import EXIT_INTERRUPTED, cancel, interrupted, outcome_line, result
from streamfence.cli.check import check
from streamfence.cli.cluster import cluster
from streamfence.cli.common import (
    DEFAULT_CONFIG,
    client_options,
    config_option,
    config_path_of,
    connect,
    load,
)
from streamfence.cli.control import reload, stop
from streamfence.cli.init import emulator, init
from streamfence.cli.keys import keys
from streamfence.cli.prune import prune
from streamfence.cli.usage import usage

if TYPE_CHECKING:
    from streamfence.config.model import DaemonConfig, ProviderProfile

# `submit`'s model when --model is not given, per wire.
DEFAULT_MODELS = {"openai": "gpt-4o-mini", "anthropic": "claude-sonnet-4-5",
                  "bedrock": "amazon.nova-lite-v1:0"}


@click.group()
@click.version_option(package_name="streamfence", prog_name="streamfence")
def main() -> None:
    """streamfence: LLM streaming calls that can't hang, leak or corrupt a transcript."""


@main.command()
@config_option
@click.option("--log-json", is_flag=True, default=False, help="Log JSON lines.")
def serve(config_path: str | None, log_json: bool) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT (`streamfence stop`);
    SIGHUP (`streamfence reload`) makes it read its config file again."""
    from streamfence.protocol import failpoints
    from streamfence.protocol.lifecycle import name_processes, set_process_title
    from streamfence.supervisor.daemon import Daemon
    from streamfence.supervisor.gatewaychild import GatewayEntry
    from streamfence.supervisor.logs import setup_logging
    from streamfence.supervisor.startup import StartupError

    set_process_title("supervisor")
    try:
        failpoints.check()  # a test's STREAMFENCE_FAILPOINTS with a typo must not pass unarmed
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    cfg = load(config_path)
    name_processes(cfg.endpoint)
    set_process_title("supervisor")
    try:
        setup_logging(cfg.log_level, log_json or cfg.log_json, log_file=cfg.log_file,
                      max_bytes=cfg.log_file_max_bytes, backups=cfg.log_file_backups)
    except OSError as exc:
        raise click.ClickException(f"{config_path_of(config_path) or '<defaults>'}: "
                                   f"daemon.log_file: cannot open {cfg.log_file}: "
                                   f"{exc.strerror}") from None
    path = config_path_of(config_path)
    gateway: GatewayEntry | None = None
    if cfg.http.listen is not None:  # aiohttp and uvloop load only for a gateway
        from streamfence.gateway.process import run_gateway as gateway
    try:
        daemon = Daemon(cfg, gateway=gateway)  # refuses a bad state dir in one line, before any of ours
        _log_what_serves(path, cfg)
        code = daemon.run()
    except StartupError as exc:  # name the file, as configuration errors do
        raise click.ClickException(f"{path or '<defaults>'}: {exc}") from None
    sys.exit(code)


def _where(profile: ProviderProfile) -> str:
    parts = [profile.kind, profile.base_url or profile.endpoint_url or "the SDK's default URL"]
    if profile.kind == "bedrock":
        parts.append(profile.region or "the AWS config's region")
    return f"{profile.name} ({', '.join(parts)})"


def _log_what_serves(path: str | None, cfg: DaemonConfig) -> None:
    """Say which config the daemon runs on, where its state lives and which
    profiles it has: a start on the defaults must not look like a configured one."""
    log = logging.getLogger("streamfence.cli")
    if path is None:
        log.warning("no config file (no --config, $STREAMFENCE_CONFIG is unset and %s has no "
                    "%s): running on the built-in defaults; `streamfence init` writes a "
                    "config to start from", os.getcwd(), DEFAULT_CONFIG)
    else:
        log.info("config: %s", os.path.abspath(path))
    log.info("state dir: %s", os.path.abspath(cfg.state_dir))
    if cfg.providers:
        log.info("provider profiles: %s", "; ".join(_where(p) for p in cfg.providers.values()))
    else:
        log.warning("no provider profiles%s: the daemon runs, but refuses every call with "
                    "unknown_provider", f" (no [providers.NAME] table in {path})" if path
                    else "")


def resolve_wire(kinds: Mapping[str, str], provider: str,
                 wire: str | None) -> tuple[str, bool]:
    """The wire of a submit to `provider` (a profile or a model group: its
    kind in `kinds`), and whether it is a guess: --wire, else its kind in the
    config; openai (a guess) for a name the config lacks (the daemon's config
    may be another machine's). A --wire that contradicts the kind is refused:
    that request cannot work."""
    kind = kinds.get(provider)
    if kind is None:
        return wire or "openai", wire is None
    if wire is not None and wire != kind:
        raise click.UsageError(f"--wire {wire}, but {provider!r} is of kind {kind}; "
                               f"leave --wire out")
    return kind, False


def _parse_request(wire: str, model: str, prompt: str,
                   request_json: str | None) -> dict[str, Any]:
    if request_json:
        try:
            request: dict[str, Any] = json.loads(request_json)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--request") from None
        return request
    from streamfence.protocol.wires import sample_request

    return sample_request(wire, model, prompt)


@main.command()
@client_options
@click.option("--provider", required=True, help="A provider profile name of the daemon.")
@click.option("--wire", type=click.Choice(["openai", "anthropic", "bedrock"]), default=None,
              help="The request's shape (from --model/PROMPT). Default: the profile's kind in "
                   "the config; openai for a profile the config does not have.")
@click.option("--model", default=None,
              help="Default per wire: " + ", ".join(f"{w} {m}" for w, m in DEFAULT_MODELS.items())
              + ".")
@click.option("--request", "request_json", default=None,
              help="The provider-native request body as JSON (overrides --model/PROMPT).")
@click.option("--session", "session_id", default=None)
@click.option("--stale-timeout", type=float, default=None)
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Give up waiting for the daemon after this many seconds of silence.")
@click.option("--detach", is_flag=True, default=False,
              help="Ctrl-C leaves the call running (and says how to get its result) instead "
                   "of cancelling it.")
@click.option("--no-wait", is_flag=True, default=False,
              help="Print the call id (stdout) once accepted and exit; the call runs on "
                   "(`streamfence result --wait S ID` gives its answer, on any host of a "
                   "cluster).")
@click.argument("prompt", required=False, default="Hello!")
def submit(endpoint: str | None, credentials: str | None, config_path: str | None,
           provider: str, wire: str | None, model: str | None, request_json: str | None,
           session_id: str | None, stale_timeout: float | None, timeout: float,
           detach: bool, no_wait: bool, prompt: str) -> None:
    """Submit one call to the profile named by --provider and stream its text
    live to stdout; the call id first and the outcome last go to stderr.
    Ctrl-C cancels the call (exit 130), unless --detach."""
    from streamfence.protocol.client import ClientError

    cfg = load(config_path)
    kinds = {**{n: p.kind for n, p in cfg.providers.items()},
             **{n: g.kind for n, g in cfg.groups.items()}}
    wire, guessed = resolve_wire(kinds, provider, wire)
    options = {"stale_timeout_s": stale_timeout} if stale_timeout else None
    request = _parse_request(wire, model or DEFAULT_MODELS[wire], prompt, request_json)
    with connect(endpoint, credentials, config_path) as client:
        try:
            call_id = client.submit(provider, request, session_id=session_id, options=options,
                                    subscribe=not no_wait)
        except ClientError as exc:
            hint = (f" (profile {provider!r} is not in {config_path_of(config_path) or 'a config'}"
                    f", so the request was shaped for --wire {wire}; give --wire if it is "
                    f"another kind)") if guessed and exc.code != "unknown_provider" else ""
            raise click.ClickException(f"{exc.code}: {exc.message}{hint}") from None
        except KeyboardInterrupt:  # its id unknown here: nothing to cancel by
            click.echo("[interrupted] before the daemon answered the submit: if it took the "
                       "call, the call runs on (`streamfence status` lists the calls)", err=True)
            sys.exit(EXIT_INTERRUPTED)
        if no_wait:
            click.echo(call_id)
            return
        done: dict[str, Any] = {}
        try:
            click.echo(f"[accepted] call={call_id}", err=True)
            for event in client.events(call_id, timeout_s=timeout):
                op = event.get("op")
                if op == "delta" and event.get("kind") in ("text", "refusal"):
                    click.echo(event["data"], nl=False)
                elif op == "delta" and event.get("kind") == "notice":
                    click.echo(f"\n[notice] {event['data']}", err=True)
                elif op == "reset":
                    click.echo("\n[reset: the answer restarts]", err=True)
                elif op == "done":
                    done = event
        except KeyboardInterrupt:
            click.echo()  # end the answer's line
            interrupted(client, call_id, detach)
        click.echo()
        click.echo(outcome_line(done, call_id), err=True)
        if done.get("status") not in ("completed", "partial"):
            sys.exit(1)


@main.command()
@client_options
@click.option("--json", "as_json", is_flag=True, default=False)
def status(endpoint: str | None, credentials: str | None, config_path: str | None,
           as_json: bool) -> None:
    """Show workers (pid, state, attempt), calls, breakers and counters (an admin
    sees everything; another identity its own calls)."""
    with connect(endpoint, credentials, config_path, timeout_s=5.0) as client:
        reply = client.status()
    if as_json:
        click.echo(json.dumps(reply, indent=2, default=str))
        return
    from streamfence.cli.status_view import render_status

    render_status(reply)


@main.command()
@click.option("--rounds", default=1, show_default=True,
              help="How many times to run each fault scenario on each wire.")
@click.option("--wire", "wires", type=click.Choice(["openai", "anthropic", "bedrock", "all"]),
              default=("all",), show_default=True, multiple=True,
              help="The provider wire(s) to run the calls on.")
@click.option("--keep", is_flag=True, default=False,
              help="Keep the work dir (the daemon's state and log, the emulator's log) after a "
                   "PASS too; a FAIL always keeps it.")
def demo(rounds: int, wires: tuple[str, ...], keep: bool) -> None:
    """Emulator + daemon + a batch of calls with injected faults, live, then a
    verdict. Ctrl-C stops it (the daemon drains); a second Ctrl-C at once."""
    from streamfence.devtools.demo import run_demo
    from streamfence.protocol.wires import WIRES

    chosen = list(WIRES) if "all" in wires else list(dict.fromkeys(wires))
    try:
        ok = run_demo(rounds=rounds, wires=chosen, keep=keep)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0 if ok else 1)


main.add_command(reload)
main.add_command(stop)
main.add_command(cancel)
main.add_command(result)
main.add_command(usage)
main.add_command(init)
main.add_command(emulator)
main.add_command(check)
main.add_command(keys)
main.add_command(prune)
main.add_command(cluster)
