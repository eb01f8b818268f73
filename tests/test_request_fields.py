"""A call's request sets body fields only (streamfence.supervisor.requests):
every field the admission check accepts is checked against what the
installed SDK does with it, read from the SDK itself. openai and anthropic:
the source of `create` (and anthropic's `stream`) says which parameters go
in the body dict, which into `extra_headers`, which into `query=` and which
into the URL; botocore: the ConverseStream input shape's `location` of each
member. A field the SDK sends as a header is refused naming it, through the
real daemon too, and reaches no provider."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client import ClientError
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.wires import sample_request
from streamfence.supervisor.requests import FIELDS, HEADER_FIELDS, PATH_FIELDS, check_request
from tests.harness import DaemonProcess
from tests.wires import DaemonFactory, request_for

TRANSPORT = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
DAEMON_OWNED = {"stream", "stream_options"}


@dataclass
class Placement:
    """Where one SDK method puts its parameters on the HTTP request."""

    params: set[str]
    body: set[str] = field(default_factory=set)  # the keys of the body dict
    headers: dict[str, str] = field(default_factory=dict)  # parameter -> header name
    query: set[str] = field(default_factory=set)
    path: set[str] = field(default_factory=set)


def _names(node: ast.AST, params: set[str]) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in params}


def _dict_pairs(node: ast.AST, params: set[str]) -> dict[str, str]:
    """parameter -> key, for each `"key": parameter` of the dict literals in `node`."""
    pairs = {}
    for d in ast.walk(node):
        if isinstance(d, ast.Dict):
            for key, value in zip(d.keys, d.values, strict=True):
                if (isinstance(key, ast.Constant) and isinstance(value, ast.Name)
                        and value.id in params):
                    pairs[value.id] = str(key.value)
    return pairs


def _post_args(call: ast.Call) -> list[ast.expr] | None:
    """The positional arguments of `self._post(...)` or `partial(self._post, ...)`."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "_post":
        return list(call.args)
    if (isinstance(func, ast.Name) and func.id == "partial" and call.args
            and isinstance(call.args[0], ast.Attribute) and call.args[0].attr == "_post"):
        return list(call.args[1:])
    return None


def placement(method: Callable[..., Any]) -> Placement:
    """Read `method`'s source: where each of its parameters goes."""
    params = set(inspect.signature(method).parameters) - TRANSPORT
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    found = Placement(params)
    posts = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "extra_headers" for t in node.targets):
            found.headers |= _dict_pairs(node.value, params)
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "headers":
                found.headers |= _dict_pairs(kw.value, params)
            elif kw.arg == "query":
                found.query |= _names(kw.value, params)
        args = _post_args(node)
        if args is None:
            continue
        posts += 1
        if args:
            found.path |= _names(args[0], params)
        for kw in node.keywords:
            if kw.arg == "body":
                found.body |= {str(k.value) for d in ast.walk(kw.value) if isinstance(d, ast.Dict)
                               for k in d.keys if isinstance(k, ast.Constant)}
    assert posts == 1, f"{method.__qualname__}: {posts} requests in its source, expected 1"
    assert found.body, f"{method.__qualname__}: no body dict found in its source"
    return found


def _sdk_methods(wire: str) -> list[Callable[..., Any]]:
    if wire == "openai":
        from openai.resources.chat.completions import Completions

        return [Completions.create]
    from anthropic.resources.messages import Messages

    return [Messages.create, Messages.stream]


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_every_accepted_field_is_a_body_field_of_the_sdk(wire: str) -> None:
    accepted = FIELDS[wire]
    for method in _sdk_methods(wire):
        where = placement(method)
        name = method.__qualname__
        assert not accepted & set(where.headers), f"{name} sends {accepted & set(where.headers)} as headers"
        assert not accepted & where.query, f"{name} sends {accepted & where.query} in the query"
        assert not accepted & where.path, f"{name} sends {accepted & where.path} in the path"
        assert accepted <= where.body, f"{name} leaves {accepted - where.body} out of the body"
        assert dict(HEADER_FIELDS[wire]) == where.headers, name
    create = placement(_sdk_methods(wire)[0])
    # Every parameter of `create` is either accepted or refused by name: a new
    # SDK parameter shows up here to be placed.
    assert accepted | set(HEADER_FIELDS[wire]) == create.params - DAEMON_OWNED


def test_bedrock_fields_only_the_model_in_the_path() -> None:
    import botocore.session

    model = botocore.session.get_session().get_service_model("bedrock-runtime")
    members = model.operation_model("ConverseStream").input_shape.members
    located = {name: shape.serialization.get("location") for name, shape in members.items()}
    assert set(FIELDS["bedrock"]) == set(members)
    off_body = {name: where for name, where in located.items()
                if name in FIELDS["bedrock"] and where is not None}
    assert off_body == {name: "uri" for name in PATH_FIELDS["bedrock"]}, off_body
    assert not HEADER_FIELDS["bedrock"]


@pytest.mark.parametrize(("field_name", "header"), sorted(HEADER_FIELDS["anthropic"].items()))
def test_a_header_field_is_refused_naming_it_and_its_header(field_name: str, header: str) -> None:
    request = sample_request("anthropic", "m", "hi") | {field_name: "wrkspc_01"}
    with pytest.raises(ProtocolError) as info:
        check_request("anthropic", request)
    assert info.value.code == ErrorCode.BAD_MESSAGE
    assert f"call.request.{field_name}" in info.value.message and header in info.value.message


@pytest.mark.parametrize("model", ["..", ".", "", 7])
def test_the_bedrock_path_field_is_a_model_not_a_path(model: Any) -> None:
    request = sample_request("bedrock", "m", "hi") | {"modelId": model}
    with pytest.raises(ProtocolError) as info:
        check_request("bedrock", request)
    assert info.value.code == ErrorCode.BAD_MESSAGE
    assert "call.request.modelId" in info.value.message
    ok = sample_request("bedrock", "anthropic.claude-3-haiku-20240307-v1:0", "hi")
    assert check_request("bedrock", ok) == ok


# ---- through the real daemon --------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon({"claude": "anthropic"})


@pytest.mark.slow
def test_the_daemon_refuses_a_header_field_and_no_provider_sees_it(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    with daemon.client() as client:
        before = client.status()["counters"].get("bad_input.bad_message", 0)
        for name in sorted(HEADER_FIELDS["anthropic"]):
            request = request_for("anthropic", f"hdr-{name}") | {name: "wrkspc_forged"}
            with pytest.raises(ClientError) as info:
                client.submit("claude", request, subscribe=False)
            assert info.value.code == "bad_message", info.value
            assert f"call.request.{name}" in info.value.message, info.value.message
        after = client.status()["counters"].get("bad_input.bad_message", 0)
        done = client.run("claude", request_for("anthropic", "hdr-plain"), timeout_s=30.0)
    assert after - before == len(HEADER_FIELDS["anthropic"])
    assert done["status"] == "completed", done
    for name in HEADER_FIELDS["anthropic"]:
        assert emu.log(f"hdr-{name}") == [], f"a request with {name} reached the provider"
