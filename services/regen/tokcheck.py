"""Before a regen shard generates: is the local tokenizer the one the baseline server uses?

Prep, tokenize and vocab work on ids of the local tokenizer (`shared.tokenizer.load_tokenizer`,
`shared.chat.render_ids`); vLLM renders and tokenizes with its own copy of the target's
tokenizer files and chat template. Where the two differ (another tokenizer folder, revision,
`trust_remote_code` or template), the loss masks, vocab and benchmark prompts are built on ids
the served target never sees. So each regen shard first compares, on its first `CHECK_ROWS`
conversations that have a prompt:

- the prompt, i.e. the messages before the first assistant turn with the row's tools,
  rendered with the generation prompt and `target.chat_template_kwargs`: local `render_ids`
  vs the server's `POST /tokenize` chat form (`messages`, `add_generation_prompt`,
  `chat_template_kwargs`, `tools`: vLLM's `TokenizeChatRequest`);
- an answer-like text (that assistant turn's content, else the last user message) without
  special tokens: local `tok(text, add_special_tokens=False)` vs `/tokenize` with `prompt`
  and `add_special_tokens: false` (`TokenizeCompletionRequest`).

Both request forms are those of vllm/entrypoints/serve/tokenize/protocol.py (vLLM 0.32).

Failure policy:
- a difference refuses the shard with `ConfigError` (permanent: the job is not retried),
  naming the row, the first differing position, both ids and tokens, and what to fix;
- a server that cannot be reached, or answers 5xx or 429, is `ServiceUnavailableError`
  (the job fails and its retry checks again); 404 (wrong model name or route) too, as in
  `services.regen.client`;
- another 4xx on a row's prompt is that row being unsendable (the chat endpoint would
  reject it too, and regen counts it as a row error): the row is listed, not compared; when
  every prompt tried (up to `CHECK_ROWS`) is rejected and none compared, the server cannot
  render what the local template renders, and the shard is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from services.regen.client import ChatClient
from services.regen.conversation import request_message
from shared.chat import TemplateRenderError, render_ids
from shared.errors import ConfigError, ServiceUnavailableError
from shared.records import Conversation

#: Conversations compared per shard: a tokenizer or template that differs differs on every
#: real prompt, so a few suffice, and each costs two cheap requests.
CHECK_ROWS = 3

#: What to change when the two sides differ (the recipe fields that pick the local side).
FIX = (
    "point target.tokenizer at the served model's own tokenizer files (or unset it), pin "
    "target.revision to the served revision, set target.trust_remote_code as the server "
    "has it, and give both sides the same chat_template"
)


@dataclass
class TokenizerCheck:
    """A passed check of one shard, as recorded in its manifest (`extra.tokenizer_check`).

    Attributes:
        server: the `/tokenize` URL asked.
        rows: ids of the conversations compared (prompt and text ids equal on each).
        prompt_tokens: rendered prompt tokens compared, summed over `rows`.
        text_tokens: plain-text tokens compared, summed over `rows`.
        rejected: `"<row id>: <server message>"` of prompts the server refused (not compared).
    """

    server: str
    rows: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    text_tokens: int = 0
    rejected: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The manifest entry (JSON-serializable)."""
        return asdict(self)


def first_prompt(row: Conversation) -> tuple[list[dict[str, Any]], str] | None:
    """The messages before `row`'s first assistant turn, and an answer-like text.

    Returns:
        (request messages, text): the text is that assistant turn's content when it has
        any, else the last user message's; None when no user message comes before the first
        assistant turn (nothing a server would be asked to answer).
    """
    history: list[dict[str, Any]] = []
    answer = ""
    for m in row.messages:
        if m.role == "assistant":
            answer = m.content if isinstance(m.content, str) else ""
            break
        history.append(request_message(m))
    users = [m["content"] for m in history if m["role"] == "user" and m["content"]]
    if not users:
        return None
    return history, answer or users[-1]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ, or None when they are equal.

    Where one is a prefix of the other, that is the shorter one's length.
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(ids: list[int], strs: list[str] | None, i: int, tok: Any) -> str:
    if i >= len(ids):
        return "<end>"
    s = strs[i] if strs is not None and i < len(strs) else tok.convert_ids_to_tokens(ids[i])
    return f"{ids[i]} {s!r}"


def mismatch_message(
    tok: Any,
    target: str,
    url: str,
    row_id: str,
    what: str,
    local: list[int],
    server: list[int],
    server_strs: list[str] | None,
) -> str:
    """The one-line refusal for `local` != `server` (ids of `what` for row `row_id`)."""
    i = first_difference(local, server)
    assert i is not None
    before = tok.decode(local[max(0, i - 8) : i])[-40:]
    return (
        f"target.tokenizer {target!r} does not tokenize as the baseline server does "
        f"({url}): row {row_id}, {what}: first difference at token {i} (after {before!r}): "
        f"local {_at(local, None, i, tok)} vs server {_at(server, server_strs, i, tok)} "
        f"({len(local)} vs {len(server)} tokens); {FIX}"
    )


