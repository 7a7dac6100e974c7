"""Fused kernels for S3AC: GAE, the CISPO policy loss, the clipped and the BCE value losses, and log-probs
computed from hidden states without materialising the [N, V] logits.

The math is in s3ac.py; this file makes it fast. For GAE and the three losses the readable PyTorch definition is
the s3ac.py function of the same name (`gae`, `cispo_loss`, `value_loss`, `bce_value_loss`); this file holds, per
op, in this order:

    _name_kernel (Triton, @triton.jit)  ->  launcher / autograd.Function  ->  name (same signature as s3ac.name)

`name` here always runs Triton. GAE also has a fast path without Triton, `gae_scan` (a chunked, vectorised scan
with the same signature). s3ac.py calls these at one dispatch point, `s3ac.kernel_or(fn)`, which asks
`use_triton(tensor)`. What runs where:

    backend   CUDA tensor, Triton imports   CPU tensor, or no Triton          set by
    "auto"    kernels.name (Triton)         gae: gae_scan; losses: s3ac.name  the default
    "triton"  kernels.name (Triton)         kernels.name (TRITON_INTERPRET=1)  --kernels triton
    "torch"   s3ac.name                     s3ac.name (gae: the reverse loop)  --kernels torch

`logprobs_from_hidden` (and its chunked PyTorch reference) lives here whole and dispatches itself the same way
(Triton where use_triton holds, else logprobs_from_hidden_ref). The backend can be forced:

    set_backend("torch")        # always the PyTorch definitions of s3ac.py (and logprobs_from_hidden_ref)
    set_backend("triton")       # always Triton; CPU tensors then need TRITON_INTERPRET=1 set before import
    S3AC_KERNELS=torch python s3ac.py ...   # same, as the initial value

Shape letters: B sequences, T response tokens, N tokens flattened, H hidden size, V vocabulary size.
Mask convention: `response_mask` [B, T] is nonzero on tokens the policy generated (EOS included) and zero on
padding. Values stored at masked positions are never read into a result (the code selects with
`torch.where` / `tl.where`, never multiplies by the mask), so padding may hold NaN or inf.

Loss normaliser (as in s3ac.py): every loss is  sum over valid tokens / num_tokens,  where `num_tokens` defaults
to the number of valid tokens in the call (at least 1). With gradient accumulation, pass the token count of the
whole batch so that the micro-batch losses add up to the token mean over the batch.

Benchmarks (one JSON line per op and size):
    python kernels.py --bench        # the GPU section when CUDA and Triton are present, else the CPU section
    python kernels.py --bench-cpu    # CPU section, one thread (about 10 minutes: log-probs at V = 151,936)
    python kernels.py --bench-gpu    # GPU section: copy bandwidth, GAE, fused losses, log-prob memory
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and any(a.startswith("--bench") for a in sys.argv[1:]):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the CPU bench is single-threaded; must precede torch import

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # Triton is optional: without it s3ac.py runs its PyTorch functions.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install that fails while loading its backends
    triton = None
    tl = None
    HAS_TRITON = False


def _jit(fn=None, **kwargs):
    """`triton.jit` when Triton is importable; otherwise leave the function as plain (never called) Python."""
    if fn is None:
        return lambda f: _jit(f, **kwargs)
    return triton.jit(fn, **kwargs) if HAS_TRITON else fn


# ---------------------------------------------------------------------------------------------------------
# Backend switch
# ---------------------------------------------------------------------------------------------------------

_BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("S3AC_KERNELS", "auto").strip().lower() or "auto"
if _backend not in _BACKENDS:
    raise ValueError(f"S3AC_KERNELS={_backend!r}; expected one of {_BACKENDS}")


def set_backend(name: str) -> None:
    """Choose how the dispatching ops run.

    name: "auto" (Triton for CUDA tensors when Triton imports, PyTorch otherwise), "triton" (always Triton; CPU
    tensors then need TRITON_INTERPRET=1 set before Triton was imported) or "torch" (always PyTorch: s3ac.py's
    functions, logprobs_from_hidden_ref). The initial value comes from the environment variable S3AC_KERNELS
    (default "auto").
    Raises ValueError for any other name.
    """
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {_BACKENDS}")
    _backend = name


def get_backend() -> str:
    """The current backend name: "auto", "triton" or "torch"."""
    return _backend


def use_triton(x: Tensor) -> bool:
    """Whether an op whose inputs live where `x` does should run its Triton kernel (else the PyTorch definition).

    Backend "torch": False; "auto": x on a CUDA device and Triton importable; "triton": True, or RuntimeError when
    Triton cannot run there (see _require_triton).
    """
    if _backend == "torch":
        return False
    if _backend == "triton":
        _require_triton(x)
        return True
    return HAS_TRITON and x.is_cuda


def _require_triton(x: Tensor) -> None:
    """Raises RuntimeError when the Triton kernels cannot run on tensors that live where `x` does."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton backend is selected but triton could not be imported")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")


def _num_tokens(response_mask: Tensor, num_tokens) -> Tensor | float:
    """The loss normaliser: `num_tokens` when given, else the count of valid tokens (at least 1)."""
    if num_tokens is None:
        return (response_mask != 0).sum().clamp(min=1).float()
    return num_tokens


def _row_lambda(lam, B: int, device) -> Tensor:
    """lambda as an fp32 tensor [B] (a float is broadcast to every row)."""
    if isinstance(lam, Tensor):
        lam = lam.to(device=device, dtype=torch.float32).reshape(-1)
        if lam.numel() == 1:
            lam = lam.expand(B)
        if lam.numel() != B:
            raise ValueError(f"per-row lambda has {lam.numel()} entries for {B} rows")
        return lam.contiguous()
    return torch.full((B,), float(lam), device=device, dtype=torch.float32)


def _check_same_shape(**tensors) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected tensors of one shape [B, T], got {shapes}")


# ---------------------------------------------------------------------------------------------------------
# 1. GAE
#
# Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
# Generalized Advantage Estimation", Eq. 16):
#     delta_t = r_t + gamma * V_{t+1} - V_t
#     A_t     = sum_{l >= 0} (gamma * lam)^l * delta_{t+l}   =   delta_t + gamma * lam * A_{t+1}
# over the valid tokens of a row, with V = 0 after the last one. Masked positions are skipped: the next value
# and the running advantage are carried across them (the convention of verl's compute_gae_advantage_return).
# The readable definition is s3ac.gae, a reverse loop over T.
# ---------------------------------------------------------------------------------------------------------


@_jit
def _last_valid(h1, v1, h2, v2):
    # Scan combine for "value of the most recent valid element": the right operand wins when it is valid.
    return tl.maximum(h1, h2), tl.where(h2 != 0, v2, v1)


@_jit
def _affine_compose(a1, b1, a2, b2):
    # Scan combine for x -> b + a * x maps: apply (a1, b1) first, then (a2, b2):  b2 + a2 * (b1 + a1 * x).
    return a1 * a2, b2 + a2 * b1


