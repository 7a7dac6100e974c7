"""S3AC: Stabilized, Selective, and Scalable Actor-Critic for LLM reasoning, in one file.

S3AC trains a language model with reinforcement learning from verifiable rewards (RLVR) using a learned
critic. Generation is a token-level MDP: the state s_t is the prompt plus the response so far, the action is
the next token, a math verifier gives R = +1 (correct) or -1 (otherwise) on the last token, gamma = 1 and the
value after the last token is 0. The critic V(s_t) gives every token its own credit, and V(s_0), read from the
prompt alone, is a per-prompt baseline that works with a single rollout per prompt (K = 1).

Equations (shape letters: B sequences, T response tokens, P prompt tokens, H hidden size, V vocabulary):

    GAE (Schulman et al. 2016, eq. 16), per sequence i, masked tokens skipped:
        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        A_t     = delta_t + gamma * lambda * A_{t+1}               A_T = 0, V(s_T) = 0
    Decoupled GAE (VAPO; S3AC sec. "online training"):
        critic targets  R_t = A_t(lambda = 1) + V(s_t)             (the Monte-Carlo return)
        actor advantage A_t with lambda_i = 1 - 1 / (alpha * T_i)  (length-adaptive, alpha = 1.5)
    CISPO actor objective (MiniMax-M1, eq. 4), maximised, token-mean over the batch:
        J = sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi(a_t | s_t),   r_t = pi / mu
    Clipped value loss (PPO2 / VAPO):
        L_V = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)
    Value head init (S3AC): w ~ N(0, (1 / (H + 1))^2); critic grad-clip 10 (actor 1), critic lr 5x actor lr,
    2 critic epochs per rollout batch (actor 1).

Where this code departs from the papers:
    1. Rollouts use plain temperature sampling over the full vocabulary: the model's generation_config is replaced
       by a neutral one (no top-p, top-k or repetition penalty), so the behaviour policy mu is exactly
       softmax(logits / temperature), which the trainer recomputes (same temperature) for the importance ratio.
    2. When the actor takes one optimizer step per rollout batch (the default), mu is the pre-update policy, so
       old_logprobs are the detached log-probs of the same forward pass and the ratio is exactly 1.
    3. Learning rates are constant (no warm-up or decay); AdamW without weight decay; fp32 weights and optimizer
       states, bf16 autocast for forward passes on CUDA.
    4. The critic is a separate model (default: a copy of the actor's checkpoint) that must share the actor's
       tokenizer.
    5. Log-probs come from the last hidden state and the output embedding in chunks (kernels.logprobs_from_hidden),
       so models that rescale their logits after the output layer (Gemma-2, Granite, Cohere) are refused.
    6. A verifier check that hangs is killed after --verify-timeout seconds and counts as a wrong answer.

Run:
    python s3ac.py --model Qwen/Qwen2.5-Math-1.5B                                # paper setting, GPU
    python s3ac.py --model path/to/model.gguf --data builtin:arithmetic --steps 30  # CPU
    python s3ac.py --data ../shared/data/gsm8k_train.jsonl --eval-data ../shared/data/gsm8k_test.jsonl
    python s3ac.py --out-dir runs/x --resume                                      # continue a killed run
"""

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

import kernels


# ---------------------------------------------------------------------------------------------------------------
# 0. Arguments
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Args:
    # model
    model: str = "Qwen/Qwen2.5-Math-1.5B"  # actor: Hugging Face name, local directory, or a .gguf file
    critic_model: str = ""  # critic backbone; empty = the actor's checkpoint (must share the tokenizer)
    dtype: str = "auto"  # compute dtype: auto (bfloat16 autocast on CUDA, float32 on CPU) | float32 | bfloat16;
    #                      weights, gradients and optimizer states stay float32
    device: str = "auto"  # auto | cpu | cuda
    cache_dir: str = "~/.cache/s3ac"  # where .gguf models are converted to safetensors, once
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    # data
    data: str = "builtin:arithmetic"  # JSONL file, Hugging Face dataset (name or name:config), builtin:arithmetic[:N]
    eval_data: str = ""  # held-out problems; empty = hold out eval_size problems of --data
    prompt_key: str = ""  # JSONL/dataset field with the question; empty = question (GSM8K) or problem (MATH)
    answer_key: str = ""  # field with the gold answer; empty = answer (text after '####' for GSM8K)
    split: str = "train"  # dataset split (Hugging Face datasets only)
    eval_split: str = "test"  # split for --eval-data when it is a Hugging Face dataset
    prompt_template: str = ""  # overrides the chat template: a string with {question}
    # rollout
    rollout: str = "hf"  # rollout backend: hf (transformers generate) is the one in this version
    batch_prompts: int = 64  # prompts per step
    k: int = 1  # rollouts per prompt (1 = single-rollout mode, >1 = group mode)
    max_new_tokens: int = 1024  # response length limit, tokens
    temperature: float = 1.0  # sampling temperature, also applied to the trainer's logits
    gen_batch_size: int = 64  # sequences per generate call
    # verifier
    verify_timeout: float = 10.0  # seconds per answer before the check is killed and counted as a timeout
    # GAE
    gamma: float = 1.0  # discount
    critic_lam: float = 1.0  # lambda of the critic's targets (1 = Monte-Carlo returns)
    alpha: float = 1.5  # actor lambda_i = 1 - 1/(alpha * T_i); VAPO itself uses alpha = 0.05
    # actor
    lr: float = 1e-6  # actor learning rate
    eps_low: float = 1.0  # CISPO lower bound, relative: weight >= 1 - eps_low (1.0 = no lower clip)
    eps_high: float = 0.28  # CISPO upper bound, relative: weight <= 1 + eps_high
    actor_grad_clip: float = 1.0  # global grad-norm clip of the actor
    actor_epochs: int = 1  # passes over each rollout batch
    # critic
    critic_lr_ratio: float = 5.0  # critic learning rate = critic_lr_ratio * lr
    critic_grad_clip: float = 10.0  # global grad-norm clip of the critic
    critic_epochs: int = 2  # passes of the critic over each rollout batch
    eps_v: float = 0.5  # value clip range, absolute, on the +-1 reward scale
    critic_seed: int = 1  # seed of the value-head initialisation
    # updates (actor and critic)
    minibatches: int = 1  # optimizer steps per pass over the rollout batch
    micro_batch_size: int = 8  # sequences per forward/backward; gradients accumulate over a mini-batch
    # run
    steps: int = 200  # training steps (one rollout batch each)
    seed: int = 0  # seed of sampling, data order and rollouts
    kernels: str = "auto"  # kernels.py backend: auto | triton | torch
    threads: int = 0  # torch CPU threads; 0 = torch's default
    # logging
    out_dir: str = "runs/s3ac"  # metrics.jsonl and checkpoints/ go here
    eval_every: int = 10  # steps between greedy evaluations (0 = only at the start and the end)
    eval_size: int = 64  # held-out problems in each evaluation
    eval_max_new_tokens: int = 0  # 0 = max_new_tokens
    save_every: int = 10  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    resume: bool = False  # continue from the newest checkpoint in out_dir


