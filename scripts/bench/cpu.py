"""Section 1: CPU per delta, end to end.

The same N-chunk text stream (pieces of ~4-5 characters, like a provider's
token deltas) is read, per round and in rotated order, by:

- `openai-sdk`     the bare openai SDK loop in this process
                   (`chat.completions.create(stream=True)`, `chunk.choices[0].delta.content`);
- `anthropic-sdk`  the bare anthropic SDK loop in this process
                   (`messages.create(stream=True)`, `event.delta.text`);
- `httpx2-raw`     raw httpx2 + orjson on the OpenAI wire (the reference point of docs/ARCHITECTURE.md §6);
- `sf-openai`      streamfence: submit to the real daemon (openai profile) and read the
                   events with `streamfence.protocol.client.Client`: CPU of the supervisor, sink,
                   zygote and every worker (common.CpuMeter, before/after) plus this
                   process (the subscriber);
- `sf-anthropic`   the same on an anthropic profile.

Three shapes: `burst` (no delay: the emulator writes 64 KiB batches), `paced`
(`chunk_delay_s`, one chunk per write, like a model streaming) and `paced ×N`
(N such streams at once: the SDK loop in N threads of this process, against N
calls submitted to the daemon; openai pair only). The emulator's own CPU is
measured around every run and reported, never summed. µs/delta is CPU seconds /
chunks; c/a is the median of the per-round ratios sf-openai / openai-sdk,
against issue 32's targets (≤ 1.2 at one paced stream, ≤ 1.0 otherwise).
Beside the CPU, the notes count how often each process's threads were put
on a CPU per delta (schedstat: wake-ups, plus preemptions when loaded), the
figure a paced stream's cost follows. The daemon keeps N + 2 warm workers;
every variant runs once unmeasured first.
"""

from __future__ import annotations

import gc
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx2
import openai
import orjson

from scripts.bench.common import (
    CpuMeter,
    Section,
    daemon,
    daemon_roles,
    emulator,
    fmt_us,
    log,
    median,
    providers_for,
    realistic_text,
    rotated,
    tree,
    wait_idle,
)
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess

VARIANTS = ("openai-sdk", "anthropic-sdk", "httpx2-raw", "sf-openai", "sf-anthropic")
PROMPT = [{"role": "user", "content": "Write a short paragraph."}]