@_jit(do_not_specialize=["T"])
def _gae_kernel(rewards_ptr, values_ptr, mask_ptr, lam_ptr, adv_ptr, ret_ptr, T, gamma, BLOCK: tl.constexpr):
    # One program per row. The row is walked in chunks of BLOCK from its end to its start; inside a chunk the
    # positions are loaded in reversed order (i = 0 is the latest time step), so the backward-in-time GAE
    # recursion becomes a FORWARD associative scan. We do not use `tl.associative_scan(..., reverse=True)`:
    # triton-lang/triton#4362 reports wrong GPU results for reverse scans with non-commutative combines, and
    # both combines here are non-commutative. Two carries link the chunks: the advantage and the value at the
    # earliest valid position seen so far (both 0 past the end of the row).
    row = tl.program_id(0).to(tl.int64)
    gl = gamma * tl.load(lam_ptr + row).to(tl.float32)
    row_start = row * T
    i = tl.arange(0, BLOCK)
    carry_adv = 0.0  # A at the first valid position after the current chunk
    carry_v = 0.0  # V at the first valid position after the current chunk (0 = terminal value)
    for c in range(0, tl.cdiv(T, BLOCK)):
        t = (T - c * BLOCK - 1 - i).to(tl.int64)  # [BLOCK] time index, decreasing with i
        in_row = t >= 0
        valid = tl.load(mask_ptr + row_start + t, mask=in_row, other=0) != 0
        r = tl.load(rewards_ptr + row_start + t, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(values_ptr + row_start + t, mask=valid, other=0.0).to(tl.float32)

        # V_next(t) = V at the nearest valid position > t: scan the sequence shifted by one time step.
        t1 = t + 1
        valid1 = tl.load(mask_ptr + row_start + t1, mask=in_row & (t1 < T), other=0) != 0
        v1 = tl.load(values_ptr + row_start + t1, mask=valid1, other=0.0).to(tl.float32)
        seen, v_scan = tl.associative_scan((valid1.to(tl.int32), v1), 0, _last_valid)
        v_next = tl.where(seen != 0, v_scan, carry_v)

        # A_t = delta_t + gl * A_next on valid steps, A_t = A_next on masked ones: the map x -> b + a * x.
        delta = r + gamma * v_next - v
        a = tl.where(valid, gl, 1.0)
        b = tl.where(valid, delta, 0.0)
        a_cum, b_cum = tl.associative_scan((a, b), 0, _affine_compose)
        adv = b_cum + a_cum * carry_adv
        tl.store(adv_ptr + row_start + t, tl.where(valid, adv, 0.0), mask=in_row)
        tl.store(ret_ptr + row_start + t, tl.where(valid, adv + v, 0.0), mask=in_row)

        # The last scan element (earliest time, maybe before the row start) carries A across masked steps.
        carry_adv = tl.sum(tl.where(i == BLOCK - 1, adv, 0.0), 0)
        earliest = tl.max(tl.where(valid, i, -1), 0)
        v_earliest = tl.sum(tl.where(i == earliest, v, 0.0), 0)
        carry_v = tl.where(earliest >= 0, v_earliest, carry_v)


def _gae_triton(rewards, values, response_mask, gamma, lam):
    B, T = rewards.shape
    mask = response_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    adv = torch.empty(B, T, device=rewards.device, dtype=torch.float32)
    ret = torch.empty_like(adv)
    if B == 0 or T == 0:
        return adv, ret
    lam_rows = _row_lambda(lam, B, rewards.device)
    _gae_kernel[(B,)](rewards.contiguous(), values.contiguous(), mask, lam_rows, adv, ret, T, float(gamma), BLOCK=256)
    return adv, ret


def gae(rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam) -> tuple[Tensor, Tensor]:
    """Token-level GAE as one Triton program per row: s3ac.gae's signature, contract and result (to fp32 rounding).

    rewards, values, response_mask: [B, T] (padding may hold NaN or inf); gamma: float; lam: float or Tensor [B].
    Returns (advantages, returns), both [B, T] fp32, 0 at masked positions. Source: Schulman et al. 2016, eq. 16.
    Raises ValueError if the tensors are not of one shape [B, T] or lam has the wrong length; RuntimeError when
    Triton cannot run on these tensors (no Triton, or CPU tensors without TRITON_INTERPRET=1).
    """
    _check_same_shape(rewards=rewards, values=values, response_mask=response_mask)
    _require_triton(rewards)
    return _gae_triton(rewards, values, response_mask, gamma, lam)


# The fast path without Triton (CPU tensors, or CUDA without Triton): the same recursion as a chunked,
# vectorised scan. It rounds differently from s3ac.gae's loop (a few fp32 ulps), so the training run uses it
# wherever the Triton kernel does not apply, and `--kernels torch` selects s3ac.gae itself.
def _discounted_reverse_cumsum(x: Tensor, w: Tensor, chunk: int = 32) -> Tensor:
    """y[b, t] = sum_{s >= t} w[b]^(s - t) * x[b, s]  for x [B, T] fp32 and w [B] fp32 (or [1]) in [0, 1].

    Exact scan without rescaling: positions are cut into chunks of `chunk`; inside a chunk the sum is a matmul
    with the upper-triangular matrix K[j, i] = w^(j - i) (j >= i, else 0), and the chunk starts are linked by
    the same recursion with factor w^chunk, solved by calling this function on them. Every position only ever
    receives terms from positions at or after it, multiplied by an exact 0 otherwise, so a huge value early in
    a row cannot disturb later positions, and w = 1 stays exact (no 1 / w^t factors).
    """
    B, T = x.shape
    C = min(chunk, T)
    n = -(-T // C)
    xc = F.pad(x, (0, n * C - T)).view(B, n, C)  # [B, n, C]
    idx = torch.arange(C, device=x.device)  # [C]
    expo = (idx[:, None] - idx[None, :]).to(torch.float32)  # [C, C]  j - i (row j, column i)
    upper = expo >= 0  # [C, C]
    if w.numel() == 1:  # one factor for all rows: a single GEMM over all chunks
        K = torch.where(upper, w.reshape(()) ** expo.clamp(min=0), 0.0)  # [C, C]
        local = (xc.reshape(B * n, C) @ K).view(B, n, C)  # [B, n, C]
    else:  # a factor per row: one [C, C] matrix per row
        K = torch.where(upper, w[:, None, None] ** expo.clamp(min=0), 0.0)  # [B, C, C]
        local = torch.bmm(xc, K)  # [B, n, C]
    if n > 1:
        w_col = w.reshape(-1, 1)  # [B or 1, 1]
        starts = _discounted_reverse_cumsum(local[:, :, 0].contiguous(), w ** C, chunk)  # [B, n] y at chunk starts
        next_start = F.pad(starts[:, 1:], (0, 1))  # [B, n]  y at the start of the following chunk (0 past the end)
        decay = w_col ** (C - idx).to(torch.float32)  # [B or 1, C]  w^(C - i)
        local = local + decay[:, None, :] * next_start[:, :, None]  # [B, n, C]
    return local.reshape(B, n * C)[:, :T]


def gae_scan(rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam) -> tuple[Tensor, Tensor]:
    """Token-level GAE in PyTorch, vectorised over rows and positions: s3ac.gae's signature, contract and result
    (to fp32 rounding). The path s3ac.kernel_or(gae) takes when the Triton kernel does not apply.

    rewards, values, response_mask: [B, T] (padding may hold NaN or inf); gamma: float; lam: float or Tensor [B].
    Returns (advantages, returns), both [B, T] fp32, 0 at masked positions. Source: Schulman et al. 2016, eq. 16.
    Raises ValueError if the tensors are not of one shape [B, T] or lam has the wrong length.

    Skipping masked positions is made plain adjacency first: when some row has a masked gap between valid
    tokens, the valid tokens of every row are packed to the front (scattered by their running count) and
    unpacked at the end; rows padded only on the left or right need no packing. Then
    delta = r + gamma * V_next - V and A = the discounted reverse cumsum of delta with factor gamma * lam
    (`_discounted_reverse_cumsum`, exact and vectorised).
    """
    _check_same_shape(rewards=rewards, values=values, response_mask=response_mask)
    B, T = rewards.shape
    valid = response_mask != 0  # [B, T]
    if B == 0 or T == 0:
        z = torch.zeros(B, T, device=rewards.device, dtype=torch.float32)  # [B, T]
        return z, z.clone()
    r = torch.where(valid, rewards.float(), 0.0)  # [B, T] padding garbage dropped here
    v = torch.where(valid, values.float(), 0.0)  # [B, T]
    span_starts = valid[:, :1].sum(1) + (valid[:, 1:] & ~valid[:, :-1]).sum(1)  # [B] runs of valid tokens
    packed = bool((span_starts > 1).any())
    if packed:
        slot = valid.cumsum(1, dtype=torch.int32) - 1  # [B, T]  index of each valid token among the valid ones
        dest = torch.where(valid, slot, T).long()  # [B, T]  masked positions go to a spare column T
        spare = torch.zeros(B, T + 1, device=r.device, dtype=torch.float32)  # [B, T+1]
        r = spare.scatter(1, dest, r)[:, :T]  # [B, T] valid tokens first
        v = spare.scatter(1, dest, v)[:, :T]  # [B, T] (only zeros reach column T)
    v_next = F.pad(v[:, 1:], (0, 1))  # [B, T]  V of the next valid token; 0 after the last one (terminal)
    delta = r + gamma * v_next - v  # [B, T]  exactly 0 wherever r = v = 0 (padding, or past the packed tokens)
    if isinstance(lam, Tensor):
        gl = gamma * _row_lambda(lam, B, r.device)  # [B]
    else:
        gl = torch.tensor([gamma * float(lam)], device=r.device, dtype=torch.float32)  # [1]
    adv = _discounted_reverse_cumsum(delta, gl)  # [B, T]
    if packed:
        adv = F.pad(adv, (0, 1)).gather(1, dest)  # [B, T] back to the original positions; column T is 0
        v = torch.where(valid, values.float(), 0.0)  # [B, T] unpacked values
    else:
        adv = torch.where(valid, adv, 0.0)  # [B, T]
    return adv, adv + v  # returns = A + V, exactly 0 at masked positions (both terms are 0 there)


# ---------------------------------------------------------------------------------------------------------
# 2. CISPO policy loss
#
# CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", Sec. 3.1):
#     J = sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * log pi(token),   ratio = pi / pi_old
# The clipped ratio is a stop-gradient weight, so every token keeps a gradient (unlike PPO clipping).
# The readable definition is s3ac.cispo_loss.
# ---------------------------------------------------------------------------------------------------------


@_jit(do_not_specialize=["n_elements"])
def _cispo_kernel(logp_ptr, old_logp_ptr, adv_ptr, mask_ptr, coef_ptr, partial_ptr, n_elements, eps_low, eps_high,
                  BLOCK: tl.constexpr):
    # One program per BLOCK tokens of the flattened [B*T] batch. Writes d(per-token loss)/d(logprob) and three
    # block partial sums (loss, clipped count, k3 KL) that the host adds up in a fixed order.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = tl.load(mask_ptr + offs, mask=offs < n_elements, other=0) != 0
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    old_logp = tl.load(old_logp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    log_ratio = logp - old_logp
    ratio = tl.exp(log_ratio)
    weight = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)  # sg(clip(ratio))
    coef = tl.where(valid, -weight * adv, 0.0)  # d(-J)/d logp with the weight held constant
    clipped = valid & ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high))
    kl = tl.where(valid, (ratio - 1.0) - log_ratio, 0.0)  # k3 estimator of KL(old || new)
    tl.store(coef_ptr + offs, coef, mask=offs < n_elements)
    tl.store(partial_ptr + pid * 3 + 0, tl.sum(coef * logp, 0))
    tl.store(partial_ptr + pid * 3 + 1, tl.sum(clipped.to(tl.float32), 0))
    tl.store(partial_ptr + pid * 3 + 2, tl.sum(kl, 0))