def parse_args(argv=None) -> Args:
    """Build argparse flags from the fields of Args (one --flag-name per field)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for field in dataclasses.fields(Args):
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool or field.type == "bool":
            parser.add_argument(flag, type=_str2bool, nargs="?", const=True, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    args = Args(**vars(parser.parse_args(argv)))
    if args.rollout != "hf":
        parser.error(f"--rollout {args.rollout}: only hf is available")
    for name in ("k", "batch_prompts", "max_new_tokens", "minibatches", "micro_batch_size", "actor_epochs",
                 "critic_epochs", "gen_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _str2bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


# ---------------------------------------------------------------------------------------------------------------
# 1. Data: problems with gold answers, and prompts
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Problem:
    question: str
    answer: str  # gold answer, as text for the verifier


def make_arithmetic(n: int, seed: int) -> list:
    """`n` seeded problems of mixed difficulty: +, - and * on one- and two-digit operands.

    Example: make_arithmetic(1, 0) -> [Problem(question="What is 48 - 7?", answer="41")] (operands vary by seed).
    """
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        a, b = (rng.randint(0, 9) if rng.random() < 0.5 else rng.randint(10, 99) for _ in range(2))
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        problems.append(Problem(f"What is {a} {op} {b}?", str(value)))
    return problems


def load_problems(spec: str, prompt_key: str = "", answer_key: str = "", split: str = "train", seed: int = 0):
    """Load problems from a JSONL file, a Hugging Face dataset, or `builtin:arithmetic[:N]`.

    JSONL layouts: GSM8K (`question`, `answer` with the gold after '####'), MATH (`problem`, `answer`), or any
    fields named by prompt_key / answer_key. Raises ValueError naming file, line and field for a bad row, and for
    an empty dataset; FileNotFoundError / ImportError when the source cannot be read.
    """
    if spec.startswith("builtin:arithmetic"):
        n = int(spec.split(":")[2]) if spec.count(":") == 2 else 5000
        problems = make_arithmetic(n, seed)
    elif spec.endswith(".jsonl") or os.path.exists(spec):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"{spec}: no such data file")
        with open(spec, encoding="utf-8") as f:
            rows = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
        problems = []
        for lineno, line in rows:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{spec}, line {lineno}: not valid JSON ({e.msg})") from None
            problems.append(_row_to_problem(row, prompt_key, answer_key, f"{spec}, line {lineno}"))
    else:
        try:
            import datasets  # optional dependency, only for hub datasets
        except ImportError:
            raise ImportError(f"{spec!r} is not a file; loading it as a Hugging Face dataset needs `pip install "
                              f"datasets`") from None
        name, _, config = spec.partition(":")  # 'openai/gsm8k:main' names a dataset configuration
        ds = datasets.load_dataset(name, config or None, split=split)
        problems = [_row_to_problem(row, prompt_key, answer_key, f"{spec}[{split}], row {i}")
                    for i, row in enumerate(ds)]
    if not problems:
        raise ValueError(f"{spec}: the dataset is empty")
    return problems


def _row_to_problem(row, prompt_key: str, answer_key: str, where: str) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    qkey = prompt_key or ("question" if "question" in row else "problem")
    akey = answer_key or "answer"
    for key in (qkey, akey):
        if key not in row:
            raise ValueError(f"{where}: missing field {key!r} (fields: {sorted(row)})")
        if not isinstance(row[key], (str, int, float)) or str(row[key]).strip() == "":
            raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {row[key]!r}")
    answer = str(row[akey])
    if qkey == "question" and not answer_key and "####" in answer:  # GSM8K: reasoning, then '#### <gold>'
        answer = answer.rsplit("####", 1)[1].strip()
    return Problem(str(row[qkey]), answer)


def split_problems(train: list, eval_spec: str, args: Args):
    """(train, held_out): held_out is the first eval_size problems of --eval-data when given, else a seeded slice
    of eval_size distinct problems of train. Duplicate questions are dropped, and no question of held_out stays in
    train. Raises ValueError when too few problems are left."""
    train = list({p.question: p for p in reversed(train)}.values())[::-1]  # distinct questions, first kept
    if eval_spec:
        held_out = load_problems(eval_spec, args.prompt_key, args.answer_key, args.eval_split, seed=args.seed + 1)
        held_out = list({p.question: p for p in reversed(held_out)}.values())[::-1][: args.eval_size]
    else:
        if len(train) <= args.eval_size:
            raise ValueError(f"{args.data}: {len(train)} distinct problems, too few to hold out {args.eval_size}")
        held_out = random.Random(args.seed + 12345).sample(train, args.eval_size)
    seen = {p.question for p in held_out}
    train = [p for p in train if p.question not in seen]
    if not train:
        raise ValueError(f"{args.data}: no training problem left once the held-out questions are removed")
    return train, held_out


INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def build_prompt(tokenizer, question: str, template: str = "") -> list:
    """Token ids of the prompt: `template` with {question} replaced if given, else the tokenizer's chat template
    asking for a \\boxed{} answer, else a plain 'Question: ... Answer:' text."""
    if template:
        return tokenizer(template.replace("{question}", question))["input_ids"]  # not str.format: \\boxed{}
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
                                             tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template holds any BOS itself
    return tokenizer(f"Question: {question}\n{INSTRUCTION}\nAnswer:")["input_ids"]


def chat_stop_ids(tokenizer) -> set:
    """The special token that closes an assistant turn in the chat template (e.g. <|im_end|> for Qwen, whose base
    models name <|endoftext|> as EOS), or an empty set without a chat template."""
    if not tokenizer.chat_template:
        return set()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": "@@"}],
                                         tokenize=False)
    after = tokenizer(text.split("@@", 1)[-1], add_special_tokens=False)["input_ids"]
    return {after[0]} if after and after[0] in tokenizer.all_special_ids + list(tokenizer.added_tokens_decoder) else set()


class PromptSampler:
    """Draws prompts without replacement, reshuffling each epoch; its state is two integers (for resume)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def _order(self):
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 7919 + self.epoch))

    def draw(self, count: int) -> list:
        """The next `count` problem indices."""
        out = []
        while len(out) < count:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
            take = min(count - len(out), self.n - self.pos)
            out += self._order()[self.pos: self.pos + take].tolist()
            self.pos += take
        return out


