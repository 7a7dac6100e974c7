"""Each S3AC piece against the effect its paper claims: python .ci/mechanisms.py (or ./run.sh mechanisms).

    ./run.sh mechanisms                                  # the CPU demo's model and settings, every experiment
    python .ci/mechanisms.py --tiny                      # a random tiny Llama, a few rollouts: CI, well under a minute
    python .ci/mechanisms.py --only init_clip,bce_mse    # some experiments; --seeds 5; --out runs/mech
    python .ci/mechanisms.py --help                      # its own flags; the others go to s3ac.parse_args

Experiments (EXPERIMENTS), each one JSON line {"experiment", "seeds", "wall_s", "rows": [{"claim", "paper", "ours",
"holds"}]}, all in <out>/results.jsonl, then one markdown table (printed and written to <out>/table.md):

    init_clip  S3AC: the fresh value head's share of the squared gradient norm over the first --updates critic
               updates; held-out value loss before and after them for head std 1/(H+1), PyTorch's nn.Linear default
               and 1/sqrt(H); the share of clipped updates at grad clip 1 and 10 (std 1/(H+1))
    coverage   S3AC: token EV and value loss over the first --online-steps online steps of s3ac.train after coverage
               pretraining (--coverage-temperatures), after on-policy warm-up of about the same wall time
               (--critic-warmup-steps auto) and with neither
    daps       S3AC: share of trajectories on prompts with p_ref in (0.2, 0.8] under uniform and DAPS selection
               (K = 1), and dropped groups per step with --dynamic-sampling (K = 4), on a replay of stored outcomes
    bce_mse    PACT: the BCE and the MSE critic from the same head init on the same rollouts and updates: BCE and MSE
               of their values against the outcome, and Delta+- (s3ac.value_separation), on held-out prompts
    pact       PACT: after one actor update, a critic copy fitted to s3ac.pact_targets and one to the raw returns;
               the EV of each against the returns of fresh rollouts of the updated actor

One saved set of rollouts of the initial policy (<out>/rollouts.jsonl: --rollout-prompts prompts, --rollouts-per-prompt
each; reused when it matches) feeds init_clip, daps, bce_mse and pact; coverage trains with s3ac.train. Seeds change
the head init, the batch order and the sampling, never the saved rollouts. Spread: standard error over seeds and
min-max. The magnitudes differ from the papers' (135M model, arithmetic): the direction is what is checked.
"""

import argparse
import dataclasses
import copy
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path[:0] = [HERE, os.path.join(HERE, ".ci")]  # s3ac.py, curves.py

import torch  # noqa: E402

import s3ac  # noqa: E402
from curves import read_records  # noqa: E402

EXPERIMENTS = ("init_clip", "bce_mse", "daps", "pact", "coverage")  # coverage, the longest, last
INITS = ("inv_h_plus_1", "torch_default", "inv_sqrt_h")  # value-head initialisations (init_value_head)


# -----------------------------------------------------------------------------------------------------------------
# Measurements: small pure functions (test_s3ac.py checks each against a hand-worked case)
# -----------------------------------------------------------------------------------------------------------------
def grad_norm_share(head_sq: list, backbone_sq: list) -> float:
    """The value head's share of the squared gradient norm over several updates: sum_u |g_head,u|^2 /
    sum_u (|g_head,u|^2 + |g_backbone,u|^2), each before clipping; nan when every gradient is zero."""
    total = sum(head_sq) + sum(backbone_sq)
    return sum(head_sq) / total if total > 0 else math.nan


def clipped_share(grad_norms: list, clip: float) -> float:
    """Share of updates whose global grad norm (before clipping) exceeds clip, as s3ac.optimize counts
    critic/clipped (grad_norm > grad_clip); nan for no updates."""
    return sum(g > clip for g in grad_norms) / len(grad_norms) if grad_norms else math.nan


def mid_share(prompt_index: list, p_ref: dict, low: float = 0.2, high: float = 0.8) -> float:
    """Share of trajectories (one prompt index each) whose prompt's reference success rate p_ref[i] lies in
    (low, high]; nan for no trajectories."""
    return sum(low < p_ref[i] <= high for i in prompt_index) / len(prompt_index) if prompt_index else math.nan


def outcome_losses(values, rewards, response_mask, eps: float = 1e-6) -> dict:
    """BCE and MSE of values [B, T] (+-1 scale) against each sequence's outcome rewards [B] (+-1), token means over
    response_mask [B, T], both on PACT's [0, 1] scale: p = (V + 1) / 2 clamped to [eps, 1 - eps], y = (R + 1) / 2."""
    p = ((values.double() + 1) / 2).clamp(eps, 1 - eps)  # [B, T]
    y = ((rewards.double() + 1) / 2)[:, None].expand_as(p)  # [B, T]
    m = response_mask.double()  # [B, T]
    n = m.sum().clamp(min=1)
    bce = -(y * p.log() + (1 - y) * (1 - p).log())  # [B, T]
    return {"bce": ((bce * m).sum() / n).item(), "mse": ((((p - y) ** 2) * m).sum() / n).item()}


