"""The README's picture, and the pictures of the comparisons behind it.

    python .ci/figure.py                          # the fixed-step comparison's table -> .ci/fixed_step.png (README)
    python .ci/figure.py --demo                   # the 21-seed demo tables -> .ci/demo_curves.png
    python .ci/figure.py --runs runs/compare -o compare_band.png     # from ./run.sh compare's run folders

The README's picture (fixed_step_figure): S3AC K=1 beside FlashREINFORCE K=1 (and S3AC with --adv-norm center), 100
steps per run, greedy pass@1 on 400 held-out problems every 20 steps, a thin line per seed and the mean over seeds;
beside it each run's largest drop of the 5-step rolling training success rate below its running maximum, and its
held-out fall (the largest drop of pass@1 below its running best), a dot per run, with the lines the comparison calls
a fall (0.25 and 0.10). It reads the per-run table of .ci/JOURNAL.md ("| seed, run | pass@1 at 0 / 20 / ... |").

The 21-seed picture (--demo, band_figure): greedy pass@1 against training minutes, S3AC K=1 beside REINFORCE++ K=1
at 20 minutes, the mean over seeds with a band of one standard error, and the critic's explained variance per seed.
Its tables keep each run's evaluations ("run | seed | steps | pass@1 at step 0 | 30 | 60 | ...") and S3AC's warm-up
seconds, seconds per step and explained variances ("seed | warm-up batches (s) | steps | ..."); their run files are
gone. Each table row becomes a small run folder whose metrics.jsonl has one record per step (perf/step_s, the run's
mean step time; S3AC's warm-up as time/pretrain; the evaluations at their steps; the second half's EVs), and every
run, from a table or from compare, is read by curves.read_records, the clock of .ci/curves.py: training
minutes, evaluations left out, warm-up counted. A run whose step time the tables do not give (REINFORCE++, S3AC's
seed 8) is spread evenly over --minutes. curves.curves_figure draws one line per run in eight panels; this picture needs
the mean and band of each method over its seeds, so it is drawn here.
"""

import argparse
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, os.path.join(HERE, ".ci"))  # curves.py

from curves import read_records  # noqa: E402

METHODS = {"S3AC K=1": "s3ac-k1", "REINFORCE++ K=1": "reinforce_pp-k1"}  # the tables' names: compare's run names
LABELS = {"s3ac-k1": "S3AC K=1 (critic)", "reinforce_pp-k1": "REINFORCE++ K=1 (critic-free)", "grpo-k4": "GRPO K=4"}


EVALUATIONS = "| run | seed | steps | pass@1 at step 0 |"  # the header rows the tables begin with
DEMO = "| seed | warm-up batches (s) | steps |"
FIXED_STEP = "| seed, run | pass@1 at "  # the fixed-step comparison's per-run table
FALL_RULES = (0.25, 0.10)  # compare.py's fall of the training success rate's largest drop; the held-out fall rule


