"""The critic's offset, isolated: paired branches from one checkpoint (python .ci/offset.py).

    ./run.sh --seed 40 --steps 30 --max-minutes 0 --save-every 30 --eval-every 30 --out-dir runs/offset/seed40-base
    python .ci/offset.py --bases runs/offset/seed40-base[,...] [--shift 0.5] [--shift-steps 31-35] [--steps 40]

A base is a finished s3ac.py run of a critic algorithm (critic lambda 1) with its last checkpoint. Every branch copies
it and resumes with the base's own flags (its run.json) plus the branch's (--resume restores the RNG, so every branch
draws the same rollouts at its first step):
    control        --adv-norm none (the advantages raw)
    center         --adv-norm center
    shift          --adv-norm none, V(s_t) + shift in the actor's GAE alone on --shift-steps: the advantages of a
                   critic that lags above the success rate; the critic's targets (lambda 1: the Monte-Carlo return,
                   whatever V) and its update are untouched
    shift+center   both
or, with --branch NAME=FLAGS (repeatable), those branches instead: the base's flags, then FLAGS, then this script's
own (--out-dir, --resume, --steps, --eval-every, --save-every, --max-minutes: they win), the shift only where NAME
starts with "shift" (e.g. --shift 0 --branch control= --branch lr1e-5="--lr 1e-5": control= keeps the base's flags).
Then one markdown table (printed and written to <out>/table.md): per base and branch, over the shifted steps and
the steps after them, the means of the training reward, adv/mean, adv/pos_share, critic/offset, the actor's
entropy and grad norm and the response length, and pass@1 at every evaluation after the base (--eval-every).
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, HERE)  # s3ac.py

BRANCHES = {"control": ["--adv-norm", "none"], "center": ["--adv-norm", "center"], "shift": ["--adv-norm", "none"],
            "shift+center": ["--adv-norm", "center"]}
COLUMNS = ["rollout/reward", "adv/mean", "adv/pos_share", "critic/offset", "actor/entropy", "actor/grad_norm",
           "rollout/response_len"]


def shifted_run(shift: float, first: int, last: int, argv: list):
    """s3ac.main(argv) with V(s_t) + shift on the response tokens in compute_advantages (the actor's GAE; the critic's
    lambda-1 targets do not read V) on training steps first..last; train_step and compute_advantages are looked up
    in s3ac's module namespace, so the patch reaches the step as it runs."""
    import s3ac
    train_step, compute_advantages, now = s3ac.train_step, s3ac.compute_advantages, {}

    def step(args, state, reward_fn):
        now["step"] = state.step + 1  # the step train_step is about to take
        return train_step(args, state, reward_fn)

    def advantages(args, batch, rewards, values, mask):
        if values is not None and first <= now["step"] <= last:
            values = values + shift * mask  # [B, T] a critic that lags `shift` above the returns
        return compute_advantages(args, batch, rewards, values, mask)

    s3ac.train_step, s3ac.compute_advantages = step, advantages
    s3ac.main(argv)