class _CispoLossFn(torch.autograd.Function):
    """Fused CISPO loss: one kernel computes the loss, its gradient coefficient and the metric partials."""

    @staticmethod
    def forward(ctx, logprobs, old_logprobs, advantages, response_mask, eps_low, eps_high, num_tokens):
        n_elements = logprobs.numel()
        BLOCK = 1024
        n_blocks = triton.cdiv(n_elements, BLOCK)
        coef = torch.empty(logprobs.shape, device=logprobs.device, dtype=torch.float32)
        partial = torch.empty(n_blocks, 3, device=logprobs.device, dtype=torch.float32)
        mask = response_mask.contiguous()
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
        _cispo_kernel[(n_blocks,)](logprobs.detach().contiguous(), old_logprobs.contiguous(),
                                   advantages.contiguous(), mask, coef, partial, n_elements,
                                   float(eps_low), float(eps_high), BLOCK=BLOCK)
        sums = partial.sum(0)  # [3]  loss, clipped tokens, k3 KL; each a sum over valid tokens
        ctx.save_for_backward(coef)
        ctx.num_tokens = num_tokens
        ctx.logprobs_dtype = logprobs.dtype
        ctx.mark_non_differentiable(sums)
        return sums[0] / num_tokens, sums

    @staticmethod
    def backward(ctx, grad_loss, grad_sums):
        # loss = (1 / n) * sum_t  -w_t * A_t * logp_t        with w_t = sg(clip(exp(logp_t - old_t), ...)) constant
        # d loss / d logp_t = -w_t * A_t / n  on valid tokens, 0 on masked ones  (coef_t = -w_t * A_t, saved)
        # chain rule with the scalar upstream gradient g:  grad_logp_t = g * coef_t / n
        (coef,) = ctx.saved_tensors
        grad_logprobs = (coef * (grad_loss / ctx.num_tokens)).to(ctx.logprobs_dtype)
        return grad_logprobs, None, None, None, None, None, None


def _cispo_loss_triton(logprobs, old_logprobs, advantages, response_mask, eps_low, eps_high, num_tokens):
    loss, sums = _CispoLossFn.apply(logprobs, old_logprobs, advantages, response_mask, eps_low, eps_high, num_tokens)
    return loss, {"pg_clipfrac": sums[1] / num_tokens, "approx_kl": sums[2] / num_tokens}


