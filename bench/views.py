"""What a page of the paged views costs a scheduler replica (`scheduler.actors`, `scheduler.workers`):
the pure functions that answer them, on folds of fleet size, beside the work they avoid, in one run.

    python bench/views.py [--actors N] [--workers N] [--json]

- `actor list`'s pages (`services.scheduler.actor_list.actor_page`), on a fold of `--actors` actors
  created in no order of their ids: the first page (its sort of the ids), each next page (a
  bisection and its rows), a page after one actor more (inserted, not sorted again), beside a sort
  of every id.
- `workers`' pages (`services.scheduler.worker_list.worker_page`), on a fold of `--workers` workers
  of two classes and `--actors` actors booked on them: the first page (the ids sorted, the actors
  counted per worker and class), each next page at the same fold position, beside the pass over
  the actors alone.
- a filter's walk of `actor list`'s pages where a page's cursor (given only when a matching actor
  follows) costs most: the actors that pass are the first 1,000 ids and the last; the walk beside the
  same walk with the place of that next actor forgotten (the gap scanned again), and a pass of the
  filter over every id.

Times are `time.perf_counter` medians of three runs, in milliseconds; this machine is shared and
noisy, so the quotients, measured side by side, are what counts. With `--json` the last line is one
JSON object: `actor_first_page_ms`, `actor_next_page_ms`, `actor_page_after_create_ms`,
`actor_sort_ms`, `actor_next_page_vs_sort`, `actor_filtered_first_page_ms`, `actor_filtered_walk_ms`,
`actor_filtered_walk_forgotten_ms`, `actor_filter_pass_ms`, `actor_filtered_walk_vs_forgotten`,
`worker_first_page_ms`, `worker_next_page_ms`, `worker_actor_pass_ms`, `worker_next_page_vs_pass`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from msgspec.structs import replace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from events.schema import ACTORS_LIMIT_MAX, WORKERS_LIMIT_MAX, ActorsQuery, WorkersQuery  # noqa: E402
from services.scheduler import actor_list  # noqa: E402
from services.scheduler.actor_list import actor_page, sorted_ids  # noqa: E402
from services.scheduler.projection import Projection  # noqa: E402
from services.scheduler.worker_list import booked_per_class, worker_page  # noqa: E402
from tests.factories import (booked, created, entry, fold, placed, registered, runtime, stamp,  # noqa: E402
                             version)


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def actor_pages(actors: int) -> dict:
    ids = [f"a-{i:07d}" for i in range(actors)]
    random.Random(1).shuffle(ids)  # created in no order of their ids
    runs: dict[str, list[float]] = {"first": [], "next": [], "grown": [], "sort": []}
    for run in range(3):
        projection = fold([created(actor_id, selectors={"zone": "a"}) for actor_id in ids], Projection())
        query = ActorsQuery(limit=ACTORS_LIMIT_MAX)
        first = actor_page(projection, query)  # (its time below is of a fresh fold's first page)
        projection = fold([created(actor_id, selectors={"zone": "a"}) for actor_id in ids], Projection())
        runs["first"].append(timed(lambda: actor_page(projection, query)))
        after, pages, spent = first.next_after, 0, 0.0
        while after is not None and pages < 20:
            start = time.perf_counter()
            after = actor_page(projection, ActorsQuery(limit=ACTORS_LIMIT_MAX, after=after)).next_after
            spent += (time.perf_counter() - start) * 1e3
            pages += 1
        runs["next"].append(spent / max(pages, 1))
        runs["sort"].append(timed(lambda: sorted(projection.actors)))
        projection.apply(projection.seq + 1, created(f"a-new-{run}"))  # one actor more: inserted
        runs["grown"].append(timed(lambda: actor_page(projection, ActorsQuery(limit=ACTORS_LIMIT_MAX,
                                                                              after=first.next_after))))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"actor_first_page_ms": med["first"], "actor_next_page_ms": med["next"],
            "actor_page_after_create_ms": med["grown"], "actor_sort_ms": med["sort"],
            "actor_next_page_vs_sort": med["next"] / med["sort"]}


def actor_filtered_walk(actors: int) -> dict:
    """A filter's walk where the cursor's question costs most: the actors that pass are the first
    ACTORS_LIMIT_MAX ids and the last one, so the first page's cursor (given only when a matching actor
    follows, `paging.Ahead`) scans every id after the page to find it. The walk as the scheduler answers
    it (the next page starts where that one was found) beside the same walk with that place forgotten
    (the next page scans the gap again), and a pass of the filter over every id."""
    ids = [f"a-{i:07d}" for i in range(actors)]
    passing = set(ids[:ACTORS_LIMIT_MAX]) | {ids[-1]}
    shuffled = list(ids)
    random.Random(1).shuffle(shuffled)
    projection = fold([created(a, sandbox_class="microvm" if a in passing else "gvisor") for a in shuffled],
                      Projection())
    query = ActorsQuery(sandbox_classes=("microvm",), limit=ACTORS_LIMIT_MAX)
    actor_page(projection, query)  # the ids sorted, once

    def walk(forget: bool) -> None:
        after = None
        while True:
            if forget:
                actor_list._CACHE[projection].ahead.found.clear()
            after = actor_page(projection, replace(query, after=after)).next_after
            if after is None:
                return

    runs: dict[str, list[float]] = {"first": [], "kept": [], "forgotten": [], "pass": []}
    for _ in range(3):
        runs["first"].append(timed(lambda: actor_page(projection, query)))
        runs["kept"].append(timed(lambda: walk(False)))
        runs["forgotten"].append(timed(lambda: walk(True)))
        runs["pass"].append(timed(lambda: [a for a in sorted_ids(projection)
                                           if projection.actors[a].sandbox_class == "microvm"]))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"actor_filtered_first_page_ms": med["first"], "actor_filtered_walk_ms": med["kept"],
            "actor_filtered_walk_forgotten_ms": med["forgotten"], "actor_filter_pass_ms": med["pass"],
            "actor_filtered_walk_vs_forgotten": med["kept"] / med["forgotten"]}


def worker_pages(workers: int, actors: int) -> dict:
    v1, v2 = version("v1"), version("v2")
    gvisor = entry(runtime(v2, "runsc-v2", 16, compatible=(v1,)))
    microvm = entry(runtime(version("fc"), "fc-1"), sandbox_class="microvm")
    pin = stamp(v2, name="runsc-v2")
    events: list = [registered(f"w-{i:06d}", gvisor, microvm, cpu=1_000_000, mem=10_000_000) for i in range(workers)]
    for i in range(actors):
        actor_id, worker_id = f"a-{i:07d}", f"w-{i % workers:06d}"
        events += [created(actor_id, cpu=1, mem=1), placed(actor_id, worker_id, pin, node=f"node-{worker_id}",
                                                             cpu=1, mem=1), booked(worker_id, actor_id)]
    runs: dict[str, list[float]] = {"first": [], "next": [], "pass": []}
    for _ in range(3):
        projection = fold(events, Projection())
        query = WorkersQuery(limit=WORKERS_LIMIT_MAX)
        pages = []
        runs["first"].append(timed(lambda: pages.append(worker_page(projection, query))))
        after, count, spent = pages[0].next_after, 0, 0.0
        while after is not None:
            start = time.perf_counter()
            after = worker_page(projection, WorkersQuery(limit=WORKERS_LIMIT_MAX, after=after)).next_after
            spent += (time.perf_counter() - start) * 1e3
            count += 1
        runs["next"].append(spent / max(count, 1))
        runs["pass"].append(timed(lambda: booked_per_class(projection)))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"worker_first_page_ms": med["first"], "worker_next_page_ms": med["next"],
            "worker_actor_pass_ms": med["pass"], "worker_next_page_vs_pass": med["next"] / med["pass"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {**actor_pages(args.actors), **actor_filtered_walk(args.actors), **worker_pages(args.workers, args.actors)}
    print(f"actor list, {args.actors} actors: first page {result['actor_first_page_ms']:.1f} ms, next pages "
          f"{result['actor_next_page_ms']:.2f} ms each, after a create {result['actor_page_after_create_ms']:.2f} ms; "
          f"a sort of the ids {result['actor_sort_ms']:.1f} ms (next page / sort "
          f"{result['actor_next_page_vs_sort']:.2f})")
    print(f"actor list --class, {args.actors} actors, the first {ACTORS_LIMIT_MAX:,} and the last passing: first page "
          f"{result['actor_filtered_first_page_ms']:.1f} ms (its cursor scans every id after it), the walk "
          f"{result['actor_filtered_walk_ms']:.1f} ms, with the place of the next actor forgotten "
          f"{result['actor_filtered_walk_forgotten_ms']:.1f} ms (walk / forgotten "
          f"{result['actor_filtered_walk_vs_forgotten']:.2f}); a pass of the filter over every id "
          f"{result['actor_filter_pass_ms']:.1f} ms")
    print(f"workers, {args.workers} workers and {args.actors} actors: first page {result['worker_first_page_ms']:.1f}"
          f" ms, next pages {result['worker_next_page_ms']:.1f} ms each; the pass over the actors alone "
          f"{result['worker_actor_pass_ms']:.1f} ms (next page / pass {result['worker_next_page_vs_pass']:.2f})")
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
