"""Training curves of runs, from their metrics.jsonl: python .ci/curves.py RUN_DIR [RUN_DIR ...] -o curves.png
(./run.sh draws the CPU demo's at its end). Panels: greedy pass@1 against training minutes (evaluations left out,
critic warm-up counted) and against generated samples; per step the training reward, the critic's token-level
explained variance (EV) and its V(s_0) EV, c (the critic's compute over the actor's), response length and entropy.
read_records is also the clock of .ci/compare.py and .ci/figure.py."""

import argparse
import json
import math
import os


def read_records(run_dir: str) -> list:
    """<run_dir>/metrics.jsonl's records, with "minutes" of training (evaluations left out) and "samples" so far."""
    records, seconds, samples = [], 0.0, 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            if "perf/step_s" in r:  # a training step (step 0's evaluation comes before any training)
                seconds += r["perf/step_s"] - (r.get("time/eval") or 0.0)
            seconds += r.get("time/pretrain") or 0.0
            samples += r.get("rollout/samples") or 0
            records.append(dict(r, minutes=seconds / 60, samples=samples))
    return records


PLOT_PANELS = [("minutes", "eval/pass@1", "greedy pass@1 against training minutes (evaluations left out)"),
               ("samples", "eval/pass@1", "greedy pass@1 against generated samples"),
               ("step", "rollout/reward", "training reward"), ("step", "critic/explained_var", "token-level EV"),
               ("step", "critic/adv_explained_var", "V(s_0) EV"), ("step", "critic/compute_ratio", "c"),
               ("step", "rollout/response_len", "response length"), ("step", "actor/entropy", "entropy")]


def curves_figure(run_dirs: list):
    """A matplotlib figure: a panel per PLOT_PANELS (x, y, title), a line per run (its directory); nulls skipped."""
    import matplotlib.pyplot as plt
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    labels = names if len(set(names)) == len(names) else list(run_dirs)
    colours = plt.get_cmap("tab10" if len(run_dirs) <= 10 else "tab20")
    fig, axes = plt.subplots(2, 4, figsize=(22, 9))
    for i, (run_dir, label) in enumerate(zip(run_dirs, labels)):
        records = read_records(run_dir)
        for ax, (x, y, _) in zip(axes.flat, PLOT_PANELS):
            points = [(r[x], r[y]) for r in records if isinstance(r.get(y), (int, float)) and math.isfinite(r[y])]
            if points:
                ax.plot(*zip(*points), marker="o" if y == "eval/pass@1" else None, label=label,
                        color=colours(i % colours.N))
    for ax, (x, y, title) in zip(axes.flat, PLOT_PANELS):
        ax.set(title=title, xlabel=x, ylabel=y)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_runs(run_dirs: list, out: str) -> str:
    """Training curves of several runs in one PNG, one colour per run.
    Draws curves_figure(run_dirs) into `out`; returns out."""
    import matplotlib
    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt
    fig = curves_figure(run_dirs)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv=None):
    """python .ci/curves.py RUN_DIR [RUN_DIR ...] -o FILE.png: the curves of plot_runs."""
    parser = argparse.ArgumentParser(prog=".ci/curves.py", description=plot_runs.__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="directories with a metrics.jsonl")
    parser.add_argument("-o", "--out", default="curves.png", help="the PNG to write")
    opts = parser.parse_args(argv)
    missing = [d for d in opts.run_dirs if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing:
        parser.error(f"no metrics.jsonl in {', '.join(missing)}")
    print(plot_runs(**vars(opts)))


if __name__ == "__main__":
    main()
