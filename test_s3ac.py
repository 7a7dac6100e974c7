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

import pytest
import torch

import kernels
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
def gae_loop(rewards, values, mask, gamma, lam):
    """Plain Python GAE over one row, skipping masked tokens (fp64 floats)."""
    adv, nextv, last = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        if mask[t]:
            delta = rewards[t] + gamma * nextv - values[t]
            last = delta + gamma * lam * last
            nextv = values[t]
            adv[t] = last
    return adv


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gae_hand_cases(backend):
    kernels.set_backend(backend)
    try:
        adv, ret = kernels.gae(torch.tensor([[0.0, 1, 0]]), torch.tensor([[0.0, 0, 100]]),
                               torch.tensor([[1.0, 1, 0]]), 1.0, 0.95)
        assert torch.allclose(adv, torch.tensor([[0.95, 1.0, 0.0]]), atol=1e-6)
        adv, ret = kernels.gae(torch.tensor([[0.0, 0, 1, 0, 0]]), torch.tensor([[0.5, 0.6, 0.7, 9, 9]]),
                               torch.tensor([[1.0, 1, 1, 0, 0]]), 1.0, 0.95)
        assert torch.allclose(adv, torch.tensor([[0.46575, 0.385, 0.30, 0, 0]]), atol=1e-6)
        assert torch.allclose(ret, torch.tensor([[0.96575, 0.985, 1.0, 0, 0]]), atol=1e-6)  # A + V, 0 on padding
    finally:
        kernels.set_backend("auto")


def test_gae_matches_loop_and_ignores_padding_garbage():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 37
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    lengths = torch.tensor([37, 1, 0, 20, 36, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    mask[0, 10:15] = 0  # interior masked span
    lam = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.0, 1.0])
    adv, ret = kernels.gae(rewards, values, mask, 0.99, lam)
    for garbage in (float("nan"), float("inf"), 1e8):
        bad_v = torch.where(mask.bool(), values, garbage)
        bad_r = torch.where(mask.bool(), rewards, garbage)
        adv2, ret2 = kernels.gae(bad_r, bad_v, mask, 0.99, lam)
        assert torch.equal(adv2, adv) and torch.equal(ret2, ret)
    for i in range(B):
        ref = gae_loop(rewards[i].double().tolist(), values[i].double().tolist(), mask[i].tolist(), 0.99,
                       lam[i].item())
        assert torch.allclose(adv[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5)
    assert (adv != 0).sum() == mask.sum()  # every valid token gets credit, no padding does
    assert torch.equal(adv[2], torch.zeros(T))  # fully masked row


def test_gae_single_token():
    adv, ret = kernels.gae(torch.tensor([[1.0]]), torch.tensor([[0.25]]), torch.tensor([[1.0]]), 1.0, 0.95)
    assert adv.item() == pytest.approx(0.75) and ret.item() == pytest.approx(1.0)


def test_decoupled_gae_uses_monte_carlo_returns_and_adaptive_lambda():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    values = torch.tensor([[0.2, -0.1, 0.4, 7.0], [0.3, 0.5, float("nan"), 1.0]])
    rewards = torch.tensor([1.0, -1.0])
    adv, ret, _ = s3ac.decoupled_gae(rewards, values, mask, 1.0, 1.0, 1.5)
    assert torch.allclose(ret, torch.tensor([[1.0, 1, 1, 0], [-1, -1, 0, 0]]), atol=1e-6)  # critic: lambda = 1
    for i, T in enumerate([3, 2]):
        lam = 1 - 1 / (1.5 * T)  # actor: lambda_i = 1 - 1/(alpha T_i)
        r = [0.0] * 4
        r[T - 1] = rewards[i].item()
        ref = gae_loop(r, torch.nan_to_num(values[i]).tolist(), mask[i].tolist(), 1.0, lam)
        assert torch.allclose(adv[i], torch.tensor(ref, dtype=torch.float32), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Masks, positions, log-probs, values
# ---------------------------------------------------------------------------------------------------------------
def test_response_mask_from_positions_when_pad_equals_eos():
    mask, truncated = s3ac.response_mask_from_ids(torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9]]), {2})
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, True]


def test_generate_truncation_and_eos_in_prompt(tiny):
    _, model, tok = tiny
    eos = tok.eos_token_id
    prompt = tok("12+3=")["input_ids"]
    # the model is random: greedy continuation decides which token it emits first; make THAT token the stop id
    first = s3ac.generate_hf(model, [prompt], [0], {10**6}, eos, 1, 1.0, 4, greedy=True).response_ids[0, 0].item()
    b = s3ac.generate_hf(model, [prompt + [first], prompt], [0, 1], {first}, eos, 6, 1.0, 4, greedy=True)
    # row 0 has the stop id inside its prompt: its response is still judged by its own tokens only
    assert b.response_mask[1].tolist()[0] == 1 and not b.truncated[1] and b.response_mask[1].sum() == 1
    # a response that never emits a stop id hits the limit, keeps its last token, mask all ones, truncated
    c = s3ac.generate_hf(model, [prompt], [0], {10**6}, eos, 6, 1.0, 4, greedy=True)
    full = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=eos)[0, len(prompt):]
    assert c.response_ids[0].tolist() == full.tolist()
    assert c.response_mask.tolist() == [[1.0] * 6] and c.truncated.tolist() == [True]
    if b.truncated[0]:
        assert b.response_mask[0].sum() == 6


