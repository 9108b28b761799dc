"""The generic test: every catalogue invariant x engine x padding mode x device.

IDs read ``INV-MASK-001-impl-padded-cpu`` and are the same on every xdist worker.
"""

from __future__ import annotations

import pytest

from spec.run.runner import implied_reason, run_invariant


def test_invariant(instance) -> None:
    info, engine, mode, device = instance
    implied = implied_reason(info, engine)  # e.g. verl-megatron: packing and its layer only, no engine object
    if implied:
        pytest.skip(implied)
    outcome = run_invariant(info, engine, mode, device)
    if outcome.status == "skip":
        pytest.skip(outcome.reason)
    if info.layout and outcome.status != "pass":
        pytest.xfail(f"layout profile (not part of the verdict): {outcome.status}: {outcome.counterexample} -> "
                     f"{outcome.error or outcome.reason}")
    if outcome.status == "xfail":
        pytest.xfail(f"known failure of {engine.name} ({outcome.known_hits} of {outcome.examples} examples): "
                     f"{outcome.reason}")
    if outcome.status == "xpass":
        pytest.fail(f"{info.id} is listed as a known failure of {engine.name} ({outcome.reason}) but passed: "
                    "update the engine's known-failure records")
    assert outcome.status != "error", (
        f"suite error in {info.id} on {engine.name} [{mode}, {device}]\n{outcome.counterexample}\n{outcome.error}")
    assert outcome.status == "pass", (
        f"{info.id} ({info.title}) fails on {engine.name} [{mode}, {device}]\n"
        f"minimal counterexample: {outcome.counterexample}\n{outcome.error}")
