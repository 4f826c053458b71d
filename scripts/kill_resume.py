"""A batch run killed with SIGKILL at random moments resumes to the uninterrupted output.

Usage: python scripts/kill_resume.py [--prompts 200] [--kills 2] [--max-new-tokens 16]
                                     [--json out/kill_resume.json] [-- extra hx options]

Takes roughly 15-30 minutes with the defaults on the 2-core development VM (estimated:
``--prompts 24 --kills 1`` took 7 min 13 s beside other work, 70-93 s per uninterrupted run,
most of it loading and planning; the defaults answer 8x the prompts and add a kill per
sampling, each sampling running hx once uninterrupted and ``--kills`` + 1 more times).

Writes PROMPTS mixed-length prompts, runs ``hx generate --prompts`` once uninterrupted, then
again killing it with SIGKILL at KILLS random moments (each the moment the output holds a
random number of further lines, uniform between one and 80 % of the prompts still to answer:
results are written as they complete, so this is a random point of the run's work) and
restarting it until it finishes; greedy, then sampled (temperature 0.8, seed 7). Checks that
every id is written exactly once and that the completions equal the uninterrupted run's;
prints a table. Runs in ``hx generate``'s default mode for a prompts file (throughput).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

from hx.cli.console import print_table

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls count "
         "stars above the quiet river and [bracketed] words stay as they are").split()


def write_prompts(path: Path, n: int, seed: int = 0) -> None:
    """``n`` prompts of 4 to 48 words, ids ``p0``..."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 48))]
            f.write(json.dumps({"id": f"p{i}", "prompt": " ".join(words)}) + "\n")


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def hx(*args: str, kill_at: int | None = None, out: Path | None = None) -> bool:
    """Run ``hx``; with ``kill_at``, SIGKILL it the moment ``out`` has that many lines.
    Returns whether it was killed (it may finish first)."""
    run = subprocess.Popen([sys.executable, "-m", "hx", *args], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    while run.poll() is None:
        if kill_at is not None and lines_in(out) >= kill_at:
            run.send_signal(signal.SIGKILL)
            return run.wait() == -signal.SIGKILL
        time.sleep(0.005)
    if run.returncode:
        raise SystemExit(f"hx exited with {run.returncode}: {' '.join(args)}")
    return False


def completions(path: Path) -> tuple[dict, int]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: r["completion"] for r in rows}, len(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--max-new-tokens", default="16")
    parser.add_argument("--json", help="write the results as JSON")
    parser.add_argument("extra", nargs="*", help="more hx generate options (after --)")
    args = parser.parse_args()
    rng = random.Random(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_prompts(tmp / "p.jsonl", args.prompts)
        for name, sampling in (("greedy", ()), ("sampled", ("--temperature", "0.8",
                                                           "--seed", "7"))):
            def command(out: Path) -> tuple[str, ...]:
                return ("generate", "--prompts", str(tmp / "p.jsonl"), "-o", str(out),
                        "--max-new-tokens", args.max_new_tokens, *sampling, *args.extra)

            start = time.perf_counter()
            hx(*command(tmp / f"{name}-whole.jsonl"))
            whole_s = time.perf_counter() - start
            killed_out, kills, runs = tmp / f"{name}-killed.jsonl", 0, 0
            for _ in range(args.kills):
                runs += 1
                done = lines_in(killed_out)  # kill after a random share of what is left
                kills += hx(*command(killed_out), out=killed_out,
                            kill_at=done + rng.randint(1, max(1, int(0.8 * (args.prompts
                                                                              - done)))))
            hx(*command(killed_out))
            want, _ = completions(tmp / f"{name}-whole.jsonl")
            got, lines = completions(killed_out)
            rows.append({"sampling": name, "prompts": args.prompts, "kills": kills,
                         "runs": runs + 1, "lines": lines, "ids_once": lines == len(got)
                         and set(got) == set(want), "equal": got == want,
                         "uninterrupted_s": round(whole_s, 1)})
    table = Table(title="batch runs killed with SIGKILL and resumed")
    for col in rows[0]:
        table.add_column(col.replace("_", " "), justify="right")
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    print_table(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ids_once"] and r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
