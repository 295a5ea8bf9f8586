"""Where a larql command's wall time goes from the outside, for the first run on a fresh machine:
the interpreter's start (site packages, `.pth` files), importing larql (torch, CUDA libraries),
the command itself, the exit handlers, and the process's teardown after them — with every
thread's stack written every `--dump-every` seconds, so a long stretch outside larql's own code
(one a profiler started inside the command does not see) shows what it waits on.

    .venv/bin/python benchmarks/cold_start.py [--dump-every 10] [--out DIR] -- \\
        bench --device cuda --dtype bfloat16 --depths 32000 -n 8 --repeats 1 ...

Everything after `--` is the `larql` command's arguments. It prints one line a phase (seconds
from the spawn) and writes `timeline.txt` and `stacks.txt` under `--out`. On a GPU machine run it
first thing after the machine starts, then once more: the second run shows what the first paid
once (compiled kernels cached on disk, files in the page cache).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# Runs in the measured process: marks each phase with the seconds since the parent spawned it,
# and a daemon thread writes every thread's stack every `every` seconds (through
# `sys._current_frames`, holding the GIL: faulthandler's watchdog, which reads them without it,
# crashed the process when it dumped during an import). The teardown after the exit handlers
# has no Python left to dump it: its share is the last line's time less the one before.
BOOT = r"""
import atexit, os, sys, threading, time, traceback
spawned = float(os.environ["COLD_START_SPAWNED"])
every = float(os.environ["COLD_START_EVERY"])
timeline = open(os.environ["COLD_START_TIMELINE"], "a", buffering=1)
stacks = open(os.environ["COLD_START_STACKS"], "w", buffering=1)
def mark(what):
    timeline.write(f"{time.time() - spawned:10.2f}  {what}\n")
def dump_every():
    while True:
        time.sleep(every)
        frames = sys._current_frames()  # (with the GIL: a consistent view)
        stacks.write(f"--- {time.time() - spawned:.2f} s\n")
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            if frame is not None and thread is not threading.current_thread():
                stacks.write(f"thread {thread.name}:\n" + "".join(traceback.format_stack(frame)))
mark("interpreter up (site packages and .pth files read)")
threading.Thread(target=dump_every, name="cold-start-stacks", daemon=True).start()
atexit.register(mark, "exit handlers done")  # registered first: runs last
import larql.cli.app as cli
mark("larql's CLI imported (a command imports torch when it needs it)")
sys.argv = ["larql", *sys.argv[1:]]
code = 0
try:
    cli.main()
except SystemExit as e:
    code = e.code
mark("command returned")
alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
mark(f"threads still alive: {', '.join(alive)}")
atexit.register(mark, "exit handlers start")  # registered last: runs first
sys.exit(code)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump-every", type=float, default=10.0, help="seconds between dumps")
    parser.add_argument("--out", type=Path, default=Path("cold-start"), help="output folder")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then larql's arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the larql command after --, e.g. -- engines")
    args.out.mkdir(parents=True, exist_ok=True)
    timeline, stacks = args.out / "timeline.txt", args.out / "stacks.txt"
    timeline.write_text("")
    spawned = time.time()
    env = {
        **os.environ,
        "COLD_START_SPAWNED": repr(spawned),
        "COLD_START_TIMELINE": str(timeline),
        "COLD_START_STACKS": str(stacks),
        "COLD_START_EVERY": str(args.dump_every),
    }
    done = subprocess.run([sys.executable, "-c", BOOT, *command], env=env, check=False)
    with timeline.open("a") as f:
        f.write(f"{time.time() - spawned:10.2f}  process ended (exit code {done.returncode})\n")
    print(f"seconds from the spawn (stacks every {args.dump_every:g} s: {stacks})")
    print(timeline.read_text(), end="")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
