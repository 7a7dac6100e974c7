"""Tests for kernels.py: every op on both backends (the Triton kernels run on CPU tensors through the Triton
interpreter), checked against an independent gold (a plain Python loop for GAE, fp64 autograd for the losses
and log-probs), plus hand-worked cases, traps and the backend switch."""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import (kernels imports it)

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels as K

_K_BACKENDS = ["torch"]
if K.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    _K_BACKENDS.append("triton")


@pytest.fixture(params=_K_BACKENDS)
def kbackend(request):
    """Runs the test once per available backend and restores "auto" afterwards."""
    K.set_backend(request.param)
    yield request.param
    K.set_backend("auto")


@pytest.fixture
def ktriton():
    """Forces the Triton backend (skips where it cannot run) and restores "auto" afterwards."""
    if "triton" not in _K_BACKENDS:
        pytest.skip("triton with TRITON_INTERPRET=1 not available")
    K.set_backend("triton")
    yield
    K.set_backend("auto")


# ------------------------------------------------------------------------------------------------- golds


def _k_gae_loop(rewards, values, mask, gamma, lam):
    """Gold GAE: the reversed Python loop on Python floats (fp64), skipping masked positions."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        lam_b = float(lam[b]) if isinstance(lam, torch.Tensor) else lam
        next_v, lastgaelam = 0.0, 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
                lastgaelam = delta + gamma * lam_b * lastgaelam
                next_v = float(values[b, t])
                adv[b, t] = lastgaelam
    ret = torch.where(mask.bool(), adv + values.double(), torch.zeros((), dtype=torch.float64))
    return adv, ret


def _k_rl_batch(B, T, seed, garbage=True, gap=True):
    """An RL-like batch: +-1 reward on each row's last valid token, values in (-1, 1), right padding (row 0 left
    padded), an interior masked span in row 1 if `gap`, a fully masked last row, and NaN / inf / 1e8 in every
    masked slot."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [B, T]
    mask[0] = mask[0].flip(0)
    if gap and B > 1 and T >= 8:
        mask[1, T // 4: T // 2] = 0.0  # interior span
        mask[1, -1] = 1.0
    if B > 2:
        mask[-1] = 0.0  # fully masked row
    values = torch.rand(B, T, generator=g) * 2 - 1
    rewards = torch.zeros(B, T)
    last = torch.where(mask.bool(), torch.arange(T).expand(B, T), -1).amax(1)  # [B] last valid index
    for b in range(B):
        if last[b] >= 0:
            rewards[b, last[b]] = 1.0 if torch.rand((), generator=g) < 0.5 else -1.0
    rewards += 0.01 * torch.randn(B, T, generator=g) * mask  # small dense shaping reward
    if garbage:
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e8])
        pick = torch.randint(0, 4, (B, T), generator=g)
        values = torch.where(mask.bool(), values, junk[pick])
        rewards = torch.where(mask.bool(), rewards, junk[pick.flip(1)])
    return rewards, values, mask


# ------------------------------------------------------------------------------------------------- backend


def test_kernels_set_backend_rejects_unknown_name():
    with pytest.raises(ValueError):
        K.set_backend("cuda")
    with pytest.raises(ValueError):
        K.set_backend("Torch")
    assert K.get_backend() in ("auto", "triton", "torch")


