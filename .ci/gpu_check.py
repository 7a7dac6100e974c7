"""The checks that need a CUDA GPU, as one script: ./run.sh gpu-check (or python .ci/gpu_check.py).

    python .ci/gpu_check.py                        # on a CUDA GPU: parts 1-4 below, about 4-5 minutes on one H200
    python .ci/gpu_check.py --tiny                 # the same code on tiny models and batches; runs on the CPU too
    python .ci/gpu_check.py --parts step,train     # some of the parts
    python .ci/gpu_check.py --timeout step=300     # another time budget for a part, in seconds
    python .ci/gpu_check.py --rollout hf           # part 3 with HF generate even where vLLM is installed
    python .ci/gpu_check.py step-check --help      # part 3 alone, in this process: its own flags

Parts, in this order; each runs as a subprocess with its own time budget, and a part that fails or runs out of
time is reported and the next one runs:

    1. kernels  pytest -k kernels with TRITON_INTERPRET=0: every kernels.py op against the s3ac.py function and
                fp64, T = 8192 and gamma * lambda = 1 included, on the GPU through Triton's compiler (CUDA only)
    2. bench    python .ci/bench.py --gpu: GAE at [512, 8192], [4096, 1024] and [64, 32768] fp32 in us and as %
                of the copy bandwidth measured in the same run, the fused losses forward and forward + backward at
                [512, 8192], log-prob peak memory against the naive path at V = 151,936 (CUDA only)
    3. step     python .ci/gpu_check.py step-check (step_check, on s3ac.py's own functions): rollout tokens/s
                (vLLM when installed, else HF generate), then one S3AC step and one GRPO step on the same batch, on
                a Qwen2.5-1.5B-shaped random model in bf16 autocast (--tiny: a tiny one); seconds per phase,
                S3AC's extra wall time over GRPO, peak GPU memory; tokens/s, TFLOP/s and share of the bf16 peak of
                the actor and critic updates; the actor update with AdamW(fused=True) against the default
    4. memory   python .ci/gpu_check.py memory-check: the paper setting's default flags on the 1.5B shape (random
                weights): the memory plan, then log pi_old, values and the first actor and critic updates on a
                paper-shaped batch of 64 rows, each phase's measured peak beside the plan's estimate, perf/padding
    5. train    python s3ac.py for a few steps on a small random model (PACT critic sync, BCE critic, DAPS), then
                --resume from its checkpoint: every logged number finite, the weights finite, steps continued

Output, in --out (default: $S3AC_GPU_CHECK_DIR, else $OUT, else runs/gpu-check), at most 8 files:
    results.jsonl        every JSON line of every part with its "part" added, then one line per part:
                         {"part", "status": ok | failed | timeout | skipped, "seconds", "timeout_s", "rc", "why"}
                         and a last {"part": "all", "status", "seconds", "failed"}
    <part>.log           the part's whole output (stdout and stderr)
    kernels.xml          pytest's JUnit report of part 1
    train_metrics.jsonl  the metrics.jsonl of part 4
The same JSON lines go to stdout. The exit status is 0 when no part failed or ran out of time.
"""

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
PARTS = ("kernels", "bench", "step", "memory", "train")
NEEDS_CUDA = ("kernels", "bench")
TIMEOUT_S = {"kernels": 100, "bench": 80, "step": 170, "memory": 100, "train": 140}  # seconds, 9.8 minutes in all
TIMEOUT_TINY_S = {"kernels": 300, "bench": 75, "step": 120, "memory": 120, "train": 240}  # --tiny on 2 CPU cores


def default_out_dir() -> str:
    """$S3AC_GPU_CHECK_DIR, else $OUT, else runs/gpu-check (beside this file)."""
    return os.environ.get("S3AC_GPU_CHECK_DIR") or os.environ.get("OUT") or os.path.join(HERE, "runs", "gpu-check")


def json_lines(text: str) -> list:
    """The lines of text that hold a JSON object, parsed."""
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def run_part(name: str, cmd: list, timeout_s: float, out_dir: str, env: dict = None) -> tuple:
    """Run one part: cmd as a subprocess in its own process group, its stdout and stderr written to
    <out_dir>/<name>.log, killed with its children after timeout_s seconds.

    Returns (summary, rows): summary = {"part", "status": "ok" | "failed" | "timeout", "rc", "seconds",
    "timeout_s", "log"}; rows = the JSON lines the part printed (also those printed before a failure or a kill),
    each with "part" added. A part whose rows hold an "error" key counts as failed.
    """
    log_path = os.path.join(out_dir, f"{name}.log")
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=HERE, env=env, start_new_session=True)
        try:
            rc, status = proc.wait(timeout=timeout_s), None
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, status = proc.returncode, "timeout"
    with open(log_path) as f:
        rows = [{"part": name, **row} for row in json_lines(f.read())]
    if status is None:
        status = "ok" if rc == 0 and not any("error" in row for row in rows) else "failed"
    summary = {"part": name, "status": status, "rc": rc, "seconds": round(time.time() - t0, 1),
               "timeout_s": timeout_s, "log": os.path.basename(log_path)}
    return summary, rows