def held_out_split(successes: list, n: int) -> set:
    """The n pool prompts whose rollouts only evaluate the critics, so that they hold both outcomes where the pool
    does: the last min(P // 2, n // 2) of the P prompts with a success (successes[i]: right answers among prompt i's
    saved rollouts; the rest stay in training), then the last prompts without one, then any others."""
    wins = [i for i, s in enumerate(successes) if s > 0]
    take = min(len(wins) // 2, n // 2)
    held = wins[len(wins) - take:]
    later = [i for i in reversed(range(len(successes))) if i not in held]
    return set(held + ([i for i in later if successes[i] == 0] + [i for i in later if successes[i] > 0])[: n - take])


def spread(values: list) -> dict:
    """{"mean", "se" (sample std / sqrt(n)), "min", "max", "n"} of the finite values (nan where undefined)."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"mean": math.nan, "se": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    se = statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else math.nan
    return {"mean": sum(v) / len(v), "se": se, "min": min(v), "max": max(v), "n": len(v)}


def fmt(s: dict) -> str:
    """'0.123 ± 0.004 [0.118, 0.130] (n 3)' of a spread."""
    if not s["n"]:
        return "nan"
    se = "" if math.isnan(s["se"]) else f" ± {s['se']:.3f}"
    return f"{s['mean']:.3f}{se} [{s['min']:.3f}, {s['max']:.3f}] (n {s['n']})"


# -----------------------------------------------------------------------------------------------------------------
# Shared set-up: model, prompts, one saved set of rollouts
# -----------------------------------------------------------------------------------------------------------------
def tiny_model(path: str) -> str:
    """A random tiny causal LM and a character tokenizer with a chat template, saved at path (no downloads): the
    GPU check's make_random_model, hidden 32, 2 layers."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # .ci/
    from gpu_check import make_random_model
    make_random_model(path, hidden=32, layers=2, heads=4)
    return path


def tiny_reward(golds: list, completions: list, truncated: list):
    """--tiny's stand-in reward (a random model is never right): +1 when the characters' code points sum to an odd
    number, else -1, so that every figure has both outcomes to work with."""
    rewards = [1.0 if sum(map(ord, c)) % 2 else -1.0 for c in completions]
    return rewards, ["correct" if r > 0 else "wrong" for r in rewards]


class Lab:
    """What every experiment shares: flags, tokenizer, prompts, the reward, the initial actor and critic, the saved
    rollouts, and the critics fitted by init_clip (reused by daps, bce_mse and pact)."""

    def __init__(self, opts, args, reward_fn):
        from transformers import AutoTokenizer
        self.opts, self.args, self.reward_fn = opts, args, reward_fn
        self.device = torch.device("cpu")
        self.path = s3ac.resolve_model(args.model, args.cache_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.actor = s3ac.load_actor(self.path, self.device)
        eos = self.actor.generation_config.eos_token_id
        self.eos_ids = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, (list, tuple)) else [eos]),
                        *s3ac.chat_stop_ids(self.tokenizer)} - {None}
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        train, _ = s3ac.split_problems(s3ac.load_problems(args.data, args.prompt_key, args.answer_key, args.split,
                                                          args.seed), args.eval_data, args)
        self.problems = random.Random(args.seed).sample(train, opts.rollout_prompts)  # the prompt pool
        self.prompts = [s3ac.build_prompt(self.tokenizer, p.question, args.prompt_template, args.instruction)
                        for p in self.problems]
        self.base_critic = s3ac.load_critic(self.path, self.device, args.critic_seed)
        self.rows = self.saved_rollouts()
        successes = [sum(s3ac.succeeded(r["reward"]) for r in self.rows if r["prompt_index"] == i)
                     for i in range(len(self.prompts))]
        held = held_out_split(successes, opts.held_out_prompts)
        self.train_rows = [r for r in self.rows if r["prompt_index"] not in held]
        self.held_batch, self.held_rewards = s3ac.rows_to_batch([r for r in self.rows if r["prompt_index"] in held],
                                                                self.pad_id)
        self.runs = {}  # (init, clip, critic_loss, seed) -> fit_run's result, with the fitted critic

    def saved_rollouts(self) -> list:
        """<out>/rollouts.jsonl: --rollouts-per-prompt responses of the initial actor to each pool prompt at
        --temperature, rows {prompt_index (in the pool), replica, prompt_ids, response_ids, reward}; generated once,
        reused while the model, prompts and sizes match."""
        path = os.path.join(self.opts.out, "rollouts.jsonl")
        key = {"model": self.args.model, "prompts": self.prompts, "k": self.opts.rollouts_per_prompt,
               "temperature": self.args.temperature, "max_new_tokens": self.args.max_new_tokens, "tiny": self.opts.tiny}
        if os.path.exists(path):
            with open(path) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            if lines and lines[0] == {"key": key}:
                return lines[1:]
        k, n = self.opts.rollouts_per_prompt, len(self.prompts)
        index = [i for i in range(n) for _ in range(k)]
        torch.manual_seed(self.args.seed)
        batch = s3ac.generate_hf(self.actor, [self.prompts[i] for i in index], index, self.eos_ids, self.pad_id,
                                 self.args.max_new_tokens, self.args.temperature, self.args.gen_batch_size)
        rewards = self.reward(batch, index)
        lengths = batch.response_mask.sum(1).long().tolist()
        rows = [{"prompt_index": i, "replica": j % k, "prompt_ids": self.prompts[i],
                 "response_ids": batch.response_ids[j, :lengths[j]].tolist(), "reward": rewards[j].item()}
                for j, i in enumerate(index)]
        s3ac._write_atomic(path, "".join(json.dumps(r) + "\n" for r in [{"key": key}] + rows))
        return rows

    def reward(self, batch, index: list):
        """Rewards [B] of a generated batch answering pool prompts `index`."""
        texts = s3ac.decode_responses(self.tokenizer, batch.response_ids, self.eos_ids | {self.pad_id})
        return s3ac.call_reward(self.reward_fn, [self.problems[i].answer for i in index], texts,
                                batch.truncated.tolist())[0]

    def batches(self, seed: int) -> list:
        """--updates batches of --update-size training rows each, in a seeded order (cycling if short)."""
        order = list(range(len(self.train_rows)))
        random.Random(seed).shuffle(order)
        size = self.opts.update_size
        order = (order * (1 + self.opts.updates * size // max(len(order), 1)))[: self.opts.updates * size]
        return [s3ac.rows_to_batch([self.train_rows[i] for i in order[s: s + size]], self.pad_id)
                for s in range(0, len(order), size)]


# -----------------------------------------------------------------------------------------------------------------
# Critic updates with per-parameter gradient norms
# -----------------------------------------------------------------------------------------------------------------
def init_value_head(critic, kind: str, seed: int):
    """Re-initialise critic.value_head.weight [1, H]: inv_h_plus_1 N(0, (1/(H+1))^2) (S3AC, s3ac.Critic's own),
    inv_sqrt_h N(0, 1/H), torch_default nn.Linear's kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(H), 1/sqrt(H))."""
    w = critic.value_head.weight
    H, g = w.shape[1], torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if kind == "inv_h_plus_1":
            w.normal_(0.0, 1.0 / (H + 1), generator=g)
        elif kind == "inv_sqrt_h":
            w.normal_(0.0, 1.0 / math.sqrt(H), generator=g)
        elif kind == "torch_default":
            w.uniform_(-1.0 / math.sqrt(H), 1.0 / math.sqrt(H), generator=g)
        else:
            raise ValueError(f"value-head init {kind!r}: expected one of {INITS}")
    return critic


def critic_step(critic, optimizer, batch, returns, response_mask, critic_loss: str, eps_v: float, clip: float,
                micro_batch_tokens: int) -> dict:
    """One critic optimizer step as s3ac.optimize takes it (micro-batches, token mean over the whole batch, global
    clip), reading the squared gradient norms of the value head and of the backbone before clipping. The clip anchor
    old_values is the values of this same forward (update_critic's anchor, before any step has moved the critic)."""
    critic.train()
    num_tokens = response_mask.sum().clamp(min=1)
    v_loss = 0.0
    for rows in s3ac.micro_batches(batch, micro_batch_tokens):
        raw = s3ac.critic_values(critic, batch.rows(rows))  # [b, t] V (mse) or z (bce)
        t = raw.shape[1]
        loss, _ = s3ac.critic_loss_fn(raw, raw.detach(), returns[rows, :t], response_mask[rows, :t], critic_loss, eps_v,
                                      num_tokens)
        loss.backward()
        v_loss += loss.item()
    head = set(id(p) for p in critic.value_head.parameters())
    sq = lambda ps: sum(float(p.grad.double().pow(2).sum()) for p in ps if p.grad is not None)
    head_sq = sq([p for p in critic.parameters() if id(p) in head])
    backbone_sq = sq([p for p in critic.parameters() if id(p) not in head])
    grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), clip).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"head_sq": head_sq, "backbone_sq": backbone_sq, "grad_norm": grad_norm, "v_loss": v_loss}


