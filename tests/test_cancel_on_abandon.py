"""Issue 15, item 2: cancel on abandon, the client side. A `stream_text` closed
or garbage collected before its done, an abandoned `run`, and Ctrl-C (a real
SIGINT) to a real `streamfence submit` cancel the call: the emulator's own
record shows the provider connection closed within 1 s of it, and the call
ends `cancelled`. A detached call (`detach=True`, `submit --detach`) runs to
its end, and `streamfence result` reads it; `streamfence cancel CALL_ID`
stops a running call.

One daemon for the whole module (its start is most of the time); each test
has its own emulator key. The fast tests at the end are the I/O-free part
(ClientCore's bookkeeping) without a daemon.
"""

from __future__ import annotations

import asyncio
import gc
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from streamfence.devtools.emulator.control import (
    EmulatorClient,
    Record,
)
from streamfence.protocol.client import AsyncClient, Client
from streamfence.protocol.client_core import ClientCore
from streamfence.protocol.codec import decode_untrusted, encode
from tests.harness import DaemonProcess
from tests.wires import request_for

LONG = [{"fault": "ok", "chunks": 200, "chunk_delay_s": 0.05}]  # 10 s of text
SHORT = [{"fault": "ok", "chunks": 30, "chunk_delay_s": 0.05}]  # 1.5 s of text


def _closed_within_1s(emu: EmulatorClient, key: str, since: float) -> Record:
    """The emulator's record of `key`'s one request: its connection closed by the
    client (aborted, not completed) less than 1 s after `since` (time.time())."""
    record: Record = emu.wait_for(lambda log: log[0] if log and log[0]["aborted"] else None,
                                  timeout=10.0, what="the provider connection to close",
                                  key=key)
    assert not record["completed"], record
    assert record["ended"] - since < 1.0, f"closed {record['ended'] - since:.3f} s after"
    return record


def _ran_to_its_end(emu: EmulatorClient, key: str) -> Record:
    record: Record = emu.wait_for(lambda log: log[0] if log and log[0]["ended"] else None,
                                  timeout=15.0, what="the provider stream to end", key=key)
    assert record["completed"] and not record["aborted"], record
    return record


def _first_chunk(emu: EmulatorClient, key: str) -> None:
    emu.wait_for(lambda log: bool(log and log[0]["chunks_sent"] > 0), timeout=10.0,
                 what="the provider's first chunk", key=key)


def _status(daemon: DaemonProcess, call_id: str) -> str:
    with daemon.client() as client:
        done = client.result(call_id, wait_s=10.0)
    assert done is not None, f"call {call_id} has not ended within 10 s"
    return str(done["status"])


# ---- stream_text and run ------------------------------------------------------------------

@pytest.mark.slow
def test_a_closed_stream_text_cancels_its_call(daemon: DaemonProcess,
                                               emu: EmulatorClient) -> None:
    emu.script("closed", LONG)
    with daemon.client() as client:
        stream = client.stream_text("emu", request_for("openai", "closed"))
        assert all(next(stream) for _ in range(3))
        stream.close()
        closed = time.time()
        assert list(stream) == [] and stream.done is None
        assert stream.call_id is not None
        _closed_within_1s(emu, "closed", closed)
    assert _status(daemon, stream.call_id) == "cancelled"


@pytest.mark.slow
def test_a_garbage_collected_stream_text_cancels_its_call(daemon: DaemonProcess,
                                                          emu: EmulatorClient) -> None:
    emu.script("collected", LONG)
    with daemon.client() as client:
        stream = client.stream_text("emu", request_for("openai", "collected"))
        assert all(next(stream) for _ in range(3))
        call_id = stream.call_id
        assert call_id is not None
        del stream
        gc.collect()
        collected = time.time()
        _closed_within_1s(emu, "collected", collected)
    assert _status(daemon, call_id) == "cancelled"


