"""Does the impact score predict what RL gains? python .ci/readiness.py (or ./run.sh readiness).

    ./run.sh readiness                          # the CPU demo's model and settings, its checkpoints, four strata
    python .ci/readiness.py --tiny              # two random tiny models x two strata: CI, well under a minute
    python .ci/readiness.py --help              # its own flags; the others go to every s3ac.py run
    python .ci/readiness.py table --model A,B --data builtin:arithmetic   # the step-0 table alone (table --help)

Points: every checkpoint (--checkpoints) x every stratum (--strata: filters of --data's strata such as
op=+:digits=2x2). For each point, three figures:
    readiness  `readiness.py table` of the checkpoint on --readiness-prompts training problems of the stratum (one run
               for every checkpoint and stratum): impact, H (headroom), S (usable signal), pass@1 sampled;
    before     greedy pass@1 on --eval-size held-out problems of the stratum (the RL run's evaluation at step 0);
    after      the same after a short critic-free RL run from the checkpoint on the stratum's training problems
               (`s3ac.py --algo grpo --k 4`, the same --steps, --batch-prompts and flags for every point; the paper's
               theory is about critic-free updates): gain = after - before.
Then Spearman's rho, each with a percentile bootstrap 95% interval over points (--bootstrap resamples), beside the
value-gradient paper's figures: impact, H alone and S alone against the gain (paper: impact 0.60); pass@1 before
against after (current ability alone, for reference); and rank(pass@1 before) + rank(impact) against after (the
paper's combined predictor, 0.73; a sum of ranks since pass@1 and impact have different scales).

Held-out problems: a seeded sample of the stratum's problems whose questions are not in --exclude-data (the data the
checkpoints were trained on: the CPU demo's task), so that a later checkpoint has not seen them. Outputs
in --out-dir: data/ (every stratum's train and held-out problems, readiness.jsonl), readiness/ and c<i>-s<j>/ (one
per run, skipped when its `done` holds the same flags), points.jsonl, table.md, result.json.
"""

import argparse
import dataclasses
import glob
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, HERE)  # s3ac.py

from s3ac import (DATA_SEED, Args, Batch, Policy, Verifier, _write_atomic, actor_logprobs,  # noqa: E402
                  apply_memory_plan, autocast, call_reward, compute_dtype, costate_norms, decode_responses, distinct,
                  generate_hf, grpo_advantages, headroom, impact_score, init_distributed, load_models, load_problems,
                  make_rewards, micro_batches, parse_args, pass_at_k, prepare_prompts, resolve_model, succeeded,
                  usable_signal)

PAPER = {"impact": 0.60, "combined": 0.73}  # the value-gradient paper's Spearman figures (OLMo-2 1B checkpoints)
DEMO_TASK = "builtin:arithmetic:op=+*:digits=1x1,1x2,2x1"  # the CPU demo's --data (run.sh)
DEMO_STRATA = "op=+:digits=1x2,op=+:digits=2x1,op=*:digits=1x2,op=*:digits=2x1"  # its strata with room to hold out


