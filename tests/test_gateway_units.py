"""The gateway's pure parts: the `[http]` table, routing a model to a
profile, the HTTP keys derived from an identity's credentials, and the
OpenAI chunks' prebuilt bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamfence.config.model import ConfigError, HttpConfig, parse_config
from streamfence.gateway import openai_chat
from streamfence.gateway.keys import HttpKeys, http_key
from streamfence.gateway.routes import NoRoute, Route, models, route
from streamfence.protocol.keys import KeyStore

PROFILES = {"oa": {"kind": "openai"}, "oa2": {"kind": "openai"}, "an": {"kind": "anthropic"}}


def _config(http: dict[str, object]) -> HttpConfig:
    return parse_config({"providers": PROFILES, "http": http}).http


def test_the_http_table() -> None:
    assert parse_config({}).http == HttpConfig()
    http = _config({"listen": "127.0.0.1:7757", "routes": {"gpt-4o": "oa"}})
    assert http.host_port == ("127.0.0.1", 7757) and http.routes == {"gpt-4o": "oa"}
    cases: list[tuple[dict[str, object], str]] = [
        ({"listen": "0.0.0.0:7756"}, "reachable from other hosts"),
        ({"listen": "7756"}, "must be HOST:PORT"),
        ({"listen": 7756}, "expected str"),
        ({"routes": {"m": "nope"}}, "no provider profile 'nope'"),
        ({"port": 1}, "http.port: unknown key"),
        ({"listen": "127.0.0.1:7756"}, "port 7756 is the daemon's events endpoint"),
        ({"listen": "127.0.0.1:7755"}, "port 7755 is the daemon's client")]
    for bad, why in cases:
        with pytest.raises(ConfigError, match=why):
            _config(bad)


def test_routing_a_model_to_a_profile() -> None:
    cfg = parse_config({"providers": PROFILES, "http": {"routes": {"gpt-4o": "oa2"}}})
    http, providers = cfg.http, cfg.providers
    assert route(http, providers, "openai", "m", "oa") == Route("oa", "m", "openai")  # header
    assert route(http, providers, "openai", "gpt-4o", None) == Route("oa2", "gpt-4o", "openai")
    assert route(http, providers, "openai", "oa/gpt-x/y", None) == Route("oa", "gpt-x/y",
                                                                        "openai")
    assert route(http, providers, "anthropic", "claude", None) == Route("an", "claude",
                                                                       "anthropic")
    with pytest.raises(NoRoute, match="2 openai profiles"):
        route(http, providers, "openai", "gpt-x", None)
    # A profile of another kind serves too: the Route says which wire to translate to.
    assert route(http, providers, "openai", "an/claude", None) == Route("an", "claude",
                                                                       "anthropic")
    assert route(http, providers, "anthropic", "m", "oa") == Route("oa", "m", "openai")
    with pytest.raises(NoRoute, match="no provider profile 'zz'"):
        route(http, providers, "openai", "m", "zz")
    # No profile of the endpoint's kind, one profile at all: that one.
    only = parse_config({"providers": {"br": {"kind": "bedrock"}}})
    assert route(only.http, only.providers, "openai", "m", None) == Route("br", "m", "bedrock")
    assert models(http, providers, frozenset({"oa2"})) == [("gpt-4o", "oa2"), ("oa2/*", "oa2")]


def test_an_http_key_names_its_identity_and_follows_its_credentials(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys")
    alice = store.register("alice", "tcp://127.0.0.1:7755")
    keys = HttpKeys(store.dir)
    key = http_key(alice)
    assert key.startswith("sf-alice.") and keys.identify(key) == alice
    for wrong in ("", "alice", "sf-alice.", key[:-1] + ("0" if key[-1] != "0" else "1"),
                  "sf-bob." + key.rpartition(".")[2], "sf-../server." + "0" * 64):
        assert keys.identify(wrong) is None, wrong
    rotated = store.register("alice", "tcp://127.0.0.1:7755", replace=True)
    assert keys.identify(key) is None and keys.identify(http_key(rotated)) == rotated
    store.revoke("alice")
    assert keys.identify(http_key(rotated)) is None


@pytest.mark.parametrize("usage", [False, True])
def test_prebuilt_chunks_are_the_encoded_chunks(usage: bool) -> None:
    """Issue 32: a text or refusal piece after the first goes out as prebuilt
    bytes around the piece's JSON; they are exactly the chunk `_chunk` encodes."""
    pieces = [("text", "  "), ("text", 'hé "llo"\n'), ("text", " 日本\u2028"), ("refusal", "no")]
    fast = openai_chat.ChatCompletionStream("c1", 'gpt "x"/é', usage, 1700000000)
    slow = openai_chat.ChatCompletionStream("c1", 'gpt "x"/é', usage, 1700000000)
    for seq, (kind, piece) in enumerate(pieces, 1):
        got = fast.feed({"op": "delta", "seq": seq, "attempt": 1, "kind": kind, "data": piece})
        field = {"text": "content", "refusal": "refusal"}[kind]
        want = b"".join(slow._chunk(seq, {field: p}) for _, p in slow._gate.admit(kind, piece))
        assert got == want, (got, want)