@pytest.mark.parametrize("name", ["gae", "cispo_loss", "value_loss", "bce_value_loss", "logprobs_from_hidden"])
def test_kernels_dispatch_follows_backend(monkeypatch, name):
    calls = []
    monkeypatch.setattr(K, f"_{name}_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(K, f"{name}_ref", lambda *a, **k: calls.append("torch"))
    x = torch.zeros(2, 3)
    args = {
        "gae": (x, x, x, 1.0, 0.95),
        "cispo_loss": (x, x, x, x, 0.2, 0.28),
        "value_loss": (x, x, x, x, 0.2),
        "bce_value_loss": (x, x, x),
        "logprobs_from_hidden": (x, torch.zeros(5, 3), torch.zeros(2, dtype=torch.long)),
    }[name]
    fn = getattr(K, name)
    try:
        K.set_backend("torch")
        fn(*args)
        K.set_backend("auto")  # CPU tensors: reference
        fn(*args)
        if "triton" in _K_BACKENDS:
            K.set_backend("triton")
            fn(*args)
    finally:
        K.set_backend("auto")
    assert calls == ["torch", "torch"] + (["triton"] if "triton" in _K_BACKENDS else [])


# ------------------------------------------------------------------------------------------------- GAE


def test_kernels_gae_hand_cases(kbackend):
    adv, ret = K.gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.0, 0.0, 100.0]]),
                     torch.tensor([[1.0, 1.0, 0.0]]), 1.0, 0.95)
    assert torch.allclose(adv, torch.tensor([[0.95, 1.0, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.95, 1.0, 0.0]]), atol=1e-6)
    adv, ret = K.gae(torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]]), torch.tensor([[0.5, 0.6, 0.7, 9.0, 9.0]]),
                     torch.tensor([[1, 1, 1, 0, 0]]), 1.0, 0.95)
    # deltas: 0.1, 0.1, 0.3  ->  A_2 = 0.3, A_1 = 0.1 + 0.95 * 0.3 = 0.385, A_0 = 0.1 + 0.95 * 0.385 = 0.46575
    assert torch.allclose(adv, torch.tensor([[0.46575, 0.385, 0.30, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.96575, 0.985, 1.0, 0.0, 0.0]]), atol=1e-6)
    # interior masked span: the value after the gap is the next value, the advantage crosses the gap
    adv, _ = K.gae(torch.tensor([[0.0, 5.0, 0.0, 1.0]]), torch.tensor([[0.2, -7.0, 0.4, 0.5]]),
                   torch.tensor([[True, False, True, True]]), 0.9, 0.5)
    a3 = 1.0 - 0.5
    a2 = 0.9 * 0.5 - 0.4 + 0.45 * a3
    a0 = 0.9 * 0.4 - 0.2 + 0.45 * a2
    assert torch.allclose(adv, torch.tensor([[a0, 0.0, a2, a3]]), atol=1e-6)


@pytest.mark.parametrize("gap", [True, False])
@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (3, 1000)])
def test_kernels_gae_matches_python_loop(kbackend, B, T, gap):
    rewards, values, mask = _k_rl_batch(B, T, seed=T, gap=gap)
    for gamma, lam in [(1.0, 0.95), (0.99, 0.9), (1.0, torch.linspace(0.5, 0.999, B))]:
        adv, ret = K.gae(rewards, values, mask, gamma, lam)
        gold_adv, gold_ret = _k_gae_loop(rewards, values, mask, gamma, lam)
        assert adv.dtype == torch.float32 and adv.shape == (B, T)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()  # no padding garbage leaked
        assert torch.allclose(adv.double(), gold_adv, atol=1e-5, rtol=1e-5)
        assert torch.allclose(ret.double(), gold_ret, atol=1e-5, rtol=1e-5)
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_kernels_gae_kernel_does_not_specialize_on_length():
    if not K.HAS_TRITON:
        pytest.skip("triton not installed")
    fn = K._gae_kernel  # a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1
    names = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize", [])
    assert "T" in [fn.arg_names[i] if isinstance(i, int) else i for i in names]  # a new length reuses the binary


def test_kernels_gae_triton_matches_reference(ktriton):
    rewards, values, mask = _k_rl_batch(5, 700, seed=7)
    lam = torch.tensor([0.9, 0.95, 1.0, 0.0, 0.5])
    adv_t, ret_t = K.gae(rewards, values, mask, 0.99, lam)
    adv_r, ret_r = K.gae_ref(rewards, values, mask, 0.99, lam)
    assert torch.allclose(adv_t, adv_r, atol=1e-5) and torch.allclose(ret_t, ret_r, atol=1e-5)


