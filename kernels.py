"""Fused kernels for S3AC: GAE, the CISPO policy loss, the clipped and the BCE value losses, and log-probs
computed from hidden states without materialising the [N, V] logits.

The math is in s3ac.py; this file makes it fast. For GAE and the three losses the readable PyTorch definition is
the s3ac.py function of the same name (`gae`, `cispo_loss`, `value_loss`, `bce_value_loss`); this file holds, per
op, in this order:

    _name_kernel (Triton, @triton.jit)  ->  launcher / autograd.Function  ->  name (same signature as s3ac.name)

`name` here always runs Triton. s3ac.py dispatches at one point: its function of the same name runs
kernels.name when `use_triton(first tensor argument)` holds, else its own PyTorch definition. What runs where:

    backend   CUDA tensor, Triton imports   CPU tensor, or no Triton           set by
    "auto"    kernels.name (Triton)         s3ac.name (gae: the reverse loop)  the default
    "triton"  kernels.name (Triton)         kernels.name (TRITON_INTERPRET=1)  --kernels triton
    "torch"   s3ac.name                     s3ac.name                          --kernels torch

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

s3ac.py imports this file as module `s3ac_kernels`; elsewhere, `from s3ac import kernels` (the name `kernels` is
Hugging Face's kernel-hub package, which transformers >= 5.25 imports). This file never imports s3ac.
Tests: pytest test_s3ac.py -k kernels (on the CPU under TRITON_INTERPRET=1). Benchmarks: python .ci/bench.py --help.
"""

from __future__ import annotations

import contextlib
import os

import torch
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
#
# The loop carries a state (A, V) leftwards: A the running advantage, V the next valid token's value (0, 0 past
# the row's end). A valid step t maps it to (gl * A + gamma * V + r_t - v_t, v_t) with gl = gamma * lam (that is
# A_t = delta_t + gl * A_{t+1}); a masked step leaves it. Any span of steps is such a map, five numbers
#     A <- P * A + K * V + S,     V <- F if H else V       (H: the span holds a valid token; F: its earliest value)
# and spans compose associatively (_gae_combine), so rows are cut into chunks of BLOCK_T steps, two launches:
#   (a) _gae_summary_kernel, a program per (row, chunk): its chunk's map (chunk 0's is never needed; T <= BLOCK_T
#       skips this launch);
#   (b) _gae_kernel, a program per (row, chunk): folds the later chunks' maps into the state (A_in, V_in) entering
#       its chunk, scans the chunk and writes A_t = P_t * A_in + K_t * V_in + S_t and R_t = A_t + v_t.
# A result only ever combines steps at or after it (never a 1 / gl factor): a huge early value cannot disturb
# later positions and gamma * lam = 1 stays exact. Inputs are read twice (once per launch), outputs written once.
# ---------------------------------------------------------------------------------------------------------

GAE_BLOCK_T = 2048  # time steps per program (one chunk); a runtime T never changes the compiled kernels
GAE_NUM_WARPS = 8
GAE_BLOCK_C = 64  # chunk maps folded per step of _gae_kernel's carry loop


@_jit
def _gae_combine(p1, k1, s1, h1, f1, p2, k2, s2, h2, f2):
    # Scan combine of two span maps: span 1 holds the LATER time steps and is applied first, span 2 after it.
    #   A <- P2 * (P1 * A + K1 * V + S1) + K2 * V1' + S2   with V1' = F1 if H1 else V, so K2 reaches V only
    #   when span 1 has no valid token, and otherwise multiplies its earliest value F1 (F is 0 when H is, so
    #   K2 * F1 needs no select).
    p = p1 * p2
    k = p2 * k1 + tl.where(h1 != 0, 0.0, k2)
    s = p2 * s1 + s2 + k2 * f1
    return p, k, s, h1 | h2, tl.where(h2 != 0, f2, f1)


