"""Streaming-loader benchmarks: tokenizing throughput, peak RSS as the dataset grows, one huge single-line file.

    .venv/bin/python bench/loader.py throughput     # MB/s of raw encode_batch vs StreamingDataLoader; loader/raw ratios
    .venv/bin/python bench/loader.py dataset-size   # trainer peak RSS at 1x/4x/16x the corpus; ratios to 1x
    .venv/bin/python bench/loader.py huge-line      # MB/s reading a 100 MB one-line file; peak RSS growth / file size

throughput [--reps 3] [--no-extra] [--vocab-size 1024]: a byte-level BPE (vocab 1024, tokenizer.train_bpe)
is trained once on tinystories_train + tinyshakespeare (+ tinystories_train_extra_lowercase unless --no-extra),
then: (a) raw: `tokenizer.encode_batch` over the documents in chunks of 256, taking `.ids` of every encoding;
(b) loader: the full StreamingDataLoader (shuffle buffer 10000, seq_len 128, batch 32, prefetch 2) over the
same documents, drained to the end of the epoch: once reading the files itself (LocalFiles, the real pipeline)
and once from the documents already in memory (ListSource, no file reading). The three alternate, --reps times;
the best of each is kept. Prints MB/s per measurement and loader/raw ratios (files, in memory). Goal >= 0.80.
About 12 s on 2 cores.

dataset-size [--sizes 1,4,16] [--steps 30] [--reps 3] [--keep]: the 1x corpus is tinystories_train.txt +
tinystories_train_extra_lowercase.txt + tinyshakespeare.txt (4.7 MB). For a multiplier k a temporary directory
gets k copies of each file (c00_*.txt ... c{k-1}_*.txt); both paths read the same directory. A byte-level BPE
(vocab 512 = the default for 200K params) is trained once on the 1x corpus and passed as --tokenizer. Each size
is trained --reps times per path as a subprocess, so each peak RSS belongs to its own process:

    train_optimized.py [--use-streaming] --dataset-id DIR --tokenizer tok.json --max-steps 30
        --target-params 200000 --seq-len 128 --batch-size 16 --eval-tokens 4096 --eval-every 1000000 ...

The figure is summary.json's peak_rss_mb (ru_maxrss of the trainer), median over --reps; /usr/bin/time's max
RSS, when that program exists, is printed per run as a cross-check. Prints a table with ratios to the 1x run of
the same path. Goal: streaming largest/1x < 1.05; full-load grows with the data. On 2 cores a run takes ~8 s
(streaming, any size) to ~40 s (full load at 16x): the defaults' 18 runs take ~4-5 min (estimated).

huge-line [--mb 100] [--reps 3]: writes a file of one line (English words, no newline, no <|endoftext|>) to a
temp dir, then reads it with slm.data.readers.read_file --reps times in a fresh subprocess each (so peak RSS is
the reader's own). Prints throughput in MB/s (median of the repetitions; ratio to the 50 MB/s goal) and the
process's peak RSS growth over its baseline after imports, as a ratio of the file's size. The reader cuts a
document longer than MAX_DOC_CHARS (4M characters) into pieces at spaces, so memory is bounded by the cap,
not by the line. Goal: >= 50 MB/s and peak growth well under the file's size. About 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
STORIES, EXTRA, SHAKESPEARE = "tinystories_train.txt", "tinystories_train_extra_lowercase.txt", "tinyshakespeare.txt"
THROUGHPUT_GOAL = 0.80  # loader / raw
SIZE_GOAL = 1.05  # streaming peak RSS, largest / 1x
HUGE_LINE_GOAL_MBS = 50.0
SIZE_TARGET_PARAMS = 200_000
TIME = "/usr/bin/time"


# ---- shared: corpus, arguments, timing, RSS ----

def corpus_paths(names: list[str]) -> list[str]:
    """The corpus files under ../shared/data; exits naming the first one missing."""
    paths = [os.path.join(DATA, n) for n in names]
    for p in paths:
        if not os.path.isfile(p):
            sys.exit(f"missing corpus {p} (expected ../shared/data relative to the repo root)")
    return paths


def comma_ints(text: str) -> list[int]:
    """argparse type for a comma-separated list of integers."""
    return [int(s) for s in text.split(",")]


def add_reps(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--reps", type=int, default=3, help=help)


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def time_max_rss_mb(path: str) -> float | None:
    """The max RSS that `/usr/bin/time -f %M -o path` wrote (KB), in MB; None when there is no such file."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read().split()[-1]) / 1024