def test_kernels_gae_fully_masked_and_single_token(kbackend):
    adv, ret = K.gae(torch.tensor([[2.0], [float("nan")]]), torch.tensor([[3.0], [float("inf")]]),
                     torch.tensor([[1.0], [0.0]]), 1.0, 0.95)
    assert torch.equal(adv, torch.tensor([[-1.0], [0.0]])) and torch.equal(ret, torch.tensor([[2.0], [0.0]]))
    adv, ret = K.gae(torch.ones(3, 70), torch.ones(3, 70), torch.zeros(3, 70), 1.0, 1.0)
    assert (adv == 0).all() and (ret == 0).all()


@pytest.mark.parametrize("gap", [True, False])
def test_kernels_gae_huge_early_values_do_not_change_late_advantages(kbackend, gap):
    # gamma * lam = 1: an exact scan needs no 1 / (gamma * lam)^t rescaling, and late positions never see
    # early ones. T spans several chunks of both implementations.
    B, T, early = 3, 600, 5
    rewards, values, mask = _k_rl_batch(B, T, seed=3, garbage=False, gap=gap)
    mask[:, :early] = 1.0
    mask[0, early:] = 1.0  # row 0 was left padded
    adv, _ = K.gae(rewards, values, mask, 1.0, 1.0)
    huge_r, huge_v = rewards.clone(), values.clone()
    huge_r[:, :early] += 1e8
    huge_v[:, :early] -= 1e8
    adv_huge, _ = K.gae(huge_r, huge_v, mask, 1.0, 1.0)
    assert torch.equal(adv_huge[:, early:], adv[:, early:])  # bit-exact
    assert (adv_huge[:, :early] - adv[:, :early]).abs().min() > 1e7  # the early change did happen
    gold, _ = _k_gae_loop(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(adv.double(), gold, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- losses


def _k_loss_batch(B, T, seed):
    """Random loss inputs with a fully masked row, an interior span and garbage at masked positions."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[0] = 0.0
    if T >= 8:
        mask[-1, 2:6] = 0.0
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e8])

    def field(x):
        return torch.where(mask.bool(), x, junk[torch.randint(0, 4, (B, T), generator=g)])

    return g, mask, field


def test_kernels_cispo_hand_case(kbackend):
    logprobs = torch.tensor([[math.log(1.5), 0.3]], requires_grad=True)  # old logprob 0 -> ratio 1.5
    loss, metrics = K.cispo_loss(logprobs, torch.tensor([[0.0, 9.0]]), torch.tensor([[1.0, 9.0]]),
                                 torch.tensor([[1.0, 0.0]]), 0.2, 0.28, num_tokens=1)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.28, 0.0]]))
    assert math.isclose(loss.item(), -1.28 * math.log(1.5), rel_tol=1e-6)
    assert metrics["pg_clipfrac"].item() == 1.0
    assert math.isclose(metrics["approx_kl"].item(), 0.5 - math.log(1.5), rel_tol=1e-5)


@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (2, 1000)])
def test_kernels_cispo_matches_fp64_gold(kbackend, B, T):
    g, mask, field = _k_loss_batch(B, T, seed=T)
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.4 * torch.randn(B, T, generator=g)  # ratios on both sides of the clip range
    adv = torch.randn(B, T, generator=g)
    eps_low, eps_high, n_tokens, upstream = 0.2, 0.28, 777.0, 0.37
    logprobs = field(new).requires_grad_()
    loss, metrics = K.cispo_loss(logprobs, field(old), field(adv), mask, eps_low, eps_high, num_tokens=n_tokens)
    (loss * upstream).backward()

    valid = mask.bool()
    lp = new.double()[valid].requires_grad_()
    ratio = torch.exp(lp - old.double()[valid])
    weight = torch.clamp(ratio, 1 - eps_low, 1 + eps_high).detach()
    gold = -(weight * adv.double()[valid] * lp).sum() / n_tokens
    (gold * upstream).backward()
    gold_grad = torch.zeros(B, T, dtype=torch.float64)
    gold_grad[valid] = lp.grad
    assert torch.allclose(loss.double(), gold, atol=1e-6, rtol=1e-5)
    assert torch.allclose(logprobs.grad.double(), gold_grad, atol=1e-7, rtol=1e-5)
    outside = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).sum().item()
    assert math.isclose(metrics["pg_clipfrac"].item(), outside / n_tokens, rel_tol=1e-6)
    kl = ((ratio - 1) - torch.log(ratio)).sum().item() / n_tokens
    assert math.isclose(metrics["approx_kl"].item(), kl, rel_tol=1e-4, abs_tol=1e-7)
    assert not metrics["approx_kl"].requires_grad


def test_kernels_cispo_microbatches_add_up(kbackend):
    g, mask, field = _k_loss_batch(4, 50, seed=1)
    old = -torch.rand(4, 50, generator=g)
    new = (old + 0.3 * torch.randn(4, 50, generator=g)).requires_grad_()
    adv = torch.randn(4, 50, generator=g)
    full, m_full = K.cispo_loss(new, old, adv, mask, 0.2, 0.28)
    (g_full,) = torch.autograd.grad(full, new)
    n = mask.sum()
    parts = [K.cispo_loss(new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], 0.2, 0.28, num_tokens=n)
             for i in (0, 2)]
    (g_parts,) = torch.autograd.grad(parts[0][0] + parts[1][0], new)
    assert torch.allclose(parts[0][0] + parts[1][0], full, atol=1e-6)
    assert torch.allclose(g_parts, g_full, atol=1e-7)
    for key in ("pg_clipfrac", "approx_kl"):
        assert torch.allclose(parts[0][1][key] + parts[1][1][key], m_full[key], atol=1e-6)


def test_kernels_value_loss_hand_cases(kbackend):
    for v, want_loss, want_grad, want_clip in [(9.0, 11.52, 0.0, 1.0), (1.0, 40.5, -9.0, 0.0)]:
        values = torch.tensor([[v]], requires_grad=True)
        loss, metrics = K.value_loss(values, torch.tensor([[5.0]]), torch.tensor([[10.0]]), torch.ones(1, 1), 0.2)
        loss.backward()
        assert math.isclose(loss.item(), want_loss, rel_tol=1e-6)
        assert math.isclose(values.grad.item(), want_grad, abs_tol=1e-6)
        assert metrics["v_clipfrac"].item() == want_clip


@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (2, 1000)])
def test_kernels_value_loss_matches_fp64_gold(kbackend, B, T):
    g, mask, field = _k_loss_batch(B, T, seed=T + 1)
    old_v = torch.randn(B, T, generator=g)
    v = old_v + 0.3 * torch.randn(B, T, generator=g)  # about half the tokens move more than eps_v
    ret = torch.randn(B, T, generator=g)
    eps_v, upstream = 0.2, -1.7
    values = field(v).requires_grad_()
    loss, metrics = K.value_loss(values, field(old_v), field(ret), mask, eps_v)
    (loss * upstream).backward()

    valid = mask.bool()
    n = max(int(valid.sum()), 1)
    vd = v.double()[valid].requires_grad_()
    od, rd = old_v.double()[valid], ret.double()[valid]
    unclipped = (vd - rd) ** 2
    clipped = (od + torch.clamp(vd - od, -eps_v, eps_v) - rd) ** 2  # the formula as written in the papers
    gold = 0.5 * torch.max(unclipped, clipped).sum() / n
    (gold * upstream).backward()
    gold_grad = torch.zeros(B, T, dtype=torch.float64)
    gold_grad[valid] = vd.grad
    assert torch.allclose(loss.double(), gold, atol=1e-6, rtol=1e-5)
    assert torch.allclose(values.grad.double(), gold_grad, atol=1e-6, rtol=1e-5)
    gold_clipfrac = (clipped > unclipped + 1e-9).sum().item() / n
    assert math.isclose(metrics["v_clipfrac"].item(), gold_clipfrac, rel_tol=1e-6, abs_tol=1e-9)


@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (2, 1000)])
def test_kernels_bce_value_loss_matches_fp64_gold(kbackend, B, T):
    g, mask, field = _k_loss_batch(B, T, seed=T + 2)
    z = 4 * torch.randn(B, T, generator=g)
    z[-1, -1] = 60.0  # far in the saturated region
    y = torch.rand(B, T, generator=g)
    logits = field(z).requires_grad_()
    loss, _ = K.bce_value_loss(logits, field(y), mask)
    grad_up = 2.5
    (loss * grad_up).backward()

    valid = mask.bool()
    n = max(int(valid.sum()), 1)
    zd = z.double()[valid].requires_grad_()
    yd = y.double()[valid]
    logsig = torch.nn.functional.logsigmoid
    gold = -(yd * logsig(zd) + (1 - yd) * logsig(-zd)).sum() / n  # -y log s - (1 - y) log(1 - s), s = sigmoid(z)
    (gold * grad_up).backward()
    gold_grad = torch.zeros(B, T, dtype=torch.float64)
    gold_grad[valid] = zd.grad
    assert torch.allclose(loss.double(), gold, atol=1e-6, rtol=1e-5)
    assert torch.allclose(logits.grad.double(), gold_grad, atol=1e-7, rtol=1e-5)


def test_kernels_bce_value_loss_hand_case(kbackend):
    z = torch.tensor([[0.0, 2.0]], requires_grad=True)
    loss, _ = K.bce_value_loss(z, torch.tensor([[1.0, 0.25]]), torch.ones(1, 2), num_tokens=1)
    loss.backward()
    want = math.log(2) + (math.log1p(math.exp(2.0)) - 0.5)
    assert math.isclose(loss.item(), want, rel_tol=1e-6)
    s = 1 / (1 + math.exp(-2.0))
    assert torch.allclose(z.grad, torch.tensor([[-0.5, s - 0.25]]))


# ------------------------------------------------------------------------------------------------- log-probs


class _KLargestTensors(TorchDispatchMode):
    """Watches every aten op's outputs: the most rows of any [rows, V] tensor, and the largest storage (bytes)
    behind any output, not counting storages the size of the [V, H] weight (its gradient and views of it)."""

    def __init__(self, V, H):
        super().__init__()
        self.V, self.H = V, H
        self.logit_rows = 0
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                if t.dim() == 2 and t.shape[1] == self.V and t.shape[0] != self.H:
                    self.logit_rows = max(self.logit_rows, t.shape[0])
                nbytes = t.untyped_storage().nbytes()
                if nbytes not in (self.V * self.H * 4, self.V * self.H * 2):
                    self.max_bytes = max(self.max_bytes, nbytes)
        return out


def _k_logprob_gold(hidden, weight, targets, temperature):
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp_all = torch.log_softmax(h @ w.T / temperature, dim=-1)
    logp = logp_all.gather(1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return h, w, logp, entropy


def test_kernels_logprobs_hand_case(kbackend):
    logp, entropy = K.logprobs_from_hidden(torch.tensor([[2.0, 1.0, 0.0]]), torch.eye(3), torch.tensor([0]), 0.5)
    assert math.isclose(logp.item(), -0.14293, abs_tol=1e-5)
    p = torch.softmax(torch.tensor([4.0, 2.0, 0.0], dtype=torch.float64), 0)
    assert math.isclose(entropy.item(), -(p * p.log()).sum().item(), abs_tol=2e-6)  # lse - E[z] in fp32


@pytest.mark.parametrize("N,H,V,rows_per_chunk", [(37, 16, 1000, 8), (5, 16, 49152, 2), (3, 8, 151936, 2)])
def test_kernels_logprobs_match_fp64_gold(kbackend, monkeypatch, N, H, V, rows_per_chunk):
    monkeypatch.setattr(K, "LOGITS_CHUNK_ELEMENTS", rows_per_chunk * V)  # several chunks, last one partial
    g = torch.Generator().manual_seed(V)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / math.sqrt(H)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    temperature = 0.7
    upstream = torch.randn(N, generator=g)
    with _KLargestTensors(V, H) as probe:
        logp, entropy = K.logprobs_from_hidden(hidden, weight, targets, temperature)
        (logp * upstream).sum().backward()
    assert 0 < probe.logit_rows <= rows_per_chunk < N  # logits exist only a chunk of rows at a time
    assert probe.max_bytes <= rows_per_chunk * V * 4 < N * V * 4  # nothing as large as the fp32 [N, V] logits
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32 and not entropy.requires_grad

    h, w, gold_logp, gold_entropy = _k_logprob_gold(hidden, weight, targets, temperature)
    (gold_logp * upstream.double()).sum().backward()
    assert torch.allclose(logp.double(), gold_logp, atol=1e-4, rtol=1e-5)
    assert torch.allclose(entropy.double(), gold_entropy, atol=1e-4, rtol=1e-5)
    assert torch.allclose(hidden.grad.double(), h.grad, atol=1e-5, rtol=1e-4)
    assert torch.allclose(weight.grad.double(), w.grad, atol=1e-5, rtol=1e-4)


def test_kernels_logprobs_bf16(kbackend, monkeypatch):
    monkeypatch.setattr(K, "LOGITS_CHUNK_ELEMENTS", 4 * 3000)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 32, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(3000, 32, generator=g) / 6).bfloat16().requires_grad_()
    targets = torch.randint(0, 3000, (11,), generator=g)
    logp, entropy = K.logprobs_from_hidden(hidden, weight, targets)
    logp.sum().backward()
    assert logp.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    h, w, gold_logp, gold_entropy = _k_logprob_gold(hidden, weight, targets, 1.0)  # gold from the bf16 inputs
    gold_logp.sum().backward()
    # the bf16 matmul output rounds logits to ~3 significant digits; everything after it is fp32
    assert torch.allclose(logp.double(), gold_logp, atol=0.05)
    assert torch.allclose(entropy.double(), gold_entropy, atol=0.05)
    assert torch.allclose(hidden.grad.double(), h.grad, atol=0.02, rtol=0.02)
    assert torch.allclose(weight.grad.double(), w.grad, atol=0.02, rtol=0.02)


def test_kernels_logprobs_triton_matches_reference(ktriton, monkeypatch):
    monkeypatch.setattr(K, "LOGITS_CHUNK_ELEMENTS", 3 * 5000)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 24, generator=g).requires_grad_()
    weight = torch.randn(5000, 24, generator=g).requires_grad_()  # large logits: a peaked softmax
    targets = torch.randint(0, 5000, (10,), generator=g)
    logp_t, ent_t = K.logprobs_from_hidden(hidden, weight, targets, 1.3)
    (gh_t, gw_t) = torch.autograd.grad(logp_t.sum(), (hidden, weight))
    logp_r, ent_r = K.logprobs_from_hidden_ref(hidden, weight, targets, 1.3)
    (gh_r, gw_r) = torch.autograd.grad(logp_r.sum(), (hidden, weight))
    assert torch.allclose(logp_t, logp_r, atol=1e-4) and torch.allclose(ent_t, ent_r, atol=1e-4)
    assert torch.allclose(gh_t, gh_r, atol=1e-4) and torch.allclose(gw_t, gw_r, atol=1e-5)


def test_kernels_logprobs_rejects_bad_arguments():
    with pytest.raises(ValueError):
        K.logprobs_from_hidden(torch.zeros(2, 3), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        K.logprobs_from_hidden(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long), 0.0)
