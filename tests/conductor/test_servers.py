"""The conductor's servers without starting vLLM: the GPU-free check, readiness failures,
`eyrie serve stop`, which servers each stage's shards need, and `serving` refusing a bad
eagle3 draft before it starts anything.

The nvidia-smi cases run a real executable named nvidia-smi on PATH that prints what the
real tool prints for `--query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.conductor.cli import main
from services.conductor.gpu import busy_gpus, check_gpus_free, parse_memory_used
from services.conductor.processes import free_port, is_running
from services.conductor.readiness import wait_ready
from services.conductor.servers import ServerHandle, serving
from shared.artifacts import RunStore
from shared.draft import random_llama_draft
from shared.errors import ContractMismatchError, ServiceUnavailableError
from shared.recipe import resolve_recipe
from shared.stage import get_stage

IDLE = "0, 4, 81559\n1, 4, 81559\n"
BUSY = "0, 4, 81559\n1, 61234, 81559\n"


def _fake_smi(tmp_path, monkeypatch, output: str) -> None:
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}:/usr/bin:/bin")


def test_parse_and_busy():
    usage = parse_memory_used(BUSY)
    assert usage == {0: (4, 81559), 1: (61234, 81559)}
    assert busy_gpus(usage) == [1]


def test_idle_gpus_pass(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, IDLE)
    check_gpus_free()


def test_busy_gpu_refused(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, BUSY)
    with pytest.raises(ServiceUnavailableError, match=r"GPU 1: 61234/81559 MiB"):
        check_gpus_free()


def test_no_nvidia_smi_skips_with_note(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level("INFO"):
        check_gpus_free()
    assert "GPU-free check skipped" in caplog.text


def test_readiness_fails_fast_when_the_server_died(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("ValueError: bad flag --speculative-config\n")
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match="exited during startup(.|\n)*bad flag"):
        wait_ready(f"http://127.0.0.1:{free_port()}", 60, alive=lambda: False, log_path=log)
    assert time.monotonic() - t0 < 5


def test_readiness_times_out(tmp_path):
    with pytest.raises(ServiceUnavailableError, match="not ready after 1s"):
        wait_ready(f"http://127.0.0.1:{free_port()}", 1, poll_s=0.2)


def test_serve_stop_never_signals_a_non_vllm_pid(tmp_path, monkeypatch, capsys):
    """A stale state file whose pid now belongs to another program: stop leaves it alone."""
    monkeypatch.setenv("EYRIE_DATA", str(tmp_path))
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        state = tmp_path / "serve" / "baseline-8000.json"
        state.parent.mkdir()
        h = ServerHandle("baseline", "http://127.0.0.1:8000", "m", "process", pid=other.pid)
        state.write_text(json.dumps(h.__dict__))
        assert main(["serve", "stop"]) == 0
        assert (
            "removed the stale record of baseline server at http://127.0.0.1:8000"
            in capsys.readouterr().out
        )
        assert is_running(other.pid)
        assert not state.exists()
    finally:
        other.kill()
        other.wait()


def test_serve_stop_with_nothing_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EYRIE_DATA", str(tmp_path))
    assert main(["serve", "stop"]) == 0
    assert "no Eyrie vLLM server" in capsys.readouterr().out


@pytest.fixture
def recipe(smollm2_path):
    return resolve_recipe(
        {
            "name": "servers",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": "x.jsonl"}],
            "layers": [2, 15, 27],
            "serve": {"port": free_port(), "eagle3_port": free_port()},
        }
    )


def test_servers_each_stage_needs(recipe):
    def servers(stage, r, shards):
        return get_stage(stage).servers(r, shards)

    assert servers("regen", recipe, [0, 1, 2]) == ["baseline"]
    assert servers("bench", recipe, [0, 1]) == ["baseline", "eagle3"]
    assert servers("bench", recipe, [1]) == ["eagle3"]
    assert servers("extract", recipe, [0]) == []  # extract.backend hf (the default)
    assert servers("train", recipe, [0]) == []
    assert servers("tokenize", recipe, [0]) == []
    off = resolve_recipe(
        {
            **recipe.model_dump(mode="json"),
            "regen": {"enabled": False},
            "extract": {"backend": "vllm"},
            "bench": {"side_by_side": False},
        }
    )
    assert not get_stage("regen").enabled(off)
    assert servers("extract", off, [0, 1]) == ["extract"]
    # Not side by side: the two bench shards' servers run one after the other.
    assert get_stage("bench").shard_groups(off, [0, 1]) == [[0], [1]]
    assert get_stage("bench").shard_groups(recipe, [0, 1]) == [[0, 1]]


def test_bench_rounds_alternate_and_each_measured_k_gets_its_own_servers(recipe, tmp_path):
    from services.bench.stage import bench_plan
    from shared.vllm import speculative_config

    bench = get_stage("bench")
    r = resolve_recipe(
        {**recipe.model_dump(mode="json"), "bench": {"rounds": 2, "measure_k": [1, 3, 2]}}
    )
    # k=3 is the recipe's own: served once. Per k, per round, baseline then eagle3.
    assert [(p.k, p.round, p.mode) for p in bench_plan(r)] == [
        (k, rnd, mode) for k in (3, 1, 2) for rnd in (0, 1) for mode in ("baseline", "eagle3")
    ]
    store = RunStore.create(r, root=tmp_path / "data")
    shards = bench.shard_numbers(store)
    assert shards == list(range(12))
    # The servers of one k run together, its rounds enqueued in order; the next k restarts.
    assert bench.shard_groups(r, shards) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert bench.servers(r, [4, 5, 6, 7]) == ["baseline", "eagle3"]
    ks = [speculative_config(bench.server_recipe(r, s), "eagle3", tmp_path) for s in (1, 5, 9)]
    assert [c["num_speculative_tokens"] for c in ks if c] == [3, 1, 2]
    assert bench.server_recipe(r, 0) is r  # the recipe's own k: the run's recipe unchanged
    # A shard is resumed from where it stopped: the remaining ones keep their k groups.
    assert bench.shard_groups(r, [3, 4, 9]) == [[3], [4], [9]]
    # One server at a time: no alternation; every k's baseline rounds first, then each k's
    # eagle3 rounds (the baseline server is the same for every k: it starts once).
    seq = resolve_recipe(
        {**r.model_dump(mode="json"), "bench": {**r.bench.model_dump(), "side_by_side": False}}
    )
    assert [(p.k, p.round, p.mode) for p in bench_plan(seq)] == [
        *((k, rnd, "baseline") for k in (3, 1, 2) for rnd in (0, 1)),
        *((k, rnd, "eagle3") for k in (3, 1, 2) for rnd in (0, 1)),
    ]
    groups = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert bench.shard_groups(seq, list(range(12))) == groups
    assert bench.servers(seq, [2, 3]) == ["baseline"]
    assert bench.servers(seq, [6, 7]) == ["eagle3"]


def test_bench_refuses_a_server_drafting_another_k():
    from services.bench.stage import check_served_k
    from shared.errors import StageFailedError

    sweep = {"url": "http://h:1", "windows": [{"counters": {"accepted_per_position": [5, 2, 1]}}]}
    check_served_k(sweep, 3)
    with pytest.raises(
        StageFailedError, match="drafts 3 tokens per step, this bench shard measures k=1"
    ):
        check_served_k(sweep, 1)


def test_serving_refuses_before_starting_anything(recipe, smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_DATA", str(tmp_path / "data"))
    store = RunStore.create(recipe, root=tmp_path / "data")
    out = store.export.vllm_draft
    random_llama_draft(smollm2_path, out, [2, 15, 27], 64)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] = 32000
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ContractMismatchError, match="refusing to start an eagle3 server"):
        with serving(recipe, store, ["baseline", "eagle3"]):
            pytest.fail("the body must not run")
    # Refused before the baseline too: no server log, no state file.
    assert not store.serve.log_path("baseline").exists()
    assert not store.serve.log_path("eagle3").exists()
    assert not list((tmp_path / "data").glob("serve/*.json"))


def test_a_hub_id_without_a_local_copy_starts_no_server(recipe, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from shared.errors import ConfigError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("EYRIE_DATA", str(tmp_path / "data"))
    hub = resolve_recipe({**recipe.model_dump(mode="json"), "target": {"path": "acme/absent"}})
    store = RunStore.create(hub, root=tmp_path / "data")
    with pytest.raises(ConfigError, match="acme/absent has no local copy.*eyrie pull"):
        with serving(hub, store, ["baseline"]):
            pytest.fail("the body must not run")
    assert not store.serve.log_path("baseline").exists()


def test_free_port_is_bindable_and_outside_the_kernels_ephemeral_range():
    """A port from the ephemeral range can be taken by any outgoing connection before the
    server binds it (a CI demo lost its vLLM port that way)."""
    import socket
    from pathlib import Path

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


class _Recorded:
    """The pool's side of the backend, recorded: which servers start and stop, in order."""

    def __init__(self, monkeypatch):
        from services.conductor import gpu, servers

        self.events: list[tuple[str, str, object]] = []
        self.dead: set[str] = set()
        self.gpu_checks = 0
        recorded = self

        class Backend(servers.Backend):
            name = "process"

            def alive(self, handle):
                return handle.url not in recorded.dead

            def stop(self, handle):
                recorded.events.append(("stop", handle.mode, handle.model))

        def start_server(backend, recipe, store, mode):
            k = recipe.bench.num_speculative_tokens if mode == "eagle3" else None
            self.events.append(("start", mode, k))
            return ServerHandle(mode, f"http://{mode}-{k}", k, "process")

        def check_gpus_free():
            self.gpu_checks += 1

        monkeypatch.setattr(servers, "get_backend", lambda name: Backend())
        monkeypatch.setattr(servers, "start_server", start_server)
        monkeypatch.setattr(gpu, "check_gpus_free", check_gpus_free)


