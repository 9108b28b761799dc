"""The code blocks a standalone reproducer is made of.

The stand-in model, the hand-off around it (the padding poisoned, sequence-parallel ranks in threads) and
the top-K processor are the suite's own code, written out from their source (:func:`suite_blocks`), so a
reproducer's model is the model the suite ran; they are written beside the file as ``repro_suite.py``
(:func:`write_beside`). The reference (float64, per sequence, with the oracle's tolerance rule), the micro-batch
builder, the checks and ``main`` are the module :mod:`.runtime`, importing nothing of the suite, copied beside the
file as ``repro_runtime.py``; the file loads both (:data:`LOADER`) and binds its engine and case into the runtime
(:data:`SHARE`).
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

from ..execute import handoff, harness
from ..protocol import engine as protocol_engine
from ..protocol.engine import MEDIA_TOKEN_MARKS, MEDIA_TOKEN_TYPES, OutputSpan, PaddedLayout, ReproSnippet
from ..protocol.profile import AUDIO_INPUT_KEYS, MEDIA_INPUT_KEYS, ROUTES_RECORDED, ROUTES_SWITCH, drawn_config, layout_starts
from ..protocol.vendor import assignments, definitions, source
from ..truth import (audio, closeness, failing, handoff_checks, media_checks, microbatch_checks, oracle, outputs_checks,
                     rank_checks, routes, rules, settings_checks, slice_checks, state_checks, toy_model, vision)
from . import runtime
from .vendored import loader, preamble, suite_guard

__all__ = ["suite_blocks", "suite_module", "write_beside", "PREAMBLE", "LOADER", "SHARE", "RUNTIME_NAME", "SUITE_NAME",
           "DISTRIBUTION", "engine_block"]

#: the imports a file opens with (its ``from __future__`` import first)
PREAMBLE = source(preamble, future=True)


def suite_blocks() -> str:
    """The suite's stand-in model, hand-off and processor, as source."""
    parts = ["# ---- the stand-in model and its vision and audio towers (the suite's spec/truth/vision.py, audio.py, "
             "toy_model.py, written "
             "out) ----", "from functools import lru_cache", "",
             assignments({"MEDIA_INPUT_KEYS": MEDIA_INPUT_KEYS, "AUDIO_INPUT_KEYS": AUDIO_INPUT_KEYS}),
             definitions(vision), definitions(audio), definitions(toy_model),
             "# ---- the hand-off around the model (spec/execute/handoff.py, harness.py), written out ----",
             "POISONS = {" + ", ".join(f"{k!r}: float({str(v)!r})" for k, v in handoff.POISONS.items()) + "}", ""]
    for fn in (PaddedLayout, layout_starts, drawn_config, rules.layout_width, rules.layout_columns, rules.layout_mask, handoff.ThreadedAllGather, handoff._settings,
               handoff._poison_padded, handoff._poison_tail, handoff._fields, handoff._per_token, handoff._shared,
               handoff.check_model_inputs, handoff.check_media_inputs, handoff._check_audio_inputs, handoff.execution_context, handoff._tracked, handoff._call_model,
               handoff.rank_outputs, harness._in_threads):
        parts += [inspect.getsource(fn), ""]
    for fn in (rules.offsets, rules.padded_length):
        parts += [inspect.getsource(fn), ""]
    parts += ["# ---- the top-K distillation processor the suite hands the engine (spec/truth/oracle.py) ----"]
    for fn in (oracle._overlap, oracle._overlap_terms, oracle.topk_terms, oracle.TopKProcessor):
        parts += [inspect.getsource(fn), ""]
    parts += ["# ---- the oracle's rule for an output the engine declares at a lower precision (spec/truth/oracle.py) ----",
              "from dataclasses import dataclass, field", "",
              f"LOW_SAFETY = {oracle.LOW_SAFETY!r}", f"OVERLAP_KEYS = {oracle.OVERLAP_KEYS!r}",
              "_DTYPES = {" + ", ".join(f"{k!r}: torch.{str(v).removeprefix('torch.')}"
                                        for k, v in oracle._DTYPES.items()) + "}", ""]
    for fn in (oracle.unit_roundoff, oracle.topk_tie_slack, rules.response_positions, oracle.Expected):
        parts += [inspect.getsource(fn), ""]
    parts += ["# ---- the oracle itself, per sequence (spec/truth/oracle.py: expected_loop, the reference the vectorised "
              "oracle is tested against) ----", "import math", "",
              assignments({"EPS": oracle.EPS, "SAFETY": oracle.SAFETY, "CANCELLATION_SAFETY": oracle.CANCELLATION_SAFETY,
                           "TEMPERATURE_FLOOR": rules.TEMPERATURE_FLOOR,
                           "LOG_PROB_MIN_CLAMP": oracle.LOG_PROB_MIN_CLAMP})]
    for fn in (oracle._softmax_terms, oracle._bound, oracle.scaled_logits, oracle.cancellation_bounds, oracle.log_prob_min_clamp,
               oracle._cancellation_dtypes, oracle._sample_media, oracle.expected_loop):
        parts += [inspect.getsource(fn), ""]
    parts += ["# ---- what a consumer reads (spec/protocol/engine.py, spec/truth/rules.py) ----"]
    for fn in (OutputSpan, rules.read_positions, rules.full_length_mask, protocol_engine._flag_width,
               protocol_engine._lengths, protocol_engine._response_index, protocol_engine.response_view):
        parts += [inspect.getsource(fn), ""]
    parts += ["# ---- the media keys a model takes, as handed (spec/protocol/engine.py) ----",
              assignments({"MEDIA_TOKEN_TYPES": MEDIA_TOKEN_TYPES, "MEDIA_TOKEN_MARKS": MEDIA_TOKEN_MARKS}),
              inspect.getsource(protocol_engine.media_view), ""]
    parts += ["# ---- the checks, as the invariants run them (spec/truth/failing.py, closeness.py, handoff_checks.py, "
              "media_checks.py, outputs_checks.py, slice_checks.py, microbatch_checks.py, rank_checks.py, "
              "state_checks.py, settings_checks.py) ----",
              definitions(failing), definitions(closeness), definitions(handoff_checks), definitions(media_checks),
              definitions(outputs_checks),
              definitions(slice_checks), definitions(microbatch_checks), definitions(rank_checks),
              definitions(state_checks), definitions(settings_checks),
              "# ---- an MoE rollout's routed experts (spec/truth/routes.py, spec/protocol/profile.py) ----",
              assignments({"ROUTES_SWITCH": ROUTES_SWITCH, "ROUTES_RECORDED": ROUTES_RECORDED}), definitions(routes)]
    return "\n".join(parts)


