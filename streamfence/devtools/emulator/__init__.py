"""streamfence's provider emulator: a real HTTP server on 127.0.0.1 that speaks
LLM providers' streaming wires, with faults scripted per request.

Modules (each states its contract at the top):

* ``script``      step fields, fault kinds, per-key scripts, deterministic texts
* ``state``       the request log (the ground truth of chaos verdicts)
* ``stream``      wire-agnostic fault player and batched body writer
* ``openai_wire`` ``POST /v1/chat/completions`` (SSE and whole bodies)
* ``anthropic_wire`` ``POST /v1/messages`` (Anthropic SSE and whole bodies)
* ``bedrock_wire`` ``POST /model/{id}/converse-stream`` and ``/converse``
* ``eventstream`` AWS's binary event-stream framing (prelude, headers, CRCs)
* ``app``         the aiohttp app: provider routes + ``/_emu/...`` control API
* ``__main__``    ``python -m streamfence.devtools.emulator --host 127.0.0.1 --port 0``
* ``control``     ``EmulatorProcess`` and ``EmulatorClient`` for tests and scripts
* ``bench``       ``python -m streamfence.devtools.emulator.bench``: throughput self-check

Anthropic SSE and Bedrock's event-stream are meant to be sibling ``*_wire``
modules that render a ``stream.StreamPlan`` and reuse ``stream.play``.
"""
