"""The records stages hand each other: one pydantic model per JSON artifact (or line).

Where each lives and how it is read and written is `shared.artifacts`; this module only says
what a record holds. Every model forbids unknown keys, so a writer and a reader that drift
apart fail on the first record instead of training on a misread one.

Tensors and Arrow datasets are described in `shared.artifacts` (shapes and dtypes there).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "user", "assistant", "tool"]


class Record(BaseModel):
    """Base of every record: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


# -- conversations ---------------------------------------------------------------------------


class ToolFunction(Record):
    """The function of a tool call; `arguments` is JSON text, as the OpenAI API carries it."""

    name: str
    arguments: str


class ToolCall(Record):
    """One assistant tool call (OpenAI chat format)."""

    type: Literal["function"] = "function"
    function: ToolFunction
    id: str | None = None


class Message(Record):
    """One chat message in Eyrie's canonical form (OpenAI chat roles and fields)."""

    role: Role
    content: str | None = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def chat_dict(self) -> dict[str, Any]:
        """The message as a plain dict for chat templates and requests (unset keys left out).

        `content` is always present, null where the source had null: templates such as
        DeepSeek-V3's render tool calls only when `content is none`.
        """
        return {"content": self.content, **self.model_dump(exclude_none=True)}


class Conversation(Record):
    """A canonical conversation: what prep writes, dedup keeps and regen re-answers.

    Attributes:
        id: `<dataset name>:<source row>`, stable for the run.
        source: the dataset name (preset or file stem).
        messages: system?, then user/assistant/tool turns, ending with an assistant turn.
        tools: the OpenAI tool schemas offered to the model, or None.
    """

    id: str
    source: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """`messages` as plain dicts."""
        return [m.chat_dict() for m in self.messages]


class QuarantinedRow(Record):
    """A source row prep could not turn into a conversation, kept for inspection.

    Attributes:
        file: the source file (or `hub:<id>`); row: its index in the source.
        field: the culprit field (`conversations[3].value`); reason: the counted key.
        raw: the raw row as JSON text, cut to 2,000 characters.
    """

    file: str | None
    row: int
    field: str
    reason: str
    detail: str = ""
    raw: str = ""


# -- plan -------------------------------------------------------------------------------------

Reader = Literal["jsonl", "json_array", "hf"]


class DatasetLoad(Record):
    """What planning found in one dataset's source.

    Attributes:
        file: the local file, or `hub:<id>`.
        rows: complete rows found.
        truncated: the file ended or broke before its last row was complete.
        error_byte_offset: where it broke (bytes from the start), if it did.
        error: the parser's message there.
        bad_lines: JSONL lines that are not JSON: `{"line": 1-based, "error": str}`.
    """

    file: str
    rows: int
    truncated: bool = False
    error_byte_offset: int | None = None
    error: str | None = None
    bad_lines: list[dict[str, Any]] = Field(default_factory=list)


class DataSource(Record):
    """Where one recipe dataset's rows come from and how they are read.

    Attributes:
        name: label used as each conversation's `source`.
        adapter: the format adapter (`services.prep.formats.ADAPTERS`), `auto` until the
            plan resolves it.
        reader: `jsonl` / `json_array` (local files read by byte range from the plan's row
            index) or `hf` (an Arrow dataset read by row number).
        path: local file or hub id; config_name, split: hub settings.
    """

    name: str
    adapter: str
    reader: Reader
    path: str
    config_name: str | None = None
    split: str | None = None


class PlanDataset(Record):
    """One recipe dataset as planned: its source, its size and what the plan took.

    Attributes:
        source: how a prep worker reads its rows (adapter resolved).
        rows: rows available; selected: rows the plan picked.
        load: what the scan found.
    """

    source: DataSource
    rows: int
    selected: int
    load: DatasetLoad


class Plan(Record):
    """The run's plan: the datasets and how their selected rows are cut into prep shards.

    Shard N holds selection rows `[N * shard_rows, (N + 1) * shard_rows)`.
    """

    recipe_hash: str
    num_shards: int
    shard_rows: int
    selected: int
    datasets: list[PlanDataset]


# -- prep and dedup ---------------------------------------------------------------------------


class PrepReport(Record):
    """Per prep shard: rows in, kept, and counts per skip reason and realignment.

    `fields` counts message fields read under another name (`reasoning_alias:thinking`) and
    fields no adapter knows (`unknown_field:assistant.<name>`): kept rows, not dropped data
    left unseen.

    Attributes:
        per_source: per source dataset (`DataSource.name`): `rows_in`, `kept`, `skipped`.
    """

    rows_in: int
    kept: int
    skipped: dict[str, int]
    realigned: dict[str, int]
    skipped_by_source: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="source dataset name -> skip reason -> rows"
    )
    fields: dict[str, int] = Field(
        default_factory=dict, description="assistant message field -> rows that had it"
    )
    per_source: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="source dataset name -> rows_in, kept, skipped"
    )