@pytest.mark.slow
def test_async_stream_text_left_by_async_with_and_an_abandoned_run_cancel(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    emu.script("async-with", LONG)
    emu.script("async-run", LONG)

    async def main() -> tuple[str, float, float]:
        async with AsyncClient(daemon.endpoint, credentials=daemon.credentials_path) as client:
            async with client.stream_text("emu", request_for("openai", "async-with")) as stream:
                async for _ in stream:
                    break  # the `async with` closes it
            left = time.time()
            assert stream.call_id is not None
            # run() whose caller gives up (wait_for cancels its task) is abandoned too.
            run = asyncio.ensure_future(client.run("emu", request_for("openai", "async-run")))
            await asyncio.to_thread(_first_chunk, emu, "async-run")
            gave_up = time.time()
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            return stream.call_id, left, gave_up

    call_id, left, gave_up = asyncio.run(main())
    _closed_within_1s(emu, "async-with", left)
    _closed_within_1s(emu, "async-run", gave_up)
    assert _status(daemon, call_id) == "cancelled"


@pytest.mark.slow
def test_a_detached_stream_text_runs_to_its_end_and_result_reads_it(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    emu.script("detached", SHORT)
    with daemon.client() as client:
        stream = client.stream_text("emu", request_for("openai", "detached"), detach=True)
        assert next(stream)
        call_id = stream.call_id
        assert call_id is not None
        stream.close()
        del stream
        gc.collect()
    record = _ran_to_its_end(emu, "detached")  # with the client closed too
    with daemon.client() as client:
        done = client.result(call_id, wait_s=10.0)
    assert done is not None and done["status"] == "completed", done
    assert done["response"]["content"] == record["text"]


# ---- the CLI: submit and Ctrl-C, submit --detach, cancel, result ------------------------------

def _cli(daemon: DaemonProcess, *args: str) -> list[str]:
    command, *rest = args
    return [sys.executable, "-m", "streamfence.cli", command, "--config",
            str(daemon.config_path), *rest]


def _first_output(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes]:
    """Read the process's stdout and stderr until stdout has text and stderr a
    whole line; return both as read so far."""
    assert proc.stdout is not None and proc.stderr is not None
    got = {proc.stdout: b"", proc.stderr: b""}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        while not (got[proc.stdout] and b"\n" in got[proc.stderr]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer text from `streamfence submit` within {timeout} s; "
                                   f"read {got}")
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 4096)
                if not chunk:
                    raise AssertionError(f"submit exited with {proc.wait(5)} before its text: "
                                         f"read {got}")
                got[key.fileobj] += chunk  # type: ignore[index]
    return got[proc.stdout], got[proc.stderr]


def _as_in_a_terminal() -> None:
    """SIGINT as a foreground command gets it: a shell that runs the tests in
    the background (`cmd &`, as a CI runner may) starts them with SIGINT
    ignored, and a child inherits that, so Python never installs its
    KeyboardInterrupt handler and the Ctrl-C below would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_submit(daemon: DaemonProcess, key: str,
                      *flags: str) -> tuple[str, float, int, str]:
    """Start `streamfence submit` on `key`, SIGINT it once it printed some text;
    return the call id it printed, when it was interrupted, its exit code and
    all it wrote on stderr."""
    proc = subprocess.Popen(_cli(daemon, "submit", "--provider", "emu", "--model",
                                 f"gpt-emu#{key}", *flags, "hi"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_as_in_a_terminal)
    try:
        _, err = _first_output(proc, timeout=30.0)
        first = err.decode().splitlines()[0]
        assert first.startswith("[accepted] call="), err  # the call id, first
        proc.send_signal(signal.SIGINT)
        interrupted = time.time()
        _, rest = proc.communicate(timeout=30.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return first.removeprefix("[accepted] call="), interrupted, proc.returncode, \
        (err + rest).decode()


@pytest.mark.slow
def test_ctrl_c_to_submit_cancels_the_call_and_exits_130(daemon: DaemonProcess,
                                                         emu: EmulatorClient) -> None:
    emu.script("ctrl-c", LONG)
    call_id, interrupted, code, err = _interrupt_submit(daemon, "ctrl-c")
    _closed_within_1s(emu, "ctrl-c", interrupted)
    assert code == 130, err
    assert f"[cancelled] call={call_id}" in err and "(Ctrl-C)" in err, err
    assert _status(daemon, call_id) == "cancelled"


@pytest.mark.slow
def test_ctrl_c_to_submit_detach_leaves_the_call_running(daemon: DaemonProcess,
                                                         emu: EmulatorClient) -> None:
    emu.script("cli-detached", SHORT)
    call_id, _, code, err = _interrupt_submit(daemon, "cli-detached", "--detach")
    assert code == 130, err
    assert f"[detached] call={call_id} runs on" in err and f"streamfence result {call_id}" in err
    record = _ran_to_its_end(emu, "cli-detached")
    shown = subprocess.run(_cli(daemon, "result", call_id, "--wait", "10"), capture_output=True,
                           text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == record["text"] + "\n"
    assert f"[completed] call={call_id}" in shown.stderr


@pytest.mark.slow
def test_the_cancel_command_stops_a_running_call(daemon: DaemonProcess,
                                                 emu: EmulatorClient) -> None:
    emu.script("cancel-cmd", LONG)
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "cancel-cmd"), subscribe=False)
    _first_chunk(emu, "cancel-cmd")
    cancelled = subprocess.run(_cli(daemon, "cancel", call_id), capture_output=True, text=True,
                               timeout=30)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith(f"[cancelled] call={call_id}"), cancelled.stdout
    record = emu.wait_for(lambda log: log[0] if log[0]["ended"] else None, timeout=10.0,
                          what="the provider connection to close", key="cancel-cmd")
    assert record["aborted"] and not record["completed"], record
    assert _status(daemon, call_id) == "cancelled"
    again = subprocess.run(_cli(daemon, "result", call_id), capture_output=True, text=True,
                           timeout=30)
    assert again.returncode == 1 and f"[cancelled] call={call_id}" in again.stderr, again


# ---- the bookkeeping, without I/O ----------------------------------------------------------

def test_only_owned_calls_are_cancelled_once_and_a_refused_send_stays_queued() -> None:
    core = ClientCore("ipc:///nowhere", 1.0, 1 << 20)
    core.owned.add("c1")
    core.leave("c1")
    core.leave("c1")  # a second close: nothing more
    core.leave("c2")  # not owned (submit, events(), detach): never cancelled
    assert list(core.to_cancel) == ["c1"]
    core.send_cancels(lambda frame: False)  # the socket would block: kept
    assert list(core.to_cancel) == ["c1"] and core.closing() == 0
    sent: list[bytes] = []

    def send(frame: bytes) -> bool:
        sent.append(frame)
        return True

    core.send_cancels(send)
    msg = decode_untrusted(sent[0], 1 << 20)
    assert isinstance(msg, dict) and (msg["op"], msg["call_id"]) == ("cancel", "c1")
    assert not core.to_cancel and core.closing() == 1000  # lingers for the answer
    core.router.route([encode({"v": 1, "op": "cancelling", "ref": msg["ref"],
                               "call_id": "c1"})])  # the answer: dropped
    assert core.router.cancels_unanswered == 0 and core.closing() == 0


def test_a_left_call_is_read_no_more() -> None:
    core = ClientCore("ipc:///nowhere", 1.0, 1 << 20)
    core.router.reading("c1", 0)
    core.leave("c1")
    assert core.router.is_finished("c1")  # its later events are discarded
    assert core.router.next_event("c1") is None


def test_close_of_a_client_cancels_its_unfinished_streams_but_not_detached_ones() -> None:
    client = Client("ipc:///nonexistent/sf", timeout_s=1.0)  # libzmq queues for it
    streams = [client.stream_text("emu", request_for("openai", "x")),
               client.stream_text("emu", request_for("openai", "y"), detach=True)]
    for stream, call_id in zip(streams, ("c8", "c9"), strict=True):
        stream.call_id = call_id  # as if accepted, no done yet
        if not stream.detach:
            client._core.owned.add(call_id)
    client.close()
    assert not client._core.to_cancel and client._core.router.cancels_unanswered == 1
    assert list(client._core.router._cancel_refs.values()) == ["c8"]
    del streams, stream  # their finalizers find the client closed: nothing more
