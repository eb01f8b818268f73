"""A chat request in no provider's wire: what the gateway's translation
reads a caller's body into (gateway/from_wire.py) and writes a target's
body from (gateway/to_wire.py); gateway/translate.py joins them.

Why a neutral form rather than one function per pair of wires: two caller
wires and three targets are 2 readers and 3 writers, not 4+ pair
functions, and a refusal names the CALLER's field (every piece keeps the
`path` where the caller wrote it, e.g. `messages[2].content[0]`), however
the target would have numbered it.

It holds only what every step can carry across: text, images (base64 or a
URL), tool calls and results, tool definitions and choice, the system
prompt, max tokens, temperature, top_p, stop sequences, an end-user id and
Anthropic's cache breakpoints. A reader refuses a field it has no place
for; a writer refuses a piece its wire cannot express (`Untranslatable`,
which the gateway answers with a 400 in the caller's error format).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SHOWN_CHARS = 60  # of a caller's value quoted in a refusal


class Untranslatable(Exception):
    """A request the target's wire cannot carry, or one whose shape is wrong;
    the message starts with the caller's field path."""


def cannot(path: str, what: str, target: str) -> Untranslatable:
    """`messages[2].content[0].type: 'input_audio' cannot be sent to an anthropic profile`."""
    article = "an" if target[:1] in "aeiou" else "a"
    return Untranslatable(f"{path}: {what} cannot be sent to {article} {target} profile")


def shown(value: Any) -> str:
    """A caller's value in a refusal: its repr, cut short (a body is the
    caller's, and the message goes back to it and to the log)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def malformed(path: str, expected: str) -> Untranslatable:
    return Untranslatable(f"{path}: must be {expected}")


@dataclass(frozen=True, slots=True)
class Text:
    path: str
    text: str
    cache: bool = False  # an Anthropic cache breakpoint after it (cache_control)


@dataclass(frozen=True, slots=True)
class Image:
    path: str
    media_type: str | None = None  # with `data`
    data: str | None = None  # base64
    url: str | None = None  # an http(s) URL (no data)


@dataclass(frozen=True, slots=True)
class ToolCall:
    path: str
    id: str
    name: str
    arguments: dict[str, Any]  # the decoded JSON object


@dataclass(frozen=True, slots=True)
class ToolResult:
    path: str
    id: str  # the ToolCall's
    content: tuple[Text | Image, ...]
    is_error: bool = False


Block = Text | Image | ToolCall | ToolResult


@dataclass(slots=True)
class Turn:
    role: str  # "user" (tool results too) or "assistant"
    blocks: list[Block]


@dataclass(frozen=True, slots=True)
class Tool:
    path: str
    name: str
    description: str | None
    schema: dict[str, Any]  # JSON schema of the arguments
    cache: bool = False


@dataclass(frozen=True, slots=True)
class Choice:
    path: str
    mode: str  # "auto", "any" (a tool must be called), "none", "tool" (this `name`)
    name: str | None = None


@dataclass(slots=True)
class Chat:
    """One request; `paths` maps a scalar field here (max_tokens, temperature,
    top_p, stop, user, parallel) to the caller's name for it."""

    system: list[Text] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    choice: Choice | None = None
    parallel: bool = True  # False: at most one tool call per answer
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    user: str | None = None
    paths: dict[str, str] = field(default_factory=dict)

    def add(self, role: str, block: Block) -> None:
        """`block` at the end of the conversation: consecutive pieces of one
        role are one turn (Anthropic and Bedrock alternate roles; OpenAI's
        tool messages and the user message after them are one user turn)."""
        if self.turns and self.turns[-1].role == role:
            self.turns[-1].blocks.append(block)
        else:
            self.turns.append(Turn(role, [block]))
