"""The engine's own time in `spec verify`, by the check whose call spent it: what no change to the suite can cut.

    python -m bench.engine_time --engine verl [--profile ci] [--only STREAM,...]

Runs the catalogue as `spec verify` runs it (its groups, :func:`spec.run.runner.run_group`, each drawn case shaped
for every member, the example's runs shared by call) in this process, one thread, and times every call into the
engine's code (each engine-side wrapper of :mod:`spec.execute.attribution`, outermost only: the engine's objects,
helpers, micro-batch layer and packer) and every real-rank round trip (parent side, wall: the ranks' own work).
Each is charged to the check that made it: a run shared by call goes to the first check that asked it.

Prints, per stream (group) and over the run: wall time, the engine's own seconds and calls, the round trips, and the
checks whose calls cost the engine most. The engine's seconds are a floor for any run of the same checks on the
same cases: with W workers the wall time cannot fall below (engine + round trips) / W however cheap the suite's own
stages (drawing, materialization, the oracle, the comparisons) become.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

#: what a worker's engine-side time is charged to outside any check (a group's set-up)
OUTSIDE = "(outside a check)"


class EngineClock:
    """The engine's own seconds and calls, and the real-rank round trips, by the check running when they were made."""

    def __init__(self) -> None:
        self.check = OUTSIDE
        self.depth = 0
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()
        self.ranks: Counter = Counter()
        self.tier = OUTSIDE  # the size tier of the running check's case (spec.cases.coverage.tier_of)
        self.by_tier: Counter = Counter()  # engine and round-trip seconds by the case's tier
        self.checks_by_tier: Counter = Counter()  # check x example steps by the case's tier
        self.steps_by_tier: Counter = Counter()  # the checks' whole wall seconds (the suite's stages too) by tier

    def totals(self) -> tuple[float, float, int]:
        """The engine's seconds, the round trips' seconds and the engine's calls so far, over every check."""
        return sum(self.seconds.values()), sum(self.ranks.values()), sum(self.calls.values())

    def _timed(self, fn, seconds: Counter, calls: Counter | None = None):
        """``fn``, its wall time charged to the running check in ``seconds`` (and a call in ``calls``): the outermost
        timed call only, so an engine-side call inside another one (or inside a round trip, where the parent reads the
        ranks' replies) is its caller's."""
        clock = self

        def timed(*args, **kwargs):
            if clock.depth:
                return fn(*args, **kwargs)
            clock.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.depth -= 1
                spent = time.perf_counter() - start
                seconds[clock.check] += spent
                clock.by_tier[clock.tier] += spent
                if calls is not None:
                    calls[clock.check] += 1
        return timed

    def engine_side(self, original):
        """A replacement for :func:`spec.execute.attribution._engine_side` whose wrappers are timed."""
        return lambda fn, where: self._timed(original(fn, where), self.seconds, self.calls)

    def round_trip(self, original):
        """``spec.execute.ranks.execute``, timed."""
        return self._timed(original, self.ranks)


def install(clock: EngineClock) -> None:
    """Wrap the engine-side calls, the round trips, and the runner's per-check step (which names the check)."""
    from spec.cases.coverage import tier_of
    from spec.cases.structure import EngineCase
    from spec.execute import attribution, ranks
    from spec.run import runner

    attribution._engine_side = clock.engine_side(attribution._engine_side)
    ranks.execute = clock.round_trip(ranks.execute)  # every caller reads it through the module, at call time
    check = runner.StreamRun.check

    def named(self, member, case, shared, runs):
        clock.check = member.info.id
        clock.tier = tier_of(case) if isinstance(case, EngineCase) else "dense"
        clock.checks_by_tier[clock.tier] += 1
        start = time.perf_counter()
        try:
            return check(self, member, case, shared, runs)
        finally:
            clock.steps_by_tier[clock.tier] += time.perf_counter() - start
            clock.check, clock.tier = OUTSIDE, OUTSIDE
    runner.StreamRun.check = named


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="verl")
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--only", default=None, help="comma-separated stream keys (as printed) to run alone")
    parser.add_argument("--top", type=int, default=12, help="checks listed (most engine time first)")
    parser.add_argument("--workers", type=int, default=2, help="the floor's worker count")
    args = parser.parse_args(argv)

    import torch

    from spec.run.groups import groups
    from spec.run.profiles import load_profile
    from spec.run.registry import load_engine
    from spec.run.runner import instances, run_group, stream_key

    load_profile(args.profile)
    torch.set_num_threads(1)
    clock = EngineClock()
    install(clock)
    engine = load_engine(args.engine)
    pairs = instances()
    wanted = set(args.only.split(",")) if args.only else None
    streams: list[tuple[str, float, float, float, int]] = []
    by_check_stream: dict[str, str] = {}
    start = time.perf_counter()
    for task in groups(pairs):
        members = [pairs[n] for n in task]
        key = stream_key(*members[0]).decode()
        if wanted and key not in wanted:
            continue
        before = clock.totals()
        began = time.perf_counter()
        run_group(members, engine, "cpu")
        wall = time.perf_counter() - began
        eng, trips, calls = (now - then for now, then in zip(clock.totals(), before))
        streams.append((key, wall, eng, trips, calls))
        for info, mode in members:
            by_check_stream.setdefault(info.id, key)
        print(f"{key}: {wall:.1f} s", file=sys.stderr)
    total = time.perf_counter() - start
    engine_s, ranks_s, calls_n = clock.totals()

    print(f"Engine time in `spec verify`: engine `{args.engine}`, profile `{args.profile}`, one process, 1 thread\n")
    print("| stream | wall s | engine s | engine calls | round trips s | engine + round trips share |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, wall, eng, trips, calls in sorted(streams, key=lambda s: -s[1]):
        print(f"| {key} | {wall:.1f} | {eng:.1f} | {calls} | {trips:.1f} | {(eng + trips) / max(wall, 1e-9):.0%} |")
    print(f"| **all** | {total:.1f} | {engine_s:.1f} | {calls_n} | {ranks_s:.1f} | "
          f"{(engine_s + ranks_s) / max(total, 1e-9):.0%} |\n")
    print("| check (its stream) | engine s | engine calls | round trips s |")
    print("|---|---:|---:|---:|")
    for check, seconds in clock.seconds.most_common(args.top):
        print(f"| {check} ({by_check_stream.get(check, '-')}) | {seconds:.1f} | {clock.calls[check]} | "
              f"{clock.ranks[check]:.1f} |")
    print("\n| case tier | check steps | steps' wall s | engine + round trips s | engine s a step |")
    print("|---|---:|---:|---:|---:|")
    for tier, seconds in clock.by_tier.most_common():
        steps = clock.checks_by_tier[tier]
        print(f"| {tier} | {steps} | {clock.steps_by_tier[tier]:.1f} | {seconds:.1f} | {seconds / max(steps, 1):.3f} |")
    floor = (engine_s + ranks_s) / args.workers
    print(f"\nFloor with {args.workers} workers (the engine's own seconds and the round trips, perfectly shared): "
          f"{floor:.1f} s of wall time, however cheap the suite's own stages become.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
