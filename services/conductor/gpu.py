"""Is the node's GPU actually free? The operator's check before a GPU phase starts.

The Redis lease says which phase *should* own the GPUs; this checks that nothing else holds
memory on them (a leftover server from a crashed phase, another user's job), with
`nvidia-smi`. A machine without `nvidia-smi` (the CPU demo) skips the check with a log note.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from shared.errors import ServiceUnavailableError

log = logging.getLogger("eyrie.serve.gpu")

#: Memory in MiB an idle GPU still reports used (driver/context overhead).
IDLE_USED_MIB = 1024

QUERY = ["--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"]


def parse_memory_used(csv_text: str) -> dict[int, tuple[int, int]]:
    """Parse `nvidia-smi --query-gpu=index,memory.used,memory.total` CSV output.

    Returns:
        GPU index → (used MiB, total MiB).
    """
    out: dict[int, tuple[int, int]] = {}
    for line in csv_text.strip().splitlines():
        idx, used, total = (x.strip() for x in line.split(","))
        out[int(idx)] = (int(used), int(total))
    return out


def busy_gpus(usage: dict[int, tuple[int, int]], idle_mib: int = IDLE_USED_MIB) -> list[int]:
    """Indices of GPUs with more than `idle_mib` MiB in use."""
    return [i for i, (used, _) in sorted(usage.items()) if used > idle_mib]


def check_gpus_free(idle_mib: int = IDLE_USED_MIB) -> None:
    """Refuse to start a GPU phase while any GPU holds more than `idle_mib` MiB.

    Raises:
        ServiceUnavailableError: a GPU is in use; the message lists each busy GPU's memory
            and says how to find the holder.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        log.info("no nvidia-smi on this machine: GPU-free check skipped (CPU run)")
        return
    res = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise ServiceUnavailableError(f"nvidia-smi failed ({res.returncode}): {res.stderr}")
    usage = parse_memory_used(res.stdout)
    busy = busy_gpus(usage, idle_mib)
    if busy:
        detail = ", ".join(f"GPU {i}: {usage[i][0]}/{usage[i][1]} MiB" for i in busy)
        raise ServiceUnavailableError(
            f"GPUs not free before a GPU phase ({detail} used; idle is <= {idle_mib} MiB). "
            "Stop the holder (`nvidia-smi` lists its processes; `eyrie serve stop` stops "
            "Eyrie's servers) and retry."
        )
