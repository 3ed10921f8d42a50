"""`python -m services.train.ddp RUN_DIR`: one trainer rank, as torchrun starts it.

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
    """Train the run in folder `RUN_DIR` as this rank. Returns 0 on success."""
    from services.train.stage import run_training
    from shared.artifacts import RunStore
    from shared.errors import ArtifactError

    p = argparse.ArgumentParser(prog="python -m services.train.ddp")
    p.add_argument("run_dir", help="the run's folder (<data root>/runs/<run id>)")
    args = p.parse_args(argv)
    store = RunStore.at(args.run_dir)
    if not store.exists():
        raise ArtifactError(f"{args.run_dir}: no run there")
    run_training(store, store.recipe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