# -----------------------------------------------------------------------------------------------------------------
# Statistics: small pure functions (test_s3ac.py checks each against hand-worked cases)
# -----------------------------------------------------------------------------------------------------------------
def average_ranks(values: list) -> list:
    """Ranks 1..n of values, ties given the mean of the ranks they span ([10, 20, 20, 30] -> [1, 2.5, 2.5, 4])."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks, start = [0.0] * len(values), 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start: end + 1]:
            ranks[i] = (start + end) / 2 + 1  # the mean of ranks start + 1 .. end + 1
        start = end + 1
    return ranks


def spearman(x: list, y: list) -> float:
    """Spearman's rho: Pearson's correlation of the average ranks of x and y (ties allowed); nan for fewer than two
    points or a constant x or y."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} x values against {len(y)} y values")
    if len(x) < 2:
        return math.nan
    rx, ry = average_ranks(x), average_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def quantile(values: list, q: float) -> float:
    """The q-quantile of values by linear interpolation between order statistics (numpy's default); nan for none."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def bootstrap_ci(points: list, statistic, resamples: int = 1000, seed: int = 0, level: float = 0.95):
    """Percentile bootstrap interval of statistic(points) over `resamples` resamples of the points with replacement
    (seeded): (low, high, kept), resamples whose statistic is nan (e.g. a constant column) left out and counted out
    of kept."""
    rng = random.Random(seed)
    stats = [statistic(rng.choices(points, k=len(points))) for _ in range(resamples)]
    stats = [s for s in stats if not math.isnan(s)]
    return quantile(stats, (1 - level) / 2), quantile(stats, (1 + level) / 2), len(stats)


def combined_predictor(points: list) -> list:
    """rank(pass@1 before) + rank(impact) of each point: the paper's current-ability-plus-impact predictor, as a sum
    of ranks (the two figures have different scales)."""
    return [a + b for a, b in zip(average_ranks([p["before"] for p in points]),
                                  average_ranks([p["impact"] for p in points]))]


CORRELATIONS = [  # (name, predictor of a point list, target of a point list, the paper's figure)
    ("impact vs gain", lambda ps: [p["impact"] for p in ps], lambda ps: [p["gain"] for p in ps], PAPER["impact"]),
    ("H vs gain", lambda ps: [p["headroom"] for p in ps], lambda ps: [p["gain"] for p in ps], None),
    ("S vs gain", lambda ps: [p["S"] for p in ps], lambda ps: [p["gain"] for p in ps], None),
    ("pass@1 before vs after", lambda ps: [p["before"] for p in ps], lambda ps: [p["after"] for p in ps], None),
    ("rank(pass@1 before) + rank(impact) vs after", combined_predictor, lambda ps: [p["after"] for p in ps],
     PAPER["combined"])]


def correlations(points: list, resamples: int, seed: int) -> list:
    """Each CORRELATIONS row: {"name", "rho", "low", "high", "kept" (bootstrap resamples with a defined rho),
    "paper"}."""
    out = []
    for name, x, y, paper in CORRELATIONS:
        rho_of = lambda ps: spearman(x(ps), y(ps))  # noqa: E731
        low, high, kept = bootstrap_ci(points, rho_of, resamples, seed)
        out.append({"name": name, "rho": rho_of(points), "low": low, "high": high, "kept": kept, "paper": paper})
    return out


def tables(points: list, rows: list) -> str:
    """The points and the correlations, two markdown tables."""
    f = lambda v: "nan" if v is None or math.isnan(v) else f"{v:.3g}"  # noqa: E731
    out = ["| checkpoint | stratum | pass@1 before | after | gain | impact | H | S | pass@1 sampled |",
           "|---" * 9 + "|"]
    out += [f"| {p['checkpoint']} | {p['stratum']} | {f(p['before'])} | {f(p['after'])} | {f(p['gain'])} | "
            f"{f(p['impact'])} | {f(p['headroom'])} | {f(p['S'])} | {f(p['pass@1 sampled'])} |" for p in points]
    out += ["", f"| Spearman ({len(points)} points) | rho | bootstrap 95% interval | paper |", "|---|---|---|---|"]
    out += [f"| {r['name']} | {f(r['rho'])} | [{f(r['low'])}, {f(r['high'])}] ({r['kept']} resamples) | "
            f"{'-' if r['paper'] is None else r['paper']} |" for r in rows]
    return "\n".join(out)


# -----------------------------------------------------------------------------------------------------------------
# The step-0 table (python .ci/readiness.py table): readiness per checkpoint and stratum, nothing trained
# -----------------------------------------------------------------------------------------------------------------
def strata_groups(problems: list, spec: str) -> dict:
    """{stratum: problem indices}: "all", then for spec "auto" each Problem.strata field alone and all together
    (op=+, ..., digits=1x2, ..., op=+:digits=1x2, ...), for spec "f1,f2" those together. ValueError: unknown field."""
    seen = list(dict.fromkeys(f for p in problems for f in p.strata))  # the data's fields, first seen first
    fields = seen if spec == "auto" else spec.split(",")
    if set(fields) - set(seen):
        raise ValueError(f"--strata {spec}: no problem has {sorted(set(fields) - set(seen))} (fields: {seen})")
    groups = {"all": list(range(len(problems)))}
    alone = [[f] for f in fields] if spec == "auto" else []  # each field alone, then all together (once)
    for chosen in alone + ([fields] if len(fields) > 1 or spec != "auto" else []):
        names = [":".join(f"{f}={p.strata[f]}" for f in chosen) if set(chosen) <= set(p.strata) else None
                 for p in problems]
        groups.update({name: [i for i, x in enumerate(names) if x == name] for name in sorted(set(names) - {None})})
    return groups


def block_costates(policy: Policy, batch: Batch, advantages, block: int, temperature: float, micro_batch_tokens: int):
    """costate_norms [B, T] at the OUTPUT of block `block` (the input of block + 1, hooked in the actor's own
    forward), one forward and backward per micro-batch of the rows whose advantages [B, T] are not all 0; the others
    have costates 0 (L does not depend on them) and run nothing. No parameter gradient is kept."""
    norms = torch.zeros(advantages.shape, device=advantages.device)  # [B, T]
    moving = [i for i, m in enumerate(advantages.ne(0).any(1).tolist()) if m]  # rows with a gradient
    outputs = []
    handle = policy.lm.base_model.layers[block].register_forward_hook(
        lambda module, inputs, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    try:
        for rows in micro_batches(batch, micro_batch_tokens, moving) if moving else []:
            with torch.enable_grad():
                mbatch = batch.rows(rows)
                logprobs, _ = actor_logprobs(policy, mbatch, temperature)  # [b, t]
                t = logprobs.shape[1]
                norms[rows, :t] = costate_norms(outputs[-1], logprobs, advantages[rows, :t],
                                                mbatch.response_mask.to(logprobs.device))[0]  # [b, t]
            outputs.clear()
    finally:
        handle.remove()
    return norms  # [B, T]


def checkpoint_readiness(args: Args, name: str, problems: list, opts, reward_fn, device) -> list:
    """readiness's JSON lines of checkpoint `name`, one per stratum: per problem, of opts.k samples at --temperature,
    pass@1, pass@k, mixed, H (headroom), the token mean of the entropy, and for the first opts.costate_prompts problems
    the costate norm (block_costates, GRPO's advantages) and S (usable_signal); greedy pass@1; per stratum the mean
    and population std over its problems (costate and S: over those measured), and impact_score."""
    from transformers import AutoTokenizer
    path = resolve_model(name, args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems, prompts, _ = prepare_prompts(args, tokenizer, problems, [], True)
    args = apply_memory_plan(dataclasses.replace(args, algo="grpo", rollout="hf"), path, device, 1)
    policy, _, _, eos_ids, pad_id = load_models(args, path, path, None, tokenizer, device, 0, 1)
    L, n, k, amp = policy.lm.config.num_hidden_layers, len(problems), opts.k, compute_dtype(args.dtype, device)
    block = L // 2 if opts.block == "auto" else int(opts.block)  # auto: the middle (why: s3ac.py's departure 13)
    if not 0 <= block < L:
        raise ValueError(f"--block {opts.block}: {name} has blocks 0 to {L - 1}")
    print(f"{name}: {n} problems x {k} samples, costates at the output of block {block} of {L}", file=sys.stderr)
    torch.manual_seed(args.seed)
    policy.eval()

    def answers(greedy: bool):  # (Batch, rewards [B]) of k samples per problem, or of one greedy answer
        index = [i for i in range(n) for _ in range(1 if greedy else k)]
        with autocast(device, amp):
            batch = generate_hf(policy.lm, [prompts[i] for i in index], index, eos_ids, pad_id, args.max_new_tokens,
                                args.temperature, args.gen_batch_size, greedy, args.top_p, args.top_k)
        texts = decode_responses(tokenizer, batch.response_ids, eos_ids | {pad_id})
        return batch, call_reward(reward_fn, [problems[i].answer for i in index], texts, batch.truncated.tolist())[0]

    t0 = time.time()
    batch, rewards = answers(greedy=False)
    t1 = time.time()
    mask, index = batch.response_mask, batch.prompt_index  # [B, T], [B]
    advantages, _ = grpo_advantages(rewards, index, mask)  # [B, T] population std, 0 for equal rewards
    measured = index < opts.costate_prompts  # [B] the samples of the first --costate-prompts problems
    with autocast(device, amp):
        norms = block_costates(policy, batch, (advantages * measured[:, None]).to(device), block, args.temperature,
                               args.micro_batch_tokens)  # [B, T]
    t2 = time.time()
    per_problem = lambda x: torch.zeros(n, dtype=torch.float64).index_add(0, index, x.double().cpu())  # [n] sums
    tokens, right = per_problem(mask.sum(1)), per_problem(succeeded(rewards))  # [n] each
    # the mean token entropy, estimated by -log mu of the sampled tokens (E_a~pi[-log pi(a|s)] = H(pi(.|s)))
    ent = per_problem(-(batch.sampler_logprobs * mask).sum(1)) / tokens  # [n] nats
    costate = torch.where(torch.arange(n) < opts.costate_prompts, per_problem(norms.sum(1)) / tokens, math.nan)  # [n]
    h, signal = headroom(rewards, index, opts.alpha_headroom)[0], usable_signal(costate, ent)  # [n] each
    measures = {**({"greedy pass@1": succeeded(answers(greedy=True)[1]).double()} if opts.greedy else {}),
                "pass@1": right / k, f"pass@{k}": right.clone().apply_(lambda c: pass_at_k(k, int(c), k)),
                "mixed": ((right > 0) & (right < k)).double(), "headroom": h, "entropy": ent, "costate": costate,
                "S": signal}  # [n] each
    print(f"{name}: sampling {t1 - t0:.0f} s, costates {t2 - t1:.0f} s, greedy {time.time() - t2:.0f} s",
          file=sys.stderr)
    finite = lambda v: v[v.isfinite()]  # costate and S: only the --costate-prompts problems have them
    return [{"model": name, "stratum": stratum, "n": len(rows), "k": k, "alpha": opts.alpha_headroom, "block": block,
             **{key: {"mean": finite(v[rows]).mean().item(), "std": finite(v[rows]).std(correction=0).item()}
                for key, v in measures.items()}, "impact": impact_score(finite(signal[rows]), h[rows])}
            for stratum, rows in strata_groups(problems, opts.strata).items()]


def readiness_table(lines: list) -> str:
    """readiness's JSON lines as one markdown table: a row per checkpoint and stratum, each per-problem measure as
    its mean ± std over the problems (pass@1's std: the spread of the problems' success rates)."""
    keys = [key for key, value in lines[0].items() if isinstance(value, dict)]
    out = [f"| model | stratum | n | {' | '.join(keys)} | impact |", "|---" * (len(keys) + 4) + "|"]
    for r in lines:  # the model as its last two path parts
        cells = [f"{r[key]['mean']:.3g} ± {r[key]['std']:.2g}" for key in keys] + [f"{r['impact']:.3g}"]
        out.append(f"| {'/'.join(os.path.normpath(r['model']).split(os.sep)[-2:])} | {r['stratum']} | {r['n']} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def readiness(argv=None):
    """python .ci/readiness.py table --model A[,B ...] [flags]: the task table at step 0 and the value-gradient
    readiness of every checkpoint on every stratum of --data (checkpoint_readiness; our readings: s3ac.py's
    departure 13): one markdown table, JSON lines in --out. Trains nothing; rollouts, rewards and log-probs are
    training's."""
    parser = argparse.ArgumentParser(prog=".ci/readiness.py table",
                                     description="Will RL help these checkpoints, and where?",
                                     epilog="Other flags (python s3ac.py --help) set the model, data and rollouts.")
    for flag, default, text in (
            ("--prompts", 256, "problems, a seeded sample of --data"), ("--k", 16, "samples per problem (>= 2)"),
            ("--block", "auto", "the block m whose output's costates are measured; auto = L // 2, the middle"),
            ("--costate-prompts", 32, "the problems (the first of the sample) whose costates are measured: a "
             "backward pass per mixed group"),
            ("--alpha-headroom", 1.0, "alpha of the headroom H_alpha: the K samples reweighted by exp(alpha R)"),
            ("--strata", "auto", "auto: each field alone and all together | f1,f2: those together (and all)"),
            ("--out", "readiness.jsonl", "JSON lines, one per checkpoint and stratum")):
        parser.add_argument(flag, type=type(default), default=default, help=text)
    parser.add_argument("--no-greedy", dest="greedy", action="store_false", help="no greedy pass@1 (one answer each)")
    opts, rest = parser.parse_known_args(argv)
    if opts.k < 2 or opts.prompts < 1:
        parser.error(f"--k {opts.k} --prompts {opts.prompts}: need K >= 2 samples and at least one problem")
    args = parse_args(rest)
    reward_fn, _, owned = make_rewards(args)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    try:
        problems = distinct(load_problems(args.data, args.prompt_key, args.answer_key, args.split, DATA_SEED,
                                          math_golds=isinstance(reward_fn, Verifier)))
        problems = random.Random(args.seed).sample(problems, min(opts.prompts, len(problems)))
        device = init_distributed(args.device)[2]
        lines = [line for name in args.model.split(",")
                 for line in checkpoint_readiness(args, name, problems, opts, reward_fn, device)]
    except (ValueError, OSError, ImportError) as e:
        if args.debug:
            raise
        sys.exit(f".ci/readiness.py table: error: {' '.join(str(e).split()) or type(e).__name__}")
    finally:
        for fn in owned:
            fn.close()
    _write_atomic(opts.out, "".join(json.dumps(line) + "\n" for line in lines))
    print(readiness_table(lines))
    return lines


# -----------------------------------------------------------------------------------------------------------------
# The experiment: data, runs, points
# -----------------------------------------------------------------------------------------------------------------
def parse_stratum(spec: str) -> dict:
    """'op=+:digits=2x2' -> {"op": "+", "digits": "2x2"}. Raises ValueError for a part without '='."""
    pairs = [part.partition("=") for part in spec.split(":")]
    if not spec or any(not eq or not key or not value for key, eq, value in pairs):
        raise ValueError(f"--strata: {spec!r} is not field=value[:field=value ...]")
    return {key: value for key, _, value in pairs}


def split_strata(opts) -> list:
    """Per stratum spec: (spec, train problems, held-out problems), written to <out-dir>/data/. Held out: a seeded
    sample of at most --eval-size of the stratum's problems whose questions are not in --exclude-data; the rest
    train. Raises ValueError for a stratum with fewer than 4 problems to hold out or none left to train on."""
    problems = distinct(load_problems(opts.data, seed=opts.seed))
    excluded = load_problems(opts.exclude_data) if opts.exclude_data else []  # builtin data: one set for every seed
    seen = {p.question for p in excluded}
    rng, out, readiness_rows = random.Random(opts.seed + 12345), [], []
    os.makedirs(os.path.join(opts.out_dir, "data"), exist_ok=True)
    for j, spec in enumerate(opts.strata.split(",")):
        want = parse_stratum(spec)
        mine = [p for p in problems if all(p.strata.get(k) == v for k, v in want.items())]
        fresh = [p for p in mine if p.question not in seen]
        held = rng.sample(fresh, min(opts.eval_size, len(fresh) // 2))
        train = [p for p in mine if p.question not in {h.question for h in held}]
        if len(held) < 4 or not train:
            raise ValueError(f"--strata {spec}: {len(mine)} problems, {len(fresh)} not in --exclude-data: too few")
        for part, rows in (("train", train), ("eval", held)):
            _write_atomic(os.path.join(opts.out_dir, "data", f"s{j}-{part}.jsonl"), "".join(
                json.dumps({"question": p.question, "answer": p.answer}) + "\n" for p in rows))
        readiness_rows += [{"question": p.question, "answer": p.answer, "strata": {"stratum": spec}}
                           for p in rng.sample(train, min(opts.readiness_prompts, len(train)))]
        out.append((spec, len(train), len(held)))
    _write_atomic(os.path.join(opts.out_dir, "data", "readiness.jsonl"),
                  "".join(json.dumps(r) + "\n" for r in readiness_rows))
    return out


def run_once(argv: list, out: str, resume: bool = True, script: str = "s3ac.py"):
    """python <script> argv (out: its directory), unless resume and out/done holds the same argv; then out/done.
    Raises SystemExit when out/done holds other flags (resume)."""
    done = os.path.join(out, "done")
    if resume and os.path.exists(done):
        with open(done) as f:
            if f.read().strip() == json.dumps(argv):
                return
        raise SystemExit(f"{out}: finished with other settings (see {done}); remove it or pick another --out-dir")
    os.makedirs(out, exist_ok=True)
    subprocess.run([sys.executable, os.path.join(HERE, script), *argv], check=True)
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)  # a 135M model's weights and optimizer
    _write_atomic(done, json.dumps(argv) + "\n")


def eval_pass_at_1(run_dir: str):
    """(pass@1 at step 0, pass@1 of the last evaluation) of a run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        evals = [r["eval/pass@1"] for r in map(json.loads, f) if r.get("eval/pass@1") is not None]
    return evals[0], evals[-1]


def tiny_setup(tmp: str) -> list:
    """--tiny: two random tiny Qwen2 models (.ci/gpu_check.py's make_random_model, seeds 0 and 1) and a stand-in
    reward (a random model is never right: +1 when the code points of the completion and the gold sum to an odd
    number), in tmp. Returns the flags that point every run at them."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # .ci/
    from gpu_check import make_random_model
    for seed in (0, 1):
        make_random_model(os.path.join(tmp, f"tiny{seed}"), hidden=32, layers=2, heads=4, seed=seed)
    with open(os.path.join(tmp, "parity.py"), "w") as f:
        f.write("def reward(golds, completions, truncated):\n"
                "    r = [1.0 if sum(map(ord, c + g)) % 2 else -1.0 for g, c in zip(golds, completions)]\n"
                "    return r, ['correct' if x > 0 else 'wrong' for x in r]\n")
    return ["--reward-fn", os.path.join(tmp, "parity.py") + ":reward", "--max-new-tokens", "8",
            "--micro-batch-tokens", "64", "--gen-batch-size", "16", "--lr", "1e-3", "--threads", "1"]


def main(argv=None):
    """Parse flags, split the strata, run readiness per checkpoint and one RL run per point, print and write the
    tables. Returns result.json's contents."""
    parser = argparse.ArgumentParser(prog=".ci/readiness.py", description=__doc__.split("\n")[0],
                                     epilog="Other flags (python s3ac.py --help) go to every s3ac.py run. The step-0 "
                                     "table alone: python .ci/readiness.py table --help.")
    parser.add_argument("--tiny", action="store_true", help="two random tiny models x two strata, a few steps (CI)")
    for flag, default, text in (
            ("--model", "", "the step-0 checkpoint (the CPU demo's model); --checkpoints auto starts with it"),
            ("--checkpoints", "auto", "comma-separated; auto = --model, then runs/cpu-demo/checkpoints/step_*/actor"),
            ("--strata", DEMO_STRATA, "comma-separated stratum filters of --data, field=value[:field=value]"),
            ("--data", "builtin:arithmetic:40000", "problems with strata (split into train and held out per stratum)"),
            ("--exclude-data", DEMO_TASK, "the checkpoints' training data: never held out ('' = none)"),
            ("--eval-size", 100, "held-out problems per stratum, at most (half of the stratum's, if fewer)"),
            ("--readiness-prompts", 64, "training problems per stratum that readiness samples"),
            ("--readiness-k", 8, "readiness: samples per problem"),
            ("--algo", "grpo", "the RL run's algorithm (critic-free: grpo, rloo, reinforce_pp)"),
            ("--k", 4, "the RL run's rollouts per prompt"), ("--batch-prompts", 8, "the RL run's prompts per step"),
            ("--steps", 8, "the RL run's steps (the same budget for every point)"),
            ("--seed", 0, "seed of the splits, samples and runs"),
            ("--bootstrap", 1000, "bootstrap resamples of the points"),
            ("--out-dir", os.path.join(HERE, "runs", "readiness"), "data, runs, points.jsonl, table.md, result.json")):
        parser.add_argument(flag, type=type(default), default=default, help=text)
    opts, rest = parser.parse_known_args(argv)
    tmp = tempfile.TemporaryDirectory() if opts.tiny else None
    if opts.tiny:
        rest = tiny_setup(tmp.name) + rest
        opts.checkpoints = ",".join(os.path.join(tmp.name, f"tiny{s}") for s in (0, 1))
        opts.strata, opts.data, opts.exclude_data = "op=+,op=-", "builtin:arithmetic:400", ""
        opts.eval_size, opts.readiness_prompts, opts.readiness_k = 4, 3, 2
        opts.k, opts.batch_prompts, opts.steps, opts.bootstrap = 2, 2, 1, 200
    if opts.checkpoints == "auto":
        demo = sorted(glob.glob(os.path.join(HERE, "runs", "cpu-demo", "checkpoints", "step_*", "actor")),
                      key=lambda d: int(re.findall(r"step_(\d+)", d)[-1]))
        opts.checkpoints = ",".join(([opts.model] if opts.model else []) + demo)
        print(f"--checkpoints auto: {opts.checkpoints}", file=sys.stderr)
    checkpoints = [c for c in opts.checkpoints.split(",") if c]
    if not checkpoints:
        parser.error("no checkpoint: give --model or --checkpoints")
    try:
        strata = split_strata(opts)
        for spec, n_train, n_held in strata:
            print(f"stratum {spec}: {n_train} training problems, {n_held} held out", file=sys.stderr)
        data = os.path.join(opts.out_dir, "data")
        out = os.path.join(opts.out_dir, "readiness")  # one run: every checkpoint on every stratum
        run_once(["table", *rest, "--model", ",".join(checkpoints), "--data", os.path.join(data, "readiness.jsonl"),
                  "--prompts", "1000000", "--k", str(opts.readiness_k), "--strata", "stratum", "--seed", str(opts.seed),
                  "--out", os.path.join(out, "readiness.jsonl")], out, resume=not opts.tiny,
                 script=os.path.join(".ci", "readiness.py"))
        with open(os.path.join(out, "readiness.jsonl")) as f:
            ready = {(r["model"], r["stratum"]): r for r in map(json.loads, f)}
        points = []
        for i, ckpt in enumerate(checkpoints):
            for j, (spec, _, n_held) in enumerate(strata):
                out = os.path.join(opts.out_dir, f"c{i}-s{j}")
                run_once([*rest, "--model", ckpt, "--data", os.path.join(data, f"s{j}-train.jsonl"), "--eval-data",
                          os.path.join(data, f"s{j}-eval.jsonl"), "--eval-size", str(n_held), "--algo", opts.algo,
                          "--k", str(opts.k), "--batch-prompts", str(opts.batch_prompts), "--steps", str(opts.steps),
                          "--eval-every", "0", "--save-every", "0", "--seed", str(opts.seed), "--out-dir", out], out,
                         resume=not opts.tiny)  # --tiny's models live in a new directory each time
                before, after = eval_pass_at_1(out)
                r = ready[ckpt, f"stratum={spec}"]
                points.append({"checkpoint": ckpt, "stratum": spec, "before": before, "after": after,
                               "gain": after - before, "impact": r["impact"], "headroom": r["headroom"]["mean"],
                               "S": r["S"]["mean"], "pass@1 sampled": r["pass@1"]["mean"]})
    finally:
        if tmp is not None:
            tmp.cleanup()
    rows = correlations(points, opts.bootstrap, opts.seed)
    text = tables(points, rows)
    print(text)
    _write_atomic(os.path.join(opts.out_dir, "points.jsonl"), "".join(json.dumps(p) + "\n" for p in points))
    _write_atomic(os.path.join(opts.out_dir, "table.md"), text + "\n")
    result = {"points": points, "correlations": rows, "opts": vars(opts), "flags": rest}
    clean = lambda v: None if isinstance(v, float) and math.isnan(v) else v  # noqa: E731  nan -> null
    _write_atomic(os.path.join(opts.out_dir, "result.json"), json.dumps(
        {**result, "correlations": [{k: clean(v) for k, v in r.items()} for r in rows]}, indent=1) + "\n")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["table"]:
        readiness(sys.argv[2:])
    else:
        main()
