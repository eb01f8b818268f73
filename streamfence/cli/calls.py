"""The commands about one call the daemon has: `cancel CALL_ID`, `result CALL_ID`,
and what `submit` does on Ctrl-C (`interrupted`).

Where things are printed: a call's answer text goes to stdout and nothing
else does (so `streamfence submit ... > answer.txt` and `streamfence result
ID > answer.txt` hold only the answer); the call id (`[accepted] call=ID`),
notices and the outcome line (`[STATUS] call=ID attempts=N`) go to stderr.
`cancel` prints its one line to stdout: it has no answer text.

Exit codes: 0 a call that ended completed or partial (or a cancel that was
taken); 1 one that ended failed or cancelled, or an error of the command
(click's); 130 `submit` interrupted by Ctrl-C (SIGINT), whether it cancelled
the call or, with --detach, left it running; 75 (EX_TEMPFAIL) `result` of a
call that has not ended yet.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from streamfence.cli.common import client_options, connect

if TYPE_CHECKING:
    from streamfence.protocol.client import Client

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
EXIT_PENDING = 75  # sysexits' EX_TEMPFAIL: ask again later
CANCEL_WAIT_S = 5.0  # how long `submit` waits for the done of the call Ctrl-C cancelled
OK_STATUSES = ("completed", "partial")


def outcome_line(done: dict[str, Any], call_id: str) -> str:
    """`[completed] call=ID attempts=N`, with the error's code and message if any."""
    err = done.get("error") or {}
    return (f"[{done.get('status')}] call={call_id} attempts={done.get('attempts')}"
            + (f" error={err.get('code')}: {err.get('message')}" if err else ""))


def interrupted(client: Client, call_id: str, detach: bool) -> NoReturn:
    """`submit` got Ctrl-C while its call ran: cancel it (unless `detach`), say
    what became of it on stderr, exit 130. A second Ctrl-C exits at once."""
    if detach:
        click.echo(f"[detached] call={call_id} runs on: `streamfence result {call_id}` prints "
                   f"its answer, `streamfence cancel {call_id}` stops it", err=True)
        sys.exit(EXIT_INTERRUPTED)
    from streamfence.protocol.client import ClientError

    try:
        reply = client.cancel(call_id)
        done = reply if reply["op"] == "done" else client.result(call_id, wait_s=CANCEL_WAIT_S)
    except KeyboardInterrupt:
        click.echo(f"[interrupted] call={call_id}: a second Ctrl-C, before the daemon answered "
                   f"the cancel (`streamfence cancel {call_id}` makes sure)", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except (ClientError, TimeoutError) as exc:
        click.echo(f"[interrupted] call={call_id}: could not cancel it ({exc}); it may run on",
                   err=True)
        sys.exit(EXIT_INTERRUPTED)
    if done is None:
        click.echo(f"[cancelling] call={call_id} (Ctrl-C)", err=True)
    else:
        click.echo(outcome_line(done, call_id) + " (Ctrl-C)", err=True)
    sys.exit(EXIT_INTERRUPTED)


@click.command()
@client_options
@click.option("--wait", "wait_s", type=float, default=CANCEL_WAIT_S, show_default=True,
              help="Seconds to wait for the call's done after the daemon took the cancel "
                   "(0: print `cancelling` at once).")
@click.option("--json", "as_json", is_flag=True, default=False,
              help="Print the daemon's reply (the done event, or `cancelling`) as JSON.")
@click.argument("call_id")
def cancel(endpoint: str | None, credentials: str | None, config_path: str | None,
           wait_s: float, as_json: bool, call_id: str) -> None:
    """Cancel a call: prints its done (`[cancelled] call=ID ...`; the outcome of a
    call that had ended already), or `[cancelling] call=ID` if the done has not
    come within --wait."""
    from streamfence.protocol.client import ClientError

    with connect(endpoint, credentials, config_path) as client:
        try:
            reply = client.cancel(call_id)
            if reply["op"] != "done" and wait_s > 0:
                reply = client.result(call_id, wait_s=wait_s) or reply
        except ClientError as exc:
            raise click.ClickException(f"{exc.code}: {exc.message}") from None
    if as_json:
        click.echo(json.dumps(reply, indent=2, default=str))
    elif reply["op"] == "done":
        click.echo(outcome_line(reply, call_id))
    else:
        click.echo(f"[cancelling] call={call_id}")


@click.command()
@client_options
@click.option("--wait", "wait_s", type=float, default=0.0, show_default=True,
              help="Seconds to wait for a call that has not ended.")
@click.option("--json", "as_json", is_flag=True, default=False,
              help="Print the done event as JSON instead.")
@click.argument("call_id")
def result(endpoint: str | None, credentials: str | None, config_path: str | None,
           wait_s: float, as_json: bool, call_id: str) -> None:
    """Print a call's answer (stdout) and outcome (stderr); exit 75 if it has
    not ended (within --wait)."""
    from streamfence.protocol.client import ClientError

    with connect(endpoint, credentials, config_path) as client:
        try:
            done = client.result(call_id, wait_s=wait_s)
            if done is not None and (done.get("response") or {}).get("content_omitted"):
                done = _with_content(client, call_id, done)
        except ClientError as exc:
            raise click.ClickException(f"{exc.code}: {exc.message}") from None
    if done is None:
        click.echo(f"[pending] call={call_id}: it has not ended (--wait SECONDS waits)", err=True)
        sys.exit(EXIT_PENDING)
    if as_json:
        click.echo(json.dumps(done, indent=2, default=str))
    else:
        response = done.get("response") or {}
        click.echo(response.get("content") or response.get("refusal") or "")
        click.echo(outcome_line(done, call_id), err=True)
    sys.exit(0 if done.get("status") in OK_STATUSES else 1)


def _with_content(client: Client, call_id: str, done: dict[str, Any]) -> dict[str, Any]:
    """A done too large to hold its answer (PROTOCOL §6 `content_omitted`): the
    answer read back from the call's events (the last attempt's text)."""
    client.subscribe(call_id, 0)
    attempt: int = 0
    parts: list[str] = []
    for event in client.events(call_id):
        if event["op"] in ("delta", "reset") and event.get("attempt", attempt) != attempt:
            attempt, parts = event["attempt"], []  # a new attempt's answer replaces it
        if event["op"] == "delta" and event.get("kind") == "text":
            parts.append(event["data"])
    return {**done, "response": {**done["response"], "content": "".join(parts)}}
