"""This trainer against nanoGPT, side by side in one sitting: a quality race and a speed race.

    .venv/bin/python bench/vs_nanogpt.py            # the full race (~8 min on a quiet 2-core machine)
    .venv/bin/python bench/vs_nanogpt.py --quick    # a short smoke run of the same steps (~2 min)
    .venv/bin/python bench/vs_nanogpt.py --json out.json --keep   # also write the figures, keep the scratch dir
    .venv/bin/python bench/vs_nanogpt.py --peer-compile            # nanoGPT at its best CPU setting (torch.compile)
    .venv/bin/python bench/vs_nanogpt.py --no-quality --shape 10m --speed-steps 80 --skip 20 --peer-compile
                                                    # the speed race at nanoGPT's GPU Shakespeare model, batch 8

The peer is ../shared/peers/nanoGPT (see its PROVENANCE.md). It is copied to a scratch folder under /tmp
(never into this repository), its data is prepared there from ../shared/data/tinyshakespeare.txt by its own
prepare.py (vocab 65; train.bin/val.bin are checked against tinyshakespeare_{train,val}.txt), and it is run
with the venv's torch.

Quality race: nanoGPT's CPU "baby GPT" recipe (its README command, 2000 iterations) is run and its process
wall clock W measured; then this trainer runs `train_optimized.py --use-streaming --dataset-id
tinyshakespeare_train.txt --eval-dataset-id tinyshakespeare_val.txt --target-params 800000 --seq-len 64
--max-time W` (--max-time counts from our process start, so both get the same wall clock from process start;
--seq-len 64 is nanoGPT's block size, so both models train and are scored with the same context: --context 0
gives ours the trainer's default, 128). Both are
scored on the whole val split (111,540 characters = bytes, ASCII) in bits per byte:
  * nanoGPT: its out-*/ckpt.pt (the checkpoint its recipe keeps: the best of its 20-batch val estimates,
    taken every 250 iterations) is loaded with torch and scored here on non-overlapping 64-character
    windows of val.bin (each window's targets are the next characters: every character after the first is
    scored once, each with the context its window gives, as its block size allows);
  * ours: the trainer's own eval of the whole val file (non-overlapping --seq-len token rows). The reader
    splits the file into documents at blank lines and packs each as its tokens + <|endoftext|>, which
    stands for the "\\n\\n" between them: an exact, invertible coding of the text (checked here:
    "\\n\\n".join(documents) + "\\n" == the file). The trainer divides the nats by the bytes of the scored
    tokens counting <|endoftext|> as 1 byte (110,601 bytes); this harness divides the same nats by the
    file's 111,540 bytes, as for nanoGPT. Both figures are printed; the ratio uses the second.
  The two runs cannot be interleaved (ours' budget is nanoGPT's measured wall clock), so they run back to
  back; the CPU time other programs took during each run is measured (/proc/stat minus our own children)
  and printed beside it, and nanoGPT's median iteration time in the quality race is printed beside its
  median in the interleaved speed race as a check that the sitting's load did not change much.

Speed race, at nanoGPT's baby shape (4 layers, d_model 128, 4 heads, seq 64, batch 12, vocab 65): nanoGPT's
recipe with --max_iters N (no eval after iteration 0), and ours with `--n-layers 4 --d-model 128 --n-heads 4
--seq-len 64 --batch-size 12 --target-params 800000` (d_ff 344: the MLP width that makes SwiGLU's three
matrices the size of GELU's two) and a character-level tokenizer.json built here with `tokenizers` (the same
65 characters and ids as nanoGPT's meta.pkl; no end-of-text token, so documents are packed with no
separator), --max-steps N, --log-every 1 (a host sync and a log row every step, as nanoGPT's
--log_interval=1). Both programs start together in their own process groups and are time-sliced with
SIGSTOP/SIGCONT: only one runs at a time, alternating every --slice seconds until both finish, so both see the
same machine (and the same other programs' load) in alternating slices. Step time = the wall time between
consecutive step ends (nanoGPT's printed per-iteration `time`, ours' metrics.jsonl elapsed_s differences);
the figure is the median over the same step range (steps skip+1..N, i.e. nanoGPT's iterations skip..N-1), so
compile/warm-up steps and the few steps that straddle a slice boundary (at most one per slice) do not count.
That holds while a slice holds several steps: a program whose median step exceeds a quarter of --slice is
named in a warning with the slice to rerun at (at seq 1,024 a 2 s step in 4 s slices measured 6 s: most steps
straddled a boundary and counted the other program's slice).
tokens/s = 768 / median step time; model FLOP/s = 6 x params x tokens/s, with params counted the same way for
both: every parameter except a learned position table, the tied token embedding once (it is the output
layer's matrix) -- nanoGPT's own get_num_params() (795,904) and ours' count_params (800,000; rotary
positions, no table).

--shape 10m: the speed race at nanoGPT's Shakespeare GPU model instead (6 layers, d_model 384, 6 heads, seq
256), with batch 8 so a step takes about a second on 2 cores; ours gets --target-params = nanoGPT's
get_num_params() there, so SwiGLU's d_ff matches GELU's parameter count.
--peer-compile runs nanoGPT with --compile=True (torch.compile: its best CPU setting; its first
iterations compile and fall in the skipped warm-up) in both races.

Precision: both of our runs take --matmul-precision, by default bfloat16 where the CPU has
AVX512-BF16 or AMX-BF16 (the projections', MLP's and head's products with bf16 operands and float32 sums;
slm/model/matmul.py), else float32. nanoGPT's recipe on CPU runs float32 (its train.py uses no autocast on
CPU), and it is raced as its README gives it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import pickle
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))
PEER = os.path.join(SHARED, "peers", "nanoGPT")
DATA = os.path.join(SHARED, "data")
PY = sys.executable

# nanoGPT's README command for CPU (PROVENANCE.md), less --max_iters/--lr_decay_iters, added per race.
NANOGPT_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                  "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                  "--n_embd=128", "--dropout=0.0"]
# nanoGPT's shape, its optimizer (AdamW, cosine) and its --dropout=0.0: the speed race times the same algorithm in
# both programs (the trainer's default Muon spends extra FLOPs per step that 6 x params x tokens does not count, and
# its default dropout from the second epoch on would start within the race's 500 steps, with a compile).
SHAPES = {  # the speed race's shapes: nanoGPT's CPU baby GPT, and its Shakespeare GPU model at batch 8
    "baby": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12),
    "10m": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=8),
}
SAME_ALGORITHM = ["--optimizer", "adamw", "--schedule", "cosine", "--dropout", "0"]
BABY = ["--n-layers", "4", "--d-model", "128", "--n-heads", "4", "--seq-len", "64", "--batch-size", "12",
        "--target-params", "800000", *SAME_ALGORITHM]


def shape_flags(shape: dict, target: int) -> tuple[list[str], list[str]]:
    """(nanoGPT's flags, ours) for a speed-race shape."""
    theirs = [f"--n_layer={shape['n_layer']}", f"--n_head={shape['n_head']}", f"--n_embd={shape['n_embd']}",
              f"--block_size={shape['block_size']}", f"--batch_size={shape['batch_size']}"]
    ours = ["--n-layers", str(shape["n_layer"]), "--d-model", str(shape["n_embd"]), "--n-heads", str(shape["n_head"]),
            "--seq-len", str(shape["block_size"]), "--batch-size", str(shape["batch_size"]), "--target-params",
            str(target), *SAME_ALGORITHM]
    return theirs, ours
CLK = os.sysconf("SC_CLK_TCK")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 200 nanoGPT iterations, 150 speed steps")
    p.add_argument("--iters", type=int, default=None, help="nanoGPT iterations in the quality race (default 2000)")
    p.add_argument("--speed-steps", type=int, default=None, help="steps of each program in the speed race (default 500)")
    p.add_argument("--skip", type=int, default=None, help="warm-up steps left out of the speed medians (default 50)")
    p.add_argument("--slice", type=float, default=None, help="seconds per time slice in the speed race (default 4)")
    p.add_argument("--no-quality", action="store_true", help="speed race only")
    p.add_argument("--no-speed", action="store_true", help="quality race only")
    p.add_argument("--context", type=int, default=64,
                   help="our quality run's --seq-len: nanoGPT's block size, 64 (0: the trainer's default, 128)")
    p.add_argument("--matmul-precision", default=None, choices=("float32", "bfloat16"),
                   help="our runs' --matmul-precision, both races (default: bfloat16 where the CPU "
                        "has AVX512-BF16 or AMX-BF16, else float32; nanoGPT's CPU recipe is float32 either way)")
    p.add_argument("--ours", default="", help="extra flags for our quality-race run (quoted), e.g. '--seq-len 256'")
    p.add_argument("--quiet-below", type=float, default=0.5,
                   help="before each race, wait until other programs use fewer cores than this (0: don't wait)")
    p.add_argument("--max-wait", type=float, default=1800.0, help="seconds to wait for a quiet machine, at most")
    p.add_argument("--retries", type=int, default=3,
                   help="times a race disturbed by other programs (>= --quiet-below cores over 10 s) is run again")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="give up on a quality-race program after this many seconds (a loaded machine)")
    p.add_argument("--peer-huge-pages", action="store_true",
                   help="run nanoGPT under the trainer's huge-page malloc too (GLIBC_TUNABLES=glibc.malloc.hugetlb=1; "
                        "the trainer sets it for itself, slm/cli/malloc.py): the same allocator for both")
    p.add_argument("--shape", default="baby", choices=sorted(SHAPES), help="the speed race's shape (default baby)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="the speed race's block size instead of the shape's (e.g. 1024 with --batch-size 2 for the 10m "
                        "shape: the same tokens a step as its seq 256 x 8)")
    p.add_argument("--batch-size", type=int, default=None, help="the speed race's batch instead of the shape's")
    p.add_argument("--peer-compile", action="store_true", help="nanoGPT with --compile=True (torch.compile)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, runs, checkpoints)")
    a = p.parse_args()
    a.iters = a.iters or (200 if a.quick else 2000)
    if a.matmul_precision is None:
        from slm.model.matmul import cpu_has_bf16_dot

        a.matmul_precision = "bfloat16" if cpu_has_bf16_dot() else "float32"
    a.speed_steps = a.speed_steps or (150 if a.quick else 500)
    a.skip = a.skip if a.skip is not None else (30 if a.quick else 50)
    a.slice = a.slice or (2.0 if a.quick else 4.0)
    return a


# ---------------------------------------------------------------- the machine and its load

def machine() -> dict:
    model = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        pass
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "torch", "numpy"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": model,
            "cores": os.cpu_count(), "python": sys.version.split()[0], **versions}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        with open("/proc/loadavg") as f:
            return "load average: " + " ".join(f.read().split()[:3])


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, steal) jiffies of the whole machine since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _stat(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _proc_jiffies(pid: int) -> int:
    """CPU of a live process and of the children it has reaped (torch.compile's g++ runs, say)."""
    fields = _stat(pid)
    try:  # utime + stime (all threads) + cutime + cstime
        return sum(int(fields[i]) for i in (11, 12, 13, 14))
    except (IndexError, ValueError):
        return 0


def _with_descendants(pids: tuple[int, ...]) -> set[int]:
    """The processes and every live descendant (compiler processes not yet reaped)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat(int(name))):
            parent[int(name)] = int(fields[1])
    out, todo = set(pids), list(pids)
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in out]
        out.update(kids)
        todo += kids
    return out


class Others:
    """CPU that programs other than this harness and its children took over an interval, in cores."""

    def __init__(self, pids: tuple[int, ...] = ()):
        self.pids = pids
        self.t, (self.busy, self.steal) = time.time(), _cpu_jiffies()
        self.mine = self._mine()

    def _mine(self) -> float:
        t = os.times()  # self + reaped children, in seconds
        live = sum(_proc_jiffies(p) for p in _with_descendants(self.pids)) / CLK
        return t.user + t.system + t.children_user + t.children_system + live

    def done(self) -> dict:
        dt = max(time.time() - self.t, 1e-9)
        busy, steal = _cpu_jiffies()
        others = ((busy - self.busy) / CLK - (self._mine() - self.mine)) / dt
        return {"others_cores": max(others, 0.0), "steal_cores": (steal - self.steal) / CLK / dt, "wall_s": dt}


def load_line(o: dict) -> str:
    return f"other programs used {o['others_cores']:.2f} of {os.cpu_count()} cores (steal {o['steal_cores']:.2f})"


def wait_quiet(a: argparse.Namespace, probe_s: float = 5.0) -> dict:
    """Wait until other programs use fewer than --quiet-below cores in two consecutive probe windows (at most
    --max-wait seconds). nanoGPT's two OpenMP threads slow down many-fold when the cores are oversubscribed
    (2.5 s an iteration instead of 0.07 s at a load average of 7 on this machine), so a loaded machine decides
    the race, not the programs."""
    t0, calm, last = time.time(), 0, None
    if a.quiet_below <= 0:
        return {"waited_s": 0.0, "quiet": None}
    while True:
        o = Others()
        time.sleep(probe_s)
        last = o.done()["others_cores"]
        calm = calm + 1 if last < a.quiet_below else 0
        waited = time.time() - t0
        if calm >= 2:
            if waited > 3 * probe_s:
                print(f"[wait] quiet after {waited:.0f}s (other programs: {last:.2f} cores)", flush=True)
            return {"waited_s": waited, "quiet": True, "others_cores": last}
        if waited >= a.max_wait:
            print(f"[wait] still loaded after {waited:.0f}s (other programs: {last:.2f} cores): racing anyway",
                  flush=True)
            return {"waited_s": waited, "quiet": False, "others_cores": last}
        if calm == 0 and int(waited) % 60 < probe_s:
            print(f"[wait] other programs use {last:.2f} cores (>= {a.quiet_below:g}); waiting ({waited:.0f}s)",
                  flush=True)


# ---------------------------------------------------------------- the peer's scratch copy and data

def setup_scratch(root: str) -> str:
    """Copy the peer, put tinyshakespeare.txt where its prepare.py looks, run it, check its output."""
    import numpy as np

    peer = os.path.join(root, "nanoGPT")
    shutil.copytree(PEER, peer)
    for dirpath, dirnames, filenames in os.walk(peer):  # the shared copy is read-only; the scratch must be writable
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    data_dir = os.path.join(peer, "data", "shakespeare_char")
    shutil.copyfile(os.path.join(DATA, "tinyshakespeare.txt"), os.path.join(data_dir, "input.txt"))
    subprocess.run([PY, "prepare.py"], cwd=data_dir, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(data_dir, "meta.pkl"), "rb") as f:
        itos = pickle.load(f)["itos"]
    for split, name in (("train", "tinyshakespeare_train.txt"), ("val", "tinyshakespeare_val.txt")):
        ids = np.fromfile(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16)
        with open(os.path.join(DATA, name), encoding="utf-8") as f:
            text = f.read()
        assert "".join(itos[int(i)] for i in ids) == text, f"nanoGPT's {split}.bin differs from {name}"
    return peer


def char_tokenizer(path: str, peer: str) -> None:
    """A tokenizer.json with nanoGPT's 65 characters and ids (a BPE with no merges: one token per character)."""
    from tokenizers import Tokenizer, decoders, models

    with open(os.path.join(peer, "data", "shakespeare_char", "meta.pkl"), "rb") as f:
        stoi = pickle.load(f)["stoi"]
    tok = Tokenizer(models.BPE(vocab=dict(stoi), merges=[]))
    tok.decoder = decoders.Fuse()
    tok.save(path)
    assert Tokenizer.from_file(path).encode("First Citizen:\n").ids == [stoi[c] for c in "First Citizen:\n"]


# ---------------------------------------------------------------- running the two programs

def nanogpt_cmd(iters: int, out_dir: str, speed: bool, compile_: bool = False,
                shape: list[str] = ()) -> list[str]:
    extra = [f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--out_dir={out_dir}", *shape]
    if compile_:
        extra += ["--compile=True"]  # after the recipe's --compile=False: the last flag wins in its configurator
    if not speed and iters % 250:  # the recipe evaluates (and keeps a checkpoint) every 250: also at the end
        extra += [f"--eval_interval={iters}"]
    if speed:  # no eval after iteration 0, no checkpoint
        extra += ["--eval_interval=1000000000"]
    return [PY, "train.py", *NANOGPT_RECIPE, *extra]


def ours_cmd(out_dir: str, *flags: str) -> list[str]:
    return [PY, os.path.join(ROOT, "train_optimized.py"), "--use-streaming", "--output-dir", out_dir, *flags]


class Disturbed(Exception):
    """Other programs took the cores during a race: the race is run again once the machine is quiet."""


class Watch:
    """Other programs' CPU over the last `window_s` seconds, from snapshots taken at each `check(pids)` (pids: the
    race's programs, the same at every call); `check` raises Disturbed when it reaches `limit` cores (limit <= 0:
    never)."""

    def __init__(self, limit: float, window_s: float = 10.0):
        self.limit, self.window_s, self.samples = limit, window_s, []

    def check(self, pids: tuple[int, ...]) -> None:
        now = Others(pids)
        self.samples = [o for o in self.samples if now.t - o.t <= self.window_s] + [now]
        first = self.samples[0]
        if self.limit <= 0 or now.t - first.t < 0.8 * self.window_s:
            return
        o = first.done()
        if o["others_cores"] >= self.limit:
            raise Disturbed(f"other programs used {o['others_cores']:.2f} cores over {o['wall_s']:.0f}s")


def run_timed(cmd: list[str], cwd: str, log: str, timeout: float, watch: Watch) -> tuple[float, dict]:
    """Run to the end, output to `log`; (process wall seconds, other programs' load meanwhile). Raises
    Disturbed (the program ended) when other programs take the cores meanwhile."""
    others = Others()
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while p.poll() is None:
                try:
                    p.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    watch.check((p.pid,))
                if time.time() - t0 > timeout:
                    sys.exit(f"{' '.join(cmd[:3])} ... did not finish in {timeout:g}s ({load_line(others.done())}): "
                             f"the machine is too loaded for a race; see {log}:\n" + tail(log, 3))
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed (exit {p.returncode}); see {log}:\n" + tail(log))
    return wall, others.done()


def tail(path: str, n: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def interleave(jobs: dict[str, tuple[list[str], str, str]], slice_s: float, watch: Watch) -> dict[str, dict]:
    """Start every job in its own process group, stopped; then let one run at a time for `slice_s` seconds,
    round robin, until all have exited. Per job: wall seconds it ran, slices, other programs' load during
    its slices (in cores)."""
    procs, stats = {}, {}
    with contextlib.ExitStack() as stack:
        for name, (cmd, cwd, log) in jobs.items():
            f = stack.enter_context(open(log, "w"))
            procs[name] = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            os.killpg(procs[name].pid, signal.SIGSTOP)
            stats[name] = {"run_s": 0.0, "slices": 0, "others_core_s": 0.0, "steal_core_s": 0.0}
        try:
            while any(p.poll() is None for p in procs.values()):
                for name, p in procs.items():
                    if p.poll() is not None:
                        continue
                    others = Others((p.pid,))
                    os.killpg(p.pid, signal.SIGCONT)
                    t_end = time.time() + slice_s
                    while p.poll() is None and time.time() < t_end:
                        try:
                            p.wait(timeout=min(1.0, max(t_end - time.time(), 0.01)))
                        except subprocess.TimeoutExpired:
                            watch.check(tuple(q.pid for q in procs.values()))
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGSTOP)
                    o = others.done()
                    s = stats[name]
                    s["run_s"] += o["wall_s"]
                    s["slices"] += 1
                    s["others_core_s"] += o["others_cores"] * o["wall_s"]
                    s["steal_core_s"] += o["steal_cores"] * o["wall_s"]
        finally:
            for p in procs.values():
                if p.poll() is None:  # interrupted or disturbed: end what this harness started
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    for name, p in procs.items():
        s = stats[name]
        s["others_cores"], s["steal_cores"] = s["others_core_s"] / s["run_s"], s["steal_core_s"] / s["run_s"]
        if p.returncode != 0:
            sys.exit(f"{name} failed (exit {p.returncode}); see {jobs[name][2]}:\n" + tail(jobs[name][2]))
    return stats


# ---------------------------------------------------------------- reading and scoring

def nanogpt_step_times(log: str) -> dict[int, float]:
    """{step (1-based) : seconds} from nanoGPT's `iter k: loss x, time y ms` lines (iteration k is step k+1)."""
    pat = re.compile(r"^iter (\d+): loss [-\d.naninf]+, time ([\d.]+)ms")
    out = {}
    with open(log) as f:
        for line in f:
            if m := pat.match(line):
                out[int(m.group(1)) + 1] = float(m.group(2)) / 1e3
    return out


def ours_step_times(run_dir: str) -> dict[int, float]:
    """{step : seconds since the previous step's end} from metrics.jsonl (--log-every 1)."""
    rows = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "elapsed_s" in r and "tokens_per_sec" in r:
                rows[r["step"]] = r["elapsed_s"]
    return {s: rows[s] - rows[s - 1] for s in rows if s - 1 in rows}


def median_over(times: dict[int, float], first: int, last: int) -> tuple[float, int]:
    xs = [times[s] for s in range(first, last + 1) if s in times]
    return statistics.median(xs), len(xs)


def score_nanogpt(peer: str, ckpt_path: str) -> dict:
    """nanoGPT's checkpoint on the whole val split: non-overlapping 64-character windows, nats summed."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, peer)
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.remove(peer)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)  # our own scratch file
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.eval()
    block = ckpt["model_args"]["block_size"]
    val = torch.from_numpy(np.fromfile(os.path.join(peer, "data", "shakespeare_char", "val.bin"),
                                       dtype=np.uint16).astype(np.int64))
    n_targets = len(val) - 1
    starts = list(range(0, n_targets, block))
    nats, scored = 0.0, 0
    with torch.no_grad():
        full = [s for s in starts if s + block <= n_targets]
        for i in range(0, len(full), 256):
            idx = torch.tensor(full[i: i + 256])[:, None] + torch.arange(block)[None]
            x, y = val[idx], val[idx + 1]
            logits, _ = model(x, y)
            nats += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
            scored += y.numel()
        for s in starts[len(full):]:  # the last, shorter window
            x, y = val[s:n_targets][None], val[s + 1: n_targets + 1][None]
            logits, _ = model(x, y)
            nats += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
            scored += y.numel()
    assert scored == n_targets
    return {"bpb": nats / math.log(2) / scored, "chars_scored": scored, "iter": ckpt["iter_num"],
            "params": model.get_num_params(), "estimate_val_loss": float(ckpt["best_val_loss"])}


def score_ours(run_dir: str, val_path: str) -> dict:
    """The trainer's eval (summary.json) in bits per byte of the val file: its nats over the file's bytes."""
    from tokenizers import Tokenizer

    from slm.data.heldout import build_eval_set
    from slm.data.sources import resolve_source
    from slm.data.tokenizer import special_ids

    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    tok_path = os.path.join(run_dir, "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    docs = list(resolve_source(val_path).documents())
    with open(val_path, "rb") as f:
        raw = f.read()
    exact = ("\n\n".join(docs) + "\n").encode() == raw  # <|endoftext|> stands for each "\n\n": no text lost
    es = build_eval_set(docs, tok, config["seq_len"], None, val_path, special_ids(tok, tok_path))
    tokens = float(es.mask.sum())
    nats = summary["eval_loss"] * tokens
    trainer_bpb = nats / math.log(2) / es.n_bytes
    assert abs(trainer_bpb - summary["eval_bpb"]) < 1e-4 * summary["eval_bpb"], (trainer_bpb, summary["eval_bpb"])
    return {"bpb": nats / math.log(2) / len(raw), "trainer_bpb": summary["eval_bpb"], "coding_exact": exact,
            "file_bytes": len(raw), "trainer_bytes": es.n_bytes, "eval_tokens": int(tokens),
            "steps": summary["steps"], "tokens": summary["tokens"], "params": summary["params"],
            "tokens_per_sec": summary["tokens_per_sec"], "model": config["model"], "seq_len": config["seq_len"],
            "batch_size": config["batch_size"], "learning_rate": config["learning_rate"],
            "wall_time_s": summary["wall_time_s"]}


# ---------------------------------------------------------------- the races

def attempts(a: argparse.Namespace, what: str, run, waits: list, restarts: list):
    """run() once the machine is quiet; again (up to --retries times) when other programs disturb it."""
    for _ in range(a.retries + 1):
        waits.append(wait_quiet(a))
        try:
            return run(Watch(a.quiet_below))
        except Disturbed as e:
            restarts.append(f"{what}: {e}")
            print(f"[restart] {what} disturbed ({e}): ended, to be raced again once the machine is quiet", flush=True)
    sys.exit(f"{what}: disturbed {a.retries + 1} times; try again when the machine is quieter")


def quality_race(a: argparse.Namespace, peer: str, scratch: str) -> dict:
    out = {"waits": [], "restarts": []}
    ng_out = os.path.join(peer, "out-quality")
    ng_log = os.path.join(scratch, "nanogpt-quality.log")

    def nanogpt(watch: Watch):
        shutil.rmtree(ng_out, ignore_errors=True)
        print(f"[quality] {uptime()}", flush=True)
        return run_timed(nanogpt_cmd(a.iters, ng_out, False, a.peer_compile), peer, ng_log, a.timeout, watch)

    wall, load = attempts(a, "nanoGPT's quality run", nanogpt, out["waits"], out["restarts"])
    steps = nanogpt_step_times(ng_log)
    med, _ = median_over(steps, a.skip + 1, a.iters)
    ng = score_nanogpt(peer, os.path.join(ng_out, "ckpt.pt"))
    ng.update(wall_s=wall, iters=a.iters, median_step_s=med, load=load)
    print(f"[quality] nanoGPT: {a.iters} iterations in {wall:.1f}s wall (median iteration {med * 1e3:.1f} ms); "
          f"ckpt of iteration {ng['iter']}: {ng['bpb']:.4f} bits/byte on the whole val split "
          f"({ng['chars_scored']:,} characters); {load_line(load)}", flush=True)
    budget = round(wall, 1)
    run_dir = os.path.join(scratch, "ours-quality")
    flags = ["--dataset-id", os.path.join(DATA, "tinyshakespeare_train.txt"),
             "--eval-dataset-id", os.path.join(DATA, "tinyshakespeare_val.txt"),
             "--target-params", "800000", "--max-time", f"{budget:g}",
             *(["--seq-len", str(a.context)] if a.context else []), "--matmul-precision", a.matmul_precision,
             *a.ours.split()]

    def ours(watch: Watch):
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"[quality] {uptime()}", flush=True)
        return run_timed(ours_cmd(run_dir, *flags), ROOT, os.path.join(scratch, "ours-quality.log"),
                         budget + a.timeout, watch)

    ours_wall, ours_load = attempts(a, "our quality run", ours, out["waits"], out["restarts"])
    us = score_ours(run_dir, os.path.join(DATA, "tinyshakespeare_val.txt"))
    us.update(wall_s=ours_wall, max_time=budget, flags=flags[4:], load=ours_load)
    s = us["model"]
    print(f"[quality] ours (--max-time {budget:g}): {us['steps']} steps, {us['tokens']:,} tokens, "
          f"{s['n_layers']}x{s['d_model']} d_ff {s['d_ff']} vocab {s['vocab_size']}, seq {us['seq_len']}, "
          f"process wall {ours_wall:.1f}s; {us['bpb']:.4f} bits/byte on the whole val split "
          f"(trainer's own figure {us['trainer_bpb']:.4f} over {us['trainer_bytes']:,} bytes); {load_line(ours_load)}",
          flush=True)
    print(f"[quality] {uptime()}", flush=True)
    out.update(nanogpt=ng, ours=us, ratio=us["bpb"] / ng["bpb"])
    return out


def speed_race(a: argparse.Namespace, peer: str, scratch: str) -> dict:
    tok = os.path.join(scratch, "char_tokenizer.json")
    char_tokenizer(tok, peer)
    run_dir = os.path.join(scratch, "ours-speed")
    ng_out = os.path.join(peer, "out-speed")
    shape = dict(SHAPES[a.shape], **{k: v for k, v in (("block_size", a.seq_len), ("batch_size", a.batch_size)) if v})
    ng_params = nanogpt_params(peer, shape)
    theirs, our_shape = shape_flags(shape, 800_000 if a.shape == "baby" else ng_params)
    tokens_per_step = shape["batch_size"] * shape["block_size"]
    # No --eval-dataset-id: a 1,024-token held-out head keeps the end-of-run eval short (it is not timed).
    ours = ours_cmd(run_dir, "--dataset-id", os.path.join(DATA, "tinyshakespeare_train.txt"), "--tokenizer", tok,
                    *our_shape, "--matmul-precision", a.matmul_precision, "--max-steps", str(a.speed_steps),
                    "--log-every", "1", "--eval-tokens", "1024", "--eval-every", "1000000000",
                    "--checkpoint-every", "1000000000")
    jobs = {"nanoGPT": (nanogpt_cmd(a.speed_steps, ng_out, True, a.peer_compile, theirs), peer,
                        os.path.join(scratch, "nanogpt-speed.log")),
            "ours": (ours, ROOT, os.path.join(scratch, "ours-speed.log"))}
    waits, restarts = [], []

    def race(watch: Watch):
        for d in (run_dir, ng_out):
            shutil.rmtree(d, ignore_errors=True)
        print(f"[speed] {uptime()}", flush=True)
        return interleave(jobs, a.slice, watch)

    stats = attempts(a, "the speed race", race, waits, restarts)
    first, last = a.skip + 1, a.speed_steps
    ng_med, ng_n = median_over(nanogpt_step_times(jobs["nanoGPT"][2]), first, last)
    us_med, us_n = median_over(ours_step_times(run_dir), first, last)
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    out = {"shape": a.shape, "peer_compile": a.peer_compile, "steps": [first, last], "slice_s": a.slice, "waits": waits, "restarts": restarts,
           "nanoGPT": {"median_step_s": ng_med, "n": ng_n, "params": ng_params, **stats["nanoGPT"]},
           "ours": {"median_step_s": us_med, "n": us_n, "params": cfg["params"], "model": cfg["model"],
                    "devices": cfg["devices"], **stats["ours"]}}
    for k in ("nanoGPT", "ours"):
        r = out[k]
        r["tokens_per_sec"] = tokens_per_step / r["median_step_s"]
        r["gflops"] = 6 * r["params"] * r["tokens_per_sec"] / 1e9
        print(f"[speed] {k}: median step {r['median_step_s'] * 1e3:.2f} ms over steps {first}-{last} ({r['n']} steps), "
              f"{r['tokens_per_sec']:,.0f} tok/s, {r['gflops']:.1f} model GFLOP/s (6 x {r['params']:,} x tok/s); ran "
              f"{r['run_s']:.0f}s in {r['slices']} slices, during which {load_line(r)}", flush=True)
        if r["median_step_s"] * 4 > a.slice:  # a step that straddles a boundary counts the other's slice too
            print(f"[speed] WARNING: {k}'s steps ({r['median_step_s']:.1f} s) are too long for {a.slice:g} s slices: "
                  f"many straddle a slice boundary and include the other program's slice; rerun with --slice "
                  f"{math.ceil(r['median_step_s'] * 10)}", flush=True)
    out["ratio"] = out["ours"]["gflops"] / out["nanoGPT"]["gflops"]
    out["step_time_ratio"] = out["nanoGPT"]["median_step_s"] / out["ours"]["median_step_s"]
    print(f"[speed] {uptime()}", flush=True)
    return out


def nanogpt_params(peer: str, shape: dict = SHAPES["baby"]) -> int:
    """nanoGPT's get_num_params() at a shape (all parameters less the position table)."""
    import torch  # noqa: F401  (model.py needs it)

    sys.path.insert(0, peer)
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.remove(peer)
    return GPT(GPTConfig(vocab_size=65, dropout=0.0, bias=False, **{k: v for k, v in shape.items()
                                                                   if k != "batch_size"})).get_num_params()


def main() -> None:
    a = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # the finally blocks end the programs
    if a.peer_compile:  # inductor compiles in nanoGPT's process: a pool of compile workers would read as load
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # from other programs (their CPU is not yet our children's)
    if a.peer_huge_pages:  # inherited by every program started from here (ours sets it for itself anyway)
        from slm.cli.malloc import with_huge_pages

        os.environ.update(with_huge_pages(dict(os.environ)))
    m = machine()
    print(f"vs nanoGPT, one sitting: {m['date']} | {m['cpu']}, {m['cores']} cores | python {m['python']}, "
          f"jax {m['jax']}, jaxlib {m['jaxlib']}, flax {m['flax']}, optax {m['optax']}, torch {m['torch']}, "
          f"numpy {m['numpy']} | ours --matmul-precision {a.matmul_precision}{' | --quick' if a.quick else ''}"
          f" | speed race at the {a.shape} shape{f' (seq {a.seq_len})' if a.seq_len else ''}"
          f"{f' (batch {a.batch_size})' if a.batch_size else ''} | nanoGPT {'--compile=True' if a.peer_compile else 'as its recipe (no compile)'}"
          f"{' | nanoGPT under GLIBC_TUNABLES=' + os.environ['GLIBC_TUNABLES'] if a.peer_huge_pages else ''}", flush=True)
    start_uptime = uptime()
    print(f"[start] {start_uptime}", flush=True)
    scratch = tempfile.mkdtemp(prefix="vs-nanogpt-", dir="/tmp")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, "inductor")  # a killed race's half-written .so
    results: dict = {"machine": m, "args": vars(a), "uptime_start": start_uptime}
    try:
        peer = setup_scratch(scratch)
        t0 = time.time()
        if not a.no_quality:
            results["quality"] = quality_race(a, peer, scratch)
        if not a.no_speed:
            results["speed"] = speed_race(a, peer, scratch)
        results["uptime_end"] = uptime()
        waits = results.get("quality", {}).get("waits", []) + results.get("speed", {}).get("waits", [])
        results["waited_s"] = sum(w.get("waited_s", 0.0) for w in waits)
        results["race_s"] = time.time() - t0 - results["waited_s"]
        report(results)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        if a.keep:
            print(f"scratch kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def report(r: dict) -> None:
    m = r["machine"]
    print()
    print(f"== vs nanoGPT, {m['date']}, {m['cpu']} ({m['cores']} cores), jax {m['jax']}, torch {m['torch']}; "
          f"{r['race_s'] / 60:.1f} min racing (+ {r['waited_s'] / 60:.1f} min waiting for a quiet machine)")
    print(f"   load at start: {r['uptime_start']}")
    restarts = r.get("quality", {}).get("restarts", []) + r.get("speed", {}).get("restarts", [])
    if restarts:
        print(f"   races restarted after other programs took the cores: {'; '.join(restarts)}")
    if "quality" in r:
        q = r["quality"]
        ng, us = q["nanogpt"], q["ours"]
        print(f"   quality (whole val split, bits/byte; lower is better): nanoGPT {ng['bpb']:.4f} "
              f"({ng['iters']} iterations, {ng['wall_s']:.1f}s) | ours {us['bpb']:.4f} "
              f"(--max-time {us['max_time']:g}: {us['steps']} steps, process {us['wall_s']:.1f}s) | ratio "
              f"{q['ratio']:.3f} (goal <= 0.78)")
        print(f"      other programs' load: nanoGPT's run {ng['load']['others_cores']:.2f} cores, ours "
              f"{us['load']['others_cores']:.2f} cores")
    if "speed" in r:
        s = r["speed"]
        ng, us = s["nanoGPT"], s["ours"]
        print(f"   speed at nanoGPT's shape (median step, steps {s['steps'][0]}-{s['steps'][1]}, interleaved in "
              f"{s['slice_s']:g}s slices): nanoGPT {ng['median_step_s'] * 1e3:.2f} ms = {ng['gflops']:.1f} GFLOP/s | "
              f"ours {us['median_step_s'] * 1e3:.2f} ms = {us['gflops']:.1f} GFLOP/s | ratio {s['ratio']:.2f}x "
              f"(goal >= 1.5); step time {s['step_time_ratio']:.2f}x; ours --matmul-precision "
              f"{r['args']['matmul_precision']}, nanoGPT float32 (its CPU recipe)")
        print(f"      other programs' load during the slices: nanoGPT's {ng['others_cores']:.2f} cores, ours "
              f"{us['others_cores']:.2f} cores")
        if "quality" in r:
            qm = r["quality"]["nanogpt"]["median_step_s"]
            print(f"      nanoGPT's median iteration in the quality race {qm * 1e3:.2f} ms vs {ng['median_step_s'] * 1e3:.2f} "
                  f"ms here ({qm / ng['median_step_s']:.2f}x)")
    print(f"   load at end: {r['uptime_end']}")
    print(f"   verdict: {verdict(r, r['args']['quiet_below'] or 0.5)}")


def verdict(r: dict, limit: float = 0.5) -> str:
    """Whether other programs' load left the race to the programs (their CPU < `limit` cores in every phase)."""
    loads = []
    if "quality" in r:
        loads += [r["quality"]["nanogpt"]["load"]["others_cores"], r["quality"]["ours"]["load"]["others_cores"]]
    if "speed" in r:
        loads += [r["speed"]["nanoGPT"]["others_cores"], r["speed"]["ours"]["others_cores"]]
    worst = max(loads, default=0.0)
    if worst < limit:
        return f"quiet (other programs used at most {worst:.2f} cores in any phase)"
    return (f"LOADED: other programs used up to {worst:.2f} cores in a phase; these figures measure the load, "
            f"not the programs (not a valid claim)")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