def base_flags(base: str) -> tuple:
    """(flags, step): the flags of the run whose newest checkpoint is in base (its run.json, every resolved field
    but out_dir, resume and plot), and that checkpoint's step. ValueError: no checkpoint, or a critic lambda below 1
    (the shift would move the critic's targets too)."""
    import s3ac
    ckpt = s3ac.latest_checkpoint(base)
    if ckpt is None:
        raise ValueError(f"{base}: no checkpoint (run it with --save-every N)")
    with open(os.path.join(ckpt, "run.json")) as f:
        saved = json.load(f)["args"]
    if saved["critic_lam"] != 1.0 or saved["algo"] not in s3ac.CRITIC_ALGOS:
        raise ValueError(f"{base}: --algo {saved['algo']}, --critic-lam {saved['critic_lam']}: the branches need a "
                         f"critic with lambda 1")
    flags = [part for key, value in saved.items() if key not in ("out_dir", "resume", "plot")
             for part in (f"--{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value))]
    return flags, int(os.path.basename(ckpt).split("_")[-1])


def branch_table(runs: dict, first: int, last: int) -> str:
    """Markdown rows of runs {(base, branch): metrics.jsonl records}: each COLUMNS mean over steps first..last and
    over the steps after last, and pass@1 at each evaluation after first - 1."""
    evals = sorted({r["step"] for records in runs.values() for r in records
                    if r.get("eval/pass@1") is not None and r["step"] >= first})
    head = [f"{c} {w}" for c in COLUMNS for w in (f"{first}-{last}", f"> {last}")]
    lines = ["| base | branch | " + " | ".join(head + [f"pass@1 at {s}" for s in evals]) + " |",
             "|---" * (len(head) + len(evals) + 2) + "|"]
    for (base, name), records in runs.items():
        steps = {r["step"]: r for r in records if "perf/step_s" in r}
        cells = []
        for c in COLUMNS:
            for window in ([s for s in steps if first <= s <= last], [s for s in steps if s > last]):
                v = [steps[s][c] for s in window if steps[s].get(c) is not None]
                cells.append(f"{sum(v) / len(v):+.3f}" if v else "-")
        passes = {r["step"]: r["eval/pass@1"] for r in records if r.get("eval/pass@1") is not None}
        cells += [f"{passes[s]:.3f}" if s in passes else "-" for s in evals]
        lines.append(f"| {os.path.basename(base)} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    import s3ac
    parser = argparse.ArgumentParser(prog=".ci/offset.py", description=__doc__.split("\n")[0])
    parser.add_argument("--bases", required=True, help="comma-separated run directories with a checkpoint")
    parser.add_argument("--shift", type=float, default=0.5, help="added to V(s_t) in the actor's GAE (+-1 scale)")
    parser.add_argument("--shift-steps", default="31-35", help="first-last training step of the shift")
    parser.add_argument("--steps", type=int, default=40, help="the step every branch stops after")
    parser.add_argument("--eval-every", type=int, default=5, help="steps between evaluations of every branch")
    parser.add_argument("--out", default="runs/offset", help="one directory per base and branch, table.md")
    parser.add_argument("--branch", action="append", metavar="NAME=FLAGS", help="a branch of one's own, its s3ac.py "
                        "flags one string (repeatable; replaces the four)")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # a branch's own process
    opts = parser.parse_args(argv)
    first, last = (int(x) for x in opts.shift_steps.split("-"))
    branches = BRANCHES if not opts.branch else {}
    for name, eq, flags in (b.partition("=") for b in opts.branch or ()):
        if not eq or not re.fullmatch(r"[A-Za-z0-9][\w.+-]*", name) or name in branches:
            parser.error(f"--branch {name}{eq}{flags}: need NAME=FLAGS, NAME letters, digits, . _ + - (a directory "
                         f"name) and not given twice")
        try:
            branches[name] = shlex.split(flags)
        except ValueError as e:  # an unclosed quote
            parser.error(f"--branch {name}={flags}: {e}")
    runs = {}
    for base in opts.bases.split(","):
        flags, step = base_flags(base)
        if not step < first <= last <= opts.steps:
            parser.error(f"--shift-steps {opts.shift_steps} must lie after {base}'s step {step}, by --steps")
        for name, extra in branches.items():
            out = os.path.join(opts.out, f"{os.path.basename(base)}-{name}")
            shift = opts.shift if name.startswith("shift") else 0.0
            child = [str(shift), str(first), str(last), *flags, *extra, "--out-dir", out, "--resume", "true",
                     "--steps", str(opts.steps), "--eval-every", str(opts.eval_every), "--save-every", "0",
                     "--max-minutes", "0"]
            done = os.path.join(out, "done")  # a finished branch: the arguments it ran with
            if os.path.exists(done) and open(done).read().strip() != json.dumps(child):
                raise SystemExit(f"{out}: finished with other settings (see {done}); remove it or pick another --out")
            if not os.path.exists(done):
                shutil.rmtree(out, ignore_errors=True)  # the base's logs and its newest checkpoint alone
                shutil.copytree(base, out, ignore=lambda d, names: ["checkpoints"] if d == base else [])
                ckpt = s3ac.latest_checkpoint(base)
                shutil.copytree(ckpt, os.path.join(out, "checkpoints", os.path.basename(ckpt)))
                subprocess.run([sys.executable, os.path.abspath(__file__), "--bases", base, "--child", *child],
                               check=True)
                shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
                with open(done, "w") as f:
                    f.write(json.dumps(child) + "\n")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                runs[(base, name)] = [json.loads(line) for line in f]
    table = branch_table(runs, first, last)
    print(table)
    with open(os.path.join(opts.out, "table.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    if "--child" in sys.argv:  # .ci/offset.py --bases B --child SHIFT FIRST LAST s3ac-flags...
        shift, first, last, *rest = sys.argv[sys.argv.index("--child") + 1:]
        shifted_run(float(shift), int(first), int(last), rest)
    else:
        main()
