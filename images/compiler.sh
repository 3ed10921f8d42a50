#!/bin/sh
# A C/C++ toolchain for torch.compile at run time, in the images whose processes compile:
# Triton builds its CUDA launcher with the host's C compiler (the draft's forward under flex
# attention on a GPU node), and inductor's CPU kernels need g++ (train.fused_loss; vLLM on
# CPU without enforce_eager). Both build against Python's headers. Without them the first
# compile stops with "Failed to find C compiler" (pytorch/pytorch#116696), which slim
# images meet at run time, not at build time.
#   compiler.sh install   gcc, g++, libc6-dev, and python3-dev where the base's Python has
#                         no headers (Debian's python3; the official python image ships them)
#   compiler.sh check     compiles one kernel with torch.compile (run with the image's torch)
set -eu
case "${1:-}" in
  install)
    headers=$(python3 -c 'import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))')
    pkgs="gcc=4:12.* g++=4:12.* libc6-dev=2.36-*"
    [ "$headers" = True ] || pkgs="$pkgs python3-dev=3.11.*"
    apt-get update
    # shellcheck disable=SC2086  # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs
    rm -rf /var/lib/apt/lists/*
    ;;
  check)
    python -c "import torch; f = torch.compile(lambda x: (x * 2).sum()); assert f(torch.ones(3)).item() == 6"
    rm -rf /tmp/torchinductor_*
    ;;
  *) echo "usage: compiler.sh install|check" >&2; exit 2 ;;
esac