# ---- throughput ----

def throughput(args: argparse.Namespace) -> None:
    from slm.data.readers import read_file
    from slm.data.sources import ListSource, LocalFiles
    from slm.data.stream import StreamingDataLoader
    from slm.data.tokenizer import train_bpe

    paths = corpus_paths([STORIES, SHAKESPEARE] + ([] if args.no_extra else [EXTRA]))
    docs = [d for p in paths for d in read_file(p)]
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    print(f"corpus: {', '.join(os.path.basename(p) for p in paths)}")
    print(f"        {len(docs):,} documents, {n_bytes:,} bytes ({n_bytes / 2**20:.2f} MB); cpu cores: {os.cpu_count()}")
    secs, tok = timed(lambda: train_bpe(docs, args.vocab_size))
    print(f"trained byte-level BPE, vocab {tok.get_vocab_size()}, in {secs:.1f}s")

    def raw() -> int:
        n = 0
        for i in range(0, len(docs), 256):
            for e in tok.encode_batch(docs[i : i + 256], add_special_tokens=False):
                n += len(e.ids)
        return n

    def loader(source: Any) -> tuple[int, int]:
        dl = StreamingDataLoader(source, tok, seq_len=128, batch_size=32, shuffle_buffer_size=10_000, prefetch=2)
        return drain(dl, len(docs))

    files, memory = LocalFiles("bench", paths), ListSource("bench", docs)
    # Alternate the three measurements so that they see the same machine state (2 busy cores are noisy).
    best = {"raw": float("inf"), "files": float("inf"), "memory": float("inf")}
    info: dict[str, Any] = {}
    for _ in range(args.reps):
        for name, fn in (("raw", raw), ("files", lambda: loader(files)), ("memory", lambda: loader(memory))):
            t, info[name] = timed(fn)
            best[name] = min(best[name], t)
    raw_tokens = info["raw"]
    batches, loader_tokens = info["files"]
    assert loader_tokens == raw_tokens + len(docs), "the loader should see every token plus one EOT per document"
    print_throughput(args.reps, n_bytes / 2**20, best, raw_tokens, batches)


def drain(dl: Any, n_docs: int) -> tuple[int, int]:
    """Iterate a StreamingDataLoader (batch 32 x 128) to the end of its epoch; (batches, tokens read)."""
    batches = 0
    for b in dl:
        assert b["input_ids"].shape == (32, 128)
        batches += 1
    assert dl.documents_read == n_docs, (dl.documents_read, n_docs)
    return batches, dl.tokens_read


def print_throughput(reps: int, mb: float, best: dict[str, float], raw_tokens: int, batches: int) -> None:
    speed = {k: mb / v for k, v in best.items()}
    ratio_files = speed["files"] / speed["raw"]
    ratio_memory = speed["memory"] / speed["raw"]
    print(f"raw encode_batch (256 docs/call, .ids):  {speed['raw']:.3f} MB/s  ({raw_tokens:,} tokens)")
    print(f"StreamingDataLoader, reading the files:   {speed['files']:.3f} MB/s  ({batches} batches of 32x128)")
    print(f"StreamingDataLoader, documents in memory: {speed['memory']:.3f} MB/s")
    print(f"ratio loader/raw: {ratio_files:.3f} (files), {ratio_memory:.3f} (in memory); "
          f"goal >= {THROUGHPUT_GOAL:.2f}: {'met' if ratio_files >= THROUGHPUT_GOAL else 'NOT met'}")
    print()
    print(f"| measurement (best of {reps}) | MB/s | s | ratio to raw |")
    print("|---|---:|---:|---:|")
    print(f"| raw `encode_batch`, 256 docs/call | {speed['raw']:.3f} | {best['raw']:.2f} | 1.000 |")
    print(f"| StreamingDataLoader, files (buffer 10000, 128x32, prefetch 2) | {speed['files']:.3f} | "
          f"{best['files']:.2f} | {ratio_files:.3f} |")
    print(f"| StreamingDataLoader, in-memory docs | {speed['memory']:.3f} | {best['memory']:.2f} | "
          f"{ratio_memory:.3f} |")
    print(f"| goal | | | >= {THROUGHPUT_GOAL:.2f} |")


