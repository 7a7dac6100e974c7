"""Side-by-side S3AC runs at equal training minutes: ./run.sh compare (or python .ci/compare.py).

    ./run.sh compare [--seeds 3] [--minutes 20] [--critic-layers 4]    # the CPU demo's model and settings
    python .ci/compare.py --help                                       # its own flags; the others go to every run

S3AC K=1 with the partial-trunk critic (its own --critic-layers, --critic-lr-ratio, --critic-epochs and
--critic-warmup-steps; the full-critic run keeps s3ac.py's defaults, the paper's), REINFORCE++ K=1, GRPO K=4 on a
quarter of the prompts (equal samples per step) and S3AC K=1 with the full critic. One run of s3ac.py per seed, one
after another, seed 0 of every config first; each with the same --max-minutes, training data and held-out problems
(<out-dir>/data/). Then one table (compare_table, printed and written to <out-dir>/table.md) and the curves of every
run (s3ac.plot_runs, <out-dir>/compare.png).
"""

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, HERE)  # s3ac.py

from s3ac import _write_atomic, critic_efficiency, load_problems, plot_runs, read_records  # noqa: E402


def mean_se(values: list):
    """(mean, standard error = sample std (n - 1) / sqrt(n)) of the finite values; se NaN for one, both for none."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    mean = sum(v) / len(v) if v else math.nan
    return mean, math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1) / len(v)) if len(v) > 1 else math.nan


def run_summary(records: list, at_minutes: float) -> dict:
    """One run of the comparison, from s3ac.read_records: the training minutes it reached (a run stopped by
    --max-minutes passes the budget by up to one step); its final pass@1 (last evaluation); pass@1 at at_minutes
    (the last evaluation by that minute of training, or after the step running at that minute: a run stopped by
    --max-minutes ends with the step that crosses the budget, so its final evaluation counts at it); token EV and
    V(s_0) EV averaged over the second half of its steps; c over all steps; and efficiency 1 / ((1 - EV)(1 + c)) of
    those means, once with the token EV (the variance the per-token values remove) and once with V(s_0) EV (as
    critic/efficiency). NaN where the run logged no such key (critic-free runs)."""
    steps, evals = [r for r in records if "perf/step_s" in r], [r for r in records if r.get("eval/pass@1") is not None]
    half = steps[len(steps) // 2:]
    begun = [r["minutes"] if "perf/step_s" not in r else prev["minutes"]  # training minutes when r's step began
             for prev, r in zip([{"minutes": 0.0}] + records, records)]
    on_time = [r for r, t in zip(records, begun)
               if r.get("eval/pass@1") is not None and (r["minutes"] <= at_minutes or t < at_minutes)]
    token_ev = mean_se([r.get("critic/explained_var") for r in half])[0]
    v0_ev = mean_se([r.get("critic/adv_explained_var") for r in half])[0]
    c = mean_se([r.get("critic/compute_ratio") for r in steps])[0]
    return {"minutes": records[-1]["minutes"], "final pass@1": evals[-1]["eval/pass@1"],
            "pass@1 at equal minutes": on_time[-1]["eval/pass@1"],
            "token EV": token_ev, "V(s_0) EV": v0_ev, "c": c, "efficiency, token EV": critic_efficiency(token_ev, c),
            "efficiency, V(s_0) EV": critic_efficiency(v0_ev, c)}


def compare_table(runs: dict) -> str:
    """A markdown table of runs {name: [s3ac.read_records of each seed]}: per name, mean ± standard error over seeds
    of each run_summary column ("-": none). Equal minutes: the least training time any run reached (with
    --max-minutes, the budget plus the shortest overshoot)."""
    at = min(seed[-1]["minutes"] for seeds in runs.values() for seed in seeds)
    rows = {name: [run_summary(seed, at) for seed in seeds] for name, seeds in runs.items()}
    columns = list(next(iter(rows.values()))[0])
    lines = ["| run | seeds | " + " | ".join(columns).replace("equal minutes", f"{at:.1f} min") + " |",
             "|---" * (len(columns) + 2) + "|"]
    for name, summaries in rows.items():
        cells = [mean_se([s[c] for s in summaries]) for c in columns]
        lines.append(f"| {name} | {len(summaries)} | " + " | ".join(
            "-" if math.isnan(m) else f"{m:.3f}" if math.isnan(se) else f"{m:.3f} ± {se:.3f}" for m, se in cells)
            + " |")
    return "\n".join(lines)


def compare(argv=None):
    """Side-by-side runs at equal training minutes (./run.sh compare), then one table and one figure.

    The runs and outputs are those of this file's docstring. Other flags go to every run. A finished run (its
    directory holds `done`, the flags it ran with) is not run again; one finished with other flags stops the
    comparison with a one-line error (SystemExit) that names its directory."""
    parser = argparse.ArgumentParser(prog=".ci/compare.py", description=compare.__doc__.split("\n")[0],
                                     epilog="Other flags (python s3ac.py --help) go to every run.")
    for flag, default, text in (
            ("--seeds", 3, "seeds of S3AC and REINFORCE++ (K = 1)"), ("--grpo-seeds", 2, "seeds of GRPO K = 4"),
            ("--full-critic-seeds", 1, "seeds of S3AC with the full critic"),
            ("--minutes", 20.0, "training minutes of every run (--max-minutes)"),
            ("--critic-layers", 4, "k of the partial-trunk critic"),
            ("--critic-lr-ratio", 20.0, "the partial-trunk critic's learning rate over the actor's"),
            ("--critic-epochs", 1, "the partial-trunk critic's passes over each batch"),
            ("--critic-warmup-steps", 4, "the partial-trunk critic's on-policy updates before training (timed)"),
            ("--eval-every", 15, "steps between evaluations of every run (and one at its end)"),
            ("--batch-prompts", 16, "prompts per step at K = 1; GRPO answers a quarter of them 4 times"),
            ("--eval-size", 200, "held-out problems, the same for every run"),
            ("--data", "builtin:arithmetic", "problems, split once into training and held-out"),
            ("--out-dir", "runs/compare", "one directory per run, data/, table.md, compare.png")):
        parser.add_argument(flag, type=type(default), default=default, help=text)
    opts, rest = parser.parse_known_args(argv)
    problems = list({p.question: p for p in load_problems(opts.data)}.values())  # distinct questions
    held = set(random.Random(12345).sample(range(len(problems)), opts.eval_size))
    data = {part: os.path.join(opts.out_dir, "data", f"{part}.jsonl") for part in ("train", "eval")}
    os.makedirs(os.path.dirname(data["train"]), exist_ok=True)
    for part, keep in (("train", False), ("eval", True)):  # one split for every run and seed
        _write_atomic(data[part], "".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                                          for i, p in enumerate(problems) if (i in held) == keep))
    b, k = opts.batch_prompts, str(opts.critic_layers)
    partial = ["--critic-layers", k, "--critic-lr-ratio", str(opts.critic_lr_ratio), "--critic-epochs",
               str(opts.critic_epochs), "--critic-warmup-steps", str(opts.critic_warmup_steps)]
    configs = {f"s3ac-k1-layers{k}": (opts.seeds, ["--k", "1", "--batch-prompts", str(b), *partial]),
               "reinforce_pp-k1": (opts.seeds, ["--algo", "reinforce_pp", "--k", "1", "--batch-prompts", str(b)]),
               "grpo-k4": (opts.grpo_seeds, ["--algo", "grpo", "--k", "4", "--batch-prompts", str(b // 4)]),
               "s3ac-k1-full": (opts.full_critic_seeds, ["--k", "1", "--batch-prompts", str(b)])}
    runs = {name: [os.path.join(opts.out_dir, f"{name}-seed{s}") for s in range(n)] for name, (n, _) in configs.items()}
    order = sorted(((seed, name, out) for name, dirs in runs.items() for seed, out in enumerate(dirs)),
                   key=lambda run: run[0])  # seed 0 of every config first: a stopped comparison stays balanced
    for seed, name, out in order:
        flags = ["--data", data["train"], "--eval-data", data["eval"], "--eval-size", str(opts.eval_size),
                 "--eval-every", str(opts.eval_every), "--steps", "1000000", "--max-minutes", str(opts.minutes),
                 "--save-every", "0", "--seed", str(seed), "--out-dir", out, *configs[name][1], *rest]
        done = os.path.join(out, "done")  # a finished run: the flags it ran with, one JSON list
        if os.path.exists(done):
            with open(done) as f:
                if f.read().strip() != json.dumps(flags):
                    raise SystemExit(f"{out}: finished with other settings (see {done}); remove it or pick another "
                                     "--out-dir")
            continue
        subprocess.run([sys.executable, os.path.join(HERE, "s3ac.py"), *flags], check=True)
        shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)  # gigabytes per run
        _write_atomic(done, json.dumps(flags) + "\n")
    table = compare_table({name: [read_records(d) for d in dirs] for name, dirs in runs.items()})
    print(table)
    _write_atomic(os.path.join(opts.out_dir, "table.md"), table + "\n")
    print(plot_runs([d for dirs in runs.values() for d in dirs], os.path.join(opts.out_dir, "compare.png")))


if __name__ == "__main__":
    compare()
