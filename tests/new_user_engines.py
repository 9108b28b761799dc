"""Engines shaped as new users' adapters came out, for tests/test_new_users.py: impl changed the way a
third-party library differs (a float mask, no position_ids, entropy as a metric, a missing dependency, a record that
can never match). Loadable as ``--engine tests.new_user_engines:<Name>``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import impl
from spec.engines.impl.adapter import ImplEngine
from spec.protocol import Convention, KnownFailure
from spec.protocol.profile import VERL_CONVENTIONS

_MODULE = __name__
#: impl's profile without verl's int32 mask convention (a third party promises none)
NO_INT32 = replace(ImplEngine.profile, conventions=VERL_CONVENTIONS - {Convention.INT32_ATTENTION_MASK})


def _declaring(profile, **fields):
    """``profile`` with ``fields`` declared; against a suite whose profile lacks such a field (before these fields),
    ``profile`` as it is, so that this module still loads there and the tests fail on what they check."""
    try:
        return replace(profile, **fields)
    except TypeError:
        return profile


def _named(cls: type) -> type:
    cls.name = f"{_MODULE}:{cls.__name__}"
    return cls


def _with_mask(mask_of):
    """impl's LM head whose padded attention mask is ``mask_of(int32 mask)``."""
    class Engine(impl.LMHeadEngine):
        def prepare_model_inputs(self, mb):
            inputs, args = super().prepare_model_inputs(mb)
            if inputs.get("attention_mask") is not None:
                inputs = {**inputs, "attention_mask": mask_of(inputs["attention_mask"])}
            return inputs, args
    return Engine


@_named
class FloatMask(ImplEngine):
    """A 0.0/1.0 float32 padded mask: a Hugging Face model casts a 2-D mask to bool (no false alarm)."""

    profile = NO_INT32
    engine_classes = {"lm": _with_mask(lambda m: m.float()), "value": impl.ValueHeadEngine}


@_named
class AdditiveBiasMask(ImplEngine):
    """A 2-D float mask of 0 (keep) and -inf (drop): an additive bias, which a model casting to bool reads wrongly."""

    profile = NO_INT32
    engine_classes = {"lm": _with_mask(lambda m: torch.zeros_like(m, dtype=torch.float32).masked_fill(m == 0,
                                                                                                  float("-inf"))),
                      "value": impl.ValueHeadEngine}


class _NoPositions(impl.LMHeadEngine):
    """Hands the model no position_ids (a RoPE model computes them)."""

    def prepare_model_inputs(self, mb):
        inputs, args = super().prepare_model_inputs(mb)
        return {k: v for k, v in inputs.items() if k != "position_ids"}, args


_PADDED_ROPE = replace(ImplEngine.profile, modes=("padded",), positions=("rope",), media=())


@_named
class NoPositionIds(ImplEngine):
    """A padded-only RoPE engine that hands the model no position_ids, and declares it."""

    profile = _declaring(_PADDED_ROPE, model_computes_positions=True)
    engine_classes = {"lm": _NoPositions, "value": impl.ValueHeadEngine}


@_named
class NoPositionIdsUndeclared(ImplEngine):
    """The same engine, not declaring it: its model would read positions nobody handed."""

    profile = _PADDED_ROPE
    engine_classes = {"lm": _NoPositions, "value": impl.ValueHeadEngine}


class _MetricEntropy(impl.LMHeadEngine):
    """Entropy computed under no_grad, as a metric only (logged, never an entropy bonus)."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)
        if "entropy" in out:
            out["entropy"] = out["entropy"].detach()
        return out


@_named
class EntropyAsMetric(ImplEngine):
    """Entropy as a metric only, declared (EngineProfile.metrics)."""

    profile = _declaring(ImplEngine.profile, metrics=frozenset({"entropy"}))
    engine_classes = {"lm": _MetricEntropy, "value": impl.ValueHeadEngine}


@_named
class EntropyMetricWithGrad(ImplEngine):
    """Declares entropy a metric only, yet returns it attached to the graph."""

    profile = _declaring(ImplEngine.profile, metrics=frozenset({"entropy"}))


class _NeedsTyro(impl.LMHeadEngine):
    def __init__(self, **settings):
        import tyro_not_installed_here  # noqa: F401 - the library's own import of a module this machine lacks
        super().__init__(**settings)


@_named
class MissingDependency(ImplEngine):
    """An engine whose library imports a module not installed here."""

    engine_classes = {"lm": _NeedsTyro, "value": impl.ValueHeadEngine}


@_named
class NoRefusals(ImplEngine):
    """impl declaring no unsupported setting: INV-FLAG-004 has nothing to hand it."""

    profile = replace(ImplEngine.profile, refuses={})


@_named
class UnmatchableRecord(ImplEngine):
    """A record asking output= of a check whose failures name no key: it could never match."""

    known_failures = (KnownFailure("INV-FLAG-003", "a record that asks a fact the check never carries",
                                   output="log_probs"),)


@_named
class MisspeltRecord(ImplEngine):
    """A record naming an invariant that does not exist."""

    known_failures = (KnownFailure("INV-SLICE-06", "a typo"),)