# ---------------------------------------------------------------------------------------------------------------
# 2. Models: actor (causal LM) and critic (backbone + linear value head)
# ---------------------------------------------------------------------------------------------------------------
def resolve_model(name: str, cache_dir: str) -> str:
    """A Hugging Face name or directory is returned as is; a .gguf file is de-quantised once into a
    safetensors checkpoint under cache_dir (written atomically) and that directory is returned.

    Raises FileNotFoundError for a missing .gguf file.
    """
    if not name.endswith(".gguf"):
        return name
    if not os.path.isfile(name):
        raise FileNotFoundError(f"{name}: no such .gguf file")
    stat = os.stat(name)
    key = hashlib.sha1(f"{os.path.abspath(name)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = os.path.join(os.path.expanduser(cache_dir), f"{os.path.basename(name)[:-5]}-{key}")
    if os.path.isdir(out):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, file = os.path.split(os.path.abspath(name))
    print(f"converting {name} to safetensors in {out} (once)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a model still marked as gguf-quantised
    plain = type(quantized)(config)
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


def autocast(device, dtype):
    """bf16 autocast for forward passes (weights, gradients and optimizer states stay fp32); off for float32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def load_actor(path: str, device):
    """The policy as an fp32 causal LM on `device`, with a neutral generation_config (transformers fills every
    sampling field a caller leaves unset from it, so a checkpoint's top-p or repetition penalty would otherwise
    change the behaviour policy). Raises ValueError for models whose logits are rescaled after the output
    embedding, which log-probs computed from hidden states would miss."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    for field in ("final_logit_softcapping", "logits_scaling", "logit_scale"):
        if getattr(model.config, field, None) not in (None, 1.0):
            raise ValueError(f"{path}: config.{field} rescales logits; log-probs from hidden states would skip it")
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError(f"{path}: the output layer has a bias; log-probs from hidden states would skip it")
    old = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=old.eos_token_id, pad_token_id=old.pad_token_id,
                                               bos_token_id=old.bos_token_id)
    return model


class Critic(nn.Module):
    """V(s_t): a transformer backbone and a linear value head without bias.

    The head is initialised from N(0, (1/(H+1))^2) with its own seed (S3AC: a large head init lets the head
    dominate the first gradients, and a global clip then also shrinks the backbone's).
    """

    def __init__(self, backbone: nn.Module, seed: int):
        super().__init__()
        hidden = backbone.config.hidden_size
        self.backbone = backbone
        self.value_head = nn.Linear(hidden, 1, bias=False, dtype=torch.float32)
        nn.init.normal_(self.value_head.weight, 0.0, 1.0 / (hidden + 1),
                        generator=torch.Generator().manual_seed(seed))

    def forward(self, input_ids, attention_mask, position_ids):
        """Values at every position, [B, L] fp32 (B sequences of L tokens)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state  # [B, L, H]
        with torch.autocast(hidden.device.type, enabled=False):  # the head stays fp32 under bf16 autocast
            return self.value_head(hidden.float()).squeeze(-1)  # [B, L]


def load_critic(path: str, device, seed: int, head_file: str = "") -> Critic:
    """fp32 critic from a backbone checkpoint; the value head comes from head_file when resuming, else fresh."""
    from transformers import AutoModel
    critic = Critic(AutoModel.from_pretrained(path, dtype=torch.float32), seed)
    if head_file:
        from safetensors.torch import load_file
        critic.value_head.load_state_dict(load_file(head_file))
    return critic.to(device)


# ---------------------------------------------------------------------------------------------------------------
# 3. Rollout: sample responses, build masks
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 on prompt tokens
    response_ids: torch.Tensor  # [B, T] right-padded
    response_mask: torch.Tensor  # [B, T] float, 1 on generated tokens (stop token included), 0 on padding
    truncated: torch.Tensor  # [B] bool, True when no stop token was generated (length limit hit)
    prompt_index: torch.Tensor  # [B] index of the problem each sequence answers (groups for K > 1)

    def rows(self, idx):
        """The sub-batch of the sequences `idx` (a list or a [b] index tensor)."""
        return Batch(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))


def response_mask_from_ids(response_ids, eos_ids):
    """Mask and truncation flag of generated responses, from the position of the first stop token.

    response_ids: [B, T] the generated tokens only (never the prompt), right-padded. eos_ids: iterable of stop
    token ids. Returns response_mask [B, T] float (1 up to and including the first stop token, 1 everywhere when
    there is none) and truncated [B] bool (no stop token). Padding is found from positions, never by comparing
    ids with the pad id, which may equal a stop id.
    Example: ids [[5, 6, 2, 2, 2]], eos {2} -> mask [[1, 1, 1, 0, 0]], truncated [False].
    """
    B, T = response_ids.shape
    is_stop = torch.isin(response_ids, torch.tensor(sorted(eos_ids), device=response_ids.device))  # [B, T]
    truncated = ~is_stop.any(1)  # [B]
    first_stop = torch.where(truncated, T - 1, is_stop.int().argmax(1))  # [B] last valid position
    positions = torch.arange(T, device=response_ids.device)  # [T]
    return (positions[None, :] <= first_stop[:, None]).float(), truncated  # [B, T], [B]


def _pad(seqs, value: int, left: bool):
    """[len(seqs), longest] long tensor of the token lists, padded with `value` on the left or the right."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if left and len(s):
            out[i, width - len(s):] = torch.as_tensor(s)
        elif len(s):
            out[i, :len(s)] = torch.as_tensor(s)
    return out


@torch.no_grad()
def generate_hf(model, prompts: list, prompt_index: list, eos_ids, pad_id: int, max_new_tokens: int,
                temperature: float, batch_size: int, greedy: bool = False) -> Batch:
    """Sample one response per prompt with transformers' generate (left padding, stop on any eos id).

    prompts: list of token-id lists (repeat a prompt K times for K rollouts). Sampling is plain temperature
    sampling over the full vocabulary (the model's generation_config is not used), or greedy.
    """
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=not greedy, temperature=None if greedy else temperature, top_k=None if greedy else 0,
                              top_p=None if greedy else 1.0, max_new_tokens=max_new_tokens,
                              eos_token_id=sorted(eos_ids), pad_token_id=pad_id)
    device = next(model.parameters()).device
    responses = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start: start + batch_size]
        ids = _pad(chunk, pad_id, left=True).to(device)  # [b, P]
        attn = _pad([[1] * len(p) for p in chunk], 0, left=True).to(device)  # [b, P]
        out = model.generate(input_ids=ids, attention_mask=attn, generation_config=config)  # [b, P + T]
        responses += out[:, ids.shape[1]:].cpu().tolist()  # generated tokens only
    response_ids = _pad(responses, pad_id, left=False)  # [B, T]
    response_mask, truncated = response_mask_from_ids(response_ids, eos_ids)
    response_ids = torch.where(response_mask.bool(), response_ids, pad_id)  # clean tail after the stop
    return Batch(_pad(prompts, pad_id, left=True), _pad([[1] * len(p) for p in prompts], 0, left=True),
                 response_ids, response_mask, truncated, torch.as_tensor(prompt_index))


