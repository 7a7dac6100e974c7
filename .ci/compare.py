"""Side-by-side runs at equal training minutes or a fixed step count: ./run.sh compare (or python .ci/compare.py).

    ./run.sh compare [--seeds 6] [--grpo-seeds 3] [--minutes 20]     # the CPU demo's model, task and critic
    ./run.sh compare --steps 100 --first-seed 8 --seeds 16 --only s3ac-k1,flash_reinforce-k1   # fixed steps
    python .ci/compare.py --help                                       # its own flags; the others go to every run

S3AC K=1 (with --s3ac-flags, the demo's critic), REINFORCE++ K=1, FlashREINFORCE K=1 and GRPO K=4 on a quarter of
the prompts (equal samples per step); --only s3ac-k1,flash_reinforce-k1 runs one pair. One run of s3ac.py per seed,
one after another, seed s of every config before seed s + 1; each with the same --max-minutes, the same training
data and the same held-out problems (--eval-data heldout is one fixed sample for every seed), and seed s of every
config draws the same prompt order (S3AC's critic warm-up takes its first batches). With --steps N every run stops
after step N instead (no minute budget): pass@1 "at the end" is then at the fixed step, and the tables give no
figure at equal minutes (an evaluation every 20 steps would read a run 4-17% slower at step 80 against another's
step 100: the figure would be partly the evaluation grid). With --minutes every arm evaluates at its own end, and
pass@1 at equal minutes is the evaluation of the step running at the least time any run reached (equal_minutes).
--only s3ac-center-k1 and s3ac-none-k1 add S3AC with --adv-norm center and none (run only when named: the default is
center, so s3ac-k1 runs it). Then one table (compare_table) with pass@1 at equal minutes and at the end, each run's
best pass@1, the step it came at and its final minus best, its largest drop (largest_drop) and whether it fell by
FALL or more, its held-out fall (heldout_fall), its response length at the end and FlashREINFORCE's trust-region
drop share; one row per run (runs_table); and the paired differences by seed (paired_table): S3AC (s3ac-k1, else
s3ac-center-k1, else s3ac-none-k1) less each other setting at equal minutes, at the end, at equal samples and in
largest drop, with their standard errors, and the paired-variance test of pass@1 at the end (pitman_morgan); last,
the largest drop a run that never moved would show (noise_floor). Printed and written to <out-dir>/table.md; the
curves of every run (curves.plot_runs) to <out-dir>/compare.png.
"""

import argparse
import itertools
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path[:0] = [HERE, os.path.join(HERE, ".ci")]  # s3ac.py, curves.py

from curves import plot_runs, read_records  # noqa: E402
from s3ac import _write_atomic, critic_efficiency  # noqa: E402