def _kill_group(proc):
    """SIGTERM to the process group of proc, SIGKILL 10 s later if it is still there."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def junit_counts(path: str) -> dict:
    """Test counts from a pytest JUnit XML report: passed / failed / skipped, the same for the test ids that
    name a CUDA case, and the ids of the failed tests."""
    import xml.etree.ElementTree as ET
    counts = {"passed": 0, "failed": 0, "skipped": 0, "cuda_passed": 0, "cuda_failed": 0, "failed_tests": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None else
                   "skipped" if case.find("skipped") is not None else "passed")
        counts[outcome] += 1
        name = case.get("name", "")
        if "cuda" in name and outcome != "skipped":
            counts[f"cuda_{outcome}"] += 1
        if outcome == "failed":
            counts["failed_tests"].append(name)
    return counts


def part_command(name: str, opts, python: str) -> list:
    """The command line of one part."""
    if name == "kernels":  # -v: a part stopped at its time limit still shows which tests passed
        import importlib.util
        workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []  # compiles run in parallel with xdist
        return [python, "-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider", "-rfE", *workers,
                "test_s3ac.py", "-k", "kernels", f"--junitxml={os.path.join(opts.out, 'kernels.xml')}"]
    if name == "bench":
        return [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py"), "--gpu"]
    if name == "step":
        size = ["--size", "tiny", "--prompts", "8", "--tokens", "16", "--micro-batch-tokens", "96"] if opts.tiny else []
        return [python, os.path.abspath(__file__), "step-check", "--rollout", opts.rollout, *size,
                *shlex.split(opts.step_args)]
    if name == "memory":
        return [python, os.path.abspath(__file__), "memory-check"] + (["--tiny"] if opts.tiny else [])
    return [python, os.path.abspath(__file__), "train-check", "--out", opts.out] + (["--tiny"] if opts.tiny else [])


def main(argv=None) -> int:
    """Run the parts in order and write their output (see the module docstring); returns the exit status."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["step-check"]:
        return step_check(argv[1:])
    if argv[:1] == ["train-check"]:
        return train_check(argv[1:])
    if argv[:1] == ["memory-check"]:
        return memory_check(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--tiny", action="store_true", help="tiny models and batches (the CPU path the tests run)")
    parser.add_argument("--out", default=default_out_dir(), help="folder for results.jsonl and the logs")
    parser.add_argument("--timeout", action="append", default=[], metavar="PART=SECONDS",
                        help="time budget of a part (repeatable)")
    parser.add_argument("--rollout", default="auto", choices=("auto", "hf", "vllm"),
                        help="part 3's rollout engine: auto = vllm when installed, else hf")
    parser.add_argument("--step-args", default="", help="extra flags for part 3 (step-check --help)")
    opts = parser.parse_args(argv)
    parts = [p for p in opts.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; expected some of {PARTS}")
    budget = dict(TIMEOUT_TINY_S if opts.tiny else TIMEOUT_S)
    for item in opts.timeout:
        part, _, seconds = item.partition("=")
        if part not in PARTS or not seconds:
            parser.error(f"--timeout {item!r}: expected PART=SECONDS with PART one of {PARTS}")
        budget[part] = float(seconds)
    import torch  # after the argument checks: importing torch takes seconds
    cuda = torch.cuda.is_available()
    if not cuda and not opts.tiny:
        parser.error("no CUDA GPU here: --tiny runs the same code on tiny models on the CPU")
    os.makedirs(opts.out, exist_ok=True)
    results = os.path.join(opts.out, "results.jsonl")
    open(results, "w").close()

    def emit(row):
        print(json.dumps(row), flush=True)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")

    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_INTERPRET="0")  # Triton's compiler, not its interpreter
    emit({"part": "setup", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
          "python": sys.executable, "parts": parts, "timeouts_s": {p: budget[p] for p in parts},
          "tiny": opts.tiny})
    t_all, failed = time.time(), []
    for name in parts:
        if name in NEEDS_CUDA and not cuda:
            emit({"part": name, "status": "skipped", "why": "needs a CUDA GPU"})
            continue
        print(f"--- {name}: {shlex.join(part_command(name, opts, sys.executable))}", file=sys.stderr, flush=True)
        if name == "kernels" and os.path.isfile(os.path.join(opts.out, "kernels.xml")):
            os.remove(os.path.join(opts.out, "kernels.xml"))  # an earlier run's report must not count for this one
        summary, rows = run_part(name, part_command(name, opts, sys.executable), budget[name], opts.out, env)
        for row in rows:
            emit(row)
        if name == "kernels" and os.path.isfile(os.path.join(opts.out, "kernels.xml")):
            counts = junit_counts(os.path.join(opts.out, "kernels.xml"))
            emit({"part": name, "check": "pytest", **counts})
            if counts["cuda_passed"] == 0 and summary["status"] == "ok":
                summary.update(status="failed", why="no CUDA test case ran")
        if summary["status"] != "ok":
            failed.append(name)
            with open(os.path.join(opts.out, summary["log"])) as f:
                summary.setdefault("why", f.read()[-1500:])  # the end of the log
        emit(summary)
    emit({"part": "all", "status": "failed" if failed else "ok", "seconds": round(time.time() - t_all, 1),
          "failed": failed})
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------
# Part 3: rollout throughput and the time of each phase of one S3AC and one GRPO step, on random weights
# ---------------------------------------------------------------------------------------------------------------
MODEL_SIZES = {  # part 3's model: Qwen2.5-1.5B's shape; a tiny one for CPU tests (head_dim 32 for vLLM's CPU attention)
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=1024)}