def _bench_groups(recipe, tmp_path, side_by_side):
    r = resolve_recipe(
        {
            **recipe.model_dump(mode="json"),
            "bench": {"measure_k": [1, 2], "rounds": 2, "side_by_side": side_by_side},
        }
    )
    store = RunStore.create(r, root=tmp_path / "data")
    random_llama_draft(Path(r.target.path), store.export.vllm_draft, [2, 15, 27], 64)
    bench = get_stage("bench")
    return store, [
        (bench.server_recipe(r, g[0]), bench.servers(r, g))
        for g in bench.shard_groups(r, bench.shard_numbers(store))
    ]


@pytest.mark.parametrize("side_by_side", [True, False])
def test_the_bench_starts_its_baseline_once_for_every_k(
    recipe, tmp_path, monkeypatch, side_by_side
):
    """k = 3, 1, 2 in 2 rounds: one baseline start and one eagle3 start per k (4 in all,
    against 6 when each k group started its own baseline), each eagle3 server stopped before
    the next k's starts; side by side the baseline stays up beside every k's eagle3."""
    from services.conductor.servers import server_pool

    rec = _Recorded(monkeypatch)
    store, groups = _bench_groups(recipe, tmp_path, side_by_side)
    with server_pool(store) as pool:
        urls = [pool.serve(r, modes) for r, modes in groups]
    up, down = ("start", "baseline", None), ("stop", "baseline", None)
    eagle3 = [(e, "eagle3", k) for k in (3, 1, 2) for e in ("start", "stop")]
    if side_by_side:
        assert rec.events == [up, *eagle3, down]
        assert urls[1] == {"baseline": "http://baseline-None", "eagle3": "http://eagle3-1"}
    else:
        assert len(groups) == 6  # every k's baseline rounds, then each k's eagle3 rounds
        assert rec.events == [up, down, *eagle3]
        assert urls[:3] == [{"baseline": "http://baseline-None"}] * 3
    assert rec.gpu_checks == (1 if side_by_side else 4)  # whenever the pool was empty


def test_a_kept_server_that_died_is_started_again(recipe, tmp_path, monkeypatch):
    from services.conductor.servers import server_pool

    rec = _Recorded(monkeypatch)
    store, groups = _bench_groups(recipe, tmp_path, True)
    with server_pool(store) as pool:
        pool.serve(*groups[0])
        rec.dead.add("http://baseline-None")
        pool.serve(*groups[1])
    assert rec.events[2:5] == [
        ("stop", "eagle3", 3),
        ("stop", "baseline", None),
        ("start", "baseline", None),
    ]