@_jit
def _gae_chunk_load(rewards_ptr, values_ptr, mask_ptr, row_start, chunk, T, BLOCK_T: tl.constexpr):
    # The chunk's positions in reversed order (i = 0 is its latest time step), so the backward-in-time recursion
    # is a FORWARD associative scan; we do not use `tl.associative_scan(..., reverse=True)`: triton-lang/triton#4362
    # reports wrong GPU results for reverse scans with non-commutative combines.
    i = tl.arange(0, BLOCK_T)
    t = chunk.to(tl.int64) * BLOCK_T + (BLOCK_T - 1 - i)  # [BLOCK_T] time index, decreasing with i
    in_row = t < T
    valid = tl.load(mask_ptr + row_start + t, mask=in_row, other=0) != 0
    r = tl.load(rewards_ptr + row_start + t, mask=valid, other=0.0).to(tl.float32)  # padding is never read
    v = tl.load(values_ptr + row_start + t, mask=valid, other=0.0).to(tl.float32)
    return t, in_row, valid, r, v


@_jit
def _gae_chunk_scan(valid, r, v, gamma, gl):
    # Element i of the scan: the map of positions t .. chunk end (each step's own map: see the section comment)
    return tl.associative_scan((tl.where(valid, gl, 1.0), tl.where(valid, gamma, 0.0), r - v, valid.to(tl.int32), v),
                               0, _gae_combine)


@_jit
def _lane(x, pick):
    return tl.sum(tl.where(pick, x, 0), 0)  # the one element of x where pick holds


@_jit(do_not_specialize=["T"])
def _gae_summary_kernel(rewards_ptr, values_ptr, mask_ptr, lam_ptr, summary_ptr, T, gamma, lam,
                        BLOCK_T: tl.constexpr, LAM_PER_ROW: tl.constexpr):
    # Launch (a): grid (B, n_chunks - 1). Writes the map of chunk c = 1 + program_id(1) of its row to
    # summary[:, row, c], a [5, B, n_chunks] fp32 tensor (P, K, S, H, F; H as 0.0 / 1.0).
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1) + 1
    gl = gamma * (tl.load(lam_ptr + row).to(tl.float32) if LAM_PER_ROW else lam)
    _, _, valid, r, v = _gae_chunk_load(rewards_ptr, values_ptr, mask_ptr, row * T, chunk, T, BLOCK_T)
    p, k, s, h, f = _gae_chunk_scan(valid, r, v, gamma, gl)
    i = tl.arange(0, BLOCK_T)
    last = i == BLOCK_T - 1  # the scan's last element is the whole chunk: store that one lane only
    at = summary_ptr + row * tl.cdiv(T, BLOCK_T) + chunk + 0 * i.to(tl.int64)  # [BLOCK_T] all the same address
    stride = tl.num_programs(0).to(tl.int64) * tl.cdiv(T, BLOCK_T)  # B * n_chunks
    tl.store(at, p, mask=last)
    tl.store(at + stride, k, mask=last)
    tl.store(at + 2 * stride, s, mask=last)
    tl.store(at + 3 * stride, h.to(tl.float32), mask=last)
    tl.store(at + 4 * stride, f, mask=last)