def step_check(argv) -> int:
    """Part 3 (python .ci/gpu_check.py step-check [--size tiny] ...) on s3ac.py's own functions, as JSON lines;
    nothing downloaded (weights random, vLLM's "dummy" load format): rollout tokens/s for a Qwen2.5-1.5B-sized model
    at --prompts x --tokens; the weight sync; the seconds of each phase of one S3AC step and one GRPO step on the
    same rollout batch, with the peak GPU memory of each; the ratio of their wall times (S3AC's paper reports
    the critic costs 27-40% more wall time per step than GRPO); per timed phase ("throughput" rows) tokens/s and
    TFLOP/s = 6 x trainable parameters x tokens / seconds for an update (forward + backward), 2 x forward parameters
    x tokens / seconds for a no-grad pass, and their share of BF16_DENSE_PEAK_TFLOPS; the actor update with
    torch.optim.AdamW's default step and with fused=True, back to back ("optimizer_compare"). --size tiny runs the
    same code on a small model, on the CPU too. Returns 0."""
    parser = argparse.ArgumentParser(prog=".ci/gpu_check.py step-check",
                                     description=step_check.__doc__.split("\n")[0])
    parser.add_argument("--size", default="1.5b", choices=sorted(MODEL_SIZES))
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rollout", default="auto", choices=("auto", "vllm", "hf"))
    parser.add_argument("--micro-batch-tokens", type=int, default=16 * 640)
    parser.add_argument("--critic-layers", default="0,3,6",
                        help="the S3AC critics to time, comma-separated: 0 the full separate critic, k >= 1 the "
                             "partial-trunk critic on the actor's last k blocks (at most all of them)")
    opts = parser.parse_args(argv)
    L = MODEL_SIZES[opts.size]["num_hidden_layers"]
    layers = list(dict.fromkeys(min(int(k), L) for k in opts.critic_layers.split(",") if k.strip()))
    import tempfile
    import torch
    if opts.size != "tiny" and not torch.cuda.is_available():
        parser.error(f"--size {opts.size} needs a CUDA GPU (--size tiny runs the same code on CPU)")
    from transformers import AutoModel, Qwen2Config, Qwen2ForCausalLM
    sys.path.insert(0, HERE)  # s3ac.py, at the repository root
    from s3ac import (Args, Critic, Policy, VLLMRollout, adaptive_lambda, autocast, compute_dtype, decoupled_gae,
                      generate_hf, grpo_advantages, load_critic, policy_logprobs, resolve_args,
                      store_critic_features, synced_time, tis_weights, trunk_features, update_actor, update_critic,
                      uses_vllm, value_pass)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def report(row: dict):
        print(json.dumps(row), flush=True)

    def peak_memory_gib():  # the most GPU memory PyTorch's tensors held since the last reset; None on the CPU
        return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

    config = Qwen2Config(**MODEL_SIZES[opts.size], tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    args = resolve_args(Args(model="random", micro_batch_tokens=opts.micro_batch_tokens, max_new_tokens=opts.tokens,
                             k=4, lr=1e-6, minibatches=1))  # one optimizer step per update, as measured before
    amp = compute_dtype(args.dtype, device)
    use_vllm = uses_vllm(opts, device)
    eos_ids, pad_id = {config.vocab_size - 1}, 0  # random weights: a stop is rare, responses run to --tokens
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, config.vocab_size - 1, (opts.prompts, opts.prompt_len), generator=g).tolist()
    index = [i // args.k for i in range(opts.prompts)]  # groups of k for GRPO
    with tempfile.TemporaryDirectory() as path:
        config.save_pretrained(path)
        torch.manual_seed(0)
        with torch.device(device):  # random weights drawn where they live: fast for 1.5B parameters on a GPU
            model = Qwen2ForCausalLM(config).float()
            backbone = AutoModel.from_config(config).float() if 0 in layers else None
        model.generation_config.eos_token_id = None
        policy = Policy(model)
        critics = {k: Critic(backbone, args.critic_seed).to(device) if k == 0 else
                   load_critic(path, device, args.critic_seed, layers=k, actor=policy) for k in layers}
        actor_opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
        critic_opts = {k: torch.optim.AdamW(c.parameters(), lr=args.lr * args.critic_lr_ratio, weight_decay=0.0)
                       for k, c in critics.items()}
        report({"check": "setup", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "model": f"qwen2-{opts.size}-shaped, random weights", "parameters": sum(p.numel() for p in
                model.parameters()), "rollout": "vllm" if use_vllm else "hf", "torch": torch.__version__,
                "critic_parameters": {k: sum(p.numel() for p in c.parameters() if p.requires_grad)
                                      for k, c in critics.items()}})

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = synced_time(device)  # rollout (the same batch serves both algorithms)
        if use_vllm:
            engine = VLLMRollout(path, args, device, 0, 1, load_format="dummy", skip_tokenizer_init=True,
                                 max_model_len=opts.prompt_len + opts.tokens)
            t1 = synced_time(device)
            engine.generate(prompts[:2], index[:2], eos_ids, pad_id, 4, 1.0)  # warm-up
            t2 = synced_time(device)
            batch = engine.generate(prompts, index, eos_ids, pad_id, opts.tokens, 1.0)
        else:
            model.eval()
            t1 = t2 = synced_time(device)
            with autocast(device, amp):
                batch = generate_hf(model, prompts, index, eos_ids, pad_id, opts.tokens, 1.0, opts.prompts)
        rollout_s = synced_time(device) - t2
        generated = int(batch.response_mask.sum())
        report({"check": "rollout", "engine": "vllm" if use_vllm else "hf", "prompts": opts.prompts,
                "prompt_len": opts.prompt_len, "max_tokens": opts.tokens, "generated_tokens": generated,
                "seconds": rollout_s, "tokens_per_s": generated / rollout_s, "engine_start_s": t1 - t0,
                "peak_memory_gib": peak_memory_gib()})
        if use_vllm:
            t0 = synced_time(device)
            engine.sync(policy)  # wake the weights, copy the actor in, in buckets
            report({"check": "weight_sync", "seconds": synced_time(device) - t0,
                    "bytes": sum(p.numel() * amp.itemsize for p in model.state_dict().values())})
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()

        # HF generate's own log-probs (autocast, as in training) against the trainer's recomputation: the TIS weights
        sub = (prompts[:min(32, opts.prompts)], index[:min(32, opts.prompts)])
        model.eval()
        with autocast(device, amp):
            sampled = generate_hf(model, *sub, eos_ids, pad_id, min(opts.tokens, 128), 1.0, len(sub[0]))
            trainer = policy_logprobs(policy, sampled, 1.0, args.micro_batch_tokens)  # [b, T] log pi_old
        mask = sampled.response_mask.to(device)  # [b, T]
        mu = sampled.sampler_logprobs.to(device)  # [b, T] the sampler's log mu
        gap = (trainer - mu).abs()[mask.bool()]  # [N]
        _, weights = tis_weights(trainer, mu, mask, args.is_cap)
        report({"check": "sampler_logprobs", "engine": "hf", "dtype": str(amp).split(".")[1], "tokens": gap.numel(),
                "logprob_gap_mean": gap.mean().item(), "logprob_gap_max": gap.max().item(), "is_cap": args.is_cap,
                **{key.split("/")[1]: float(value) for key, value in weights.items()}})

        if any(layers):  # HF rollouts record the partial critic's features while generating
            k = max(layers)
            block, sub = config.num_hidden_layers - k, (prompts[:min(32, opts.prompts)], index[:min(32, opts.prompts)])
            seconds = {False: [], True: []}
            model.eval()
            for record in (None, block) * 4:  # alternated; the first pair warms up, the median of the rest is kept
                torch.manual_seed(1)
                t = synced_time(device)
                with autocast(device, amp):
                    small = generate_hf(model, *sub, eos_ids, pad_id, min(opts.tokens, 128), 1.0, len(sub[0]),
                                        record_block=record)
                seconds[record is not None].append(synced_time(device) - t)
            seconds = {key: sorted(times[1:])[1] for key, times in seconds.items()}  # median of 3
            with autocast(device, amp):
                want = trunk_features(critics[k], small, args.micro_batch_tokens)  # [b, P + T, H] a second pass
                read = torch.cat([small.prompt_mask, small.response_mask[:, 1:],  # what the critic reads
                                  torch.zeros(len(sub[0]), 1)], 1).bool().to(device)  # [b, P + T]
                got, ref = (value_pass(critics[k], small, "mse", args.micro_batch_tokens, f)[0] for f in
                            (small.features, want))  # [b, T] each
            report({"check": "recorded_features", "critic_layers": k, "prompts": len(sub[0]), "repeats": 3,
                    "tokens": int(small.response_mask.sum()), "generate_s": seconds[False],
                    "generate_recording_s": seconds[True], "overhead": seconds[True] / seconds[False] - 1,
                    "max_abs_diff_vs_trunk": (small.features - want)[read].abs().max().item(),
                    "max_abs_feature": want[read].abs().max().item(),
                    "values_max_abs_diff": (got - ref).abs().max().item()})
            del small, want

        full, all_rewards = batch, torch.where(torch.rand(opts.prompts, generator=g) < 0.5, 1.0, -1.0).to(device)

        def phases(algo, k=0, rows=None):  # seconds of each phase of one step of `algo` (critic k) on the batch
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            batch, rewards = (full, all_rewards) if rows is None else (full.rows(rows), all_rewards[rows])
            batch = dataclasses.replace(batch, features=None)  # each critic's own trunk features
            times, t, mask = {}, synced_time(device), batch.response_mask.to(device)  # mask [B, T]
            if algo == "s3ac":
                critic = critics[k]
                with autocast(device, amp):
                    features = store_critic_features(critic, batch, args.micro_batch_tokens)  # None for k = 0
                    if k:  # the extra trunk pass (after vLLM rollouts; HF rollouts record it, see above)
                        times["trunk"], t = synced_time(device) - t, synced_time(device)
                    values, _ = value_pass(critic, batch, "mse", args.micro_batch_tokens, features)  # [B, T]
                times["values"], t = synced_time(device) - t, synced_time(device)
                advantages, returns, _ = decoupled_gae(rewards, values, mask, args.gamma, args.critic_lam,
                                                       adaptive_lambda(mask, args.alpha))  # s3ac.gae: Triton on CUDA
            else:
                advantages, _ = grpo_advantages(rewards, batch.prompt_index.to(device), mask)
            times["advantages"], t = synced_time(device) - t, synced_time(device)
            policy.train()
            update_actor(policy, actor_opt, batch, advantages, None, args, torch.Generator().manual_seed(0))
            times["actor"], t = synced_time(device) - t, synced_time(device)
            if algo == "s3ac":
                critic.train()
                update_critic(critic, critic_opts[k], batch, values, returns, mask, args,
                              torch.Generator().manual_seed(0))  # reads batch.features
                times["critic"] = synced_time(device) - t
            return times

        runs = [("grpo", 0)] + [("s3ac", k) for k in layers]
        for algo, k in runs:  # warm-up on the first quarter of the batch (whole GRPO groups): kernels, optimizer
            phases(algo, k, list(range(opts.prompts // 4)))  # states, first allocations
        times, peaks = {}, {}
        for algo, k in runs:
            times[algo, k] = phases(algo, k)
            peaks[algo, k] = peak_memory_gib()  # weights, gradients, Adam states and this step's activations
        for (algo, k), seconds in times.items():
            report({"check": "step", "algo": algo, **({"critic_layers": k} if algo == "s3ac" else {}),
                    "sequences": opts.prompts, "tokens": generated, **{f"{n}_s": v for n, v in seconds.items()},
                    "rollout_s": rollout_s, "train_s": sum(seconds.values()),
                    "step_s": sum(seconds.values()) + rollout_s, "peak_memory_gib": peaks[algo, k]})
        grpo_s = sum(times["grpo", 0].values())
        for k in layers:
            seconds = times["s3ac", k]
            s3ac_s, critic_side = sum(seconds.values()), sum(seconds.get(n, 0.0) for n in ("trunk", "values", "critic"))
            report({"check": "critic_overhead", "critic_layers": k,
                    "extra_wall_time": (s3ac_s - grpo_s) / (grpo_s + rollout_s),
                    "extra_train_time": (s3ac_s - grpo_s) / grpo_s, "c": critic_side / seconds["actor"],
                    **({"c_features_recorded": (critic_side - seconds["trunk"]) / seconds["actor"]} if k else {}),
                    "rollout": "vllm" if use_vllm else "hf", "target": "extra_wall_time < 0.27",
                    "paper_range": [0.27, 0.40]})

        # The achieved FLOP rate of each timed phase (and of the actor update with a fused AdamW step)
        positions = full.prompt_ids.numel() + full.response_ids.numel()  # tokens one pass over the batch processes
        peak = bf16_dense_peak_tflops(torch.cuda.get_device_name() if device.type == "cuda" else "cpu")

        def rate(phase, seconds, params, factor, passes):  # factor 6: forward + backward; 2: forward only
            tokens = passes * positions
            tflops = factor * params * tokens / seconds / 1e12  # TFLOP/s = factor x parameters x tokens / seconds
            return {"phase": phase, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                    "params": params, "flop_factor": factor, "tflop_s": tflops, "peak_tflop_s": peak,
                    "share_of_peak": tflops / peak if peak else None}

        trainable = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
        every = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        for (algo, k), seconds in times.items():
            rows = [rate("actor", seconds["actor"], trainable(policy), 6, args.actor_epochs)]
            if algo == "s3ac":  # the critic update (6x its trainable parameters), its value pass (2x, no grad) and
                # for k >= 1 the trunk pass, a no-grad forward of the actor's whole base model (2x)
                rows += [rate("critic", seconds["critic"], trainable(critics[k]), 6, args.critic_epochs),
                         rate("values", seconds["values"], every(critics[k]), 2, 1)]
                if k:
                    rows.append(rate("trunk", seconds["trunk"], every(model.base_model), 2, 1))
            for row in rows:
                report({"check": "throughput", "algo": algo, **({"critic_layers": k} if algo == "s3ac" else {}),
                        **row, "formula": f"{row['flop_factor']} x params x tokens / seconds"})

        # Before / after on one run: the actor update with AdamW's default step (foreach) and with fused=True, each
        # on its warmed-up optimizer, on the whole batch with GRPO's advantages
        advantages = grpo_advantages(all_rewards, full.prompt_index.to(device), full.response_mask.to(device))[0]
        try:
            fused_opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
        except (RuntimeError, TypeError, ValueError) as e:  # no fused AdamW for these parameters here
            report({"check": "optimizer_compare", "skipped": f"{type(e).__name__}: {e}"})
            return 0
        policy.train()
        update_actor(policy, fused_opt, full.rows(list(range(opts.prompts // 4))), advantages[: opts.prompts // 4],
                     None, args, torch.Generator().manual_seed(0))  # warm-up: the fused optimizer's states
        actor_s = {}
        for variant, optimizer in (("foreach", actor_opt), ("fused", fused_opt)):
            t = synced_time(device)
            update_actor(policy, optimizer, full, advantages, None, args, torch.Generator().manual_seed(0))
            actor_s[variant] = synced_time(device) - t
            report({"check": "optimizer_compare", "variant": variant,
                    "optimizer": f"torch.optim.AdamW({'fused=True' if variant == 'fused' else 'default: foreach'})",
                    **rate("actor", actor_s[variant], trainable(policy), 6, args.actor_epochs)})
        report({"check": "optimizer_compare", "change": "torch.optim.AdamW(fused=True) for the actor",
                "before_s": actor_s["foreach"], "after_s": actor_s["fused"],
                "ratio_before_over_after": actor_s["foreach"] / actor_s["fused"]})
    return 0


def memory_check(argv) -> int:
    """Part memory (python .ci/gpu_check.py memory-check [--tiny]): the paper setting's memory at its default flags on
    a Qwen2.5-1.5B-shaped random model (--tiny: a tiny one, on the CPU too): s3ac.memory_plan for this device,
    then log pi_old, the critic's values, and the first actor and critic updates on a paper-shaped batch (--rows rows,
    mini-batches of 32), each phase's measured peak GPU memory beside the plan's estimate for the largest
    micro-batch it ran, perf/padding of each pass, and seconds. JSON lines; returns 0."""
    parser = argparse.ArgumentParser(prog=".ci/gpu_check.py memory-check")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rows", type=int, default=64, help="rows of the batch (--tiny: 16)")
    opts = parser.parse_args(argv)
    opts.rows = 16 if opts.tiny and "--rows" not in argv else opts.rows
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    sys.path.insert(0, HERE)
    import s3ac
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = "tiny" if opts.tiny else "1.5b"
    config = Qwen2Config(**MODEL_SIZES[size], tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    config.architectures = ["Qwen2ForCausalLM"]
    flags = dict(max_new_tokens=24, max_prompt_tokens=8, micro_batch_tokens=64) if opts.tiny else {}
    args = s3ac.resolve_args(s3ac.Args(model="random", rollout="hf", minibatches=max(1, opts.rows // 32), **flags))
    gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 24.0
    plan = s3ac.memory_plan(config, args, gib, cuda=device.type == "cuda")
    args = dataclasses.replace(args, micro_batch_tokens=plan["micro_batch_tokens"] if not opts.tiny else 64,
                               gradient_checkpointing=str(plan["gradient_checkpointing"]).lower())
    print(json.dumps({"check": "memory_plan", **plan}), flush=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).float()
        backbone = Qwen2ForCausalLM(config).float().model
    if args.gradient_checkpointing == "true":
        model.gradient_checkpointing_enable()
        backbone.gradient_checkpointing_enable()
    policy, critic = s3ac.Policy(model), s3ac.Critic(backbone, args.critic_seed).to(device)
    actor_opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=args.lr * args.critic_lr_ratio, weight_decay=0.0)
    from bench import paper_shaped_lengths  # .ci/bench.py, beside this file
    p_len, t_len = paper_shaped_lengths(opts.rows, min(900, args.max_prompt_tokens), args.max_new_tokens)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, config.vocab_size - 1, (p,), generator=g).tolist() for p in p_len]
    responses = [torch.randint(1, config.vocab_size - 1, (t,), generator=g).tolist() for t in t_len]
    batch = s3ac.Batch(*s3ac._pad_prompts(prompts, 0), s3ac._pad(responses, 0, left=False),
                       s3ac._pad([[1.0] * t for t in t_len], 0.0, left=False, dtype=torch.float32),
                       torch.tensor([t == args.max_new_tokens for t in t_len]), torch.arange(opts.rows))
    mask = batch.response_mask.to(device)
    rewards = torch.where(torch.rand(opts.rows, generator=g) < 0.5, 1.0, -1.0).to(device)
    amp = s3ac.compute_dtype(args.dtype, device)
    micro = s3ac.micro_batches(batch, args.micro_batch_tokens)
    largest = max(len(mb) * int(batch.prompt_mask[mb].sum(1).max() + batch.response_mask[mb].sum(1).max())
                  for mb in micro)
    estimate = s3ac.memory_plan(config, dataclasses.replace(args, micro_batch_tokens=largest), gib,
                                cuda=device.type == "cuda")["phases_gib"]

    def phase(name, fn, plan_phase=None):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        t = s3ac.synced_time(device)
        out = fn()
        row = {"check": "memory_phase", "phase": name, "seconds": s3ac.synced_time(device) - t,
               "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               "plan_gib": estimate.get(plan_phase), "largest_micro_batch_slots": largest}
        if row["peak_gib"] is not None and row["plan_gib"]:
            row["measured_over_plan"] = row["peak_gib"] / row["plan_gib"]
        if isinstance(out, dict):
            row.update({k: v for k, v in out.items() if k.endswith(("pad_slots", "slots"))})
        print(json.dumps(row), flush=True)
        return out

    with s3ac.autocast(device, amp):
        old = phase("old_logprobs", lambda: s3ac.policy_logprobs(policy, batch, args.temperature,
                                                                 args.micro_batch_tokens))
        values, _ = phase("values", lambda: s3ac.value_pass(critic, batch, args.critic_loss, args.micro_batch_tokens))
    advantages, returns, _ = s3ac.decoupled_gae(rewards, values, mask, args.gamma, args.critic_lam,
                                                s3ac.adaptive_lambda(mask, args.alpha))
    policy.train()
    m_actor = phase("actor_update", lambda: s3ac.update_actor(policy, actor_opt, batch, advantages, old, args,
                                                               torch.Generator().manual_seed(0)), "actor_update")
    critic.train()
    m_critic = phase("critic_update", lambda: s3ac.update_critic(critic, critic_opt, batch, values, returns, mask, args,
                                                                  torch.Generator().manual_seed(0)), "critic_update")
    pad, slots = s3ac.padding_counts(batch, micro)
    pad, slots = 2 * pad + m_actor["actor/pad_slots"] + m_critic["critic/pad_slots"], 2 * slots + m_actor[
        "actor/slots"] + m_critic["critic/slots"]
    whole = batch.prompt_mask.shape[1] + batch.response_mask.shape[1]
    real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    print(json.dumps({"check": "padding", "perf/padding": pad / slots, "rows": opts.rows,
                      "full_width_padding": 1 - real / (opts.rows * whole), "micro_batches": len(micro),
                      "micro_batch_tokens": args.micro_batch_tokens, "target": "<= 0.10"}), flush=True)
    return 0


# Dense bf16 tensor-core peak of a GPU in TFLOP/s (vendor spec sheets, without sparsity), matched by a substring of
# torch.cuda.get_device_name, first match first
BF16_DENSE_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H200", 989.0), ("H100", 989.0))


def bf16_dense_peak_tflops(device_name: str):
    """BF16_DENSE_PEAK_TFLOPS of the named GPU; None for any other device (its share of peak is then null)."""
    return next((peak for key, peak in BF16_DENSE_PEAK_TFLOPS if key in device_name), None)


# ---------------------------------------------------------------------------------------------------------------
# Part 4: real training steps of s3ac.py on a small random model, then --resume
# ---------------------------------------------------------------------------------------------------------------
# Numbers s3ac.py logs as NaN (null in metrics.jsonl) by definition when every reward of the step is equal
# (Var[R] = 0, or no right or no wrong answer); a random model is almost never right, so they are NaN on most steps.
UNDEFINED_WHEN_REWARDS_EQUAL = ("critic/explained_var", "critic/adv_explained_var", "critic/value_sep",
                                "critic/efficiency", "pretrain/explained_var",  # the last two: critic warm-up's fit,
                                "pretrain/explained_var_before")  # after its updates and before any


def make_random_model(path: str, hidden: int, layers: int, heads: int, seed: int = 0):
    """A Qwen2 causal LM with random weights and a character-level tokenizer with a chat template, saved to
    path (nothing downloaded). Token ids: 0 <unk>, 1 <|im_start|>, 2 <|im_end|> (= eos = pad), then the
    printable ASCII characters and newline."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def check_records(records: list, steps: int, daps_start: int, rollouts_per_step: int) -> dict:
    """What part 4 checks in a metrics.jsonl: steps 0..steps logged once each, every number finite (NaN allowed
    only for UNDEFINED_WHEN_REWARDS_EQUAL on a step whose rewards were all equal), PACT's rho and DAPS's accept
    rate logged, not every response a verifier error. Returns the findings; "problems" lists what failed."""
    import math
    problems, nan_allowed = [], 0
    logged = [r["step"] for r in records if not {"pretrain/epoch", "pretrain/warmup_step", "perf/warmup_s"} & set(r)]
    if logged != list(range(steps + 1)):
        problems.append(f"steps logged {logged}, expected 0..{steps}")
    for r in records:
        equal = r.get("rollout/acc") in (0.0, 1.0)
        for key, value in r.items():  # s3ac.py writes NaN and inf as null
            if isinstance(value, (int, float)) and math.isfinite(value) or isinstance(value, (str, list, dict)):
                continue
            if value is None and equal and key in UNDEFINED_WHEN_REWARDS_EQUAL:
                nan_allowed += 1
            else:
                problems.append(f"step {r['step']}: {key} = {value}")
    trained = [r for r in records if r["step"] > 0]
    missing = [f"step {r['step']}: {k}" for r in trained for k in ("critic/rho_mean", "critic/v_loss",
                                                                       "actor/pg_loss", "actor/grad_norm")
               if k not in r]
    missing += [f"step {r['step']}: prompts/accept_rate" for r in trained
                if r["step"] > daps_start and "prompts/accept_rate" not in r]
    problems += [f"missing {m}" for m in missing]
    errors = sum(r.get("verify/error", 0) + r.get("verify/timeout", 0) for r in trained)
    if trained and errors >= rollouts_per_step * len(trained):
        problems.append(f"every check of the verifier failed ({errors}): is math-verify importable?")
    return {"steps_logged": logged, "nan_where_undefined": nan_allowed,
            "mixed_reward_steps": sum(1 for r in trained if 0 < r.get("rollout/acc", 0) < 1),
            "verify_errors": errors, "accept_rate": [r.get("prompts/accept_rate") for r in trained],
            "step_s": [round(r["perf/step_s"], 2) for r in trained if "perf/step_s" in r], "problems": problems}


def train_check(argv) -> int:
    """Part 4 (python .ci/gpu_check.py train-check [--tiny] [--out DIR]): a small random model trained for a few
    steps by s3ac.py with --critic-sync pact --critic-loss bce --prompt-selection daps, a checkpoint, then
    --resume for two more steps, on CUDA when there is a GPU (--tiny: a tiny model and batch, for the CPU); once
    with the full critic and once with the partial-trunk critic (--critic-layers 2, tiny 1), whose HF rollouts
    record its features. Prints one JSON line {"check": "train", "critic_layers", "ok", ...} per critic; returns 0
    when every check of both passed."""
    import importlib.util
    import math
    import shutil
    import tempfile
    import torch
    parser = argparse.ArgumentParser(prog=".ci/gpu_check.py train-check")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=default_out_dir())
    opts = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still removes the temp folder
    device = "cuda" if torch.cuda.is_available() else "cpu"
    row = {"check": "train", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    if importlib.util.find_spec("math_verify") is None:  # the verifier would score every answer as an error
        print(json.dumps({**row, "ok": False, "error": "math_verify is not importable (see .ci/README.md: .whl/)"}))
        return 1
    first, last, daps_start = 3, 5, 1  # steps 1-3, a checkpoint, then --resume for steps 4-5; DAPS from step 2
    shape = dict(hidden=32, layers=2, heads=4) if opts.tiny else dict(hidden=256, layers=4, heads=4)
    prompts, k = (4, 2) if opts.tiny else (16, 2)
    size = ["--batch-prompts", str(prompts), "--k", str(k)] + (
        ["--max-new-tokens", "8", "--micro-batch-tokens", "96", "--eval-size", "4", "--threads", "1"] if opts.tiny else
        ["--max-new-tokens", "64", "--micro-batch-tokens", "1024", "--eval-size", "8"])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if opts.tiny:
        env["OMP_NUM_THREADS"] = "1"
    work = tempfile.mkdtemp(prefix="s3ac-train-check-")
    failed = 0
    try:
        model = os.path.join(work, "model")
        make_random_model(model, **shape)
        for layers, metrics_file in ((0, "train_metrics.jsonl"), (shape["layers"] // 2, "train_metrics_partial.jsonl")):
            out = os.path.join(work, f"run-k{layers}")
            flags = ["--model", model, "--out-dir", out, "--device", device, "--rollout", "hf",
                     "--data", "builtin:arithmetic:200", "--eval-data", "heldout", "--eval-every", "0", "--lr", "1e-4",
                     "--save-every", str(first), "--critic-layers", str(layers),
                     "--critic-sync", "pact", "--critic-loss", "bce", "--prompt-selection", "daps",
                     "--daps-start", str(daps_start), *size]
            result = dict(row, critic_layers=layers)
            t0 = time.time()
            runs = []
            for extra in (["--steps", str(first)], ["--steps", str(last), "--resume"]):
                cmd = [sys.executable, os.path.join(HERE, "s3ac.py"), *flags, *extra]
                print("$ " + shlex.join(cmd), flush=True)
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
                print(proc.stdout[-4000:] + proc.stderr[-8000:], flush=True)
                runs.append(proc)
                if proc.returncode != 0:
                    result.update(ok=False, error=f"s3ac.py {shlex.join(extra)} exited with {proc.returncode}")
                    break
            if result.get("error"):
                print(json.dumps(result), flush=True)
                failed += 1
                continue
            result["seconds"] = round(time.time() - t0, 1)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f]
            shutil.copy(os.path.join(out, "metrics.jsonl"), os.path.join(opts.out, metrics_file))
            found = check_records(records, last, daps_start, rollouts_per_step=prompts * k)
            if f"at step {first}" not in runs[1].stderr:
                found["problems"].append(f"the second run did not resume at step {first}")
            from safetensors.torch import load_file
            ckpt = os.path.join(out, "checkpoints", f"step_{last}")
            bad = [f"{part}:{name}" for part in ("actor/model.safetensors", "critic/model.safetensors",
                                                 "critic/value_head.safetensors")
                   for name, t in load_file(os.path.join(ckpt, part)).items() if not torch.isfinite(t).all()]
            found["problems"] += [f"non-finite weights in step_{last}: {b}" for b in bad[:10]]
            result.update({"model": f"qwen2 hidden {shape['hidden']} x {shape['layers']} layers, random weights",
                           "flags": f"--critic-layers {layers} --critic-sync pact --critic-loss bce --prompt-selection "
                                    f"daps --daps-start {daps_start}; --steps {first}, then --resume --steps {last}",
                           **found, "ok": not found["problems"] and all(math.isfinite(s) for s in found["step_s"])})
            print(json.dumps(result), flush=True)
            failed += not result["ok"]
        return 1 if failed else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