def markdown_table(text: str, header_start: str) -> list:
    """The rows of the first markdown table whose header row starts with header_start, as {header: cell} dicts.
    Raises ValueError when there is none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header_start)), None)
    if start is None:
        raise ValueError(f"no table whose header starts with {header_start}")
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
    headers, rows = cells(lines[start]), []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(headers, cells(line))))
    return rows


def number(cell: str):
    """The first number of a table cell ("0.490 (100)" -> 0.49, "**+0.225**" -> 0.225); None for "-"."""
    found = re.search(r"[-+]?\d+(?:\.\d+)?", cell.replace("*", ""))
    return float(found[0]) if found and cell.strip() != "-" else None


def table_runs(text: str, minutes: float) -> dict:
    """{run name (compare's, e.g. s3ac-k1-seed0): metrics records}, one per row of the evaluations table for the
    methods of METHODS, with the step times of the demo's table for S3AC (else minutes spread evenly)."""
    demo = {int(r["seed"]): r for r in markdown_table(text, DEMO)}
    runs = {}
    for row in markdown_table(text, EVALUATIONS):
        if row["run"] not in METHODS:
            continue
        seed, steps = int(row["seed"]), int(row["steps"])
        evals = {0: number(row["pass@1 at step 0"])}
        evals.update({int(h): number(c) for h, c in row.items() if h.isdigit() and number(c) is not None})
        evals[int(re.search(r"\((\d+)\)", row["end (step)"])[1])] = number(row["end (step)"])
        info = demo.get(seed, {}) if row["run"] == "S3AC K=1" else {}
        step_s = number(info.get("s / step", "-")) or 60 * minutes / steps
        warmup = re.search(r"\((\d+)\)", info.get("warm-up batches (s)", ""))
        ev = {"critic/explained_var": number(info.get("token EV", "-")),
              "critic/adv_explained_var": number(info.get("V(s_0) EV", "-"))}
        records = [{"step": 0, "eval/pass@1": evals[0]}]
        if warmup:
            records.append({"step": 0, "pretrain/warmup_step": 1, "time/pretrain": float(warmup[1])})
        for n in range(1, steps + 1):
            record = {"step": n, "perf/step_s": step_s}
            if n in evals:
                record["eval/pass@1"] = evals[n]
            if n > steps / 2:  # the tables' EVs are means over the second half of the steps
                record.update({k: v for k, v in ev.items() if v is not None})
            records.append(record)
        runs[f"{METHODS[row['run']]}-seed{seed}"] = records
    return runs


def write_runs(runs: dict, folder: str) -> list:
    """Each {name: records} as <folder>/<name>/metrics.jsonl; returns the run folders."""
    dirs = []
    for name, records in runs.items():
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        with open(os.path.join(folder, name, "metrics.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
        dirs.append(os.path.join(folder, name))
    return dirs


def band_figure(run_dirs: list, points: int = 81):
    """A two-panel matplotlib figure of runs grouped by name (<method>-seed<s>): left, greedy pass@1 against
    training minutes (curves.read_records), each run's evaluations joined linearly, on a grid from 0 to the earliest
    last evaluation, mean over seeds with a band of one standard error; right, each critic run's mean token-level
    and V(s_0) explained variance over the second half of its steps, one dot per seed and the mean ± se."""
    import matplotlib.pyplot as plt
    import numpy as np
    groups = {}
    for d in sorted(run_dirs, key=lambda d: int(re.search(r"-seed(\d+)$", os.path.normpath(d))[1])):
        groups.setdefault(re.sub(r"-seed\d+$", "", os.path.basename(os.path.normpath(d))), []).append(read_records(d))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 1.2]})
    for i, (name, runs) in enumerate(groups.items()):
        curves = [[(r["minutes"], r["eval/pass@1"]) for r in rs if r.get("eval/pass@1") is not None] for rs in runs]
        grid = np.linspace(0.0, min(c[-1][0] for c in curves), points)
        ys = np.array([np.interp(grid, *zip(*c)) for c in curves])  # [seeds, points]
        mean = ys.mean(0)
        se = ys.std(0, ddof=1) / np.sqrt(len(ys)) if len(ys) > 1 else np.zeros_like(mean)
        colour = plt.get_cmap("tab10")(i)
        left.plot(grid, mean, color=colour, label=f"{LABELS.get(name, name)}, {len(ys)} seeds")
        left.fill_between(grid, mean - se, mean + se, color=colour, alpha=0.25, linewidth=0)
        for j, key in enumerate(("critic/explained_var", "critic/adv_explained_var")):
            evs = []
            for rs in runs:
                steps = [r for r in rs if "perf/step_s" in r]
                half = [r[key] for r in steps if r["step"] > len(steps) / 2 and r.get(key) is not None]
                if half:
                    evs.append(sum(half) / len(half))
            if evs:
                m, e = np.mean(evs), np.std(evs, ddof=1) / np.sqrt(len(evs)) if len(evs) > 1 else 0.0
                right.scatter(np.full(len(evs), j) + np.linspace(-0.15, 0.15, len(evs)), evs, s=12, color=colour,
                              alpha=0.6)
                right.errorbar([j + 0.3], [m], yerr=[e], fmt="o", color="black", capsize=3)
    left.set(xlabel="training minutes (evaluations left out, S3AC's critic warm-up counted)",
             ylabel="greedy pass@1, 400 held-out problems", title="CPU demo: mean over seeds ± one standard error")
    left.grid(alpha=0.3)
    left.legend(loc="lower right")
    right.set(xticks=[0, 1], xticklabels=["token EV", "V(s_0) EV"], xlim=(-0.5, 1.6), ylabel="explained variance",
              title="S3AC's critic, second half")
    right.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def fixed_step_runs(text: str) -> dict:
    """{run name as the table gives it (backquotes dropped): [{"seed", "steps", "pass@1", "largest drop",
    "held-out fall"}, ...] in table order} from the fixed-step comparison's per-run table, whose header cell
    "pass@1 at 0 / 20 / ..." gives the steps of the cells "0.265 / 0.307 / ...". Raises ValueError when there is no
    such table or a row's evaluations do not match its steps."""
    rows = markdown_table(text, FIXED_STEP)
    header = next((h for h in rows[0] if h.startswith("pass@1 at ")), "") if rows else ""
    steps = [int(x) for x in re.findall(r"\d+", header[len("pass@1 at "):])]
    runs = {}
    for row in rows:
        seed, name = row["seed, run"].split(", ", 1)
        values = [number(c) for c in row[header].split("/")]
        if len(values) != len(steps) or None in values:
            raise ValueError(f"fixed-step table, row {row['seed, run']!r}: {len(values)} evaluations for steps {steps}")
        runs.setdefault(name.replace("`", ""), []).append(
            {"seed": int(seed), "steps": steps, "pass@1": values, "largest drop": number(row["largest drop"]),
             "held-out fall": number(row["held-out fall"])})
    return runs


def fixed_step_figure(runs: dict):
    """A two-panel matplotlib figure of fixed_step_runs' runs: left, greedy pass@1 against the training step, a thin
    line per seed and a thick one for the mean over seeds of each run name; right, each run's largest drop of the
    training success rate and its held-out fall, a dot per run, beside the dashed lines that call a run fallen."""
    import matplotlib.pyplot as plt
    import numpy as np
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 1.4]})
    width = 0.5 / max(len(runs), 1)
    for i, (name, group) in enumerate(runs.items()):
        colour = plt.get_cmap("tab10")(i)
        for run in group:
            left.plot(run["steps"], run["pass@1"], color=colour, alpha=0.3, linewidth=0.8)
        left.plot(group[0]["steps"], np.mean([run["pass@1"] for run in group], axis=0), color=colour, linewidth=2.2,
                  label=f"{name}, {len(group)} seeds")
        for j, key in enumerate(("largest drop", "held-out fall")):
            x = j - 0.25 + width * (i + 0.5)
            right.scatter(np.full(len(group), x), [run[key] for run in group], s=16, color=colour, alpha=0.8)
    for j, rule in enumerate(FALL_RULES):
        right.hlines(rule, j - 0.4, j + 0.4, colors="black", linestyles="dashed", linewidth=1)
    left.set(xlabel="training step", ylabel="greedy pass@1, 400 held-out problems",
             title="CPU demo, K = 1, 100 steps: a thin line per seed, the mean thick")
    left.grid(alpha=0.3)
    left.legend(loc="upper left")
    right.set(xticks=[0, 1], xticklabels=["largest drop,\ntraining success", "held-out fall"], xlim=(-0.5, 1.5),
              title="each run's fall (dashed: fallen)")
    right.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", default=os.path.join(HERE, ".ci", "JOURNAL.md"),
                        help="the markdown file holding the measured tables")
    parser.add_argument("--demo", action="store_true", help="the 21-seed demo picture (S3AC beside REINFORCE++ "
                        "at 20 minutes) instead of the fixed-step comparison's")
    parser.add_argument("--minutes", type=float, default=20.0, help="--demo: the runs' --max-minutes, spreads the "
                        "steps of a run whose step time the tables do not give")
    parser.add_argument("--runs", help="a folder of run folders <method>-seed<s> (./run.sh compare's), drawn as "
                        "--demo draws its tables")
    parser.add_argument("-o", "--out", help="the PNG to write (default .ci/fixed_step.png, with --demo or --runs "
                        ".ci/demo_curves.png)")
    opts = parser.parse_args(argv)
    out = opts.out or os.path.join(HERE, ".ci", "demo_curves.png" if opts.demo or opts.runs else "fixed_step.png")
    import matplotlib
    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt
    with open(opts.tables) as f:
        text = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        if opts.runs:
            dirs = [os.path.join(opts.runs, d) for d in sorted(os.listdir(opts.runs))
                    if re.search(r"-seed\d+$", d) and os.path.isfile(os.path.join(opts.runs, d, "metrics.jsonl"))]
            fig = band_figure(dirs)
        elif opts.demo:
            fig = band_figure(write_runs(table_runs(text, opts.minutes), tmp))
        else:
            fig = fixed_step_figure(fixed_step_runs(text))
        fig.savefig(out, dpi=100)
        plt.close(fig)
    print(out)


if __name__ == "__main__":
    main()