@_jit(do_not_specialize=["T"])
def _gae_kernel(rewards_ptr, values_ptr, mask_ptr, lam_ptr, summary_ptr, adv_ptr, ret_ptr, T, gamma, lam,
                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, LAM_PER_ROW: tl.constexpr):
    # Launch (b): grid (B, n_chunks), walked backwards (the first programs take the last rows' last chunks, which
    # launch (a) read last, so part of them may still sit in L2).
    n_chunks = tl.cdiv(T, BLOCK_T)
    row = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    chunk = n_chunks - 1 - tl.program_id(1)
    gl = gamma * (tl.load(lam_ptr + row).to(tl.float32) if LAM_PER_ROW else lam)
    t, in_row, valid, r, v = _gae_chunk_load(rewards_ptr, values_ptr, mask_ptr, row * T, chunk, T, BLOCK_T)

    # While those loads are in flight, the state entering this chunk: the maps of chunks n_chunks - 1, ...,
    # chunk + 1 (latest first) applied to (A, V) = (0, 0), BLOCK_C maps per step (padding: the identity 1, 0, 0, 0, 0).
    stride = tl.num_programs(0).to(tl.int64) * n_chunks
    j = tl.arange(0, BLOCK_C)
    last = j == BLOCK_C - 1
    a_in, v_in = 0.0, 0.0
    for k0 in range(0, n_chunks - 1 - chunk, BLOCK_C):
        c = n_chunks - 1 - k0 - j  # [BLOCK_C] chunk index, decreasing
        m = c > chunk
        at = summary_ptr + row * n_chunks + c
        p, k, s, h, f = tl.associative_scan((tl.load(at, mask=m, other=1.0), tl.load(at + stride, mask=m, other=0.0),
                                             tl.load(at + 2 * stride, mask=m, other=0.0),
                                             (tl.load(at + 3 * stride, mask=m, other=0.0) != 0).to(tl.int32),
                                             tl.load(at + 4 * stride, mask=m, other=0.0)), 0, _gae_combine)
        a_in = _lane(p, last) * a_in + _lane(k, last) * v_in + _lane(s, last)  # the block's map: its last lane
        v_in = tl.where(_lane(h, last) != 0, _lane(f, last), v_in)

    p, k, s, _, _ = _gae_chunk_scan(valid, r, v, gamma, gl)
    adv = p * a_in + k * v_in + s  # A_t = the map of positions t .. chunk end applied to the entering state
    tl.store(adv_ptr + row * T + t, tl.where(valid, adv, 0.0), mask=in_row)
    tl.store(ret_ptr + row * T + t, tl.where(valid, adv + v, 0.0), mask=in_row)


def _gae_triton(rewards, values, response_mask, gamma, lam, block_t=None, num_warps=None):
    """Launches (a) and (b) with block_t time steps per program (default GAE_BLOCK_T; num_warps: GAE_NUM_WARPS).
    Returns (advantages, returns, the chunk maps [5, B, n_chunks] fp32 (P, K, S, H, F), chunk 0's never written)."""
    B, T = rewards.shape
    block_t, num_warps = block_t or GAE_BLOCK_T, num_warps or GAE_NUM_WARPS
    n_chunks = triton.cdiv(T, block_t)
    adv = torch.empty(B, T, device=rewards.device, dtype=torch.float32)
    ret = torch.empty_like(adv)
    summary = torch.empty(5, B, n_chunks, device=rewards.device, dtype=torch.float32)
    if B == 0 or T == 0:
        return adv, ret, summary
    mask = response_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    per_row = isinstance(lam, Tensor)
    inputs = (rewards.contiguous(), values.contiguous(), mask,
              _row_lambda(lam, B, rewards.device) if per_row else mask)  # (an unread pointer for a float lam)
    scalars = (T, float(gamma), 0.0 if per_row else float(lam))
    if n_chunks > 1:
        _gae_summary_kernel[(B, n_chunks - 1)](*inputs, summary, *scalars, BLOCK_T=block_t, LAM_PER_ROW=per_row,
                                               num_warps=num_warps)
    _gae_kernel[(B, n_chunks)](*inputs, summary, adv, ret, *scalars, BLOCK_T=block_t, BLOCK_C=GAE_BLOCK_C,
                               LAM_PER_ROW=per_row, num_warps=num_warps)
    return adv, ret, summary