def test_left_padding_generate_matches_unpadded(tiny):
    _, model, tok = tiny
    short, long = tok("7*8=")["input_ids"], tok("What is 12 + 30?")["input_ids"]
    both = s3ac.generate_hf(model, [short, long], [0, 1], {10**6}, tok.pad_token_id, 5, 1.0, 4, greedy=True)
    alone = s3ac.generate_hf(model, [short], [0], {10**6}, tok.pad_token_id, 5, 1.0, 4, greedy=True)
    assert both.response_ids[0].tolist() == alone.response_ids[0].tolist()


def test_logprob_at_temperature_hand_case():
    # logits [2, 1, 0] = hidden [1] x weight [[2], [1], [0]]; temperature 0.5 -> log softmax([4, 2, 0])[0]
    lp, ent = kernels.logprobs_from_hidden(torch.tensor([[1.0]]), torch.tensor([[2.0], [1.0], [0.0]]),
                                           torch.tensor([0]), 0.5)
    assert lp.item() == pytest.approx(-0.14293, abs=1e-5)
    p = torch.softmax(torch.tensor([4.0, 2.0, 0.0], dtype=torch.float64), 0)
    assert ent.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


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
def test_clipped_value_loss_hand_cases():
    one = torch.ones(1, 1)
    for v, loss_ref, grad_ref in [(9.0, 11.52, 0.0), (1.0, 40.5, -9.0)]:
        values = torch.tensor([[v]], requires_grad=True)
        loss, _ = kernels.value_loss(values, 5 * one, 10 * one, one, 0.2)
        loss.backward()
        assert loss.item() == pytest.approx(loss_ref) and values.grad.item() == pytest.approx(grad_ref)


def test_cispo_gradient_hand_case():
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    old = logprobs.detach() - torch.log(torch.tensor(1.5))  # ratio 1.5
    loss, m = kernels.cispo_loss(logprobs, old, torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(-1.28)  # clipped weight 1.28, no gradient through it
    assert m["pg_clipfrac"] == pytest.approx(1.0)


def test_explained_variance_uses_global_statistics():
    returns, values = torch.tensor([[0.0, 1, 10, 11]]), torch.tensor([[0.0, 1, 10.5, 10.5]])
    mask = torch.ones(1, 4)
    assert s3ac.explained_variance(values, returns, mask) == pytest.approx(0.99505, abs=1e-5)
    per_micro = [s3ac.explained_variance(values[:, i:i + 2], returns[:, i:i + 2], mask[:, :2]) for i in (0, 2)]
    assert sum(per_micro) / 2 != pytest.approx(0.99505, abs=1e-3)  # what averaging micro-batches would give
    assert s3ac.explained_variance(values, torch.ones(1, 4), mask) != s3ac.explained_variance(values, torch.ones(1, 4), mask)  # nan


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


def test_prompt_uses_chat_template_and_boxed(tiny):
    _, _, tok = tiny
    text = tok.decode(s3ac.build_prompt(tok, "What is 2 + 2?"))
    assert text.startswith("<|im_start|>user\nWhat is 2 + 2?") and "\\boxed{}" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(s3ac.build_prompt(tok, "Q", "Solve: {question} =")) == "Solve: Q ="


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
    run_s3ac(*smoke_flags(path, out, "--steps", "2", "--save-every", "1", "--keep-checkpoints", "3"))
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
    critic = s3ac.load_critic(os.path.join(ckpt, "critic"), torch.float32, "cpu", 99,
                              os.path.join(ckpt, "critic", "value_head.safetensors"))
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    assert state["step"] == 2 and state["actor_opt"]["state"] and state["critic_opt"]["state"]
    base = AutoModelForCausalLM.from_pretrained(path)
    assert any(not torch.equal(a, b) for a, b in zip(actor.parameters(), base.parameters()))
    tmp = str(tmp_path / "again")
    s3ac.save_checkpoint(tmp, 7, actor, s3ac_tokenizer(ckpt), critic, torch.optim.AdamW(actor.parameters()),
                         torch.optim.AdamW(critic.parameters()), s3ac.PromptSampler(5, 0), keep=1)
    again = s3ac.load_critic(os.path.join(tmp, "checkpoints", "step_7", "critic"), torch.float32, "cpu", 5,
                             os.path.join(tmp, "checkpoints", "step_7", "critic", "value_head.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(critic.state_dict().values(), again.state_dict().values()))


def s3ac_tokenizer(ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.join(ckpt, "actor"))


def test_resume_after_kill_matches_uninterrupted_run(smoke_run, tmp_path):
    path, full_out = smoke_run
    out = str(tmp_path / "killed")
    run_s3ac(*smoke_flags(path, out, "--steps", "1", "--save-every", "1"))
    # what a kill during step 2 leaves behind: a half-written checkpoint and no record of step 2
    os.makedirs(os.path.join(out, "checkpoints", ".tmp-step_2", "actor"))
    proc = run_s3ac(*smoke_flags(path, out, "--steps", "2", "--save-every", "1", "--resume"))
    assert "resumed from" in proc.stderr
    full, resumed = read_jsonl(os.path.join(full_out, "metrics.jsonl")), read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for key in ("rollout/reward", "rollout/response_len", "actor/pg_loss", "critic/v_loss", "critic/value_mean"):
        assert resumed[2][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-6), key
