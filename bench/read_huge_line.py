"""Reading one huge single-line .txt document (no separator anywhere): speed and memory.

    .venv/bin/python bench/read_huge_line.py             # 100 MB, 3 repetitions
    .venv/bin/python bench/read_huge_line.py --mb 200

Writes a file of one line (English words, no newline, no <|endoftext|>) to a temp dir, then reads it
with slm.data.readers.read_file --reps times in a fresh subprocess each (so peak RSS is the reader's own):
throughput in MB/s of the file (median of the repetitions) and the process's peak RSS growth over its
baseline after imports. The reader cuts a document longer than MAX_DOC_CHARS (4M characters) into
pieces at spaces, so memory is bounded by the cap, not by the line. Goal: >= 50 MB/s and peak growth
well under the file's size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_MBS = 50.0

CHILD = """
import json, resource, sys, time
from slm.data.readers import read_file
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
n = chars = longest = 0
for doc in read_file(sys.argv[1]):
    n += 1; chars += len(doc); longest = max(longest, len(doc))
s = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"s": s, "docs": n, "chars": chars, "longest": longest, "growth_mb": (peak - base) / 1024}))
"""


def write_line(path: str, mb: int) -> int:
    unit = "all work and no play makes jack a dull boy, and the quick brown fox jumps over the lazy dog; "
    block = (unit * ((1 << 20) // len(unit) + 1))[: 1 << 20]
    with open(path, "w") as f:
        for _ in range(mb):
            f.write(block)
    return os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "one_line.txt")
        size = write_line(path, args.mb)
        runs = []
        for _ in range(args.reps):
            out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, cwd=ROOT,
                                 check=True)
            runs.append(json.loads(out.stdout))
    mbs = [size / 2**20 / r["s"] for r in runs]
    growth = max(r["growth_mb"] for r in runs)
    r = runs[0]
    print(f"file: {size / 2**20:.0f} MB on one line; read as {r['docs']} documents of at most {r['longest']:,} "
          f"characters ({r['chars']:,} in all)")
    print(f"throughput: median {statistics.median(mbs):.0f} MB/s over {args.reps} runs "
          f"({', '.join(f'{x:.0f}' for x in mbs)}); goal >= {GOAL_MBS:.0f}: ratio {statistics.median(mbs) / GOAL_MBS:.2f}x")
    print(f"peak RSS growth while reading: {growth:.0f} MB = {growth / (size / 2**20):.3f}x the file")


if __name__ == "__main__":
    main()