class _Rejected(Exception):
    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


def _post(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[list[int], list | None]:
    """`(tokens, token_strs)` of one `/tokenize` request.

    Raises:
        _Rejected: 4xx other than 404/408/429 (this request is bad, the server is fine).
        ServiceUnavailableError: unreachable, 5xx, 404, 408, 429, or not vLLM's answer.
    """
    try:
        resp = http.post(url, json=body)
    except httpx.HTTPError as e:
        raise ServiceUnavailableError(
            f"{url}: {type(e).__name__}: {e}. Is the baseline server up?"
        ) from e
    if resp.status_code == 404:
        raise ServiceUnavailableError(
            f"{url}: 404 for model {body['model']!r}: {resp.text[:300]}. Check "
            "serve.served_model_name and that the baseline server is vLLM serving the target."
        )
    if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
        raise _Rejected(f"{resp.status_code} {resp.text[:300]}")
    if resp.status_code != 200:
        raise ServiceUnavailableError(
            f"{url}: {resp.status_code} {resp.text[:300]}. Is the baseline server up?"
        )
    try:
        data = resp.json()
        return list(data["tokens"]), data.get("token_strs")
    except (ValueError, KeyError, TypeError) as e:
        raise ServiceUnavailableError(
            f"{url}: the answer has no token list ({e}); regen needs a vLLM server"
        ) from e


def check_tokenizer(
    tok: Any,
    rows: Iterable[Conversation],
    client: ChatClient,
    target: str,
    transport: httpx.BaseTransport | None = None,
) -> TokenizerCheck:
    """Compare the local tokenizer with the server's `/tokenize` on a shard's first rows.

    The rows compared are the first `CHECK_ROWS` of `rows` with a prompt (`first_prompt`)
    that the local template renders.

    Args:
        tok: the local tokenizer (`shared.tokenizer.load_tokenizer`).
        rows: the shard's conversations, in row order.
        client: the regen chat client (server URL, model name, chat_template_kwargs, API
            key, timeout, retries on connection failures).
        target: the local tokenizer's folder or hub id, named in the refusal.
        transport: an httpx transport (tests); None = the network.

    Returns:
        the passed check (no rows when none has a prompt the local template renders).

    Raises:
        ConfigError: prompt or text ids differ (one line: row, first differing position,
            both ids and tokens, the fix), or the server rejected `CHECK_ROWS` prompts
            while none could be compared.
        ServiceUnavailableError: the server cannot be reached or is not vLLM (see the
            module docstring).
    """
    url = f"{client.base_url}/tokenize"
    out = TokenizerCheck(server=url)
    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    transport = transport or httpx.HTTPTransport(retries=client.max_retries)
    common = {"model": client.model, "return_token_strs": True}
    with httpx.Client(transport=transport, headers=headers, timeout=client.timeout_s) as http:
        for row in rows:
            if len(out.rows) == CHECK_ROWS or len(out.rejected) == CHECK_ROWS:
                break
            found = first_prompt(row)
            if found is None:
                continue
            messages, text = found
            tools = row.tools or None
            try:
                local = render_ids(tok, messages, client.kwargs, True, tools)
            except TemplateRenderError:
                continue  # regen counts this row as a template_render_error
            chat = {
                **common,
                "messages": messages,
                "add_generation_prompt": True,
                "chat_template_kwargs": client.kwargs,
                **({"tools": tools} if tools else {}),
            }
            local_text = tok(text, add_special_tokens=False)["input_ids"]
            plain = {**common, "prompt": text, "add_special_tokens": False}
            try:
                for kind, want, body in (
                    ("prompt", local, chat),
                    ("plain text", local_text, plain),
                ):
                    got, strs = _post(http, url, body)
                    if want != got:
                        raise ConfigError(
                            mismatch_message(tok, target, url, row.id, kind, want, got, strs)
                        )
            except _Rejected as e:
                out.rejected.append(f"{row.id}: {e.detail}")
                continue
            out.rows.append(row.id)
            out.prompt_tokens += len(local)
            out.text_tokens += len(local_text)
    if out.rejected and not out.rows:
        raise ConfigError(
            f"target.tokenizer {target!r}: the baseline server ({url}) rejected the prompts "
            f"the local chat template renders ({out.rejected[0]}); the two sides do not render "
            f"alike: {FIX}"
        )
    return out
