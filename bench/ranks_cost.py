"""Cost of the real-rank harness (spec/execute/ranks.py): pool start-up and time per example.

    PYTHONPATH=$PWD python bench/ranks_cost.py [--engine impl|verl] [--examples 30]

Prints one table: start-up of the 4-process pool, then seconds per example for the
threaded harness (impl only), real ranks, and real ranks with prepare_model_inputs only,
per world size, on drawn-like cases (5 sequences of up to 16 tokens, entropy on).
"""

from __future__ import annotations

import argparse
import time

import torch

from spec.execute import ranks
from spec.cases.structure import EngineCase
from spec.run.registry import load_engine
from spec.execute.harness import execute


def cases(n: int, sp: int) -> list[EngineCase]:
    gen = torch.Generator().manual_seed(sp)
    out = []
    for seed in range(n):
        p = tuple(int(x) for x in torch.randint(1, 9, (5,), generator=gen))
        r = tuple(int(x) for x in torch.randint(1, 9, (5,), generator=gen))
        out.append(EngineCase(prompt_lens=p, response_lens=r, vocab=33, calculate_entropy=True, sp_size=sp,
                              seed=seed))
    return out


def per_example(fn, batch: list[EngineCase]) -> float:
    start = time.perf_counter()
    for case in batch:
        fn(case)
    return (time.perf_counter() - start) / len(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="impl")
    parser.add_argument("--examples", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = load_engine(args.engine)
    start = time.perf_counter()
    ranks.pool("cpu")
    startup = time.perf_counter() - start
    start = time.perf_counter()
    ranks.execute(engine, cases(1, 2)[0])  # first use loads the engine in every rank
    load = time.perf_counter() - start
    print(f"engine {engine.name}: pool start-up {startup:.1f} s, engine load + first example {load:.1f} s")
    print("| sp | threads (ms/example) | real ranks (ms/example) | real ranks, inputs only (ms/example) |")
    print("|---:|---:|---:|---:|")
    for sp in ranks.WORLDS:
        batch = cases(args.examples, sp)
        threads = (per_example(lambda c: execute(engine, c), batch) * 1e3
                   if getattr(engine, "sp_runner", None) is None else float("nan"))
        real = per_example(lambda c: ranks.execute(engine, c), batch) * 1e3
        inputs = per_example(lambda c: ranks.execute(engine, c, stop_after_inputs=True), batch) * 1e3
        print(f"| {sp} | {threads:.1f} | {real:.1f} | {inputs:.1f} |")
    ranks.shutdown()


if __name__ == "__main__":
    main()
