"""The reward's regression gate: every verdict the project has decided, graded again by s3ac.grade.

    python .ci/gate.py                 # this checkout's s3ac.py against this checkout's testdata/
    python .ci/gate.py --rev ddb78bf   # the answer policy of another commit (its s3ac.py) against this testdata/
    python .ci/gate.py --s3ac DIR      # the s3ac.py of another checkout DIR against this testdata/

It prints the confusion matrix (decided status x graded status, with counts), the rows per source, and every row
whose graded status differs from its decided one: id, source, gold, completion, decided, graded. A rule change runs
it before and after to show what it moves. test_s3ac.py's test_reward_regression_gate runs the same comparison and
fails on any move that is not marked as known. Exit status: 1 when a move is not known, else 0.

The corpus, read from testdata/ alone (testdata/README.md describes each file):
    verdicts.jsonl         one row a line: id, source, gold, completion, truncated, status (the decided status),
                           reason; optional: fallback (--answer-fallback, default final_number), expected_fail_on (a
                           commit whose rules grade the row wrongly: a known move until the rules that fix it merge),
                           known_miss (true: a known miss of today's rules, with the reason; the gate fails when the
                           row stops moving, so the mark is removed), and provenance fields.
    verifier_labels.jsonl  hand-labelled rollouts: label +1 is the status correct, -1 any other status ("reward -1").
"""

import argparse
import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(os.path.dirname(HERE), "testdata")
STATUSES = ("correct", "wrong", "not_a_number", "no_answer", "truncated", "bad_gold", "error", "timeout")
ANY_BUT_CORRECT = "reward -1"  # the decided status of a rollout labelled -1: every status but correct agrees
FIELDS = ("source", "gold", "completion", "truncated", "status", "reason")


def _read_jsonl(path: str) -> list:
    """The rows of one corpus file, each checked for its fields. ValueError naming the file, line and field."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{os.path.basename(path)}, line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            for field in ("id",) + FIELDS:
                if field not in row:
                    raise ValueError(f"{where}: field {field!r} is missing")
            if row["status"] not in STATUSES + (ANY_BUT_CORRECT,):
                raise ValueError(f"{where}: field 'status' is {row['status']!r}, expected one of {STATUSES}")
            if not isinstance(row["truncated"], bool):
                raise ValueError(f"{where}: field 'truncated' is {row['truncated']!r}, expected true or false")
            rows.append(row)
    return rows


def _rollouts(path: str) -> list:
    """verifier_labels.jsonl as corpus rows: label +1 -> correct, -1 -> ANY_BUT_CORRECT; known_miss kept."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            r = json.loads(line)
            if r.get("label") not in (1, -1):
                raise ValueError(f"{os.path.basename(path)}, line {line_no}: field 'label' is {r.get('label')!r}, "
                                 f"expected 1 or -1")
            rows.append({"id": f"rollout:{r['id']}", "source": f"verifier_labels ({r['source']})", "gold": r["gold"],
                         "completion": r["completion"], "truncated": r["truncated"],
                         "status": "correct" if r["label"] > 0 else ANY_BUT_CORRECT, "reason": r["reason"],
                         **({"known_miss": True} if r.get("known_miss") else {})})
    return rows


def read_corpus(testdata: str = TESTDATA) -> list:
    """Every decided verdict: verdicts.jsonl and verifier_labels.jsonl.
    ValueError: a missing file or field, or an id used twice."""
    rows = _read_jsonl(os.path.join(testdata, "verdicts.jsonl"))
    rows += _rollouts(os.path.join(testdata, "verifier_labels.jsonl"))
    twice = [i for i, n in collections.Counter(r["id"] for r in rows).items() if n > 1]
    if twice:
        raise ValueError(f"testdata: ids used twice: {twice[:10]}")
    return rows


def grade_corpus(grade, rows: list) -> list:
    """The status grade(gold, completion, truncated, fallback) gives each row, in order."""
    return [grade(r["gold"], r["completion"], r["truncated"], r.get("fallback", "final_number")) for r in rows]


def agrees(decided: str, graded: str) -> bool:
    """Whether a graded status keeps the decided verdict (ANY_BUT_CORRECT: every status but correct)."""
    return graded != "correct" if decided == ANY_BUT_CORRECT else graded == decided