def gae(rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam) -> tuple[Tensor, Tensor]:
    """Token-level GAE as a chunked parallel scan in Triton: s3ac.gae's signature, contract and result (to fp32
    rounding).

    rewards, values, response_mask: [B, T] (padding may hold NaN or inf); gamma: float; lam: float or Tensor [B].
    Returns (advantages, returns), both [B, T] fp32, 0 at masked positions. Source: Schulman et al. 2016, eq. 16.
    Raises ValueError if the tensors are not of one shape [B, T] or lam has the wrong length; RuntimeError when
    Triton cannot run on these tensors (no Triton, or CPU tensors without TRITON_INTERPRET=1).
    """
    _check_same_shape(rewards=rewards, values=values, response_mask=response_mask)
    _require_triton(rewards)
    return _gae_triton(rewards, values, response_mask, gamma, lam)[:2]


# ---------------------------------------------------------------------------------------------------------
# 2. CISPO policy loss
#
# CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", Sec. 3.1):
#     J = sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * log pi(token),   ratio = pi / pi_old
# The clipped ratio is a stop-gradient weight, so every token keeps a gradient (unlike PPO clipping).
# The readable definition is s3ac.cispo_loss.
#
# The three fused losses share one shape, one launch forward and one multiply backward: a program reads a block
# of tokens once, writes d(loss)/d(input) for an upstream gradient of 1 (divided by num_tokens, read from a device
# tensor: no host sync) and adds its block sums to the loss and metrics in the same launch (_finish_loss_sums).
# ---------------------------------------------------------------------------------------------------------

LOSS_BLOCK = 4096  # tokens per program of the fused losses
LOSS_NUM_WARPS = 8
LOSS_RBLOCK = 1024  # block sums added per step by the program that finishes a loss


@_jit
def _finish_loss_sums(partial_ptr, out_ptr, n_tok, s0, s1, s2, RBLOCK: tl.constexpr):
    # A deterministic sum over programs inside the launch: each program stores its block sums in partial [3,
    # programs], then draws a ticket from the counter out[3] (an fp32 count, exact below 2^24 programs); the one
    # with the last ticket adds every block sum in program order and writes out[0:3] = sums / num_tokens. The
    # ticket's acquire-release order (after a barrier) makes the others' stores visible; volatile loads skip L1.
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    tl.store(partial_ptr + pid, s0)
    tl.store(partial_ptr + n + pid, s1)
    tl.store(partial_ptr + 2 * n + pid, s2)
    tl.debug_barrier()
    if tl.atomic_add(out_ptr + 3, 1.0, sem="acq_rel") == n - 1:
        k = tl.arange(0, 4)
        acc = tl.zeros([4, RBLOCK], dtype=tl.float32)  # [sum, block]; row 3 stays 0
        for start in range(0, n, RBLOCK):
            offs = start + tl.arange(0, RBLOCK)
            at = partial_ptr + k[:, None] * n + offs[None, :]
            acc += tl.load(at, mask=(k[:, None] < 3) & (offs[None, :] < n), other=0.0, volatile=True)
        tl.store(out_ptr + k, tl.sum(acc, 1) / n_tok, mask=k < 3)


@_jit(do_not_specialize=["n_elements"])
def _cispo_kernel(logp_ptr, old_logp_ptr, adv_ptr, mask_ptr, n_tok_ptr, grad_ptr, partial_ptr, out_ptr, n_elements,
                  eps_low, eps_high, BLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    # One program per BLOCK tokens of the flattened [B*T] batch. Writes d loss / d logprob (upstream 1) and
    # out = [loss, clipped share, k3 KL, ticket count].
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = tl.load(mask_ptr + offs, mask=offs < n_elements, other=0) != 0
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0).to(tl.float32)  # padding is never read
    old_logp = tl.load(old_logp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    n_tok = tl.load(n_tok_ptr).to(tl.float32)
    log_ratio = logp - old_logp
    ratio = tl.exp(log_ratio)
    weight = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)  # sg(clip(ratio))
    coef = tl.where(valid, -weight * adv, 0.0)  # d(-J)/d logp with the weight held constant
    clipped = valid & ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high))
    kl = tl.where(valid, (ratio - 1.0) - log_ratio, 0.0)  # k3 estimator of KL(old || new)
    tl.store(grad_ptr + offs, coef * (1.0 / n_tok), mask=offs < n_elements)
    _finish_loss_sums(partial_ptr, out_ptr, n_tok, tl.sum(coef * logp, 0), tl.sum(clipped.to(tl.float32), 0),
                      tl.sum(kl, 0), RBLOCK)