def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, eps_low: float,
               eps_high: float, num_tokens=None) -> tuple[Tensor, dict]:
    """CISPO loss (MiniMax-M1, 2025, sec. 3.1) fused into one kernel: s3ac.cispo_loss's signature and contract.

        loss = -sum_{valid t} sg(clip(ratio_t, 1 - eps_low, 1 + eps_high)) * A_t * logprobs_t / num_tokens

    logprobs, old_logprobs, advantages, response_mask: [B, T]; eps_low, eps_high relative to 1; num_tokens default
    the valid tokens (at least 1). Returns (pg_loss, {"pg_clipfrac", "approx_kl"}), as s3ac.cispo_loss.
    Raises ValueError if the four tensors are not of one shape [B, T]; RuntimeError when Triton cannot run here.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                      response_mask=response_mask)
    _require_triton(logprobs)
    n = _num_tokens(response_mask, num_tokens)
    return _cispo_loss_triton(logprobs, old_logprobs, advantages, response_mask, eps_low, eps_high, n)


# ---------------------------------------------------------------------------------------------------------
# 3. Value losses
#
# Clipped value loss (the PPO value-clipping of OpenAI baselines' ppo2, analysed in Engstrom et al. 2020,
# "Implementation Matters in Deep Policy Gradients", Sec. 3; the S3AC critic objective):
#     L = 0.5 * max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)
# written with clip(V, V_old - eps, V_old + eps), equal to V_old + clip(V - V_old, -eps, eps), which returns V
# itself (bit for bit) inside the clip range, so the two branches tie exactly there.
#
# Soft BCE value loss on a sigmoid critic (PACT, "unique token credit and policy-aligned critic training"):
#     L = softplus(z) - y * z  = BCE(sigmoid(z), y),   d L / d z = sigmoid(z) - y
# The readable definitions are s3ac.value_loss and s3ac.bce_value_loss.
# ---------------------------------------------------------------------------------------------------------


@_jit(do_not_specialize=["n_elements"])
def _value_loss_kernel(values_ptr, old_values_ptr, returns_ptr, mask_ptr, coef_ptr, partial_ptr, n_elements, eps_v,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = tl.load(mask_ptr + offs, mask=offs < n_elements, other=0) != 0
    v = tl.load(values_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    v_old = tl.load(old_values_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    ret = tl.load(returns_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    v_clip = tl.minimum(tl.maximum(v, v_old - eps_v), v_old + eps_v)
    err = v - ret
    err_clip = v_clip - ret
    use_clip = valid & (err_clip * err_clip > err * err)
    loss = 0.5 * tl.where(use_clip, err_clip * err_clip, err * err)
    coef = tl.where(use_clip, 0.0, tl.where(valid, err, 0.0))  # see _ValueLossFn.backward
    tl.store(coef_ptr + offs, coef, mask=offs < n_elements)
    tl.store(partial_ptr + pid * 2 + 0, tl.sum(tl.where(valid, loss, 0.0), 0))
    tl.store(partial_ptr + pid * 2 + 1, tl.sum(use_clip.to(tl.float32), 0))


class _ValueLossFn(torch.autograd.Function):
    """Fused clipped value loss: one kernel computes loss, gradient coefficient and clip count."""

    @staticmethod
    def forward(ctx, values, old_values, returns, response_mask, eps_v, num_tokens):
        n_elements = values.numel()
        BLOCK = 1024
        n_blocks = triton.cdiv(n_elements, BLOCK)
        coef = torch.empty(values.shape, device=values.device, dtype=torch.float32)
        partial = torch.empty(n_blocks, 2, device=values.device, dtype=torch.float32)
        mask = response_mask.contiguous()
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
        _value_loss_kernel[(n_blocks,)](values.detach().contiguous(), old_values.contiguous(), returns.contiguous(),
                                        mask, coef, partial, n_elements, float(eps_v), BLOCK=BLOCK)
        sums = partial.sum(0)  # [2]  loss, clipped tokens
        ctx.save_for_backward(coef)
        ctx.num_tokens = num_tokens
        ctx.values_dtype = values.dtype
        ctx.mark_non_differentiable(sums)
        return sums[0] / num_tokens, sums

    @staticmethod
    def backward(ctx, grad_loss, grad_sums):
        # Per valid token, L = 0.5 * max(e^2, e_c^2) with e = V - R and e_c = clip(V, V_old - eps, V_old + eps) - R.
        #  - unclipped branch wins (e^2 >= e_c^2):   dL/dV = e
        #  - clipped branch strictly larger:        then clip(V, ...) != V, so V lies strictly outside
        #    [V_old - eps, V_old + eps], the clip is flat there and dL/dV = e_c * d clip/dV = 0.
        # Inside the range clip(V, ...) == V exactly, so the branches tie and the first case applies.
        # coef_t holds dL_t/dV_t (0 on masked tokens); loss = sum_t L_t / n, upstream scalar g:
        #     grad_V_t = g * coef_t / n
        (coef,) = ctx.saved_tensors
        return (coef * (grad_loss / ctx.num_tokens)).to(ctx.values_dtype), None, None, None, None, None


def _value_loss_triton(values, old_values, returns, response_mask, eps_v, num_tokens):
    loss, sums = _ValueLossFn.apply(values, old_values, returns, response_mask, eps_v, num_tokens)
    return loss, {"v_clipfrac": sums[1] / num_tokens}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, eps_v: float,
               num_tokens=None) -> tuple[Tensor, dict]:
    """Clipped value loss fused into one kernel: s3ac.value_loss's signature and contract.

        loss = sum_{valid t} 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)_t / num_tokens

    values, old_values, returns, response_mask: [B, T]; eps_v absolute (reward units). Returns (v_loss,
    {"v_clipfrac"}), as s3ac.value_loss. Source: OpenAI baselines ppo2; Engstrom et al. 2020, sec. 3.
    Raises ValueError if the four tensors are not of one shape [B, T]; RuntimeError when Triton cannot run here.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    _require_triton(values)
    n = _num_tokens(response_mask, num_tokens)
    return _value_loss_triton(values, old_values, returns, response_mask, eps_v, n)


