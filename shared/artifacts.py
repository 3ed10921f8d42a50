"""Every on-disk artifact of a run, in one place.

A run lives at `$EYRIE_DATA/runs/<run_id>/`. Each stage writes under its own folder and
finishes by writing `manifest-<NNNNN>.json` (one per shard, `shared.store.Manifest`).
Shard files are named `shard-<NNNNN><suffix>` (5-digit, zero-padded).

Run level
    recipe.yaml, recipe.json   resolved recipe (json = canonical, what the run hash covers)
    commands.log               every command that touched the run
    plan.json                  {"num_shards": N, "datasets": [...], "shards": [[[ds, row], ...]]}
                               which source rows each prep shard reads (services.prep.plan);
                               also "recipe_hash", and per dataset {"name", "adapter", "rows",
                               "selected", "load": {"file", "truncated", "error_byte_offset"?,
                               "bad_lines"?}}
    plan/rows-N.jsonl          the raw source rows of prep shard N, {"ds", "row", "raw"} per
                               line (so a prep worker on any host reads only its shard)
    timings.json               wall seconds per stage (conductor)

prep/      (one job per shard, queue prep)
    shard-N.jsonl              canonical conversations, one JSON object per line:
                               {"id": str, "source": str, "messages": [Message], "tools": list|None}
                               Message = {"role": "system"|"user"|"assistant"|"tool",
                                          "content": str, "reasoning_content"?: str,
                                          "tool_calls"?: [{"type": "function", "function":
                                              {"name": str, "arguments": str(JSON)}}],
                                          "name"?: str}
    shard-N.quarantine.jsonl   {"file", "row", "field", "reason", "detail", "raw"} per
                               quarantined row (raw cut to 2,000 characters)
    shard-N.report.json        {"rows_in", "kept", "skipped": {reason: n}, "realigned": {...}}

dedup/     (single job)
    keep.json                  {"<shard>": [kept row indices of prep/shard-N.jsonl]} after
                               first-prompt dedup and eval decontamination
    report.json                {"duplicates": n, "contaminated": n, "kept": n}

regen/     (one job per shard, queue regen, baseline server up)
    shard-N.jsonl              one line per successfully regenerated conversation, sorted
                               by "row" (its line in prep/shard-N.jsonl):
                               {"row", "id", "source", "messages": [Message] (the k-th
                                assistant message is the target's answer of turns[k]),
                                "tools", "turns": [{"prompt_token_ids": [int] (as the server
                                rendered them), "completion_token_ids": [int] (as sampled,
                                ending with the stop token when finish_reason is "stop"),
                                "finish_reason": str}], "stopped": "" | why it stopped early,
                                "sampling": {temperature, top_p, max_tokens},
                                "chat_template_kwargs": {...}, "server": {"model", "url",
                                "fingerprint" (vLLM version), "target"}}
    shard-N.errors.jsonl       {"row", "id", "status": "error"|"skipped", "reason",
                                "detail"} for rows not regenerated (reasons: server_rejected;
                                prompt_too_long, no_user_turn, tool_calls)
    shard-N.partial.jsonl,     append-only resume points of an unfinished shard (removed
    shard-N.partial-errors.jsonl   when the manifest is written)
    manifest counts: input == success + error + skipped; turns, prompt_tokens,
                     completion_tokens, finish_length, "<status>:<reason>", "stopped:<reason>"

serve/     (launcher, services.serve)
    <mode>.log                 vLLM server log of each mode started for this run

tokenize/  (one job per shard, queue prep)
    shard-N/                   HF `datasets` save_to_disk: input_ids list[int32],
                               loss_mask list[int8] (1 = assistant-generated token),
                               seq_len int32, id str, source str
    shard-N.report.json        samples, tokens, assistant_tokens, per_source {src: same},
                               rows_in, kept, truncated, "dropped:<reason>" counts,
                               eot_appended / prompt_render_mismatch (regen input),
                               max_len_tokens, chat_template_kwargs, input ("regen"|"prep")

vocab/     (single job)
    token_freq.npy             int64 [target_vocab]: counts over loss-masked tokens
    d2t.npy                    int64 [draft_vocab]: offsets, target = draft + d2t[draft]
    t2d.npy                    bool  [target_vocab]
    coverage.json              coverage share, top left-out tokens, sizes
                               {"coverage", "target_vocab", "draft_vocab", "assistant_tokens",
                                "distinct_seen", "left_out_tokens", "left_out_distinct",
                                "top_left_out": [{"id", "text", "count", "share"}]}
    token_freq.pt              speculators' format: torch.save({target_id: count}) (ids seen)
    teacher_coverage.json      after extract (services.train.vocab.teacher_argmax_coverage):
                               {"teacher_argmax_coverage", "positions", "in_draft_vocab"}

extract/   (one job per shard, queue extract; speculators offline layout per shard)
    shard-N/data/              HF save_to_disk: input_ids, loss_mask, seq_len (same rows as
                               tokenize/shard-N, same order)
    shard-N/hidden_states/hs_<row>.safetensors
                               hidden_states bf16 [seq_len, 3+1, H] (aux ids in order, then
                               the final PRE-norm state); token_ids int64 [seq_len]
    shard-N/meta.json          {"aux_layer_ids", "aux_id_convention", "final_state":
                                "pre_norm", "target", "target_revision", "hidden_size",
                                "dtype", "quarantined": [...]}
                               also "pre_norm": true, "slots", "backend", "num_hidden_layers",
                               "rows", "written_rows", "this_run" (tokens, bytes, batches,
                               oom_retries, start/final token budget);
                               quarantined = [{"row", "id", "reason"}]: such a row keeps its
                               data/ row but has no hs file (speculators: on_missing=skip)
    vllm-hidden-states/        scratch of the vllm backend's server (connector files, deleted
                               by the client once read)

train/     (single job, queue train; services/train/checkpoints.py, metrics.py)
    checkpoints/epoch-<EEEE>/  after epoch E (1-based, 4 digits): draft.safetensors (trainable
                               weights only, fp32, speculators names: fc, layers.0.*, norm; no
                               target embeddings, no lm_head rows copied from the target, no
                               verifier norm) + training_state.pt (optimizer, scheduler, RNG
                               states, counters) + state.json {step, epoch, step_in_epoch,
                               best, validations}; last train.keep_last kept plus the best
    checkpoints/step-latest/   same files, rolling every train.step_checkpoint_every steps;
                               removed once an epoch checkpoint covers it
    metrics.jsonl              {"kind": "step", step, epoch, lr, loss, loss_<k>, acc_<k>,
                                cond_acc_<k>, tokens, tokens_per_s, grad_norm} and
                               {"kind": "epoch", epoch, step, val_loss, val_loss_<k>,
                                val_acc_<k>, tau, accept_rate_per_pos, anchors, ...}
    metrics.png                loss/accuracy per TTT step, validation simulated tau
    best.json                  {"best": {epoch, tau, val_loss}, "validations": [...]}

export/    (single job, queue train; services/train/export.py)
    vllm/                      llama-style folder (config.json + model.safetensors with d2t, t2d)
    speculators/               speculators save_pretrained folder (bf16), norm flags and
                               target_hidden_size written explicitly
    sglang/                    llama-style weights, aux ids written as k-1; config "eyrie"
                               records aux_id_convention and eyrie_aux_layer_ids (absent, and
                               the reason in export.json, when the first aux id is not 2)
    lint.json                  {folder: {"ok", "problems"}} (draft_format.lint_draft_dir)
    export.json                {"checkpoint", "written", "skipped": {folder: reason}}

eval/      (shard 0 = baseline server, shard 1 = eagle3 server, queue eval)
    shard-N.json               {"mode", "url", "model", "num_prompts", "max_tokens",
                                "prompt_source", "second_turn", "windows": [{"temperature",
                                "concurrency", "client": LevelResult (output_tok_s, ttft,
                                itl, tpot, failed...), "counters": WindowDelta (drafts,
                                draft_tokens, accepted, accepted_per_position, tau, ...)}]}
                               (services.bench.sweep; counters are deltas over the window)
    turn1-answers.json         {"answers": [str]} the target's greedy MT-Bench turn-1
                               answers, first writer wins (only with eval.second_turn)

report/    (single job, queue eval)
    report.json                rows per (temperature, concurrency) with speedup, tau and
                               acceptance; pooled tau per temperature; flags with likely
                               causes (services.bench.report, services.bench.diagnosis)
    report.md, speedup.png, acceptance.png
"""

PREP_SUFFIX = ".jsonl"
QUARANTINE_SUFFIX = ".quarantine.jsonl"
REPORT_SUFFIX = ".report.json"