def held_out_fit(lab: Lab, critic, critic_loss: str) -> dict:
    """The critic on the held-out rollouts: its own loss (unclipped) and EV (s3ac.critic_fit), the outcome BCE and
    MSE (outcome_losses) and Delta+- (s3ac.value_separation)."""
    values, raw = s3ac.value_pass(critic, lab.held_batch, critic_loss, lab.args.micro_batch_tokens)  # [B, T]
    mask = lab.held_batch.response_mask
    fit = s3ac.critic_fit(values, raw, s3ac.mc_returns(lab.held_rewards, mask, lab.args.gamma), mask, critic_loss)
    return {"v_loss": fit["pretrain/v_loss"], "ev": fit["pretrain/explained_var"],
            **outcome_losses(values, lab.held_rewards, mask),
            "value_sep": s3ac.value_separation(values, lab.held_rewards, mask)}


def fit_run(lab: Lab, init: str, clip: float, critic_loss: str, seed: int) -> dict:
    """A fresh critic (head init `init`, seed) fitted by --updates critic_steps on the seed's batches of the saved
    rollouts; cached in lab.runs. Returns {"steps", "before", "after" (held_out_fit), "critic": the fitted critic
    for std 1/(H+1), the default clip and mse, else None}."""
    key = (init, clip, critic_loss, seed)
    if key not in lab.runs:
        args = lab.args
        critic = init_value_head(copy.deepcopy(lab.base_critic), init, seed)
        optimizer = torch.optim.AdamW(critic.parameters(), lr=args.lr * args.critic_lr_ratio, weight_decay=0.0)
        before = held_out_fit(lab, critic, critic_loss)
        steps = []
        for batch, rewards in lab.batches(seed):
            returns = s3ac.mc_returns(rewards, batch.response_mask, args.gamma)  # [B, T]
            steps.append(critic_step(critic, optimizer, batch, returns, batch.response_mask, critic_loss,
                                     args.eps_v, clip, args.micro_batch_tokens))
        kept = key[:3] == ("inv_h_plus_1", args.critic_grad_clip, "mse")  # daps and pact start from it
        lab.runs[key] = {"steps": steps, "before": before, "after": held_out_fit(lab, critic, critic_loss),
                         "critic": critic if kept else None}  # the others freed: 135M fp32 weights each
    return lab.runs[key]


