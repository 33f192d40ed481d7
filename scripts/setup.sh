#!/usr/bin/env bash
# One idempotent set-up for a fresh machine of this project's kind (Debian, Python 3.11, no GPU):
# Debian packages the tests use, a virtual environment in .venv, torch's CPU build first, then the
# project with its test extras. Safe to run again: each step skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPIP=".venv/bin/python -m pip"
$VPIP install -q --upgrade pip >/dev/null
# torch first: pip takes the CPU build from this machine's disk; anything later that asks for torch
# is then satisfied instead of pulling a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch 2.13.0 (CPU)"
  $VPIP install -q torch==2.13.0
fi
echo "[setup] installing turnstile and its test extras"
$VPIP install -q -e ".[test]"
echo "[setup] done: activate with 'source .venv/bin/activate' or call .venv/bin/turnstile"