@_jit(do_not_specialize=["n_elements"])
def _bce_value_loss_kernel(logits_ptr, targets_ptr, mask_ptr, coef_ptr, partial_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = tl.load(mask_ptr + offs, mask=offs < n_elements, other=0) != 0
    z = tl.load(logits_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    y = tl.load(targets_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    softplus = tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))  # log(1 + e^z) without overflow
    loss = tl.where(valid, softplus - y * z, 0.0)
    coef = tl.where(valid, tl.sigmoid(z) - y, 0.0)
    tl.store(coef_ptr + offs, coef, mask=offs < n_elements)
    tl.store(partial_ptr + pid, tl.sum(loss, 0))


class _BceValueLossFn(torch.autograd.Function):
    """Fused soft-BCE value loss: one kernel computes loss partials and the gradient coefficient."""

    @staticmethod
    def forward(ctx, value_logits, targets, response_mask, num_tokens):
        n_elements = value_logits.numel()
        BLOCK = 1024
        n_blocks = triton.cdiv(n_elements, BLOCK)
        coef = torch.empty(value_logits.shape, device=value_logits.device, dtype=torch.float32)
        partial = torch.empty(n_blocks, device=value_logits.device, dtype=torch.float32)
        mask = response_mask.contiguous()
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
        _bce_value_loss_kernel[(n_blocks,)](value_logits.detach().contiguous(), targets.contiguous(), mask, coef,
                                            partial, n_elements, BLOCK=BLOCK)
        ctx.save_for_backward(coef)
        ctx.num_tokens = num_tokens
        ctx.logits_dtype = value_logits.dtype
        return partial.sum() / num_tokens

    @staticmethod
    def backward(ctx, grad_loss):
        # L_t = softplus(z_t) - y_t * z_t;  d softplus(z)/dz = sigmoid(z)  =>  dL_t/dz_t = sigmoid(z_t) - y_t
        # (saved as coef_t, 0 on masked tokens).  loss = sum_t L_t / n, upstream scalar g:
        #     grad_z_t = g * coef_t / n
        (coef,) = ctx.saved_tensors
        return (coef * (grad_loss / ctx.num_tokens)).to(ctx.logits_dtype), None, None, None


def _bce_value_loss_triton(value_logits, targets, response_mask, num_tokens):
    return _BceValueLossFn.apply(value_logits, targets, response_mask, num_tokens), {}


def bce_value_loss(value_logits: Tensor, targets: Tensor, response_mask: Tensor, num_tokens=None) -> tuple[Tensor, dict]:
    """Soft BCE value loss fused into one kernel: s3ac.bce_value_loss's signature and contract.

        loss = sum_{valid t} (softplus(z_t) - y_t * z_t) / num_tokens,     d loss / d z_t = (sigmoid(z_t) - y_t) / n

    value_logits, targets, response_mask: [B, T]. Returns (v_loss, {}). Source: PACT's sigmoid critic.
    Raises ValueError if the three tensors are not of one shape [B, T]; RuntimeError when Triton cannot run here.
    """
    _check_same_shape(value_logits=value_logits, targets=targets, response_mask=response_mask)
    _require_triton(value_logits)
    return _bce_value_loss_triton(value_logits, targets, response_mask, _num_tokens(response_mask, num_tokens))


# ---------------------------------------------------------------------------------------------------------
# 4. Log-probs and entropy from hidden states
#
#     z = hidden @ weight.T / temperature,   logp(y) = z_y - logsumexp(z),   entropy = logsumexp(z) - sum_j p_j z_j
# computed block by block so that the [N, V] logits never exist: forward walks blocks of rows ([rows, V]),
# backward recomputes the logits in blocks of the vocabulary ([N, V_chunk]) from the saved per-row logsumexp.
# ---------------------------------------------------------------------------------------------------------

LOGITS_CHUNK_ELEMENTS = 1 << 24  # logits held at once (rows * V forward, N * V_chunk backward): 64 MiB in fp32


@_jit(do_not_specialize=["V", "stride_row"])
def _logsumexp_entropy_kernel(logits_ptr, targets_ptr, lse_ptr, logp_ptr, entropy_ptr, V, stride_row, inv_temp,
                              BLOCK_V: tl.constexpr):
    # One program per row of a [rows, V] logits chunk; an online (streaming) logsumexp over blocks of V:
    #   m = running max, s = sum_j exp(z_j - m), w = sum_j exp(z_j - m) * z_j; rescaled by exp(m_old - m_new)
    #   when the max grows. Then lse = m + log s and entropy = lse - w / s.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    m = float("-inf")
    s = 0.0
    w = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inside = offs < V
        z = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, 0))
        rescale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # 0 outside the vocabulary
        s = s * rescale + tl.sum(e, 0)
        w = w * rescale + tl.sum(e * tl.where(inside, z, 0.0), 0)  # avoid 0 * -inf outside the vocabulary
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + row)
    z_target = tl.load(base + target).to(tl.float32) * inv_temp
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, z_target - lse)
    tl.store(entropy_ptr + row, lse - w / s)