def row(claim: str, paper: str, ours: dict, holds) -> dict:
    """One table row: ours {label: spread}, holds True / False / None (undecided: a figure is nan)."""
    return {"claim": claim, "paper": paper, "ours": ours, "holds": holds}


def greater(a: dict, b: dict):
    """Whether spread a's mean exceeds b's (None when either is nan)."""
    return None if math.isnan(a["mean"]) or math.isnan(b["mean"]) else a["mean"] > b["mean"]


# -----------------------------------------------------------------------------------------------------------------
# The experiments: each (lab, seeds) -> rows
# -----------------------------------------------------------------------------------------------------------------
def exp_init_clip(lab: Lab, seeds: list) -> list:
    """S3AC 35B: value head > 99% of the squared grad norm in the first 10 updates; std 1/(H+1) lowers the initial
    value loss (0.72 -> 0.45) and gives the lowest final one; clip 1 -> 10 cuts clipped updates 99.7% -> 12.5%."""
    clip = lab.args.critic_grad_clip
    share = {i: spread([grad_norm_share([s["head_sq"] for s in fit_run(lab, i, clip, "mse", seed)["steps"]],
                                        [s["backbone_sq"] for s in fit_run(lab, i, clip, "mse", seed)["steps"]])
                        for seed in seeds]) for i in INITS}
    first = {i: spread([fit_run(lab, i, clip, "mse", s)["before"]["v_loss"] for s in seeds]) for i in INITS}
    last = {i: spread([fit_run(lab, i, clip, "mse", s)["after"]["v_loss"] for s in seeds]) for i in INITS}
    clips = {c: spread([clipped_share([s["grad_norm"] for s in fit_run(lab, "inv_h_plus_1", c, "mse", seed)["steps"]],
                                      c) for seed in seeds]) for c in (1.0, clip)}
    n = lab.opts.updates
    lowest = lambda d: None if any(math.isnan(v["mean"]) for v in d.values()) else \
        min(d, key=lambda i: d[i]["mean"]) == "inv_h_plus_1"
    return [
        row(f"value head's share of the squared grad norm, first {n} critic updates (holds: > 0.5 for every init)",
            "> 99% (35B, fresh head)", {f"share, {i}": share[i] for i in INITS},
            None if any(math.isnan(share[i]["mean"]) for i in INITS) else all(share[i]["mean"] > 0.5 for i in INITS)),
        row("initial value loss (held out), by head init", "0.72 -> 0.45 with std 1/(H+1)",
            {f"initial, {i}": first[i] for i in INITS}, lowest(first)),
        row(f"final value loss (held out, after {n} updates), by head init", "lowest with std 1/(H+1)",
            {f"final, {i}": last[i] for i in INITS}, lowest(last)),
        row(f"share of clipped critic updates (first {n}, std 1/(H+1))", "99.7% at clip 1 -> 12.5% at clip 10",
            {f"clip {c:g}": clips[c] for c in clips}, greater(clips[1.0], clips[clip]))]


