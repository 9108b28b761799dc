"""Engines that misbehave on one real rank (crash, hang, raise), for tests/test_ranks.py.

Loaded by name (``tests.rank_engines:<attr>``) in every rank's process.
"""

from __future__ import annotations

import faulthandler
import time

import impl
from spec.run.registry import EngineUnderTest


class _OnRankOne(impl.LMHeadEngine):
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None, **verl_only):
        if self.settings.sp_rank == 1:
            self.misbehave()
        return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)


class CrashOnRankOne(_OnRankOne):
    def misbehave(self) -> None:
        faulthandler._sigsegv()  # a real segmentation fault in this rank's process


class HangOnRankOne(_OnRankOne):
    def misbehave(self) -> None:
        time.sleep(3600)  # never joins the all-gather rank 0 waits in


class RaiseOnRankOne(_OnRankOne):
    def misbehave(self) -> None:
        raise ValueError("rank one refuses")


class _Engine(EngineUnderTest):
    def __init__(self, cls: type, name: str):
        self.cls, self.name = cls, f"tests.rank_engines:{name}"

    def make(self, head: str = "lm", **settings):
        return self.cls(**settings)


CRASH = _Engine(CrashOnRankOne, "CRASH")
HANG = _Engine(HangOnRankOne, "HANG")
RAISE = _Engine(RaiseOnRankOne, "RAISE")