# ---------------------------------------------------------------------------------------------------------------
# 4. Verify: math-verify in a worker process, with a hard deadline
# ---------------------------------------------------------------------------------------------------------------
def _verify_one(gold: str, completion: str) -> str:
    """'correct' | 'wrong' | 'no_answer' | 'bad_gold' | 'error' (math-verify: verify(gold, prediction))."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    try:
        gold_parsed = parse(gold, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
        if not gold_parsed:
            return "bad_gold"
        pred_parsed = parse(completion)
        if not pred_parsed:
            return "no_answer"
        return "correct" if verify(gold_parsed, pred_parsed) else "wrong"
    except Exception:  # sympy and latex2sympy raise many kinds on odd model output
        return "error"


def _verify_worker(conn):
    """Worker process loop: (gold, completion) in, status out, until None."""
    while True:
        item = conn.recv()
        if item is None:
            return
        conn.send(_verify_one(*item))


class Verifier:
    """Reward R = +1 if math-verify finds the gold answer in the completion, else -1.

    Checks run in one worker process: math-verify's own timeouts use signal.alarm, which works only in a main
    thread, so a hung check is instead killed from here after `timeout` seconds and counted as 'timeout'. Safe to
    call from any thread. Statuses: correct, wrong, no_answer, bad_gold, error, timeout.
    """

    STATUSES = ("correct", "wrong", "no_answer", "bad_gold", "error", "timeout")

    def __init__(self, timeout: float = 10.0):
        self.timeout, self._proc, self._conn, self._lock = timeout, None, None, threading.Lock()

    def _start(self):
        ctx = multiprocessing.get_context("spawn")  # fork would copy the trainer's threads and locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_verify_worker, args=(child,), daemon=True)
        self._proc.start()
        self._conn.send(("0", "0"))  # warm-up: the worker imports math-verify before the first deadline
        if not self._conn.poll(120):
            raise RuntimeError("the verifier worker did not start within 120 s")
        self._conn.recv()

    def _kill(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        self._proc = None

    def _check(self, gold: str, completion: str) -> str:
        try:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((gold, completion))
            if self._conn.poll(self.timeout):
                return self._conn.recv()
        except (EOFError, OSError, RuntimeError):  # the worker died or did not start; the next check retries
            self._kill()
            return "error"
        self._kill()  # hung past the deadline: a fresh worker takes the next check
        return "timeout"

    def __call__(self, golds: list, completions: list):
        """Returns (rewards list[float] of +-1, statuses list[str]), one per completion."""
        with self._lock:
            statuses = [self._check(str(g), c) for g, c in zip(golds, completions)]
        return [1.0 if s == "correct" else -1.0 for s in statuses], statuses

    def close(self):
        with self._lock:
            if self._proc is not None and self._proc.is_alive():
                self._conn.send(None)
                self._proc.join(timeout=5)
            self._kill()


# ---------------------------------------------------------------------------------------------------------------
# 5. Log-probs and values on a rollout batch
# ---------------------------------------------------------------------------------------------------------------
def model_inputs(batch: Batch):
    """input_ids, attention_mask, position_ids, all [B, P + T], for prompt + response (left and right padding)."""
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)  # [B, P + T]
    attention_mask = torch.cat([batch.prompt_mask.long(), batch.response_mask.long()], 1)  # [B, P + T]
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # [B, P + T] positions count real tokens only
    return input_ids, attention_mask, position_ids


def actor_logprobs(model, batch: Batch, temperature: float):
    """log pi(a_t | s_t) and the entropy of pi(. | s_t) at the sampling temperature, both [B, T] fp32 (0 on
    padding). The logits that score response token t sit at position P - 1 + t. The [B, T, V] logits are never
    materialised (kernels.logprobs_from_hidden works in chunks over valid tokens). Entropy carries no gradient."""
    device = next(model.parameters()).device
    input_ids, attention_mask, position_ids = (x.to(device) for x in model_inputs(batch))
    P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state  # [B, P + T, H]
    valid = batch.response_mask.to(device).bool()  # [B, T]
    h = hidden[:, P - 1: P + T - 1][valid]  # [N, H] N valid response tokens
    targets = batch.response_ids.to(device)[valid]  # [N]
    weight = model.get_output_embeddings().weight  # [V, H] fp32
    with torch.autocast(device.type, enabled=False):  # log-probs in fp32 even under bf16 autocast
        lp, ent = kernels.logprobs_from_hidden(h.float(), weight, targets, temperature)  # [N]
    logprobs = torch.zeros(valid.shape, device=device).masked_scatter(valid, lp)  # [B, T]
    entropy = torch.zeros(valid.shape, device=device).masked_scatter(valid, ent.detach())  # [B, T]
    return logprobs, entropy


def critic_values(critic: Critic, batch: Batch):
    """V(s_t) for t = 0..T-1, [B, T] fp32: V(s_0) at the last prompt token (position P - 1), V(s_t) at the
    position whose logits score response token t. Padding positions hold whatever the head outputs there;
    callers mask them."""
    device = critic.value_head.weight.device
    input_ids, attention_mask, position_ids = (x.to(device) for x in model_inputs(batch))
    P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    return critic(input_ids, attention_mask, position_ids)[:, P - 1: P + T - 1]  # [B, T]


def micro_batches(n: int, size: int):
    """Index lists [0..size), [size..2 size), ... covering range(n)."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