def exp_coverage(lab: Lab, seeds: list) -> list:
    """S3AC: a coverage-pretrained critic has higher EV and lower value loss early in online training than an
    on-policy warmed-up one (of about the same wall time) or none. Runs s3ac.train in this process."""
    opts = lab.opts
    results, warmup = {}, opts.critic_warmup_steps

    def run(name, seed, extra):
        out = os.path.join(opts.out, "coverage", f"{name}-seed{seed}")
        shutil.rmtree(out, ignore_errors=True)  # a rerun starts afresh (s3ac refuses a folder with another run in it)
        args = s3ac.parse_args(opts.s3ac_argv + ["--steps", str(opts.online_steps), "--seed", str(seed),
                                                 "--out-dir", out, "--model", lab.path, *extra])
        records = read_records(os.path.dirname(s3ac.train(args, lab.reward_fn, lab.reward_fn)))
        steps = [r for r in records if "perf/step_s" in r]
        pretrain_s = sum(r.get("time/pretrain", 0.0) for r in records if r.get("step") == 0)
        return steps, pretrain_s

    for seed in seeds:
        results["neither", seed] = run("neither", seed, ["--critic-warmup-steps", "0"])  # s3ac.py warms up by default
        results["coverage", seed] = run("coverage", seed, ["--coverage-temperatures", opts.coverage_temperatures])
        if warmup == "auto":  # warm-up steps of about coverage pretraining's wall time, decided on the first seed
            per_step = statistics.mean(sum(r.get(k, 0.0) for k in ("perf/generate_s", "perf/reward_s",
                                                                    "perf/values_s", "perf/critic_s"))
                                       for r in results["neither", seed][0])
            warmup = str(max(1, round(results["coverage", seed][1] / max(per_step, 1e-9))))
        results["warmup", seed] = run("warmup", seed, ["--critic-warmup-steps", warmup])
    metric = lambda name, key: spread([statistics.mean([r[key] for r in results[name, s][0]
                                                        if r.get(key) is not None and math.isfinite(r[key])] or
                                                       [math.nan]) for s in seeds])
    ev = {name: metric(name, "critic/explained_var") for name in ("coverage", "warmup", "neither")}
    loss = {name: metric(name, "critic/v_loss") for name in ("coverage", "warmup", "neither")}
    secs = {name: spread([results[name, s][1] for s in seeds]) for name in ("coverage", "warmup")}
    both = lambda a, b: None if a is None or b is None else a and b
    k = opts.online_steps
    return [
        row(f"token EV, mean of the first {k} online steps", "coverage > on-policy (no figure given)",
            {f"EV, {n}": ev[n] for n in ev}, both(greater(ev["coverage"], ev["warmup"]),
                                                  greater(ev["coverage"], ev["neither"]))),
        row(f"value loss, mean of the first {k} online steps", "coverage < on-policy (no figure given)",
            {f"v_loss, {n}": loss[n] for n in loss}, both(greater(loss["warmup"], loss["coverage"]),
                                                          greater(loss["neither"], loss["coverage"]))),
        row(f"pretraining wall time, s (warm-up: {warmup} steps)", "same budget",
            {f"seconds, {n}": secs[n] for n in secs}, None)]


def replay_selection(outcomes: list, p_c, steps: int, batch_prompts: int, k: int, selection: str, dynamic: bool,
                     args, seed: int) -> dict:
    """Prompt selection over `steps` steps as s3ac.train_step / sample_rollouts make it (decayed counts, uniform or
    s3ac.daps_select after args.daps_start steps, dynamic sampling's drops and refills), with each rollout's reward
    drawn from its prompt's stored outcomes (a frozen actor: a replay, no generation). outcomes[i]: the +-1 rewards
    stored for pool prompt i; p_c [n]: the critic's success probabilities. Returns {"trained": prompt index of every
    trained trajectory after daps_start, "dropped": dropped groups of each step after daps_start}."""
    n = len(outcomes)
    sampler, draw = s3ac.PromptSampler(n, seed), torch.Generator().manual_seed(seed)
    successes, attempts = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    trained, dropped_per_step = [], []
    for step in range(1, steps + 1):
        successes, attempts = successes * args.daps_decay, attempts * args.daps_decay
        daps_gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        kept, dropped, parts = 0, 0, []
        for _ in range(1 + (args.max_refills if dynamic else 0)):
            count = batch_prompts - kept
            if selection == "uniform" or step <= args.daps_start:
                chosen = sampler.draw(count)
            else:
                chosen, _ = s3ac.daps_select(sampler, count, lambda c: p_c[c], successes, attempts, args.daps_n_c,
                                             args.daps_a_min, daps_gen)
            index = torch.tensor([i for i in chosen for _ in range(k)])  # [b]
            rewards = torch.tensor([outcomes[i][int(torch.randint(len(outcomes[i]), (), generator=draw))]
                                    for i in index.tolist()])  # [b]
            successes = successes.index_add(0, index, s3ac.succeeded(rewards).double())
            attempts = attempts.index_add(0, index, torch.ones(len(index), dtype=torch.float64))
            last = index
            if dynamic:
                keep = s3ac.mixed_groups(s3ac.succeeded(rewards).double(), index)  # [b]
                dropped += int((~keep).sum()) // k
                index = index[keep]
            parts.append(index)
            kept += len(index) // k
            if kept == batch_prompts:
                break
        if step > args.daps_start:
            trained += (torch.cat(parts) if kept else last).tolist()
            dropped_per_step.append(dropped)
    return {"trained": trained, "dropped": dropped_per_step}