class DedupReport(Record):
    """Run-level dedup and decontamination counts."""

    duplicates: int
    contaminated: int
    kept: int


class Split(Record):
    """The held-out split, chosen once per run from the deduplicated conversations.

    Validation conversations are regenerated and extracted like the rest, but never trained
    on: the trainer validates on them, `eyrie tau` scores checkpoints on them and the
    `heldout` benchmark prompts come from them.

    Attributes:
        seed, val_fraction: `train.seed`, `train.val_fraction`.
        conversations: deduplicated conversations in the run.
        val_ids: conversation ids held out, in selection order.
    """

    seed: int
    val_fraction: float
    conversations: int
    val_ids: list[str]


# -- regen ------------------------------------------------------------------------------------


class RegenTurn(Record):
    """One assistant answer as the server produced it.

    Attributes:
        prompt_token_ids: the prompt ids the server rendered (chat template applied).
        completion_token_ids: the ids it sampled, ending with the stop token when
            `finish_reason` is `stop`.
        finish_reason: `stop` or `length`.
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    finish_reason: str


class RegenRecord(Record):
    """A conversation re-answered by the target (one line of `regen/shard-N.jsonl`).

    Attributes:
        row: its line in the dedup shard.
        messages: the conversation with the k-th assistant message = the text of `turns[k]`.
        stopped: why regeneration stopped early ('' when it did not).
        resampled: answers drawn again because the regen answer policy rejected a draw.
        sample: which of the conversation's `regen.samples_per_prompt` draws this is (its
            tokenized id gets `#s<sample>` when > 0; all draws share the conversation id).
        failed_draws: on a conversation's first kept draw, why each of its other draws was
            not kept (quarantine reasons; counted in the manifest).
        sampling: the request's sampling fields; chat_template_kwargs: as sent.
        server: `{"model", "url", "fingerprint", "target"}` of the server that answered.
    """

    row: int
    id: str
    source: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    turns: list[RegenTurn]
    stopped: str = ""
    resampled: int = 0
    sample: int = 0
    failed_draws: list[str] = Field(default_factory=list)
    sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]
    server: dict[str, str]


class RegenFailure(Record):
    """A dedup row that was not regenerated: status `error` or `skipped`, and why."""

    row: int
    id: str | None
    status: Literal["error", "skipped"]
    reason: str
    detail: str = ""


# -- vocab, extract, train, export ------------------------------------------------------------


class LeftOutToken(Record):
    """A frequent assistant token the draft vocabulary leaves out."""

    id: int
    text: str | None = None
    count: int
    share: float


class Coverage(Record):
    """The draft vocabulary's coverage of the assistant tokens of the training split."""

    coverage: float
    target_vocab: int
    draft_vocab: int
    assistant_tokens: int
    distinct_seen: int
    left_out_tokens: int
    left_out_distinct: int
    top_left_out: list[LeftOutToken]


class QuarantinedSample(Record):
    """A tokenized row extraction did not store (it has no hidden-state file)."""

    row: int
    id: str
    reason: str


class ExtractMeta(Record):
    """What one extract shard holds and how it was made (`extract/shard-N/meta.json`).

    Attributes:
        aux_layer_ids: the 3 aux ids, in slot order; aux_id_convention: their meaning.
        final_state: `pre_norm` (the 4th slot is the input of the final norm).
        slots: a label per slot of `hidden_states[:, slot]`.
        rows: rows of the shard; written_rows: rows with a hidden-state file.
        quarantined: the rows without one, and why.
        this_run: what the last job did (tokens, bytes, batches, oom retries, budgets).
    """

    aux_layer_ids: list[int]
    aux_id_convention: str
    final_state: str
    pre_norm: bool
    slots: list[str]
    target: str
    target_revision: str
    hidden_size: int
    dtype: str
    backend: str
    num_hidden_layers: int
    server: str | None = None
    rows: int
    written_rows: int
    quarantined: list[QuarantinedSample]
    this_run: dict[str, int]


class BestCheckpoint(Record):
    """The best validated epoch and every epoch's validation (`train/best.json`)."""

    best: dict[str, Any]
    validations: list[dict[str, Any]]


class ExportSummary(Record):
    """What the export wrote (`export/export.json`).

    Attributes:
        selection: how the checkpoint was chosen: `{"by": rule, "epochs": [{"epoch", "tau",
            "val_loss"}]}`, every validated epoch's offline τ (simulated on the held-out
            split) and validation loss; empty for runs without validation.
    """

    checkpoint: str
    written: list[str]
    skipped: dict[str, str]
    selection: dict[str, Any] = Field(default_factory=dict)