def compare(rows: list, graded: list) -> dict:
    """{'matrix': Counter of (decided, graded), 'failing': rows that moved unmarked, or that are marked known_miss
    and agree now (the mark must go), 'known': rows that moved with a mark, 'fixed': rows marked expected_fail_on
    that agree now (the integrator removes the mark), 'graded': the graded status of each row by its id}."""
    out = {"matrix": collections.Counter(), "failing": [], "known": [], "fixed": [], "graded": dict()}
    for row, status in zip(rows, graded):
        out["matrix"][row["status"], status] += 1
        out["graded"][row["id"]] = status
        moved, marked = not agrees(row["status"], status), row.get("expected_fail_on") or row.get("known_miss")
        if moved:
            out["known" if marked else "failing"].append(row)
        elif row.get("known_miss"):
            out["failing"].append(row)
        elif row.get("expected_fail_on"):
            out["fixed"].append(row)
    return out


def _short(text: str, n: int = 160) -> str:
    text = json.dumps(text, ensure_ascii=False)
    return text if len(text) <= n else text[: n - 5] + '..."'


def report(rows: list, result: dict) -> str:
    """The confusion matrix, the rows per source, and one line per moved or listed row."""
    decided = [s for s in STATUSES + (ANY_BUT_CORRECT,) if any(k[0] == s for k in result["matrix"])]
    graded = [s for s in STATUSES if any(k[1] == s for k in result["matrix"])]
    corner = "decided \\ graded"
    width = max(len(s) for s in decided + [corner])
    lines = [f"{len(rows)} decided verdicts; confusion matrix (rows: decided status, columns: graded status)",
             f"{corner:<{width}} " + " ".join(f"{s:>12}" for s in graded)]
    lines += [f"{d:<{width}} " + " ".join(f"{result['matrix'][d, g] or '.':>12}" for g in graded) for d in decided]
    sources = collections.Counter(r["source"].split(" (")[0].split(":")[0] for r in rows)
    lines.append("rows per source: " + ", ".join(f"{s} {n}" for s, n in sorted(sources.items())))
    for title, key in (("moved, not known (the gate fails)", "failing"), ("moved, known", "known"),
                       ("marked expected_fail_on, agree now (remove the mark)", "fixed")):
        lines.append(f"{title}: {len(result[key])}")
        for r in result[key]:
            mark = (f" [expected_fail_on {r['expected_fail_on']}]" if r.get("expected_fail_on") else
                    " [known_miss]" if r.get("known_miss") else "")
            lines.append(f"  {r['id']} | {r['source']} | gold {_short(r['gold'], 60)} | completion "
                         f"{_short(r['completion'])} | decided {r['status']} | graded {result['graded'][r['id']]}"
                         f"{mark}")
    return "\n".join(lines)


def load_s3ac(checkout: str = None, rev: str = None):
    """s3ac.py as a module: of the checkout DIR, or of commit rev of this repository (with its kernels.py)."""
    if rev is not None:
        checkout = tempfile.mkdtemp(prefix="gate-")
        archive = subprocess.run(["git", "-C", os.path.dirname(HERE), "archive", rev, "s3ac.py", "kernels.py"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", checkout], input=archive, check=True)
    path = os.path.join(checkout or os.path.dirname(HERE), "s3ac.py")
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("s3ac", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["s3ac"] = module
    spec.loader.exec_module(module)
    if rev is not None:
        shutil.rmtree(checkout)  # s3ac.py and kernels.py are loaded: the copies can go
    return module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", help="grade with the s3ac.py of this commit")
    parser.add_argument("--s3ac", metavar="DIR", help="grade with the s3ac.py of this checkout")
    parser.add_argument("--testdata", default=TESTDATA, help="the corpus folder (default: this checkout's)")
    args = parser.parse_args(argv)
    s3ac = load_s3ac(args.s3ac, args.rev)
    rows = read_corpus(args.testdata)
    start = time.perf_counter()
    result = compare(rows, grade_corpus(s3ac.grade, rows))
    print(report(rows, result))
    print(f"graded by the s3ac.py of {args.rev or args.s3ac or 'this checkout'} in {time.perf_counter() - start:.0f} s")
    return 1 if result["failing"] else 0


if __name__ == "__main__":
    sys.exit(main())