# ---------------------------------------------------------------------------------------------------------------
# 6. Advantages: decoupled GAE
# ---------------------------------------------------------------------------------------------------------------
def outcome_rewards_to_tokens(rewards, response_mask):
    """Token rewards [B, T]: the outcome reward R [B] on the last valid token, 0 elsewhere."""
    last = (response_mask.sum(1).long() - 1).clamp(min=0)  # [B]
    token_rewards = torch.zeros_like(response_mask)  # [B, T]
    return token_rewards.scatter(1, last[:, None], rewards[:, None].to(response_mask.dtype))


def adaptive_lambda(response_mask, alpha: float):
    """VAPO's length-adaptive lambda_i = 1 - 1/(alpha * T_i), [B], T_i = response length in tokens (VAPO eq. 7).
    Clamped to [0, 1] (alpha * T_i < 1 would give a negative lambda)."""
    lengths = response_mask.sum(1).clamp(min=1)  # [B]
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)  # [B]


def decoupled_gae(rewards, values, response_mask, gamma: float, critic_lam: float, alpha: float):
    """Actor advantages with per-sequence lambda_i and critic targets with lambda = critic_lam (VAPO/S3AC).

    rewards: [B] outcome rewards; values: [B, T] V(s_t) (padding may hold anything, it never reaches a valid
    token); response_mask: [B, T]. Returns (advantages [B, T], returns [B, T], metrics). Advantages are raw:
    any whitening belongs at the call site.
    """
    token_rewards = outcome_rewards_to_tokens(rewards, response_mask)  # [B, T]
    _, returns = kernels.gae(token_rewards, values, response_mask, gamma, critic_lam)  # [B, T] critic targets
    lam = adaptive_lambda(response_mask, alpha)  # [B]
    advantages, _ = kernels.gae(token_rewards, values, response_mask, gamma, lam)  # [B, T]
    return advantages, returns, {"adv/lambda_mean": lam.mean().item()}