def _loss_launch(kernel, inputs, response_mask, num_tokens, scalars):
    """kernel(*inputs, mask, num_tokens, grad, partial, out, n_elements, *scalars), one launch. Returns (grad =
    d loss / d inputs[0] for an upstream gradient of 1, fp32 [B, T]; out = [loss, metric, metric, tickets] fp32)."""
    n_elements = inputs[0].numel()
    n_blocks = triton.cdiv(n_elements, LOSS_BLOCK)
    device = inputs[0].device
    grad = torch.empty(inputs[0].shape, device=device, dtype=torch.float32)
    partial = torch.empty(3, max(n_blocks, 1), device=device, dtype=torch.float32)
    out = torch.zeros(4, device=device, dtype=torch.float32)
    mask = response_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    if n_blocks:
        kernel[(n_blocks,)](*(x.detach().contiguous() for x in inputs), mask, _num_tokens(response_mask, num_tokens),
                            grad, partial, out,
                            n_elements, *scalars, BLOCK=LOSS_BLOCK, RBLOCK=LOSS_RBLOCK, num_warps=LOSS_NUM_WARPS)
    return grad, out


def _num_tokens(response_mask: Tensor, num_tokens) -> Tensor:
    """The loss normaliser as an fp32 tensor on the mask's device (read there: no host sync): `num_tokens` (a number
    or tensor), else the valid tokens (at least 1; one more pass over the mask; the training loop passes it)."""
    if num_tokens is None:
        return (response_mask != 0).sum().clamp(min=1).float()
    if isinstance(num_tokens, Tensor):
        return num_tokens.to(device=response_mask.device, dtype=torch.float32)
    return torch.full((), float(num_tokens), device=response_mask.device, dtype=torch.float32)


def _loss_outputs(ctx, grad, out, dtype):
    """What each fused loss's forward returns, (loss, metrics = out[1:3]), and saves: the gradient only."""
    ctx.save_for_backward(grad)
    ctx.dtype = dtype
    metrics = out[1:3]
    ctx.mark_non_differentiable(metrics)
    return out[0], metrics


class _CispoLossFn(torch.autograd.Function):
    """Fused CISPO loss: one launch computes the loss, its metrics and its gradient; backward scales that."""

    @staticmethod
    def forward(ctx, logprobs, old_logprobs, advantages, response_mask, eps_low, eps_high, num_tokens):
        grad, out = _loss_launch(_cispo_kernel, (logprobs, old_logprobs, advantages), response_mask, num_tokens,
                                 (float(eps_low), float(eps_high)))
        return _loss_outputs(ctx, grad, out, logprobs.dtype)

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics):
        # loss = (1 / n) * sum_t  -w_t * A_t * logp_t        with w_t = sg(clip(exp(logp_t - old_t), ...)) constant
        # d loss / d logp_t = -w_t * A_t / n  on valid tokens, 0 on masked ones: the kernel's grad_t
        # chain rule with the scalar upstream gradient g:  grad_logp_t = g * grad_t
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.dtype), None, None, None, None, None, None


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
    loss, metrics = _CispoLossFn.apply(logprobs, old_logprobs, advantages, response_mask, eps_low, eps_high,
                                       num_tokens)
    return loss, {"pg_clipfrac": metrics[0], "approx_kl": metrics[1]}


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
# The readable definitions are s3ac.value_loss and s3ac.bce_value_loss. Both have _cispo_kernel's shape.
# ---------------------------------------------------------------------------------------------------------


