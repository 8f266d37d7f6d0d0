"""Side by side against an earlier commit: the same workload from two trees, alternated.

    python bench/compare.py --base REV [--rounds 3] [--actors 3000] [--rate 800] [--replay N] [--json]

The machine is shared and noisy, so absolute rates wander; what a change costs is
the ratio of this tree's figure to the base's, measured in one run with the two
alternating (base, head, base, head, ...), each on a fresh nats-server. The base is
checked out with `git worktree` into a temporary directory (removed afterwards) and
run with this tree's virtual environment.

Workloads (each `bench/scheduler.py`'s `bench_resumes`, in both trees):
- `resumes_per_s`: committed resumes/s, 1 scheduler replica, 1,000 workers;
- `resumes_per_s_with_request_id`: the same, every resume with a request id;
- `cpu_ms_per_placement_1_replica_saturated`, `cpu_ms_per_placement_3_replicas_saturated`
  and their quotient `replica_cpu_ratio_3v1_saturated` (per round): the CPU of all
  scheduler processes per committed placement, from their own rusage, with 1 and with 3
  replicas, each with the same window in flight (closed loop);
- `cpu_ms_per_placement_1_replica`, `cpu_ms_per_placement_3_replicas` and
  `replica_cpu_ratio_3v1`: the same at the same offered load, `--rate` resumes/s (open
  loop; measured only in trees whose `bench_resumes` takes a `rate`, 2026-12 on);
- with `--replay N`, `bench/scheduler.py`'s `bench_replay` of an N-event log:
  `replay_events_per_s`, `replay_cpu_us_per_event` (the fold's CPU per event in its
  process) and `replay_vs_raw`, `replay_vs_raw_cpu` (against a raw nats-py read of the
  same stream in the same run).

The last line with `--json` is one JSON object: per workload the base's and this
tree's medians and `<workload>_ratio` (this tree / base).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUN = r"""
import asyncio, inspect, json, sys, tempfile
sys.path.insert(0, ".")
from warmboot.natsserver import NatsServer
from bench.scheduler import bench_resumes

async def main(actors, window, rate, replay):
    with tempfile.TemporaryDirectory() as d:
        server = NatsServer(d)
        server.start()
        try:
            out = {}
            if replay:
                from bench.scheduler import bench_replay
                got = await bench_replay(server.url, replay)
                out.update({k: got[k] for k in ("replay_events_per_s", "replay_cpu_us_per_event", "replay_vs_raw",
                                                 "replay_vs_raw_cpu") if k in got})
            if not actors:
                print(json.dumps(out))
                return
            plain = await bench_resumes(server.url, 1, actors, window, request_ids=False)
            with_ids = await bench_resumes(server.url, 1, actors, window, request_ids=True)
            three = await bench_resumes(server.url, 3, actors, window, request_ids=False)
            out.update({"resumes_per_s": plain["resumes_per_s"],
                   "resumes_per_s_with_request_id": with_ids["resumes_per_s"],
                   "cpu_ms_per_placement_1_replica_saturated": plain["cpu_ms_per_placement"],
                   "cpu_ms_per_placement_3_replicas_saturated": three["cpu_ms_per_placement"],
                   "replica_cpu_ratio_3v1_saturated": three["cpu_ms_per_placement"] / plain["cpu_ms_per_placement"]})
            if "rate" in inspect.signature(bench_resumes).parameters:  # trees since the open-loop load
                paced = [await bench_resumes(server.url, n, actors, window, request_ids=False, rate=rate, label="c")
                         for n in (1, 3)]
                out.update({"cpu_ms_per_placement_1_replica": paced[0]["cpu_ms_per_placement"],
                            "cpu_ms_per_placement_3_replicas": paced[1]["cpu_ms_per_placement"],
                            "replica_cpu_ratio_3v1": paced[1]["cpu_ms_per_placement"] / paced[0]["cpu_ms_per_placement"]})
        finally:
            server.stop()
    print(json.dumps(out))

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])))
"""


def run(tree: Path, actors: int, window: int, rate: float, replay: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", RUN, str(actors), str(window), str(rate), str(replay)], cwd=tree,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. HEAD~3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--actors", type=int, default=3000, help="actors resumed per run (0: only the replay)")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--rate", type=float, default=800.0,
                        help="resumes/s offered to 1 and to 3 replicas for replica_cpu_ratio_3v1 (open loop)")
    parser.add_argument("--replay", type=int, default=0, metavar="N",
                        help="also replay an N-event log in each round (the fold against a raw read)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            figures: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
            for r in range(args.rounds):
                for name, tree in (("base", base), ("head", ROOT)):
                    got = run(tree, args.actors, args.window, args.rate, args.replay)
                    for key, value in got.items():
                        figures[name].setdefault(key, []).append(value)
                    print(f"round {r + 1} {name:4} ({rev if name == 'base' else 'this tree'}): "
                          + ", ".join(f"{k} {v:,.3g}" for k, v in got.items()), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    result: dict[str, object] = {"base": rev, "rounds": args.rounds}
    for key in figures["head"]:
        if key not in figures["base"]:  # a figure the base's bench cannot measure
            print(f"{key}: this tree {statistics.median(figures['head'][key]):,.3g} (not measured on the base)")
            continue
        b, h = statistics.median(figures["base"][key]), statistics.median(figures["head"][key])
        result[f"{key}_base"], result[f"{key}_head"] = round(b, 3), round(h, 3)
        result[f"{key}_ratio"] = round(h / b, 3)
        print(f"{key}: base {b:,.3g}, this tree {h:,.3g}: ratio {h / b:.2f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