class Runner:
    """Runs one stream through one variant and measures it."""

    def __init__(self, emu: EmulatorProcess, proc: DaemonProcess) -> None:
        self.emu = emu
        self.control: EmulatorClient = emu.client()
        self.proc = proc
        http = httpx2.Client(trust_env=False, timeout=60.0)
        self.oa = openai.OpenAI(base_url=emu.openai_base_url, api_key="bench", max_retries=0,
                                http_client=http)
        self.an = anthropic.Anthropic(base_url=emu.anthropic_base_url, api_key="bench",
                                      max_retries=0, http_client=httpx2.Client(trust_env=False,
                                                                               timeout=60.0))
        self.raw = httpx2.Client(trust_env=False, timeout=60.0)
        self.sf = proc.client(timeout_s=30.0)
        assert proc.proc is not None
        self.daemon_pid = proc.proc.pid
        self.emu_pid = emu.pid or 0

    def close(self) -> None:
        self.sf.close()
        self.oa.close()
        self.an.close()
        self.raw.close()

    # ---- the variants: each returns the text it received ----------------------

    def _openai_sdk(self, model: str) -> str:
        parts = []
        client: Any = self.oa  # the SDK's overloads are too narrow for a bench's model names
        stream = client.chat.completions.create(model=model, messages=PROMPT, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                content = chunk.choices[0].delta.content
                if content:
                    parts.append(content)
        return "".join(parts)

    def _anthropic_sdk(self, model: str) -> str:
        parts = []
        client: Any = self.an
        stream = client.messages.create(model=model, max_tokens=4096, messages=PROMPT,
                                        stream=True)
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                parts.append(event.delta.text)
        return "".join(parts)

    def _httpx2_raw(self, model: str) -> str:
        parts = []
        body = {"model": model, "messages": PROMPT, "stream": True,
                "stream_options": {"include_usage": True}}
        url = self.emu.openai_base_url + "/chat/completions"
        with self.raw.stream("POST", url, json=body,
                             headers={"Authorization": "Bearer bench"}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = orjson.loads(line[6:])
                choices = obj.get("choices")
                if choices:
                    content = choices[0]["delta"].get("content")
                    if content:
                        parts.append(content)
        return "".join(parts)

    def _streamfence(self, profile: str, models: list[str]) -> list[str]:
        """Submit one call per model (all at once), then read each one's events."""
        calls = []
        for model in models:
            request: dict[str, Any] = {"model": model, "messages": PROMPT}
            if profile == "an":
                request["max_tokens"] = 4096
            calls.append(self.sf.submit(profile, request))
        texts = []
        for call_id in calls:  # the client buffers the other calls' events meanwhile
            parts = []
            for event in self.sf.events(call_id, timeout_s=60.0):
                if event["op"] == "delta" and event["kind"] == "text":
                    parts.append(event["data"])
                elif event["op"] == "done" and event["status"] != "completed":
                    raise RuntimeError(f"streamfence call ended {event['status']}: "
                                       f"{event['error']}")
            texts.append("".join(parts))
        return texts

    def _sdk(self, one: Callable[[str], str], models: list[str]) -> list[str]:
        """One stream in this thread, or one thread per stream (an agent runtime's shape)."""
        if len(models) == 1:
            return [one(models[0])]
        with ThreadPoolExecutor(max_workers=len(models)) as pool:
            return list(pool.map(one, models))

    def fn(self, variant: str) -> Callable[[list[str]], list[str]]:
        sdk = {"openai-sdk": self._openai_sdk, "anthropic-sdk": self._anthropic_sdk,
               "httpx2-raw": self._httpx2_raw}
        if variant in sdk:
            return lambda models: self._sdk(sdk[variant], models)
        return lambda models: self._streamfence("oa" if variant == "sf-openai" else "an", models)

    # ---- one measured run -------------------------------------------------------

    def run(self, variant: str, chunks: int, delay: float, text: str,
            streams: int = 1) -> dict[str, Any]:
        """`streams` concurrent copies of the stream; CPU is for all of them."""
        models = []
        for _ in range(streams):
            key = f"cpu-{uuid.uuid4().hex[:10]}"
            self.control.script(key, [{"fault": "ok", "chunks": chunks, "chunk_delay_s": delay,
                                       "text": text}])
            models.append(f"emu-model#{key}")
        in_daemon = variant.startswith("sf-")
        daemon_meter = CpuMeter([self.daemon_pid])
        emu_meter = CpuMeter([self.emu_pid])
        status = self.sf.status() if in_daemon else None
        gc.collect()
        pids = [*tree(self.daemon_pid), os.getpid()] if in_daemon else [os.getpid()]
        slices0 = _timeslices(pids)
        daemon_meter.start()
        emu_meter.start()
        own0 = time.process_time()
        wall0 = time.perf_counter()
        got = self.fn(variant)(models)
        wall_s = time.perf_counter() - wall0
        own_s = time.process_time() - own0
        if in_daemon:
            time.sleep(0.03)  # the worker's last steps (W_IDLE, its log line) after the done
        daemon_meter.stop()
        emu_meter.stop()
        slices1 = _timeslices(pids)
        for one in got:
            if one != text:
                raise RuntimeError(f"{variant}: received {len(one)} chars, scripted {len(text)}")
        by_role: dict[str, float] = {"client": own_s}
        roles = {os.getpid(): "client"}
        if in_daemon and status is not None:
            roles.update(daemon_roles(status))
            roles[self.daemon_pid] = "supervisor"
            for pid, used in daemon_meter.used.items():
                role = roles.get(pid, "other")
                by_role[role] = by_role.get(role, 0.0) + used
        wakeups: dict[str, int] = {}
        for pid, n in slices1.items():
            role = roles.get(pid, "other")
            wakeups[role] = wakeups.get(role, 0) + n - slices0.get(pid, 0)
        return {"cpu": sum(by_role.values()), "by_role": by_role, "wall": wall_s,
                "emu": emu_meter.total(), "wakeups": wakeups}


def _timeslices(pids: list[int]) -> dict[int, int]:
    """Times each process's threads were put on a CPU (the third figure of
    /proc/PID/task/TID/schedstat), summed by process: at a model's pace one
    per wake-up, plus the preemptions of a loaded machine. A thread that
    ended meanwhile is not seen."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    out[pid] = out.get(pid, 0) + int(f.read().split()[2])
            except (OSError, ValueError, IndexError):
                continue
    return out


def _idle_rate(runner: Runner, seconds: float) -> float:
    """CPU seconds per second the daemon burns with nothing to do."""
    meter = CpuMeter([runner.daemon_pid])
    meter.start()
    time.sleep(seconds)
    meter.stop()
    return meter.total() / seconds


PAIRS = (("sf-openai", "openai-sdk", "c/a = sf-openai ÷ openai-sdk"),
         ("sf-anthropic", "anthropic-sdk", "sf-anthropic ÷ anthropic-sdk"))


def run(quick: bool, rounds: int) -> Section:
    sec = Section("cpu", "1 CPU/delta")
    many = 8 if quick else 50
    gap = 0.01 if quick else 0.02  # s between chunks: 100/s quick, 50/s (a model's pace) full
    # name -> (chunks, chunk_delay_s, concurrent streams, variants)
    paces: dict[str, tuple[int, float, int, tuple[str, ...]]] = {
        "burst": (1000 if quick else 3000, 0.0, 1, VARIANTS),
        "paced": (40 if quick else 200, gap, 1, VARIANTS),
        f"paced ×{many}": (40 if quick else 200, gap, many, ("openai-sdk", "sf-openai")),
    }
    sec.params = {"rounds": rounds, **{f"{p} chunks": n for p, (n, *_) in paces.items()},
                  "paced chunk_delay_s": gap, "chars/delta": "~4.5",
                  "SDK streams": "one thread each"}
    with emulator() as emu, daemon(providers_for(emu, stale_timeout_s=60.0),
                                   {"workers_spare": many + 2,
                                    "workers_max": many + 8}) as proc:
        wait_idle(proc, many + 2)  # the whole warm pool: forking it is not idle CPU
        runner = Runner(emu, proc)
        try:
            idle = _idle_rate(runner, 1.0 if quick else 2.0)
            for pace, (chunks, delay, streams, variants) in paces.items():
                text = realistic_text(chunks)
                warm = realistic_text(min(chunks, 50))
                for variant in variants:  # warm-up: connections, caches, each worker once
                    runner.run(variant, min(chunks, 50), 0.0, warm, streams)
                results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
                for r in range(rounds):
                    for variant in rotated(variants, r):
                        results[variant].append(runner.run(variant, chunks, delay, text, streams))
                    log(f"  cpu {pace} round {r + 1}/{rounds}: " + ", ".join(
                        f"{v} {results[v][-1]['cpu'] / chunks / streams * 1e6:.0f}"
                        for v in variants))
                _report(sec, pace, chunks * streams, delay, results, idle)
        finally:
            runner.close()
    return sec


def _report(sec: Section, pace: str, deltas: int, delay: float,
            results: dict[str, list[dict[str, Any]]], idle: float) -> None:
    def per_delta(v: str) -> float:
        return median([r["cpu"] for r in results[v]]) / deltas

    label = f"{pace}, {deltas} chunks" + (f" @ {1 / delay:.0f}/s each" if delay else "")
    ref = {"openai-sdk": "ref: ~160 µs (paced)", "anthropic-sdk": "ref: ~80–110 µs (paced)",
           "httpx2-raw": "ref: raw httpx+json ~60 µs"}
    for v in results:
        sec.row(f"{v} ({label})", fmt_us(per_delta(v)) + "/delta", reference=ref.get(v, ""))
    for ours, theirs, name in PAIRS:
        if ours not in results or theirs not in results:
            continue
        ratio = median([c["cpu"] / a["cpu"] for c, a in
                        zip(results[ours], results[theirs], strict=True)])
        if ours == "sf-openai":
            target = 1.2 if pace == "paced" else 1.0  # issue 32: 1 paced stream / many / burst
            sec.row(f"{name} ({pace})", f"{ratio:.2f}", f"≤ {target}", "", ratio <= target)
        else:
            sec.row(f"{name} ({pace})", f"{ratio:.2f}")
    every = [r for v in results for r in results[v]]
    emu_cpu = median([r["emu"] for r in every]) / deltas
    emu_util = max(r["emu"] / r["wall"] for r in every)
    sec.row(f"emulator's own CPU ({pace})", f"{fmt_us(emu_cpu)}/chunk, ≤ {emu_util:.0%} of a core",
            "not the bottleneck", "", emu_util < 0.9)
    roles = sorted({k for r in results["sf-openai"] for k in r["by_role"]})
    parts = []
    for role in roles:
        value = median([r["by_role"].get(role, 0.0) for r in results["sf-openai"]]) / deltas
        parts.append(f"{role} {value * 1e6:.1f}")
    wakes = ", ".join(
        f"{role} {median([r['wakeups'].get(role, 0) for r in results['sf-openai']]) / deltas:.2f}"
        for role in sorted({k for r in results["sf-openai"] for k in r["wakeups"]}))
    # The SDK's threads of a paced ×N run have ended before they are read: not counted.
    sdk_wakes = (f"{median([r['wakeups'].get('client', 0) for r in results['openai-sdk']]) / deltas:.2f}"
                 if "×" not in pace else "not counted")
    wall = median([r["wall"] for r in results["sf-openai"]])
    sec.note(f"- sf-openai, {label}: µs/delta by process (medians): {', '.join(parts)}; "
             f"wall {wall:.2f} s per run; the idle daemon burns {idle * 1e3:.1f} ms CPU/s "
             f"(= {idle * wall / deltas * 1e6:.1f} µs/delta of this run's wall time); "
             f"threads put on a CPU per delta (wake-ups and preemptions, medians): {wakes} "
             f"(openai-sdk: {sdk_wakes}).")