@_jit(do_not_specialize=["n_elements"])
def _value_loss_kernel(values_ptr, old_values_ptr, returns_ptr, mask_ptr, n_tok_ptr, grad_ptr, partial_ptr, out_ptr,
                       n_elements, eps_v, BLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    # Stores d loss / dV_t (see _ValueLossFn); out = [loss, clipped share, 0, ticket count].
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = tl.load(mask_ptr + offs, mask=offs < n_elements, other=0) != 0
    v = tl.load(values_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    v_old = tl.load(old_values_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    ret = tl.load(returns_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    n_tok = tl.load(n_tok_ptr).to(tl.float32)
    v_clip = tl.minimum(tl.maximum(v, v_old - eps_v), v_old + eps_v)
    err = v - ret
    err_clip = v_clip - ret
    use_clip = valid & (err_clip * err_clip > err * err)
    loss = 0.5 * tl.where(use_clip, err_clip * err_clip, err * err)
    coef = tl.where(use_clip, 0.0, tl.where(valid, err, 0.0))  # dL_t/dV_t, 0 on masked tokens
    tl.store(grad_ptr + offs, coef * (1.0 / n_tok), mask=offs < n_elements)
    _finish_loss_sums(partial_ptr, out_ptr, n_tok, tl.sum(tl.where(valid, loss, 0.0), 0),
                      tl.sum(use_clip.to(tl.float32), 0), 0.0, RBLOCK)


class _ValueLossFn(torch.autograd.Function):
    """Fused clipped value loss: one launch computes the loss, the clip share and the gradient."""

    @staticmethod
    def forward(ctx, values, old_values, returns, response_mask, eps_v, num_tokens):
        grad, out = _loss_launch(_value_loss_kernel, (values, old_values, returns), response_mask, num_tokens,
                                 (float(eps_v),))
        return _loss_outputs(ctx, grad, out, values.dtype)

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics):
        # Per valid token, L = 0.5 * max(e^2, e_c^2) with e = V - R and e_c = clip(V, V_old - eps, V_old + eps) - R.
        #  - unclipped branch wins (e^2 >= e_c^2):   dL/dV = e
        #  - clipped branch strictly larger:        then clip(V, ...) != V, so V lies strictly outside
        #    [V_old - eps, V_old + eps], the clip is flat there and dL/dV = e_c * d clip/dV = 0.
        # Inside the range clip(V, ...) == V exactly, so the branches tie and the first case applies.
        # The kernel stored grad_t = dL_t/dV_t / n (0 on masked tokens); loss = sum_t L_t / n, upstream scalar g:
        #     grad_V_t = g * grad_t
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.dtype), None, None, None, None, None


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
    loss, metrics = _ValueLossFn.apply(values, old_values, returns, response_mask, eps_v, num_tokens)
    return loss, {"v_clipfrac": metrics[0]}


@_jit(do_not_specialize=["n_elements"])
def _bce_value_loss_kernel(logits_ptr, targets_ptr, mask_ptr, n_tok_ptr, grad_ptr, partial_ptr, out_ptr, n_elements,
                           BLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    # Stores d loss / dz_t = (sigmoid(z_t) - y_t) / n (see _BceValueLossFn); out = [loss, 0, 0, ticket count].
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = tl.load(mask_ptr + offs, mask=offs < n_elements, other=0) != 0
    z = tl.load(logits_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    y = tl.load(targets_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    n_tok = tl.load(n_tok_ptr).to(tl.float32)
    softplus = tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))  # log(1 + e^z) without overflow
    loss = tl.where(valid, softplus - y * z, 0.0)
    coef = tl.where(valid, tl.sigmoid(z) - y, 0.0)
    tl.store(grad_ptr + offs, coef * (1.0 / n_tok), mask=offs < n_elements)
    _finish_loss_sums(partial_ptr, out_ptr, n_tok, tl.sum(loss, 0), 0.0, 0.0, RBLOCK)


class _BceValueLossFn(torch.autograd.Function):
    """Fused soft-BCE value loss: one launch computes the loss and the gradient."""

    @staticmethod
    def forward(ctx, value_logits, targets, response_mask, num_tokens):
        grad, out = _loss_launch(_bce_value_loss_kernel, (value_logits, targets), response_mask, num_tokens, ())
        return _loss_outputs(ctx, grad, out, value_logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics):
        # L_t = softplus(z_t) - y_t * z_t;  d softplus(z)/dz = sigmoid(z)  =>  dL_t/dz_t = sigmoid(z_t) - y_t, so the
        # kernel's grad_t = (sigmoid(z_t) - y_t) / n (0 on masked tokens); upstream scalar g:  grad_z_t = g * grad_t
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.dtype), None, None, None


def bce_value_loss(value_logits: Tensor, targets: Tensor, response_mask: Tensor, num_tokens=None) -> tuple[Tensor, dict]:
    """Soft BCE value loss fused into one kernel: s3ac.bce_value_loss's signature and contract.

        loss = sum_{valid t} (softplus(z_t) - y_t * z_t) / num_tokens,     d loss / d z_t = (sigmoid(z_t) - y_t) / n

    value_logits, targets, response_mask: [B, T]. Returns (v_loss, {}). Source: PACT's sigmoid critic.
    Raises ValueError if the three tensors are not of one shape [B, T]; RuntimeError when Triton cannot run here.
    """
    _check_same_shape(value_logits=value_logits, targets=targets, response_mask=response_mask)
    _require_triton(value_logits)
    return _BceValueLossFn.apply(value_logits, targets, response_mask, num_tokens)[0], {}


# ---------------------------------------------------------------------------------------------------------
# 4. Log-probs and entropy from hidden states
#
#     z = hidden @ weight.T / temperature,   logp(y) = z_y - logsumexp(z),   entropy = logsumexp(z) - sum_j p_j z_j
# computed block by block so that the [N, V] logits never exist: forward walks blocks of rows ([rows, V]),
# backward recomputes the logits in blocks of the vocabulary ([N, V_chunk]) from the saved per-row logsumexp.
# ---------------------------------------------------------------------------------------------------------

LOGITS_CHUNK_ELEMENTS = 1 << 24  # logits held at once (rows * V forward, N * V_chunk backward): 64 MiB in fp32
# The head's fp32 matmuls on CUDA: "tf32" (inputs rounded to 10 mantissa bits, fp32 accumulation), or "ieee". Chosen
# by measurement (.ci/head_precision.py): TF32's log-prob error is a twelfth of what the bf16 trunk already carries,
# its arithmetic a seventh of fp32's. CPU matmuls are fp32 whatever this says.
HEAD_FP32_PRECISION = "tf32"


@contextlib.contextmanager
def head_matmul_precision(device_type: str):
    """HEAD_FP32_PRECISION for CUDA's fp32 matmuls inside the block, the process-wide setting restored after (so
    torch's legacy TF32 getters, which raise once the new API is set, still read outside). Other devices: no-op."""
    if device_type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    name, value = (("fp32_precision", HEAD_FP32_PRECISION) if hasattr(matmul, "fp32_precision")  # torch >= 2.9
                   else ("allow_tf32", HEAD_FP32_PRECISION == "tf32"))  # the legacy flag of older torch
    before = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


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
        with head_matmul_precision(hidden.device.type):
            for s in range(0, N, rows):
                logits = hidden[s:s + rows] @ weight.T  # [rows, V]  accumulates in fp32, output in input dtype
                lse[s:s + rows], logp[s:s + rows], entropy[s:s + rows] = stats(logits, targets[s:s + rows],
                                                                               temperature)
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
        with head_matmul_precision(hidden.device.type):
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
    accumulation inside; fp32 on CUDA as HEAD_FP32_PRECISION says, TF32); softmax, logsumexp, entropy and the
    weight-gradient sum run in fp32.

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