def masked_mean(x, mask):
    """Mean of x [B, T] over the positions where mask [B, T] is nonzero (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def explained_variance(values, returns, mask) -> float:
    """1 - Var[R - V] / Var[R] over all valid tokens of the batch (population variances), from global sums, never
    as the mean of per-micro-batch values. nan when the returns are constant up to rounding (Var[R] < 1e-8: every
    answer right, or every answer wrong), where the ratio would only measure float error."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    var_r = r.var(unbiased=False) if r.numel() else torch.zeros((), dtype=torch.float64)
    return float("nan") if var_r.item() < 1e-8 else (1 - (r - v).var(unbiased=False) / var_r).item()


# ---------------------------------------------------------------------------------------------------------------
# 7. Updates: actor (CISPO) then critic (clipped value loss)
# ---------------------------------------------------------------------------------------------------------------
def optimize(module, optimizer, batch: Batch, loss_fn, epochs: int, minibatches: int, micro_batch_size: int,
             grad_clip: float, generator, amp_dtype) -> dict:
    """The update loop shared by actor and critic: `epochs` passes over the batch, each split into `minibatches`
    optimizer steps; a mini-batch runs in micro-batches of micro_batch_size sequences whose gradients accumulate.

    loss_fn(rows, mbatch, num_tokens) -> (loss, metrics): rows [b] indexes the batch, mbatch = batch.rows(rows),
    num_tokens = valid tokens of the whole mini-batch; the loss must be a sum over tokens divided by num_tokens, so
    the accumulated gradient is the token-mean over the mini-batch, and so must its per-token metrics. Returns the
    metrics averaged over optimizer steps, with grad_norm (before clipping) and clipped (share of clipped steps).
    """
    device = next(module.parameters()).device
    sums, steps = {"grad_norm": 0.0, "clipped": 0.0}, 0
    for _ in range(epochs):
        perm = torch.randperm(batch.response_mask.shape[0], generator=generator)  # [B]
        for mb in perm.chunk(minibatches):
            num_tokens = batch.response_mask[mb].sum().to(device)  # loss normaliser: tokens of the mini-batch
            for rows in mb.split(micro_batch_size):
                with autocast(device, amp_dtype):  # forward only; backward runs outside autocast
                    loss, metrics = loss_fn(rows, batch.rows(rows), num_tokens)
                loss.backward()
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
            grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), grad_clip).item()
            sums["grad_norm"] += grad_norm
            sums["clipped"] += float(grad_norm > grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    return {key: value / steps for key, value in sums.items()}


def update_actor(model, optimizer, batch: Batch, advantages, old_logprobs, args: Args, generator) -> dict:
    """CISPO on the batch: args.actor_epochs passes of args.minibatches steps, token-mean loss per mini-batch.

    advantages [B, T] (on the model's device); old_logprobs [B, T]: log mu, the behaviour policy, or None when the
    actor takes one optimizer step in all, so that mu is the current policy and its log-probs are the detached
    log-probs of the same forward pass (ratio exactly 1).
    """
    device = advantages.device

    def loss_fn(rows, mbatch, num_tokens):
        logprobs, entropy = actor_logprobs(model, mbatch, args.temperature)  # [b, T]
        mask = mbatch.response_mask.to(device)  # [b, T]
        old = logprobs.detach() if old_logprobs is None else old_logprobs[rows.to(device)]  # [b, T]
        # CISPO: J = sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi; loss = -(sum of J) / num_tokens
        pg_loss, m = kernels.cispo_loss(logprobs, old, advantages[rows.to(device)], mask, args.eps_low,
                                        args.eps_high, num_tokens=num_tokens)
        return pg_loss, dict(m, pg_loss=pg_loss.detach(), entropy=(entropy * mask).sum() / num_tokens)

    metrics = optimize(model, optimizer, batch, loss_fn, args.actor_epochs, args.minibatches, args.micro_batch_size,
                       args.actor_grad_clip, generator, compute_dtype(args.dtype, device))
    return {f"actor/{k}": v for k, v in metrics.items()}


def update_critic(critic, optimizer, batch: Batch, old_values, returns, args: Args, generator) -> dict:
    """Clipped value regression toward `returns`: args.critic_epochs passes of args.minibatches steps.

    old_values [B, T]: the values the advantages used (the clipping centre); returns [B, T]: the targets; both on
    the critic's device.
    """
    device = returns.device

    def loss_fn(rows, mbatch, num_tokens):
        values = critic_values(critic, mbatch)  # [b, T]
        r = rows.to(device)
        # L_V = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2); sum / num_tokens
        v_loss, m = kernels.value_loss(values, old_values[r], returns[r], mbatch.response_mask.to(device),
                                       args.eps_v, num_tokens=num_tokens)
        return v_loss, dict(m, v_loss=v_loss.detach())

    metrics = optimize(critic, optimizer, batch, loss_fn, args.critic_epochs, args.minibatches,
                       args.micro_batch_size, args.critic_grad_clip, generator, compute_dtype(args.dtype, device))
    return {f"critic/{k}": v for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------------------------
# 8. Evaluation, checkpoints
# ---------------------------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, problems, prompts, verifier, eos_ids, pad_id, args: Args) -> dict:
    """Greedy pass@1 on held-out problems."""
    model.eval()
    batch = generate_hf(model, prompts, list(range(len(prompts))), eos_ids, pad_id,
                        args.eval_max_new_tokens or args.max_new_tokens, 1.0, args.gen_batch_size, greedy=True)
    texts = tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
    rewards, _ = verifier([p.answer for p in problems], texts)
    return {"eval/pass@1": sum(r > 0 for r in rewards) / len(rewards),
            "eval/response_len": batch.response_mask.sum(1).mean().item(), "eval/n": len(rewards)}


def save_checkpoint(out_dir: str, step: int, model, tokenizer, critic, actor_opt, critic_opt, sampler, update_gen,
                    keep: int):
    """Write checkpoints/step_N atomically: everything goes to a temporary directory that is renamed when
    complete, then the `latest` pointer is replaced. A kill at any moment leaves the previous checkpoint."""
    from safetensors.torch import save_file
    root = os.path.join(out_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f".tmp-step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(os.path.join(tmp, "actor"))
    tokenizer.save_pretrained(os.path.join(tmp, "actor"))
    critic.backbone.save_pretrained(os.path.join(tmp, "critic"))
    save_file({"weight": critic.value_head.weight.detach().cpu().contiguous()},
              os.path.join(tmp, "critic", "value_head.safetensors"))
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    rng["update"] = update_gen.get_state()
    torch.save({"step": step, "actor_opt": actor_opt.state_dict(), "critic_opt": critic_opt.state_dict(),
                "sampler": (sampler.epoch, sampler.pos), "rng": rng}, os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(os.path.join(root, "latest"), f"step_{step}\n")
    done = sorted((int(d[5:]) for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)), reverse=True)
    for old in done[keep:]:
        shutil.rmtree(os.path.join(root, f"step_{old}"), ignore_errors=True)


def _write_atomic(path: str, text: str):
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def latest_checkpoint(out_dir: str):
    """Path of the newest complete checkpoint in out_dir, or None."""
    pointer = os.path.join(out_dir, "checkpoints", "latest")
    if not os.path.isfile(pointer):
        return None
    path = os.path.join(out_dir, "checkpoints", open(pointer).read().strip())
    return path if os.path.isfile(os.path.join(path, "trainer_state.pt")) else None


def log_metrics(path: str, metrics: dict):
    """Append one JSON record (nan becomes null)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    with open(path, "a") as f:
        f.write(json.dumps(clean) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# 9. Training loop
# ---------------------------------------------------------------------------------------------------------------
def train(args: Args):
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one tqdm bar: the training steps
    kernels.set_backend(args.kernels)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    amp_dtype = compute_dtype(args.dtype, device)
    os.makedirs(args.out_dir, exist_ok=True)

    # data
    train_problems, eval_problems = split_problems(
        load_problems(args.data, args.prompt_key, args.answer_key, args.split, args.seed), args.eval_data, args)
    sampler = PromptSampler(len(train_problems), args.seed)

    # models
    ckpt = latest_checkpoint(args.out_dir) if args.resume else None
    if args.resume and ckpt is None:
        print(f"--resume: no checkpoint in {args.out_dir}, starting from step 0", file=sys.stderr)
    model_path = resolve_model(args.model, args.cache_dir)
    critic_path = resolve_model(args.critic_model, args.cache_dir) if args.critic_model else model_path
    actor_src = os.path.join(ckpt, "actor") if ckpt else model_path
    tokenizer = AutoTokenizer.from_pretrained(actor_src)
    model = load_actor(actor_src, device)
    critic = load_critic(os.path.join(ckpt, "critic") if ckpt else critic_path, device, args.critic_seed,
                         os.path.join(ckpt, "critic", "value_head.safetensors") if ckpt else "")
    random.seed(args.seed)  # after loading: a one-time .gguf conversion draws from the global RNG
    torch.manual_seed(args.seed)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        critic.backbone.gradient_checkpointing_enable()
    eos_ids = {tokenizer.eos_token_id, *_as_list(model.generation_config.eos_token_id), *chat_stop_ids(tokenizer)}
    eos_ids.discard(None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    actor_opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=args.lr * args.critic_lr_ratio, weight_decay=0.0)
    update_gen = torch.Generator().manual_seed(args.seed)  # mini-batch order in the updates
    start_step = 0
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    if ckpt:
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
        actor_opt.load_state_dict(state["actor_opt"])
        critic_opt.load_state_dict(state["critic_opt"])
        sampler.epoch, sampler.pos = state["sampler"]
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        update_gen.set_state(state["rng"]["update"])
        start_step = state["step"]
        _drop_records_after(metrics_path, start_step)  # records of steps that the kill threw away
        print(f"resumed from {ckpt} at step {start_step}", file=sys.stderr)
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh run starts a fresh log

    prompt_cache = {}

    def prompt_ids(i, problems, tag):
        if (tag, i) not in prompt_cache:
            prompt_cache[(tag, i)] = build_prompt(tokenizer, problems[i].question, args.prompt_template)
        return prompt_cache[(tag, i)]

    eval_prompts = [prompt_ids(i, eval_problems, "eval") for i in range(len(eval_problems))]
    verifier = Verifier(args.verify_timeout)

    def run_eval(step):
        t0 = time.time()
        m = evaluate(model, tokenizer, eval_problems, eval_prompts, verifier, eos_ids, pad_id, args)
        m["time/eval"] = time.time() - t0
        tqdm.write(f"step {step:4d} | eval pass@1 {m['eval/pass@1']:.3f} on {m['eval/n']} held-out problems")
        return m

    if start_step == 0:
        with autocast(device, amp_dtype):
            log_metrics(metrics_path, {"step": 0, **run_eval(0)})
    bar = tqdm(range(start_step + 1, args.steps + 1), initial=start_step, total=args.steps, desc="s3ac",
               file=sys.stderr)
    for step in bar:
        timer, metrics = time.time(), {"step": step}

        # rollout: K samples for each of batch_prompts prompts
        index = [i for i in sampler.draw(args.batch_prompts) for _ in range(args.k)]
        model.eval()
        with autocast(device, amp_dtype):
            batch = generate_hf(model, [prompt_ids(i, train_problems, "train") for i in index], index, eos_ids,
                                pad_id, args.max_new_tokens, args.temperature, args.gen_batch_size)
        metrics["time/rollout"] = time.time() - timer

        # verify
        t0 = time.time()
        texts = tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        reward_list, statuses = verifier([train_problems[i].answer for i in index], texts)
        rewards = torch.tensor(reward_list, device=device)  # [B]
        metrics["time/verify"] = time.time() - t0

        # values V(s_t) from the critic; behaviour log-probs when the actor takes several steps
        t0 = time.time()
        mask = batch.response_mask.to(device)  # [B, T]
        with torch.no_grad(), autocast(device, amp_dtype):
            critic.eval()
            values = torch.cat([critic_values(critic, batch.rows(mb))
                                for mb in micro_batches(len(index), args.micro_batch_size)])  # [B, T]
            values = torch.where(mask.bool(), values, 0.0)  # [B, T]
            old_logprobs = None
            if args.actor_epochs * args.minibatches > 1:
                old_logprobs = torch.cat([actor_logprobs(model, batch.rows(mb), args.temperature)[0]
                                          for mb in micro_batches(len(index), args.micro_batch_size)])  # [B, T]
        metrics["time/values"] = time.time() - t0

        # advantages (decoupled GAE), raw: no whitening
        advantages, returns, m = decoupled_gae(rewards, values, mask, args.gamma, args.critic_lam, args.alpha)
        metrics.update(m)

        # actor update, then critic update on the same batch
        t0 = time.time()
        model.train()
        metrics.update(update_actor(model, actor_opt, batch, advantages, old_logprobs, args, update_gen))
        metrics["time/actor"] = time.time() - t0
        t0 = time.time()
        critic.train()
        metrics.update(update_critic(critic, critic_opt, batch, values, returns, args, update_gen))
        metrics["time/critic"] = time.time() - t0

        # log (before the checkpoint, so that a checkpointed step always has its record)
        metrics.update({
            "rollout/reward": rewards.mean().item(),
            "rollout/acc": (rewards > 0).float().mean().item(),
            "rollout/response_len": mask.sum(1).mean().item(),
            "rollout/truncated": batch.truncated.float().mean().item(),
            **{f"verify/{s}": statuses.count(s) for s in Verifier.STATUSES[2:]},
            "critic/explained_var": explained_variance(values, returns, mask),
            "critic/value_mean": masked_mean(values, mask).item(),
            "critic/v0_mean": values[:, 0].mean().item(),
            "adv/mean": masked_mean(advantages, mask).item(),
            "perf/tokens_per_s": mask.sum().item() / metrics["time/rollout"],
        })
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            with autocast(device, amp_dtype):
                metrics.update(run_eval(step))
        metrics["perf/step_s"] = time.time() - timer
        log_metrics(metrics_path, metrics)
        tqdm.write(f"step {step:4d} | reward {metrics['rollout/reward']:+.3f} acc {metrics['rollout/acc']:.3f} "
                   f"len {metrics['rollout/response_len']:.0f} | pg_loss {metrics['actor/pg_loss']:+.4f} "
                   f"clipfrac {metrics['actor/pg_clipfrac']:.3f} entropy {metrics['actor/entropy']:.3f} | "
                   f"v_loss {metrics['critic/v_loss']:.4f} EV {metrics['critic/explained_var']:+.3f} "
                   f"V0 {metrics['critic/v0_mean']:+.3f} | {metrics['perf/step_s']:.0f}s")
        if step == args.steps or (args.save_every and step % args.save_every == 0):
            save_checkpoint(args.out_dir, step, model, tokenizer, critic, actor_opt, critic_opt, sampler,
                            update_gen, args.keep_checkpoints)
    verifier.close()
    return metrics_path


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _drop_records_after(path: str, step: int):
    if os.path.isfile(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= step]
        _write_atomic(path, "".join(kept))


if __name__ == "__main__":
    train(parse_args())