@_jit(do_not_specialize=["v_start", "V_chunk", "stride_row"])
def _logprob_grad_kernel(logits_ptr, targets_ptr, lse_ptr, grad_logp_ptr, v_start, V_chunk, stride_row, inv_temp,
                         BLOCK_V: tl.constexpr):
    # Overwrites an [N, V_chunk] logits block (vocabulary ids v_start ..., in place, same dtype) with
    #   d loss / d logits_ij = g_i * (onehot(y_i)_j - softmax(z_i)_j) * inv_temp   (see _LogprobsFromHidden)
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_logp_ptr + row).to(tl.float32)
    target = tl.load(targets_ptr + row) - v_start  # position of the target inside this block (maybe outside)
    for start in range(0, V_chunk, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inside = offs < V_chunk
        z = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(z - lse)
        grad = g * (tl.where(offs == target, 1.0, 0.0) - p) * inv_temp
        tl.store(base + offs, grad.to(logits_ptr.dtype.element_ty), mask=inside)


def _chunk_stats_ref(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(logsumexp, logp of target, entropy), each [rows] fp32, from a [rows, V] logits chunk (PyTorch)."""
    z = logits.float() / temperature  # [rows, V]
    lse = torch.logsumexp(z, dim=-1)  # [rows]
    logp_target = z.gather(1, targets[:, None])[:, 0] - lse  # [rows]
    z -= lse[:, None]  # [rows, V] now log p (in place: the division above made a new buffer)
    entropy = -(z.exp() * z).sum(-1)  # [rows]  H = -sum p log p
    return lse, logp_target, entropy


def _chunk_stats_triton(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    rows, V = logits.shape
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse)
    _logsumexp_entropy_kernel[(rows,)](logits, targets, lse, logp, entropy, V, logits.stride(0), 1.0 / temperature,
                                       BLOCK_V=4096)
    return lse, logp, entropy


def _chunk_grad_ref(logits: Tensor, targets: Tensor, v_start: int, lse: Tensor, grad_logp: Tensor,
                    temperature: float) -> Tensor:
    """d loss / d logits for an [N, V_chunk] block of vocabulary ids v_start ..., in the logits dtype (PyTorch)."""
    V_chunk = logits.shape[1]
    p = (logits.float() / temperature - lse[:, None]).exp_()  # [N, V_chunk] softmax, recomputed
    grad = p.mul_(-grad_logp[:, None])  # [N, V_chunk]  -g_i * p_ij
    col = targets - v_start  # [N] target column inside this block
    hit = (col >= 0) & (col < V_chunk)  # [N]
    grad.scatter_add_(1, col.clamp(0, V_chunk - 1)[:, None], torch.where(hit, grad_logp, 0.0)[:, None])  # + g_i
    return grad.div_(temperature).to(logits.dtype)


def _chunk_grad_triton(logits: Tensor, targets: Tensor, v_start: int, lse: Tensor, grad_logp: Tensor,
                       temperature: float) -> Tensor:
    N, V_chunk = logits.shape
    block = min(4096, triton.next_power_of_2(V_chunk))
    _logprob_grad_kernel[(N,)](logits, targets, lse, grad_logp.contiguous(), v_start, V_chunk, logits.stride(0),
                               1.0 / temperature, BLOCK_V=block)
    return logits


class _LogprobsFromHidden(torch.autograd.Function):
    """Chunked log-probs and entropy; saves hidden, weight, targets and the per-row logsumexp only.

    Forward walks blocks of rows (each [rows, V] logits block is reduced, then freed). Backward walks blocks of
    the vocabulary instead: each [N, V_chunk] block yields its slice of the weight gradient in one matmul over
    all N rows, so the large [V, H] gradient is never summed across chunks; the small [N, H] hidden gradient is
    summed in fp32. Both block shapes hold at most LOGITS_CHUNK_ELEMENTS logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, use_triton):
        N, V = hidden.shape[0], weight.shape[0]
        rows = max(1, LOGITS_CHUNK_ELEMENTS // V)
        stats = _chunk_stats_triton if use_triton else _chunk_stats_ref
        lse = torch.empty(N, device=hidden.device, dtype=torch.float32)
        logp = torch.empty_like(lse)
        entropy = torch.empty_like(lse)
        for s in range(0, N, rows):
            logits = hidden[s:s + rows] @ weight.T  # [rows, V]  matmul accumulates in fp32, output in input dtype
            lse[s:s + rows], logp[s:s + rows], entropy[s:s + rows] = stats(logits, targets[s:s + rows], temperature)
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.use_triton = use_triton
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        # z_i = h_i W^T / temperature,  logp_i = z_{i, y_i} - logsumexp_j z_ij
        #   d logp_i / d z_ij = onehot(y_i)_j - p_ij                     (p_i = softmax(z_i) = exp(z_i - lse_i))
        #   G_ij := d loss / d logits_ij = g_i * (onehot(y_i)_j - p_ij) / temperature   (logits = h W^T)
        #   d loss / d h = G W      = sum over vocabulary blocks c of G[:, c] W[c]     [N, H]
        #   d loss / d W[c] = G[:, c]^T h                                              [V_chunk, H] per block
        # The entropy output is marked non-differentiable, so grad_entropy is ignored.
        hidden, weight, targets, lse = ctx.saved_tensors
        N, V = hidden.shape[0], weight.shape[0]
        V_chunk = max(1, LOGITS_CHUNK_ELEMENTS // max(N, 1))
        chunk_grad = _chunk_grad_triton if ctx.use_triton else _chunk_grad_ref
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_logp = grad_logp.float().contiguous()
        for v0 in range(0, V, V_chunk):
            w = weight[v0:v0 + V_chunk]  # [V_chunk, H]
            logits = hidden @ w.T  # [N, V_chunk]  recomputed
            G = chunk_grad(logits, targets, v0, lse, grad_logp, ctx.temperature)  # [N, V_chunk]
            if need_h:
                if hidden.dtype == torch.float32:
                    grad_h.addmm_(G, w)  # [N, H]
                else:
                    grad_h += (G @ w).float()  # [N, H]  per-block product in the input dtype, sum in fp32
            if need_w:
                torch.mm(G.T, hidden, out=grad_w[v0:v0 + V_chunk])  # [V_chunk, H]
            del logits, G
        if need_h:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None


def _check_logprob_args(hidden, weight, targets, temperature):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"expected targets [N={hidden.shape[0]}], got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _logprobs_from_hidden_triton(hidden, weight, targets, temperature: float = 1.0):
    return _LogprobsFromHidden.apply(hidden, weight, targets.long(), float(temperature), True)


def logprobs_from_hidden_ref(hidden, weight, targets, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Chunked log-probs and entropy in PyTorch (see `logprobs_from_hidden` for the contract)."""
    _check_logprob_args(hidden, weight, targets, temperature)
    return _LogprobsFromHidden.apply(hidden, weight, targets.long(), float(temperature), False)


def logprobs_from_hidden(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probability of each target token and the entropy of its distribution, from final hidden states.

        z = hidden @ weight.T / temperature           (the LM head; softmax with temperature)
        logprobs[i] = z[i, targets[i]] - logsumexp_j z[i, j]
        entropy[i]  = logsumexp_j z[i, j] - sum_j softmax(z[i])_j * z[i, j]   (= -sum p log p, nats)

    Only LOGITS_CHUNK_ELEMENTS logits (a few rows times V) exist at any time; the [N, V] logits are never held.
    Backward recomputes each chunk's logits. The matmul runs in the input dtype (bf16 or fp32, fp32
    accumulation inside); softmax, logsumexp, entropy and the weight-gradient sum run in fp32.

    Args:
        hidden: [N, H] final hidden states (bf16 or fp32), may require grad.
        weight: [V, H] LM-head weight, same dtype, may require grad.
        targets: [N] int64 token ids in [0, V).
        temperature: sampling temperature (> 0) the log-probs are taken at.
    Returns:
        (logprobs, entropy), both [N] fp32 in nats. Gradient flows to hidden and weight through logprobs only;
        entropy is detached.
    Raises:
        ValueError on mismatched shapes or temperature <= 0.

    Example: logits [2, 1, 0] at temperature 0.5, target 0 -> log softmax([4, 2, 0])[0] = -0.14293.
    """
    _check_logprob_args(hidden, weight, targets, temperature)
    if use_triton(hidden):
        return _logprobs_from_hidden_triton(hidden, weight, targets, temperature)
    return logprobs_from_hidden_ref(hidden, weight, targets, temperature)


# ---------------------------------------------------------------------------------------------------------
# 5. Benchmarks:  python kernels.py --bench | --bench-cpu | --bench-gpu
# ---------------------------------------------------------------------------------------------------------


def _gae_verl_loop(rewards, values, response_mask, gamma, lam):
    """The loop of verl's compute_gae_advantage_return, vectorised over rows (no whitening): the baseline."""
    B, T = rewards.shape
    mask = response_mask.to(rewards.dtype)
    next_values = torch.zeros(B, device=rewards.device, dtype=rewards.dtype)
    lastgaelam = torch.zeros(B, device=rewards.device, dtype=rewards.dtype)
    reversed_adv = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        candidate = delta + gamma * lam * lastgaelam
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        lastgaelam = candidate * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        reversed_adv.append(lastgaelam)
    adv = torch.stack(reversed_adv[::-1], dim=1) * mask
    return adv, (adv + values) * mask


def _gae_elementwise_loop(rewards, values, response_mask, gamma, lam):
    """GAE as a plain per-element PyTorch loop (row by row, token by token): the slowest baseline."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=rewards.dtype)
    for b in range(B):
        next_v = torch.zeros((), dtype=rewards.dtype)
        lastgaelam = torch.zeros((), dtype=rewards.dtype)
        for t in reversed(range(T)):
            if response_mask[b, t]:
                delta = rewards[b, t] + gamma * next_v - values[b, t]
                lastgaelam = delta + gamma * lam * lastgaelam
                next_v = values[b, t]
                adv[b, t] = lastgaelam
    return adv, torch.where(response_mask != 0, adv + values, 0.0)


def _bench_gae_inputs(B, T, seed=0):
    """RL-like inputs: sparse +-1 final reward plus small dense noise, values in (-1, 1), lengths in [T/2, T],
    right padding; a second mask also cuts a masked span out of the middle of every row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    pos = torch.arange(T)[None, :]
    right_padded = (pos < lengths[:, None]).float()  # [B, T]
    rewards = 0.01 * torch.randn(B, T, generator=g) * right_padded
    rewards[torch.arange(B), lengths - 1] += torch.randint(0, 2, (B,), generator=g).float() * 2 - 1
    values = torch.rand(B, T, generator=g) * 2 - 1
    gap_start = (lengths // 4)[:, None]
    with_gaps = right_padded * ~((pos >= gap_start) & (pos < gap_start + lengths[:, None] // 8))
    return rewards, values, {"right_padded": right_padded, "with_gaps": with_gaps}


def _timed(fn, *args):
    import time

    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _bench_gae_cpu(print_json):
    """GAE on the CPU: "scan" is gae_scan (what the training run uses there) against s3ac.gae's reverse loop
    ("s3ac_loop", what --kernels torch runs) and verl's loop."""
    import statistics

    import s3ac

    gamma, lam = 1.0, 0.95
    for B, T in [(64, 512), (256, 2048), (512, 4096), (512, 8192)]:
        rewards, values, masks = _bench_gae_inputs(B, T)
        reps = 7 if B * T <= 2**20 else 3
        impls = {"scan": lambda m: gae_scan(rewards, values, m, gamma, lam),
                 "s3ac_loop": lambda m: s3ac.gae(rewards, values, m, gamma, lam),
                 "verl_loop": lambda m: _gae_verl_loop(rewards, values, m, gamma, lam)}
        if B * T <= 64 * 512:
            impls["elementwise_loop"] = lambda m: _gae_elementwise_loop(rewards, values, m, gamma, lam)
        for name, mask in masks.items():
            impls["scan"](mask), impls["s3ac_loop"](mask), impls["verl_loop"](mask)  # warm-up
            times = {k: [] for k in impls}
            for rep in range(reps):
                order = list(impls)[rep % len(impls):] + list(impls)[:rep % len(impls)]  # rotate the order
                for k in order:
                    times[k].append(_timed(impls[k], mask))
            gold, _ = _gae_verl_loop(rewards.double(), values.double(), mask.double(), gamma, lam)
            err_scan = (gae_scan(rewards, values, mask, gamma, lam)[0].double() - gold).abs().max().item()
            err_s3ac = (s3ac.gae(rewards, values, mask, gamma, lam)[0].double() - gold).abs().max().item()
            err_loop = (_gae_verl_loop(rewards, values, mask, gamma, lam)[0].double() - gold).abs().max().item()
            row = {"op": "gae", "device": "cpu", "B": B, "T": T, "mask": name, "reps": reps,
                   "threads": torch.get_num_threads()}
            for k, ts in times.items():
                row[f"{k}_ms"] = round(statistics.median(ts) * 1e3, 3)
            for k in impls:
                if k != "scan":  # ratio per repetition (measured side by side), then the median
                    row[f"speedup_vs_{k}"] = round(statistics.median(
                        [a / b for a, b in zip(times[k], times["scan"])]), 2)
            row["max_abs_err_scan_vs_fp64"] = err_scan
            row["max_abs_err_s3ac_loop_vs_fp64"] = err_s3ac
            row["max_abs_err_verl_loop_fp32_vs_fp64"] = err_loop
            print_json(row)


def _naive_logprobs(hidden, weight, targets, temperature):
    """What the chunked op replaces: full [N, V] logits and log-softmax."""
    logp_all = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)  # [N, V]
    logp = logp_all.gather(1, targets[:, None])[:, 0]  # [N]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp, entropy


def _logprobs_worker(impl: str, N: int, H: int, V: int) -> None:
    """One measurement in a fresh process: time of forward + backward, and the peak resident-memory increase
    over the inputs (Linux VmHWM after resetting it through /proc/self/clear_refs; ru_maxrss as a fallback)."""
    import json
    import re
    import resource
    import time

    def rss_kib(field):
        with open("/proc/self/status") as f:
            return int(re.search(field + r":\s+(\d+)", f.read()).group(1))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden = torch.randn(N, H).requires_grad_()
    weight = torch.randn(V, H).mul_(H ** -0.5).requires_grad_()
    targets = torch.randint(0, V, (N,))
    upstream = torch.randn(N)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS mark to the current RSS
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss (peak may include input setup)"
    base = rss_kib("VmRSS")
    fn = logprobs_from_hidden_ref if impl == "chunked" else _naive_logprobs
    t0 = time.perf_counter()
    logp, _ = fn(hidden, weight, targets, 1.0)
    (logp * upstream).sum().backward()
    elapsed = time.perf_counter() - t0
    peak = rss_kib("VmHWM") if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grads = (hidden.numel() + weight.numel()) * 4
    print(json.dumps({"time_s": elapsed, "peak_extra_bytes": (peak - base) * 1024, "grad_bytes": grads,
                      "method": method}))


def _bench_logprobs_cpu(print_json):
    import json
    import statistics
    import subprocess

    H, V = 1536, 151936
    env = dict(os.environ, OMP_NUM_THREADS="1", S3AC_KERNELS="torch")
    for N, reps in [(256, 3), (1024, 2), (4096, 1)]:
        impls = ["chunked", "naive"]
        try:
            import psutil

            available = psutil.virtual_memory().available
        except ImportError:
            available = float("inf")
        need = 4 * N * V * 4 + 2 * V * H * 4  # rough peak of the naive path: four [N, V] fp32 buffers
        skipped = None
        if need > 0.8 * available:
            impls, skipped = ["chunked"], f"naive skipped: needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} free"
        res = {k: [] for k in impls}
        for rep in range(reps):
            for k in (impls if rep % 2 == 0 else impls[::-1]):
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--logprobs-worker", k, str(N),
                                      str(H), str(V)], env=env, capture_output=True, text=True, check=True)
                res[k].append(json.loads(out.stdout.strip().splitlines()[-1]))
        row = {"op": "logprobs_from_hidden", "device": "cpu", "dtype": "float32", "N": N, "H": H, "V": V,
               "reps": reps, "threads": 1,
               "memory": "fresh process per run; peak RSS (" + res["chunked"][0]["method"] + ") minus RSS after "
                         "the inputs were built; it includes the [V,H] + [N,H] gradients, which *_minus_grads "
                         "subtracts"}
        for k, rs in res.items():
            row[f"{k}_fwd_bwd_s"] = round(statistics.median(r["time_s"] for r in rs), 3)
            extra = statistics.median(r["peak_extra_bytes"] for r in rs)
            row[f"{k}_peak_extra_MiB"] = round(extra / 2**20, 1)
            row[f"{k}_peak_extra_minus_grads_MiB"] = round((extra - rs[0]["grad_bytes"]) / 2**20, 1)
        if "naive" in res:
            row["time_ratio_chunked_over_naive"] = round(statistics.median(
                c["time_s"] / n["time_s"] for c, n in zip(res["chunked"], res["naive"])), 3)
            row["memory_ratio_chunked_over_naive_minus_grads"] = round(
                row["chunked_peak_extra_minus_grads_MiB"] / row["naive_peak_extra_minus_grads_MiB"], 3)
        row["naive_full_logits_MiB"] = round(N * V * 4 / 2**20, 1)
        if skipped:
            row["note"] = skipped
        print_json(row)


def _cuda_time_us(fn, warmup=3, reps=20):
    """Median wall time of fn() in microseconds, with CUDA events."""
    import statistics

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


GAE_TARGET_PCT_OF_COPY_BW = 70.0  # GAE reads and writes every element once, so a copy is its speed limit


def _bench_gpu(print_json):
    """The GPU section, one JSON line per op: copy bandwidth, GAE at [512, 8192], the fused losses forward and
    forward + backward, log-prob peak memory against the naive path. A section that raises prints
    {"op": ..., "error": ...} and the next section runs. "ref" is the s3ac.py function of the same math."""
    import traceback

    import s3ac

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    B, T = 512, 8192
    state = {}  # "copy_GB_s": the bandwidth that the other sections are compared with

    def section(op, fn):
        try:
            fn()
        except Exception as e:  # one kernel the compiler rejects must not hide the other numbers
            traceback.print_exc()
            print_json({"op": op, "device": name, "error": f"{type(e).__name__}: {e}"[:2000]})
        torch.cuda.empty_cache()

    def pct_of_copy(nbytes, us):
        copy = state.get("copy_GB_s")
        return round(100 * nbytes / (us * 1e3) / copy, 1) if copy else None

    def copy():  # read + write of 1 GiB
        src = torch.empty(2**28, device=dev, dtype=torch.float32).normal_()
        dst = torch.empty_like(src)
        us = _cuda_time_us(lambda: dst.copy_(src))
        nbytes = 2 * src.numel() * 4
        state["copy_GB_s"] = nbytes / (us * 1e3)
        print_json({"op": "copy", "device": name, "bytes": nbytes, "us": round(us, 1),
                    "GB_s": round(state["copy_GB_s"], 1)})

    def gae_bench():  # [512, 8192] fp32, bool mask
        rewards, values, masks = _bench_gae_inputs(B, T)
        rewards, values = rewards.to(dev), values.to(dev)
        mask = masks["with_gaps"].to(dev).bool()
        lam = 0.95
        adv_t, _ = _gae_triton(rewards, values, mask, 1.0, lam)
        adv_r, _ = s3ac.gae(rewards, values, mask, 1.0, lam)
        err = (adv_t - adv_r).abs().max().item()
        nbytes = B * T * (4 + 4 + 1 + 4 + 4)  # read rewards, values, mask; write advantages, returns
        us_t = _cuda_time_us(lambda: _gae_triton(rewards, values, mask, 1.0, lam))
        us_r = _cuda_time_us(lambda: s3ac.gae(rewards, values, mask, 1.0, lam), warmup=1, reps=3)  # a loop over T
        us_loop = _cuda_time_us(lambda: _gae_verl_loop(rewards, values, mask.float(), 1.0, lam), warmup=1, reps=3)
        pct = pct_of_copy(nbytes, us_t)
        copy = state.get("copy_GB_s")
        print_json({"op": "gae_triton", "device": name, "shape": [B, T], "dtype": "float32", "us": round(us_t, 1),
                    "bytes": nbytes, "GB_s": round(nbytes / (us_t * 1e3), 1), "pct_of_copy_bw": pct,
                    "us_at_copy_bw": round(nbytes / (copy * 1e3), 1) if copy else None,
                    "target_pct_of_copy_bw": GAE_TARGET_PCT_OF_COPY_BW,
                    "meets_target": pct is not None and pct >= GAE_TARGET_PCT_OF_COPY_BW,
                    "ref_us": round(us_r, 1), "verl_loop_us": round(us_loop, 1),
                    "speedup_vs_ref": round(us_r / us_t, 2), "speedup_vs_verl_loop": round(us_loop / us_t, 1),
                    "max_abs_diff_vs_ref": err})

    def losses():  # forward, and forward + backward, [512, 8192] fp32
        g = torch.Generator(device=dev).manual_seed(0)
        mask = _bench_gae_inputs(B, T)[2]["with_gaps"].to(dev).bool()
        old = -torch.rand(B, T, device=dev, generator=g)
        new = (old + 0.3 * torch.randn(B, T, device=dev, generator=g)).requires_grad_()
        other = torch.randn(B, T, device=dev, generator=g)  # advantages, returns or BCE targets
        n_tok = mask.sum().float()

        def forward(fn, *args):
            return lambda: fn(new, *args, n_tok)

        def forward_backward(fn, *args):
            def run():
                new.grad = None
                loss, _ = fn(new, *args, n_tok)
                loss.backward()
            return run

        bce_targets = torch.rand(B, T, device=dev, generator=g)
        for op, fn_t, fn_r, args, n_in in [
            ("cispo_loss", _cispo_loss_triton, s3ac.cispo_loss, (old, other, mask, 0.2, 0.28), 3),
            ("value_loss", _value_loss_triton, s3ac.value_loss, (old, other, mask, 0.2), 3),
            ("bce_value_loss", _bce_value_loss_triton, s3ac.bce_value_loss, (bce_targets, mask), 2),
        ]:
            fwd_bytes = B * T * (4 * n_in + 1 + 4)  # fp32 inputs and the mask in, the gradient coefficient out
            bwd_bytes = B * T * (4 + 4)  # the coefficient in, the gradient out
            grads = []
            for fn in (fn_t, fn_r):
                forward_backward(fn, *args)()
                grads.append(new.grad.clone())
            loss_diff = (fn_t(new, *args, n_tok)[0] - fn_r(new, *args, n_tok)[0]).abs().item()
            us = {impl: (_cuda_time_us(forward(fn, *args)), _cuda_time_us(forward_backward(fn, *args)))
                  for impl, fn in (("triton", fn_t), ("ref", fn_r))}
            print_json({"op": op, "impl": "triton", "device": name, "shape": [B, T], "dtype": "float32",
                        "fwd_us": round(us["triton"][0], 1), "fwd_pct_of_copy_bw": pct_of_copy(fwd_bytes,
                                                                                                us["triton"][0]),
                        "fwd_bwd_us": round(us["triton"][1], 1),
                        "fwd_bwd_pct_of_copy_bw": pct_of_copy(fwd_bytes + bwd_bytes, us["triton"][1]),
                        "ref_fwd_us": round(us["ref"][0], 1), "ref_fwd_bwd_us": round(us["ref"][1], 1),
                        "speedup_fwd_bwd_vs_ref": round(us["ref"][1] / us["triton"][1], 2),
                        "loss_abs_diff_vs_ref": loss_diff,
                        "grad_max_abs_diff_vs_ref": (grads[0] - grads[1]).abs().max().item()})

    def logprobs(dtype):  # peak memory above the inputs, against the naive path that holds the [N, V] logits
        N, H, V = 8192, 1536, 151936
        g = torch.Generator(device=dev).manual_seed(0)
        hidden = torch.randn(N, H, device=dev, generator=g).to(dtype).requires_grad_()
        weight = (torch.randn(V, H, device=dev, generator=g) * H ** -0.5).to(dtype).requires_grad_()
        targets = torch.randint(0, V, (N,), device=dev, generator=g)
        rows = {}
        for label, fn in [("naive", _naive_logprobs), ("triton", _logprobs_from_hidden_triton),
                          ("ref", logprobs_from_hidden_ref)]:
            def run():
                hidden.grad = weight.grad = None
                logp, _ = fn(hidden, weight, targets, 1.0)
                logp.sum().backward()
                return logp.detach()
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            logp = run()
            torch.cuda.synchronize()
            peak_extra = torch.cuda.max_memory_allocated() - base
            grads = (hidden.numel() + weight.numel()) * dtype.itemsize
            rows[label] = {"op": "logprobs_from_hidden_fwd_bwd", "impl": label, "device": name, "N": N, "H": H,
                           "V": V, "dtype": str(dtype).removeprefix("torch."),
                           "ms": round(_cuda_time_us(run, warmup=1, reps=5) / 1e3, 2),
                           "peak_extra_MiB": round(peak_extra / 2**20, 1),
                           "peak_extra_minus_grads_MiB": round((peak_extra - grads) / 2**20, 1),
                           "full_logits_MiB": round(N * V * dtype.itemsize / 2**20, 1)}
            if label == "naive":
                naive_logp, naive_peak = logp, peak_extra
            else:
                rows[label].update(peak_ratio_vs_naive=round(peak_extra / naive_peak, 3),
                                   never_held_full_logits=bool(peak_extra - grads < N * V * dtype.itemsize),
                                   max_abs_diff_logp_vs_naive=(logp - naive_logp).abs().max().item())
            del logp
        for row in rows.values():
            print_json(row)

    section("copy", copy)
    section("gae_triton", gae_bench)
    section("losses", losses)
    section("logprobs_from_hidden_fwd_bwd", lambda: logprobs(torch.float32))  # what s3ac.py's Policy runs
    section("logprobs_from_hidden_fwd_bwd", lambda: logprobs(torch.bfloat16))


def _main(argv):
    import json

    def print_json(row):
        print(json.dumps(row), flush=True)

    if argv[:1] == ["--logprobs-worker"]:
        _logprobs_worker(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return
    gpu = torch.cuda.is_available() and HAS_TRITON
    if "--bench-gpu" in argv or ("--bench" in argv and gpu):
        if not gpu:
            raise SystemExit("--bench-gpu needs CUDA and triton")
        _bench_gpu(print_json)
        return
    if "--bench" in argv or "--bench-cpu" in argv:
        torch.set_num_threads(1)
        _bench_gae_cpu(print_json)
        _bench_logprobs_cpu(print_json)
        return
    print(__doc__)


if __name__ == "__main__":
    _main(sys.argv[1:])
