"""The `streamfence` command: serve, submit, status, keys, prune, check, demo.

Client commands find the daemon and their identity without flags on the
daemon's own machine: `--credentials`, else $STREAMFENCE_CREDENTIALS, else the
admin credentials the daemon wrote in the state dir of `--config` (default
$STREAMFENCE_CONFIG, else ./streamfence.toml if it exists; docs/SECURITY.md).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from streamfence.cli.check import check
from streamfence.cli.common import client_options, config_option, config_path_of, connect, load
from streamfence.cli.keys import keys
from streamfence.cli.prune import prune


@click.group()
@click.version_option(package_name="streamfence", prog_name="streamfence")
def main() -> None:
    """streamfence: LLM streaming calls that can't hang, leak or corrupt a transcript."""


@main.command()
@config_option
@click.option("--log-json", is_flag=True, default=False, help="Log JSON lines.")
def serve(config_path: str | None, log_json: bool) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    from streamfence.supervisor.daemon import Daemon, StartupError
    from streamfence.supervisor.logs import setup_logging

    cfg = load(config_path)
    setup_logging(cfg.log_level, log_json or cfg.log_json)
    try:
        code = Daemon(cfg).run()
    except StartupError as exc:  # name the file, as configuration errors do
        raise click.ClickException(f"{config_path_of(config_path) or '<defaults>'}: {exc}") \
            from None
    sys.exit(code)


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
@click.option("--wire", type=click.Choice(["openai", "anthropic", "bedrock"]), default="openai",
              show_default=True, help="The profile's kind: shapes the request from --model/PROMPT.")
@click.option("--model", default="gpt-4o-mini", show_default=True)
@click.option("--request", "request_json", default=None,
              help="The provider-native request body as JSON (overrides --model/PROMPT).")
@click.option("--session", "session_id", default=None)
@click.option("--stale-timeout", type=float, default=None)
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Give up waiting for the daemon after this many seconds of silence.")
@click.argument("prompt", required=False, default="Hello!")
def submit(endpoint: str | None, credentials: str | None, config_path: str | None,
           provider: str, wire: str, model: str, request_json: str | None,
           session_id: str | None, stale_timeout: float | None, timeout: float,
           prompt: str) -> None:
    """Submit one call and stream its text live to the terminal."""
    from streamfence.protocol.client import ClientError

    options = {"stale_timeout_s": stale_timeout} if stale_timeout else None
    request = _parse_request(wire, model, prompt, request_json)
    with connect(endpoint, credentials, config_path) as client:
        try:
            call_id = client.submit(provider, request, session_id=session_id, options=options)
        except ClientError as exc:
            raise click.ClickException(f"{exc.code}: {exc.message}") from None
        done: dict[str, Any] = {}
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
        click.echo()
        err = done.get("error") or {}
        click.echo(f"[{done.get('status')}] call={call_id} attempts={done.get('attempts')}"
                   + (f" error={err.get('code')}: {err.get('message')}" if err else ""),
                   err=True)
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
def demo(rounds: int, wires: tuple[str, ...]) -> None:
    """Emulator + daemon + a batch of calls with injected faults, live, then a verdict."""
    from streamfence.devtools.demo import run_demo
    from streamfence.protocol.wires import WIRES

    chosen = list(WIRES) if "all" in wires else list(dict.fromkeys(wires))
    sys.exit(0 if run_demo(rounds=rounds, wires=chosen) else 1)


main.add_command(check)
main.add_command(keys)
main.add_command(prune)
