"""Tests for s3ac.py and kernels.py. Run: ./run.sh test   (or: python -m pytest -q test_s3ac.py)

Every expected number comes from an independent reference: a plain Python loop, fp64, or a hand-worked case.
Triton kernels run on CPU tensors under TRITON_INTERPRET=1.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import json
import subprocess
import sys
import threading

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels as K
import s3ac

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


def make_tiny_model(path, seed=0, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
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


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def smoke_flags(model, out_dir, *extra):
    return ["--model", model, "--out-dir", out_dir, "--data", "builtin:arithmetic:200", "--batch-prompts", "4",
            "--k", "2", "--max-new-tokens", "8", "--micro-batch-size", "3", "--eval-size", "4",
            "--eval-every", "0", "--lr", "1e-3", "--threads", "1", *extra]


# ---------------------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------------------
def test_decoupled_gae_uses_monte_carlo_returns_and_adaptive_lambda():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    values = torch.tensor([[0.2, -0.1, 0.4, 7.0], [0.3, 0.5, float("nan"), 1.0]])
    rewards = torch.tensor([1.0, -1.0])
    adv, ret, _ = s3ac.decoupled_gae(rewards, values, mask, 1.0, 1.0, 1.5)
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
    raw = AutoModelForCausalLM.from_pretrained(str(tmp_path))  # the penalty really would change the tokens
    assert s3ac.generate_hf(raw, [prompt], [0], {10**6}, tok.pad_token_id, 8, 1.0, 4,
                            greedy=True).response_ids[0].tolist() != greedy_reference(model, prompt, 8)


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

        def forward(self, input_ids, attention_mask, position_ids):
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
    for micro in (1, B):
        args = s3ac.Args(micro_batch_size=micro, minibatches=minibatches, actor_grad_clip=1e9, critic_grad_clip=1e9,
                         eps_v=0.05, temperature=0.8)
        actor, crit = copy.deepcopy(model), copy.deepcopy(critic)
        # SGD moves each weight in proportion to its gradient (Adam's first step would hide a scale error)
        m = s3ac.update_actor(actor, torch.optim.SGD(actor.parameters(), lr=1e-3), batch, advantages, None, args,
                              torch.Generator().manual_seed(0))
        m.update(s3ac.update_critic(crit, torch.optim.SGD(crit.parameters(), lr=1e-3), batch, old_values, returns,
                                    args, torch.Generator().manual_seed(0)))
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


def test_verifier_deadline_kills_and_recovers():
    v = s3ac.Verifier(timeout=1e-4)  # no check can finish in 0.1 ms
    try:
        v._start()
        rewards, statuses = v(["5"], ["\\boxed{5}"])
        assert statuses == ["timeout"] and rewards == [-1.0] and v._proc is None
        v.timeout = 20
        assert v(["5"], ["\\boxed{5}"]) == ([1.0], ["correct"])
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
    if os.path.exists(shared):
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
    train, held = s3ac.split_problems(problems, "", args)
    assert len(held) == 50 and len({p.question for p in held}) == 50
    assert not {p.question for p in train} & {p.question for p in held}
    assert len({p.question for p in train}) == len(train)
    other = write_lines(tmp_path / "e.jsonl", [json.dumps({"question": p.question, "answer": "#### " + p.answer})
                                               for p in problems[:30]])
    train2, held2 = s3ac.split_problems(problems, other, args)
    assert len(held2) == len({p.question for p in problems[:30]})
    assert not {p.question for p in train2} & {p.question for p in held2}


def test_prompt_uses_chat_template_and_boxed(tiny):
    _, _, tok = tiny
    text = tok.decode(s3ac.build_prompt(tok, "What is 2 + 2?"))
    assert text.startswith("<|im_start|>user\nWhat is 2 + 2?") and "\\boxed{}" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(s3ac.build_prompt(tok, "Q", "Solve: {question} = \\boxed{}")) == "Solve: Q = \\boxed{}"
    assert s3ac.chat_stop_ids(tok) == {tok.convert_tokens_to_ids("<|im_end|>")}


def test_args_flags_generated_from_dataclass():
    args = s3ac.parse_args(["--k", "4", "--resume", "--eps-high", "0.3", "--model", "m"])
    assert (args.k, args.resume, args.eps_high, args.model) == (4, True, 0.3, "m")
    assert s3ac.parse_args([]).model == "Qwen/Qwen2.5-Math-1.5B"
    d = s3ac.Args()
    assert (d.gamma, d.critic_lam, d.alpha, d.actor_grad_clip, d.critic_grad_clip, d.critic_lr_ratio,
            d.actor_epochs, d.critic_epochs, d.temperature) == (1.0, 1.0, 1.5, 1.0, 10.0, 5.0, 1, 2, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# End to end: smoke run, checkpoints, resume
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(tiny, tmp_path_factory):
    path = tiny[0]
    out = str(tmp_path_factory.mktemp("run"))
    run_s3ac(*smoke_flags(path, out, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "3",
                          "--minibatches", "2"))
    return path, out


REQUIRED_KEYS = ["rollout/reward", "rollout/acc", "rollout/response_len", "rollout/truncated", "verify/no_answer",
                 "verify/timeout", "verify/error", "actor/pg_loss", "actor/pg_clipfrac", "actor/approx_kl",
                 "actor/entropy", "actor/grad_norm", "critic/v_loss", "critic/explained_var",
                 "critic/value_mean", "critic/grad_norm", "perf/tokens_per_s", "time/rollout", "time/verify",
                 "time/values", "time/actor", "time/critic", "perf/step_s"]


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
# kernels.py: every op on both backends against independent golds
# ---------------------------------------------------------------------------------------------------------------
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