#: the modules copied or written beside every engine-case reproducer (:func:`write_beside`)
RUNTIME_NAME, SUITE_NAME = "repro_runtime", "repro_suite"


def suite_module() -> str:
    """``repro_suite.py``: the suite's stand-in model, hand-off, flags, processor and oracle rule, written out from
    their source (:func:`suite_blocks`) as a module of their own."""
    return ('"""The suite\'s stand-in model, hand-off, flags, top-K processor and oracle rule, written out from its '
            'source by\n`python -m spec verify` (spec/repro/templates.py) for the reproducers beside this file."""\n\n'
            + PREAMBLE + "\n" + suite_blocks())


def write_beside(folder: Path) -> None:
    """Write ``repro_suite.py`` and copy :mod:`.runtime` (``repro_runtime.py``) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{SUITE_NAME}.py").write_text(suite_module())
    shutil.copyfile(inspect.getsourcefile(runtime), folder / f"{RUNTIME_NAME}.py")


#: how a reproducer loads the two modules beside it (:mod:`.vendored.loader`), and loads them
LOADER = "\n".join([
    source(loader), "",
    "# the suite's stand-in model, hand-off, flags, processor and oracle rule, written out from its source",
    f"_suite = _beside({SUITE_NAME!r})",
    "# the micro-batch builder, one run, the float64 reference, the checks and main (spec/repro/runtime.py, copied)",
    f"_runtime = _beside({RUNTIME_NAME!r})", ""])

#: binds the file's engine, case and the suite's pieces into its runtime (after the file's constants)
SHARE = "_runtime.share(_suite, globals())"

#: the suite's and impl's top-level packages: both are the distribution ``rl-ioprep``
DISTRIBUTION = suite_guard.DISTRIBUTION


def engine_block(snippet: ReproSnippet) -> str:
    """The file's engine block: the snippet between its markers, guarded where it imports the suite."""
    guard = "" if snippet.standalone else source(suite_guard) + "\n"
    return "\n".join(["# ---- engine under test (begin) ----", guard + snippet.code.strip(),
                      "# ---- engine under test (end) ----", ""])