def exp_daps(lab: Lab, seeds: list) -> list:
    """S3AC: DAPS sends more trajectories to prompts with p_ref in (0.2, 0.8]; fewer groups dropped by dynamic
    sampling. p_ref: the pool prompts' success rate over the first half of their saved rollouts (the reference
    uniform sample); the replay draws from the second half; p_c from the std 1/(H+1) critic init_clip fitted."""
    args, opts = lab.args, lab.opts
    half = opts.rollouts_per_prompt // 2
    by_prompt = [[r for r in lab.rows if r["prompt_index"] == i] for i in range(len(lab.prompts))]
    p_ref = {i: statistics.mean(r["reward"] >= 1.0 for r in rows if r["replica"] < half)
             for i, rows in enumerate(by_prompt)}
    outcomes = [[r["reward"] for r in rows if r["replica"] >= half] for rows in by_prompt]
    share, dropped = {"uniform": [], "daps": []}, {"uniform": [], "daps": []}
    group_prompts = max(1, args.batch_prompts // opts.group_k)  # group mode: the same samples per step
    for seed in seeds:
        critic = fit_run(lab, "inv_h_plus_1", args.critic_grad_clip, "mse", seed)["critic"]
        p_c = s3ac.success_prob(s3ac.prompt_values(critic, lab.prompts, lab.pad_id, "mse", args.micro_batch_tokens))
        for selection in ("uniform", "daps"):
            single = replay_selection(outcomes, p_c.double(), opts.replay_steps, args.batch_prompts, 1, selection,
                                      False, args, seed)
            group = replay_selection(outcomes, p_c.double(), opts.replay_steps, group_prompts, opts.group_k,
                                     selection, True, args, seed)
            share[selection].append(mid_share(single["trained"], p_ref))
            dropped[selection].append(statistics.mean(group["dropped"]) if group["dropped"] else math.nan)
    share, dropped = {s: spread(v) for s, v in share.items()}, {s: spread(v) for s, v in dropped.items()}
    after = f"steps {args.daps_start + 1}-{opts.replay_steps}"
    return [
        row(f"share of trajectories on p_ref in (0.2, 0.8] prompts (K = 1, {after}, replay)",
            "more under DAPS (no figure given)", {f"share, {s}": share[s] for s in share},
            greater(share["daps"], share["uniform"])),
        row(f"dropped groups per step, --dynamic-sampling K = {opts.group_k} ({after}, replay)",
            "fewer under DAPS (no figure given)", {f"dropped, {s}": dropped[s] for s in dropped},
            greater(dropped["uniform"], dropped["daps"]))]


def exp_bce_mse(lab: Lab, seeds: list) -> list:
    """PACT: same init, same on-policy rollouts: the BCE critic reaches lower BCE and MSE and a larger Delta+-."""
    clip, n = lab.args.critic_grad_clip, lab.opts.updates
    after = {loss: [fit_run(lab, "inv_h_plus_1", clip, loss, s)["after"] for s in seeds] for loss in ("bce", "mse")}
    fig = {(loss, key): spread([a[key] for a in after[loss]]) for loss in after for key in ("bce", "mse", "value_sep")}
    return [
        row(f"outcome BCE of the values (held out, after {n} updates)", "BCE critic lower",
            {f"BCE, {loss} critic": fig[loss, "bce"] for loss in after}, greater(fig["mse", "bce"], fig["bce", "bce"])),
        row(f"outcome MSE of the values ([0, 1] scale, held out, after {n} updates)", "BCE critic lower",
            {f"MSE, {loss} critic": fig[loss, "mse"] for loss in after}, greater(fig["mse", "mse"], fig["bce", "mse"])),
        row(f"Delta+- = mean V right - mean V wrong (held out, after {n} updates)", "BCE critic larger",
            {f"Delta+-, {loss} critic": fig[loss, "value_sep"] for loss in after},
            greater(fig["bce", "value_sep"], fig["mse", "value_sep"]))]


def exp_pact(lab: Lab, seeds: list) -> list:
    """PACT: after one actor update, the critic fitted to rho-weighted targets predicts the updated actor's returns
    (fresh rollouts) better than one fitted to the raw returns. Starts from init_clip's fitted std 1/(H+1) critic."""
    args, opts = lab.args, lab.opts
    evs, rho = {"pact": [], "raw": []}, []
    for seed in seeds:
        base = fit_run(lab, "inv_h_plus_1", args.critic_grad_clip, "mse", seed)["critic"]
        order = list(range(len(lab.train_rows)))
        random.Random(seed + 99).shuffle(order)
        batch, rewards = s3ac.rows_to_batch([lab.train_rows[i] for i in order[: args.batch_prompts * args.k]],
                                            lab.pad_id)
        mask = batch.response_mask  # [B, T]
        values, _ = s3ac.value_pass(base, batch, "mse", args.micro_batch_tokens)  # [B, T]
        lam = s3ac.adaptive_lambda(mask, args.alpha) if args.actor_lam == "adaptive" else args.actor_lam
        advantages, _, _ = s3ac.decoupled_gae(rewards, values, mask, args.gamma, args.critic_lam, lam)  # [B, T]
        policy = s3ac.Policy(copy.deepcopy(lab.actor))
        policy.train()
        actor_opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed)
        sampler_logprobs = s3ac.policy_logprobs(policy, batch, args.temperature, args.micro_batch_tokens)  # [B, T] log mu
        policy.train()
        s3ac.update_actor(policy, actor_opt, batch, advantages, sampler_logprobs, args, gen)
        new_logprobs = s3ac.policy_logprobs(policy, batch, args.temperature, args.micro_batch_tokens)  # [B, T]
        returns = s3ac.mc_returns(rewards, mask, args.gamma)  # [B, T]
        targets, critic_mask, m = s3ac.pact_targets(returns, new_logprobs, sampler_logprobs, mask, args.rho_min,
                                                    args.rho_max)
        rho.append(m["critic/rho_mean"])
        index = [int(i) for i in batch.prompt_index.unique() for _ in range(opts.fresh_rollouts_per_prompt)]
        torch.manual_seed(seed)
        fresh = s3ac.generate_hf(policy.lm, [lab.prompts[i] for i in index], index, lab.eos_ids, lab.pad_id,
                                 args.max_new_tokens, args.temperature, args.gen_batch_size)
        fresh_returns = s3ac.mc_returns(lab.reward(fresh, index), fresh.response_mask, args.gamma)  # [B', T']
        for name, (t, cm) in {"pact": (targets, critic_mask), "raw": (returns, mask)}.items():
            critic = copy.deepcopy(base)
            opt = torch.optim.AdamW(critic.parameters(), lr=args.lr * args.critic_lr_ratio, weight_decay=0.0)
            critic.train()
            s3ac.update_critic(critic, opt, batch, values, t, cm, args, torch.Generator().manual_seed(seed))
            v, _ = s3ac.value_pass(critic, fresh, "mse", args.micro_batch_tokens)  # [B', T']
            evs[name].append(s3ac.explained_variance(v, fresh_returns, fresh.response_mask))
        del policy, actor_opt
    ev = {name: spread(v) for name, v in evs.items()}
    return [row("token EV on fresh rollouts of the updated actor (one actor update, then the critic)",
                "rho-weighted targets better (PACT w/o IS: 67.74% vs 72.87% avg@16 end to end)",
                {"EV, rho-weighted targets": ev["pact"], "EV, raw returns": ev["raw"], "mean rho": spread(rho)},
                greater(ev["pact"], ev["raw"]))]


