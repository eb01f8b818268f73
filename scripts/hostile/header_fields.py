"""Request fields that would choose the daemon's HTTP headers, query or
path (issue 29, item 6): submits on each wire carrying a field its SDK
sends as a header (Anthropic's `workspace_id`, `user_profile_id`), an SDK
transport option (`extra_headers`, `extra_query`, `timeout`), or a path
segment that is no model name (Bedrock's `modelId` "..").

Own checks: every such submit is refused `bad_message` naming the field,
none is accepted, and the emulator never saw a request for one of them.
"""

from __future__ import annotations

import uuid
from typing import Any

from scripts.hostile import Attack
from streamfence.protocol.client import Client, ClientError

NAME = "header fields"
ABOUT = "submits whose fields would set the provider request's headers, query or path"

_results: dict[int, dict[str, int]] = {}  # id(attack) -> outcome -> count
_keys: dict[int, list[str]] = {}


def _hostile(key: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(profile, the field, the request) for each field tried."""
    openai = {"model": f"gpt-emu#{key}", "messages": [{"role": "user", "content": "hi"}]}
    anthropic = dict(openai, model=f"claude-emu#{key}", max_tokens=64)
    bedrock = {"modelId": "..", "messages": [{"role": "user", "content": [{"text": "hi"}]}]}
    return [("an", "workspace_id", dict(anthropic, workspace_id="wrkspc_other")),
            ("an", "user_profile_id", dict(anthropic, user_profile_id="someone-else")),
            ("an", "extra_headers", dict(anthropic, extra_headers={"x-api-key": "other"})),
            ("emu", "extra_headers", dict(openai, extra_headers={"OpenAI-Organization": "o"})),
            ("emu", "extra_query", dict(openai, extra_query={"api-version": "x"})),
            ("emu", "timeout", dict(openai, timeout=0.001)),
            ("br", "modelId", bedrock)]


def attack(a: Attack) -> None:
    results = _results.setdefault(id(a), {})
    keys = _keys.setdefault(id(a), [])
    with Client(a.endpoint, 10.0, credentials=a.register("smuggler")) as c:
        while not a.stop.wait(0.05):
            key = f"hdr-{uuid.uuid4().hex[:8]}"
            keys.append(key)
            for profile, field, req in _hostile(key):
                try:
                    c.submit(profile, req, subscribe=False)
                    outcome = f"{field}: accepted"
                except ClientError as exc:
                    named = field in str(exc)
                    outcome = f"{field}: {exc.code}{'' if named else ' (field not named)'}"
                results[outcome] = results.get(outcome, 0) + 1
                a.count("hostile submits")


def checks(a: Attack) -> list[tuple[str, bool]]:
    results = _results.get(id(a), {})
    bad = {k: n for k, n in results.items() if not k.endswith(": bad_message")}
    seen = sum(len(a.emu.log(key)) for key in _keys.get(id(a), []))
    return [(f"every submit refused bad_message naming its field: {results}", not bad),
            (f"provider requests made for them: {seen}", seen == 0)]
