"""`python -m services.train.ddp RUN_ID`: one trainer rank, as torchrun starts it.

The train stage runs this under `torchrun --nproc-per-node TRAIN_GPUS` (see
`services.train.stage.train_stage`); each rank reads `RANK`, `LOCAL_RANK` and `WORLD_SIZE`
from torchrun (`services.train.runtime`), trains its share of every step under DDP, and rank
0 writes checkpoints, metrics and best.json. The stage's manifest is written by the job that
started torchrun, after every rank exited 0.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Train the run `RUN_ID` (under EYRIE_DATA) as this rank. Returns 0 on success."""
    from services.train.stage import run_training
    from shared.artifacts import RunStore
    from shared.errors import ArtifactError

    p = argparse.ArgumentParser(prog="python -m services.train.ddp")
    p.add_argument("run_id", help="the run to train (under EYRIE_DATA/runs)")
    args = p.parse_args(argv)
    store = RunStore(args.run_id)
    if not store.exists():
        raise ArtifactError(f"run {args.run_id!r} does not exist under {store.root.parent}")
    run_training(store, store.recipe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