def mean_se(values: list):
    """(mean, standard error = sample std (n - 1) / sqrt(n)) of the finite values; se NaN for one, both for none."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    mean = sum(v) / len(v) if v else math.nan
    return mean, math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1) / len(v)) if len(v) > 1 else math.nan


FALL = 0.25  # a run "fell" when its largest_drop is at least this (success rate, [0, 1])
OPT_IN = ("s3ac-center-k1", "s3ac-none-k1")  # S3AC with --adv-norm center / none: run only when --only names them


def largest_drop(records: list, window: int = 5) -> float:
    """The largest fall of a run's training success rate (rollout/acc: the share of rollouts right), as the mean of
    `window` consecutive steps, below the running maximum of that mean, over its training steps (warm-up left out):
    max_t (max_{s <= t} m_s - m_t). 0 for a curve that never falls; NaN for fewer than `window` steps."""
    acc = [r.get("rollout/acc") for r in records if "perf/step_s" in r]
    return math.nan if None in acc else drop_below_peak(acc, window)


def drop_below_peak(values: list, window: int = 1) -> float:
    """max_t (max_{s <= t} m_s - m_t), m_t the mean of `window` consecutive values; NaN for fewer than `window`.
    Rounded to 12 places, so that a drop of exactly FALL in success rates (sums of 1/16) reads as FALL."""
    means = [sum(values[i - window:i]) / window for i in range(window, len(values) + 1)]  # m_t, t = window .. n
    peaks = list(itertools.accumulate(means, max))
    return max((round(p - m, 12) for p, m in zip(peaks, means)), default=math.nan)


def heldout_fall(records: list) -> float:
    """The largest fall of a run's held-out pass@1 below its best so far, over its evaluations in order (400
    problems: a standard error near 0.025, where a 5-step window of 16 rollouts a step has one near 0.055)."""
    return drop_below_peak([r["eval/pass@1"] for r in records if r.get("eval/pass@1") is not None])


def flat_run_drops(p: float, rollouts: int, steps: int, window: int = 5, trials: int = 2000, seed: int = 0) -> tuple:
    """The noise floor of largest_drop: (median largest drop, share of runs with FALL or more) of `trials` simulated
    runs whose success rate never moves, each of `steps` steps of `rollouts` rollouts, each right with probability p."""
    rng = random.Random(seed)
    drops = sorted(drop_below_peak([sum(rng.random() < p for _ in range(rollouts)) / rollouts for _ in range(steps)],
                                   window) for _ in range(trials))
    return drops[trials // 2], sum(d >= FALL for d in drops) / trials


def pitman_morgan(x: list, y: list) -> tuple:
    """Pitman-Morgan test (Pitman 1939; Morgan 1939) of equal variances of paired samples x, y (n >= 3 pairs; fewer
    divide by zero): Var x = Var y exactly when x + y and x - y are uncorrelated; t = r sqrt(n - 2) / sqrt(1 - r^2)
    with n - 2 degrees of freedom. Returns
    (Var x / Var y, t, two-sided p), the t distribution's tail from mpmath's regularised incomplete beta; all NaN
    where a variance or x + y's or x - y's spread is 0 (a run's pass@1 the same on every seed)."""
    import mpmath  # sympy's dependency, installed with math-verify
    n = len(x)
    s, d = [a + b for a, b in zip(x, y)], [a - b for a, b in zip(x, y)]
    ms, md = sum(s) / n, sum(d) / n
    cov, spread = sum((a - ms) * (b - md) for a, b in zip(s, d)), sum((a - ms) ** 2 for a in s) * sum(
        (b - md) ** 2 for b in d)
    var = lambda v, m: sum((a - m) ** 2 for a in v)  # n times the population variance
    vx, vy = var(x, sum(x) / n), var(y, sum(y) / n)
    if spread == 0 or vy == 0:
        return math.nan, math.nan, math.nan
    r = cov / math.sqrt(spread)
    t = r * math.sqrt(n - 2) / math.sqrt(max(1 - r * r, 1e-300))
    p = float(mpmath.betainc((n - 2) / 2, 0.5, 0, (n - 2) / (n - 2 + t * t), regularized=True))
    return vx / vy, t, p


def run_summary(records: list, at_minutes: float = None) -> dict:
    """One run of the comparison, from curves.read_records: the training minutes it reached (a run stopped by
    --max-minutes passes the budget by up to one step); pass@1 at step 0; pass@1 at at_minutes (evaluation_at: NaN
    where the step running at that minute logged no evaluation, and for a fixed-step run, at_minutes None); the best
    pass@1 of all its evaluations, the step it came at, and its last minus its best (0 for a curve that ends at its
    best); token EV and V(s_0) EV averaged over the second half of its steps; c over all steps; and efficiency 1 /
    ((1 - EV)(1 + c)) of those means, once with the token EV and once with V(s_0) EV (as critic/efficiency); the
    mean response length of its last 5 steps by at_minutes (of all its steps for None); the trust region's drop
    share over all steps (FlashREINFORCE); its steps, its last evaluation (at the end), its largest_drop and whether
    that is FALL or more (1 or 0), its heldout_fall. NaN where the run logged no such key (critic-free, or no trust
    region)."""
    steps, evals = [r for r in records if "perf/step_s" in r], [r for r in records if r.get("eval/pass@1") is not None]
    half = steps[len(steps) // 2:]
    best = max(evals, key=lambda r: r["eval/pass@1"])  # the first of equal bests; a fixed-step run's whole curve
    token_ev = mean_se([r.get("critic/explained_var") for r in half])[0]
    v0_ev = mean_se([r.get("critic/adv_explained_var") for r in half])[0]
    c = mean_se([r.get("critic/compute_ratio") for r in steps])[0]
    length = mean_se([r.get("rollout/response_len") for r in steps
                      if at_minutes is None or r["minutes"] <= at_minutes][-5:])[0]
    drop = largest_drop(records)
    return {"steps": len(steps), "minutes": records[-1]["minutes"], "pass@1 at step 0": evals[0]["eval/pass@1"],
            "pass@1 at equal minutes": evaluation_at(records, at_minutes),
            "pass@1 at the end": evals[-1]["eval/pass@1"],
            "best pass@1": best["eval/pass@1"], "best at step": best["step"],
            "final - best": evals[-1]["eval/pass@1"] - best["eval/pass@1"], "largest drop": drop,
            "fell": float(drop >= FALL) if math.isfinite(drop) else math.nan, "held-out fall": heldout_fall(records),
            "token EV": token_ev, "V(s_0) EV": v0_ev, "c": c, "efficiency, token EV": critic_efficiency(token_ev, c),
            "efficiency, V(s_0) EV": critic_efficiency(v0_ev, c), "response length at the end": length,
            "trust-region drop": mean_se([r.get("actor/trust_region_drop") for r in steps])[0]}


def evaluations_by(records: list, at_minutes: float) -> list:
    """The evaluation records of a run that count at at_minutes of training: those logged by then, and the one after
    the step running at that minute (a run stopped by --max-minutes evaluates after the step that crosses it)."""
    return [r for r, t in zip(records, step_begun(records))
            if r.get("eval/pass@1") is not None and (r["minutes"] <= at_minutes or t < at_minutes)]


def evaluation_at(records: list, at_minutes: float = None) -> float:
    """pass@1 of the evaluation logged at at_minutes of training: the one after the step whose training time spans
    that minute (begun before it, ended at or after it). NaN where that step logged none, never an earlier
    evaluation (which would compare the evaluation grid), and for at_minutes None (a fixed-step run)."""
    if at_minutes is None:
        return math.nan
    spans = [r for r, t in zip(records, step_begun(records)) if t < at_minutes <= r["minutes"]]
    return next((r["eval/pass@1"] for r in spans if r.get("eval/pass@1") is not None), math.nan)


def step_begun(records: list) -> list:
    """The training minutes at which each record's step began (its own minutes for a record that is no step)."""
    return [r["minutes"] if "perf/step_s" not in r else prev["minutes"]
            for prev, r in zip([{"minutes": 0.0}] + records, records)]


def pass_at_samples(records: list, samples: int) -> float:
    """pass@1 of a run's last evaluation by `samples` generated rollouts (read_records' "samples", warm-up's too)."""
    return [r for r in records if r.get("eval/pass@1") is not None and r["samples"] <= samples][-1]["eval/pass@1"]


def equal_minutes(runs: dict) -> float:
    """The least training time any run of runs {name: [read_records of each seed]} reached: with --max-minutes,
    the budget plus the shortest overshoot."""
    return min(seed[-1]["minutes"] for seeds in runs.values() for seed in seeds)


def compare_table(runs: dict, by_minutes: bool = True) -> str:
    """A markdown table of runs {name: [curves.read_records of each seed]}: per name, mean ± standard error over seeds
    of each run_summary column ("-": none), at equal_minutes(runs) for runs on one minute budget (by_minutes), with
    no figure at equal minutes for fixed-step runs."""
    at = equal_minutes(runs) if by_minutes else None
    rows = {name: [run_summary(seed, at) for seed in seeds] for name, seeds in runs.items()}
    columns = list(next(iter(rows.values()))[0])
    lines = ["| run | seeds | " + " | ".join(columns).replace("equal minutes", minutes_label(at)) + " |",
             "|---" * (len(columns) + 2) + "|"]
    for name, summaries in rows.items():
        cells = [mean_se([s[c] for s in summaries]) for c in columns]
        lines.append(f"| {name} | {len(summaries)} | " + " | ".join(
            "-" if math.isnan(m) else f"{m:.3f}" if math.isnan(se) else f"{m:.3f} ± {se:.3f}" for m, se in cells)
            + " |")
    return "\n".join(lines)


def minutes_label(at: float) -> str:
    """The equal-minutes column's name: "3.0 min", or "equal minutes (none: fixed steps)" for at None."""
    return "equal minutes (none: fixed steps)" if at is None else f"{at:.1f} min"


def runs_table(runs: dict, dirs: dict = None, by_minutes: bool = True) -> str:
    """Markdown, one row per run of runs {name: [records of each seed]} at equal_minutes(runs) (as compare_table):
    its steps, minutes, pass@1 at equal minutes and at the end, best (step), final - best, largest drop, held-out
    fall. dirs {name: [run directory]} names each seed (its "-seed<s>" suffix); else the seeds count from 0."""
    at = equal_minutes(runs) if by_minutes else None
    columns = ["steps", "minutes", "pass@1 at equal minutes", "pass@1 at the end", "best pass@1", "best at step",
               "final - best", "largest drop", "held-out fall"]
    lines = ["| run | seed | " + " | ".join(columns).replace("equal minutes", minutes_label(at)) + " |",
             "|---" * (len(columns) + 2) + "|"]
    for name, seeds in runs.items():
        for i, records in enumerate(seeds):
            seed = dirs[name][i].rsplit("-seed", 1)[-1] if dirs else i
            s = run_summary(records, at)
            lines.append(f"| {name} | {seed} | " + " | ".join(
                "-" if math.isnan(s[c]) else f"{s[c]:.0f}" if c in ("steps", "best at step") else f"{s[c]:.3f}"
                for c in columns) + " |")
    return "\n".join(lines)


def paired_table(runs: dict, first: str, others: list, by_minutes: bool = True) -> str:
    """Markdown rows of paired differences by seed at equal_minutes(runs) (none for fixed-step runs, by_minutes
    False: those columns read "-"): for each name in others, first's pass@1
    minus that run's, over the seeds both have (seed i of one against seed i of the other), with the mean, its
    standard error and every seed's difference; the same for the mean of every evaluation from the middle of the
    budget on (a smoother figure: several evaluations, the same problems); the difference at equal samples (the
    fewest rollouts any run generated, pass_at_samples); at the end (each run's last evaluation: the fixed step of
    --steps); in largest drop; and pitman_morgan's p for equal variances of pass@1 at the end (3 pairs or more)."""
    at = equal_minutes(runs) if by_minutes else None
    n = min(seed[-1]["samples"] for seeds in runs.values() for seed in seeds)

    def late_mean(records):  # the mean pass@1 of the evaluations that count at `at`, from at / 2 on
        late = [r["eval/pass@1"] for r in evaluations_by(records, at) if r["minutes"] >= at / 2] if at else []
        return sum(late) / len(late) if late else math.nan

    lines = ["| difference | seeds | at equal minutes | per seed | mean of the evaluations from the middle on | "
             f"at equal samples ({n}) | at the end | largest drop | variance ratio at the end (p) |",
             "|---" * 9 + "|"]
    for other in others:
        pairs = list(zip(runs[first], runs[other]))
        diffs = [run_summary(a, at)["pass@1 at equal minutes"] - run_summary(b, at)["pass@1 at equal minutes"]
                 for a, b in pairs]
        late = [late_mean(a) - late_mean(b) for a, b in pairs]
        (m, se), (lm, lse) = mean_se(diffs), mean_se(late)
        sm, sse = mean_se([pass_at_samples(a, n) - pass_at_samples(b, n) for a, b in pairs])
        ends = [(run_summary(a, at)["pass@1 at the end"], run_summary(b, at)["pass@1 at the end"]) for a, b in pairs]
        em, ese = mean_se([x - y for x, y in ends])
        dm, dse = mean_se([largest_drop(a) - largest_drop(b) for a, b in pairs])
        ratio, _, p = pitman_morgan(*zip(*ends)) if len(pairs) >= 3 else (math.nan, math.nan, math.nan)
        pm = lambda m, se: "-" if math.isnan(m) else f"{m:+.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}")
        per_seed = ", ".join(pm(d, math.nan) for d in diffs)
        lines.append(f"| {first} - {other} | {len(pairs)} | {pm(m, se)} | {per_seed} | "
                     f"{pm(lm, lse)} | {pm(sm, sse)} | {pm(em, ese)} | {pm(dm, dse)} | "
                     + ("-" if math.isnan(ratio) else f"{ratio:.2f} (p {p:.2f})") + " |")
    return "\n".join(lines)


def noise_floor(runs: dict, window: int = 5) -> str:
    """One line: flat_run_drops at the runs' pooled success rate and mean rollouts a step (over the steps that logged
    both) and the fewest steps any run took (runs {name: [records]}), what largest_drop reads on a run that never
    moved; "" where no step logged both or a run took fewer than `window` steps."""
    steps = [r for seeds in runs.values() for records in seeds for r in records
             if "perf/step_s" in r and r.get("rollout/acc") is not None and r.get("rollout/samples")]
    n = min(sum("perf/step_s" in r for r in records) for seeds in runs.values() for records in seeds)
    if not steps or n < window:
        return ""
    p = sum(r["rollout/acc"] for r in steps) / len(steps)
    rollouts = round(sum(r["rollout/samples"] for r in steps) / len(steps))
    median, share = flat_run_drops(p, rollouts, n, window)
    return (f"A run whose success rate stayed at {p:.3f} ({rollouts} rollouts a step, {n} steps) would show a largest "
            f"drop of {median:.3f} (median of 2,000 simulated runs) and fall by {FALL} in {share:.0%} of them.")


def compare(argv=None):
    """Side-by-side runs at equal training minutes (./run.sh compare), then the tables and one figure.

    The runs and outputs are those of this file's docstring. Other flags go to every run. A finished run (its
    directory holds `done`, the flags it ran with) is not run again, so a stopped comparison resumes where it
    stopped; one finished with other flags stops the comparison with a one-line error (SystemExit) that names its
    directory."""
    parser = argparse.ArgumentParser(prog=".ci/compare.py", description=compare.__doc__.split("\n")[0],
                                     epilog="Other flags (python s3ac.py --help) go to every run.")
    for flag, default, text in (
            ("--seeds", 6, "seeds of S3AC, REINFORCE++ and FlashREINFORCE (K = 1)"), ("--grpo-seeds", 3, "seeds of GRPO K = 4"),
            ("--first-seed", 0, "the first seed of every config: runs and tables cover seeds --first-seed .. --seeds "
                                "- 1 (to go on where earlier runs' files are gone; their figures are then pooled by "
                                "hand)"),
            ("--minutes", 20.0, "training minutes of every run (--max-minutes), unless --steps"),
            ("--steps", 0, "a fixed step count for every run instead of --minutes (0: by minutes)"),
            ("--s3ac-flags", "", "flags of the S3AC run alone, one string (./run.sh passes the demo's critic)"),
            ("--eval-every", 20, "steps between evaluations of every run (and one at its end)"),
            ("--batch-prompts", 16, "prompts per step at K = 1; GRPO answers a quarter of them 4 times"),
            ("--only", "", "run only these settings now, comma-separated (s3ac-k1, reinforce_pp-k1, "
                           "flash_reinforce-k1, grpo-k4, s3ac-center-k1 and s3ac-none-k1: S3AC with --adv-norm "
                           "center and none; '' = all but these two), to split a comparison over several "
                           "invocations; the tables cover every finished run"),
            ("--out-dir", "runs/compare", "one directory per run, table.md, compare.png")):
        parser.add_argument(flag, type=type(default), default=default, help=text)
    opts, rest = parser.parse_known_args(argv)
    b = opts.batch_prompts
    configs = {"s3ac-k1": (opts.seeds, ["--k", "1", "--batch-prompts", str(b), *shlex.split(opts.s3ac_flags)]),
               "reinforce_pp-k1": (opts.seeds, ["--algo", "reinforce_pp", "--k", "1", "--batch-prompts", str(b)]),
               "flash_reinforce-k1": (opts.seeds, ["--algo", "flash_reinforce", "--k", "1", "--batch-prompts", str(b)]),
               "grpo-k4": (opts.grpo_seeds, ["--algo", "grpo", "--k", "4", "--batch-prompts", str(b // 4)]),
               "s3ac-center-k1": (opts.seeds, ["--k", "1", "--batch-prompts", str(b), *shlex.split(opts.s3ac_flags),
                                               "--adv-norm", "center"]),
               "s3ac-none-k1": (opts.seeds, ["--k", "1", "--batch-prompts", str(b), *shlex.split(opts.s3ac_flags),
                                             "--adv-norm", "none"])}  # OPT_IN
    only = [name for name in opts.only.split(",") if name] or [name for name in configs if name not in OPT_IN]
    if set(only) - set(configs):
        parser.error(f"--only: {', '.join(sorted(set(only) - set(configs)))} is not one of {', '.join(configs)}")
    if not 0 <= opts.first_seed < opts.seeds:
        parser.error(f"--first-seed {opts.first_seed}: must be at least 0 and below --seeds ({opts.seeds})")
    seeds = {name: range(opts.first_seed, n) for name, (n, _) in configs.items()}
    runs = {name: [os.path.join(opts.out_dir, f"{name}-seed{s}") for s in seeds[name]] for name in configs}
    order = sorted(((seed, name, out) for name in configs for seed, out in zip(seeds[name], runs[name])),
                   key=lambda run: run[0])  # the first seed of every config first: a stopped comparison stays balanced
    for seed, name, out in order:
        budget = ["--steps", str(opts.steps), "--max-minutes", "0"] if opts.steps else \
            ["--steps", "1000000", "--max-minutes", str(opts.minutes)]
        flags = ["--eval-every", str(opts.eval_every), *budget, "--save-every", "0", *rest, "--seed", str(seed),
                 "--out-dir", out, *configs[name][1]]
        done = os.path.join(out, "done")  # a finished run: the flags it ran with, one JSON list
        if os.path.exists(done):  # checked for every setting, those --only leaves out too: they are tabled
            with open(done) as f:
                if f.read().strip() != json.dumps(flags):
                    raise SystemExit(f"{out}: finished with other settings (see {done}); remove it or pick another "
                                     "--out-dir")
            continue
        if name not in only:
            continue
        subprocess.run([sys.executable, os.path.join(HERE, "s3ac.py"), *flags], check=True)
        shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)  # gigabytes per run
        _write_atomic(done, json.dumps(flags) + "\n")
    finished = {name: list(itertools.takewhile(lambda d: os.path.exists(os.path.join(d, "done")), dirs))
                for name, dirs in runs.items()}  # the first seed, the next, ... while finished: i pairs with i
    records = {name: [read_records(d) for d in dirs] for name, dirs in finished.items() if dirs}
    by_minutes = not opts.steps  # fixed-step runs: no figure at equal minutes
    table = compare_table(records, by_minutes) + "\n\n" + runs_table(records, {n: finished[n] for n in records},
                                                                      by_minutes)
    reference = next((n for n in ("s3ac-k1", *OPT_IN) if n in records), None)  # the S3AC arm the others pair with
    if reference:
        table += "\n\n" + paired_table(records, reference, [n for n in records if n != reference], by_minutes)
    floor = noise_floor(records)  # "" when no run logged enough steps
    if floor:
        table += "\n\n" + floor
    print(table)
    _write_atomic(os.path.join(opts.out_dir, "table.md"), table + "\n")
    print(plot_runs([d for dirs in finished.values() for d in dirs], os.path.join(opts.out_dir, "compare.png")))


if __name__ == "__main__":
    compare()