RUNNERS = {"init_clip": exp_init_clip, "coverage": exp_coverage, "daps": exp_daps, "bce_mse": exp_bce_mse,
           "pact": exp_pact}


def table(lines: list) -> str:
    """The markdown table of the experiments' JSON lines: one row per claim."""
    out = ["| experiment | claim | paper's figure | ours (mean ± se [min, max] (n seeds)) | direction holds |",
           "|---|---|---|---|---|"]
    for line in lines:
        for r in line["rows"]:
            ours = "; ".join(f"{label} {fmt(s)}" for label, s in r["ours"].items())
            holds = {True: "yes", False: "no", None: "-"}[r["holds"]]
            out.append(f"| {line['experiment']} | {r['claim']} | {r['paper']} | {ours} | {holds} |")
    return "\n".join(out)


def main(argv=None):
    """Parse flags, build the Lab, run the chosen experiments (one JSON line each), write results and table."""
    parser = argparse.ArgumentParser(prog=".ci/mechanisms.py", description=__doc__.split("\n")[0],
                                     epilog="Other flags (python s3ac.py --help) configure the model, data and "
                                            "updates, as the CPU demo's do.")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama, a few rollouts (CI)")
    parser.add_argument("--out", default=os.path.join(HERE, "runs", "mechanisms"), help="results, table, rollouts")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per setting (default 3; --tiny 2)")
    parser.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated of {','.join(EXPERIMENTS)}")
    for flag, default, text in (
            ("--rollout-prompts", 24, "prompts in the saved rollouts (the pool)"),
            ("--rollouts-per-prompt", 8, "saved rollouts per prompt (daps: half give p_ref, half are replayed)"),
            ("--held-out-prompts", 4, "pool prompts whose rollouts only evaluate the critics"),
            ("--updates", 10, "critic updates in init_clip and bce_mse (optimizer steps)"),
            ("--update-size", 8, "saved rollouts per critic update in init_clip and bce_mse"),
            ("--online-steps", 3, "coverage: online training steps after pretraining"),
            ("--coverage-temperatures", "0.4,0.7,1.0", "coverage: the policies of coverage pretraining"),
            ("--critic-warmup-steps", "auto", "coverage: on-policy warm-up steps; auto = coverage's wall time"),
            ("--replay-steps", 40, "daps: selection steps replayed"),
            ("--group-k", 4, "daps: K of group mode (--batch-prompts / K prompts per step)"),
            ("--fresh-rollouts-per-prompt", 2, "pact: fresh rollouts of the updated actor per batch prompt")):
        parser.add_argument(flag, type=type(default), default=default, help=text)
    opts, rest = parser.parse_known_args(argv)
    only = [name for name in opts.only.split(",") if name]
    unknown = set(only) - set(EXPERIMENTS)
    if unknown:
        parser.error(f"--only {opts.only}: unknown {sorted(unknown)}; expected some of {EXPERIMENTS}")
    base = ["--data", "builtin:arithmetic", "--eval-data", "heldout", "--eval-size", "2", "--eval-every", "0",
            "--batch-prompts", "16", "--k", "1", "--save-every", "0", "--coverage-prompts", "8",
            "--log-samples", "16"]  # coverage's runs log every rollout of a step: the rewarded ones to read
    reward_fn = None
    tmp = None
    if opts.tiny:
        tmp = tempfile.TemporaryDirectory()
        base += ["--model", tiny_model(tmp.name), "--data", "builtin:arithmetic:200", "--eval-size", "2",
                 "--max-new-tokens", "8", "--micro-batch-tokens", "64", "--batch-prompts", "4", "--coverage-prompts", "4",
                 "--coverage-epochs", "1", "--lr", "1e-3", "--daps-start", "2", "--gen-batch-size", "16"]
        opts.rollout_prompts, opts.rollouts_per_prompt, opts.held_out_prompts = 6, 4, 2
        opts.updates, opts.update_size, opts.online_steps, opts.replay_steps, opts.fresh_rollouts_per_prompt = 2, 4, 1, 6, 2
        opts.group_k, opts.coverage_temperatures = 2, "0.7,1.3"
        opts.critic_warmup_steps = "1" if opts.critic_warmup_steps == "auto" else opts.critic_warmup_steps
        reward_fn = tiny_reward
    opts.s3ac_argv = base + rest
    args = s3ac.resolve_args(s3ac.parse_args(opts.s3ac_argv))  # "auto" flags resolved
    if args.micro_batch_tokens == "auto":  # small models: the CPU's budget, no plan
        args = dataclasses.replace(args, micro_batch_tokens=s3ac.CPU_MICRO_BATCH_TOKENS)
    seeds = list(range(opts.seeds if opts.seeds is not None else 2 if opts.tiny else 3))
    os.makedirs(opts.out, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    s3ac.save_checkpoint = lambda *a, **k: None  # coverage's training runs are measured, never resumed
    verifier = None
    if reward_fn is None:
        verifier = reward_fn = s3ac.Verifier(args.verify_timeout, args.answer_fallback)
    lines, t_all = [], time.time()
    try:
        t0 = time.time()
        lab = Lab(opts, args, reward_fn)
        print(f"set-up: {len(lab.rows)} saved rollouts of {len(lab.prompts)} prompts, "
              f"{time.time() - t0:.0f} s", file=sys.stderr)
        results = os.path.join(opts.out, "results.jsonl")
        open(results, "w").close()
        for name in only:
            t0 = time.time()
            rows = RUNNERS[name](lab, seeds)
            line = {"experiment": name, "seeds": len(seeds), "wall_s": round(time.time() - t0, 1), "rows": rows}
            lines.append(line)
            print(json.dumps(line), flush=True)
            with open(results, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(f"{name}: {line['wall_s']:.0f} s", file=sys.stderr)
    finally:
        if verifier is not None:
            verifier.close()
        if tmp is not None:
            tmp.cleanup()
    text = table(lines)
    s3ac._write_atomic(os.path.join(opts.out, "table.md"), text + "\n")
    print(text)
    print(f"all: {time.time() - t_all:.0f} s", file=sys.stderr)
    return lines


if __name__ == "__main__":
    main()