# ---- dataset-size ----

SIZE_FILES = [STORIES, EXTRA, SHAKESPEARE]


def build_corpus(tmp: str, k: int) -> tuple[str, int]:
    """A directory holding k copies of each corpus file; returns (path, total bytes)."""
    d = os.path.join(tmp, f"data_{k}x")
    os.makedirs(d)
    for i in range(k):
        for src in corpus_paths(SIZE_FILES):
            shutil.copyfile(src, os.path.join(d, f"c{i:02d}_{os.path.basename(src)}"))
    return d, sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def train_tokenizer(tmp: str) -> str:
    """Train the shared BPE once on the 1x corpus; returns the tokenizer.json path."""
    from slm.data.readers import read_file
    from slm.data.tokenizer import train_bpe
    from slm.model.sizing import default_vocab_size

    docs = (doc for p in corpus_paths(SIZE_FILES) for doc in read_file(p))
    path = os.path.join(tmp, "tokenizer.json")
    train_bpe(docs, default_vocab_size(SIZE_TARGET_PARAMS)).save(path)
    return path


def run_trainer(tmp: str, data: str, tok: str, steps: int, streaming: bool, tag: str) -> tuple[float, float | None]:
    """Train once in a subprocess; returns (summary peak_rss_mb, /usr/bin/time max RSS MB or None)."""
    out = os.path.join(tmp, f"run_{tag}")
    cmd = [sys.executable, os.path.join(ROOT, "train_optimized.py"), "--dataset-id", data, "--tokenizer", tok,
           "--max-steps", str(steps), "--target-params", str(SIZE_TARGET_PARAMS), "--seq-len", "128",
           "--batch-size", "16", "--eval-tokens", "4096", "--eval-every", "1000000", "--log-every", "50",
           "--output-dir", out] + (["--use-streaming"] if streaming else [])
    time_file = os.path.join(tmp, f"time_{tag}.txt")
    if os.path.exists(TIME):
        cmd = [TIME, "-f", "%M", "-o", time_file] + cmd
    log_path = os.path.join(tmp, f"log_{tag}.txt")
    with open(log_path, "w") as log:
        secs, rc = timed(lambda: subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                                env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode)
    if rc != 0:
        with open(log_path) as f:
            sys.exit(f"run {tag} failed (exit {rc}):\n{f.read()[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        peak = json.load(f)["peak_rss_mb"]
    ext = time_max_rss_mb(time_file)
    ext_s = f"{ext:,.0f} MB" if ext is not None else "n/a"
    print(f"  {tag:>16}: peak rss {peak:,.0f} MB (/usr/bin/time {ext_s}), {secs:.0f}s", flush=True)
    return peak, ext


def median_peak(tmp: str, data: str, tok: str, args: argparse.Namespace, k: int, streaming: bool) -> float:
    """The median summary peak RSS (MB) of --reps training runs on one corpus, one path."""
    path = "streaming" if streaming else "full_load"
    return statistics.median(run_trainer(tmp, data, tok, args.steps, streaming, f"{k}x_{path}_{r}")[0]
                             for r in range(args.reps))


def dataset_size(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="mem_vs_size_")
    t_start = time.time()
    rows: list[tuple[int, float, float, float]] = []  # (multiplier, MB, streaming, full-load)
    try:
        tok = train_tokenizer(tmp)
        print(f"[bench] tokenizer trained once: {tok}; temp dir {tmp}", flush=True)
        for k in args.sizes:
            data, n_bytes = build_corpus(tmp, k)
            print(f"[bench] {k}x: {n_bytes / 1e6:.1f} MB in {len(os.listdir(data))} files", flush=True)
            stream = median_peak(tmp, data, tok, args, k, streaming=True)
            full = median_peak(tmp, data, tok, args, k, streaming=False)
            rows.append((k, n_bytes / 1e6, stream, full))
            if not args.keep:
                shutil.rmtree(data)
    finally:
        if args.keep:
            print(f"[bench] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print_dataset_size(rows)
    print(f"total {time.time() - t_start:.0f}s")


def print_dataset_size(rows: list[tuple[int, float, float, float]]) -> None:
    base_k, _, base_s, base_f = rows[0]
    print("\n| corpus size (MB) | multiplier | streaming peak RSS MB | full-load peak RSS MB |"
          "\n|---:|---:|---:|---:|")
    for k, mb, s, f in rows:
        print(f"| {mb:,.1f} | {k}x | {s:,.0f} ({s / base_s:.3f}x) | {f:,.0f} ({f / base_f:.3f}x) |")
    k, _, s, f = rows[-1]
    s_ratio, f_ratio = s / base_s, f / base_f
    print(f"\nstreaming {k}x/{base_k}x peak RSS: {s_ratio:.3f} (goal < {SIZE_GOAL}: "
          f"{'PASS' if s_ratio < SIZE_GOAL else 'FAIL'})")
    print(f"full-load {k}x/{base_k}x peak RSS: {f_ratio:.3f} (should grow: {'yes' if f_ratio > s_ratio else 'NO'})")
    print(f"full-load / streaming at {base_k}x: {base_f / base_s:.3f}; at {k}x: {f / s:.3f}")


# ---- huge-line ----

# The reader's process: as few imports as possible before the baseline (each stdlib module imported before it,
# argparse, subprocess, ..., moves the measured growth: this file's imports add ~2.7 MB to it).
HUGE_LINE_CHILD = """
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
    """Write mb MiB of words on one line (no newline, no separator); returns the file's size."""
    unit = "all work and no play makes jack a dull boy, and the quick brown fox jumps over the lazy dog; "
    block = (unit * ((1 << 20) // len(unit) + 1))[: 1 << 20]
    with open(path, "w") as f:
        for _ in range(mb):
            f.write(block)
    return os.path.getsize(path)


def huge_line(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "one_line.txt")
        size = write_line(path, args.mb)
        runs = []
        for _ in range(args.reps):
            out = subprocess.run([sys.executable, "-c", HUGE_LINE_CHILD, path], capture_output=True, text=True,
                                 cwd=ROOT, check=True)
            runs.append(json.loads(out.stdout))
    mbs = [size / 2**20 / r["s"] for r in runs]
    med = statistics.median(mbs)
    growth = max(r["growth_mb"] for r in runs)
    r = runs[0]
    print(f"file: {size / 2**20:.0f} MB on one line; read as {r['docs']} documents of at most {r['longest']:,} "
          f"characters ({r['chars']:,} in all)")
    print(f"throughput: median {med:.0f} MB/s over {args.reps} runs ({', '.join(f'{x:.0f}' for x in mbs)}); "
          f"goal >= {HUGE_LINE_GOAL_MBS:.0f}: ratio {med / HUGE_LINE_GOAL_MBS:.2f}x")
    print(f"peak RSS growth while reading: {growth:.0f} MB = {growth / (size / 2**20):.3f}x the file")


# ---- command line ----

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("throughput", help="StreamingDataLoader vs raw encode_batch, MB/s (goal loader/raw >= 0.80)")
    add_reps(p)
    p.add_argument("--no-extra", action="store_true", help=f"leave out {EXTRA}")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.set_defaults(run=throughput)
    p = sub.add_parser("dataset-size", help="trainer peak RSS vs corpus size, streaming and full-load")
    p.add_argument("--sizes", type=comma_ints, default=[1, 4, 16],
                   help="comma-separated multipliers; the first is the baseline (default 1,4,16)")
    p.add_argument("--steps", type=int, default=30, help="--max-steps of each training run")
    add_reps(p, "runs per size and path; the median peak is reported (RSS varies +-40 MB run to run here)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, runs, corpora)")
    p.set_defaults(run=dataset_size)
    p = sub.add_parser("huge-line", help="read one huge single-line .txt: MB/s and peak RSS growth")
    p.add_argument("--mb", type=int, default=100)
    add_reps(p)
    p.set_defaults(run=huge_line)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
