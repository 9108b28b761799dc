"""verl's FSDP engines as an engine under test (``--engine verl``).

Builds ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead`` /
``FSDPEngineWithValueHead`` without their constructor (no model, no process group,
no device mesh): only the attributes that ``prepare_model_inputs`` and
``prepare_model_outputs`` read are set. Nothing of verl's code is copied here; the
adapter only sets attributes and adapts the calling convention.

The installed verl is probed for what it has (signatures, attributes, module
members), not matched on its version string:

* ``prepare_model_outputs(..., logits_processor_func)``: verl >= 0.8 takes the
  top-K distillation processor as a 4th positional argument; verl 0.7.1 has no such
  parameter (and no distillation).
* ``FSDPEngine._get_packed_pad_size``: the static bucket (``pad_to_length`` /
  ``pad_to_length_bucket``).
* whether ``prepare_model_outputs`` reads the ``calculate_sum_pi_squared`` flag at all
  (verl 0.7.1 does not, although it ships the helper that computes it).
* ``verl.workers.utils.padding.<helper>``: the padding helpers.

Sequence parallelism is never run: verl's Ulysses path slices and all-gathers through
a ``torch.distributed`` process group (``verl.utils.ulysses``), while the suite
simulates ranks as threads through an ``all_gather`` seam verl does not have.
``lacks("sp")`` says so and the strategies do not draw ``sp > 1``.

What is known to be wrong in verl is listed in :attr:`VerlEngine.known_failures`
(per invariant ID, each with a counterexample in ``docs/verl-conformance.md``); the
attention-mask bug of verl < 0.8 (issue #6278) is deliberately *not* listed there:
the run must fail on it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from .engines import HELPERS, EngineUnderTest

__all__ = ["VerlEngine", "VerlCapabilities", "probe_verl", "MASK_INVARIANTS"]

#: The invariant IDs that a wrong padded attention mask (verl issue #6278: built from the
#: response-only ``loss_mask``) makes fail, directly or through the padded outputs it
#: changes. See docs/verl-conformance.md, "The mask failure".
MASK_INVARIANTS = frozenset({
    "INV-MASK-001",   # the mask itself
    "INV-MASK-003",   # its sum (r_i ones per row instead of n_i)
    "INV-VAL-001",    # padded log_probs vs the oracle
    "INV-VAL-002",    # padded entropy vs the oracle
    "INV-VAL-003",    # padded sum_pi_squared vs the oracle
    "INV-VAL-004",    # padded distillation keys vs the oracle
    "INV-KEYS-003",   # padded vs packed values
    "INV-TEMP-001",   # padded log_probs vs the oracle at per-sample temperatures
    "INV-TEMP-003",   # padded log_probs vs the oracle at T = 1
    "INV-SLICE-002",  # the response slice of padded log_probs vs the oracle
})


@dataclass(frozen=True)
class VerlCapabilities:
    version: str
    processor: bool  # prepare_model_outputs takes logits_processor_func (top-K distillation)
    bucket: bool  # static pad_to_length bucket
    sum_pi_squared: bool  # calculate_sum_pi_squared is honoured
    in_place_logits: bool  # prepare_model_outputs divides the model's logits in place (0.7.1: div_)
    helpers: tuple[str, ...]  # padding helpers verl ships


def probe_verl() -> VerlCapabilities:
    """What the installed verl offers (ImportError when verl is not installed)."""
    import verl
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.utils import padding

    lm = transformer_impl.FSDPEngineWithLMHead
    params = inspect.signature(lm.prepare_model_outputs).parameters
    try:
        source = inspect.getsource(lm.prepare_model_outputs)
    except (OSError, TypeError):  # no source: assume the out-of-place path
        source = ""
    return VerlCapabilities(
        version=str(getattr(verl, "__version__", "?")),
        processor="logits_processor_func" in params,
        bucket=hasattr(transformer_impl.FSDPEngine, "_get_packed_pad_size"),
        # verl 0.7.1 ships verl_F.calculate_sum_pi_squared_from_logits but its engine never reads the flag
        sum_pi_squared="calculate_sum_pi_squared" in source,
        in_place_logits=".div_(" in source,
        helpers=tuple(name for name in HELPERS if callable(getattr(padding, name, None))),
    )


class VerlEngineObject:
    """One verl engine object behind the suite's calling convention.

    ``prepare_model_outputs(output, output_args, micro_batch, logits_processor_func=None)``
    forwards the processor where verl takes one; verl without the parameter is called
    with three arguments, exactly as its own ``forward_step`` calls it (it then ignores
    ``distillation_use_topk``, which the suite reports, not hides).
    """

    def __init__(self, engine: Any, caps: VerlCapabilities):
        self.verl_engine = engine
        self.caps = caps

    def prepare_model_inputs(self, micro_batch):
        return self.verl_engine.prepare_model_inputs(micro_batch)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        if self.caps.processor:
            return self.verl_engine.prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        return self.verl_engine.prepare_model_outputs(output, output_args, micro_batch)

    def __repr__(self) -> str:
        return f"<verl {self.caps.version} {type(self.verl_engine).__name__}>"


def _no_padding_2_padding_with_dense_mask(fn: Callable) -> Callable:
    """verl 0.7.1's ``no_padding_2_padding`` reads ``data["attention_mask"]`` before it
    branches, although its nested branch never uses the value (lengths come from the
    nested ``prompts``/``responses``). In verl's own flow the key is always there: the
    dense mask that ``left_right_2_no_padding`` keeps. The suite's micro-batch is built
    nested from the start, so this adds that dense mask (full lengths, as
    left_right_2_no_padding would keep it) to a shallow copy when the key is missing.
    The caller's TensorDict is not touched and no result is changed."""

    def no_padding_2_padding(tensor, data):
        if "attention_mask" not in data.keys() and data["prompts"].is_nested:
            import torch

            ids = data["input_ids"]
            lens = ids.offsets().diff()
            cols = torch.arange(int(lens.max()), device=lens.device)
            data = data.copy()
            data.set("attention_mask", (cols.unsqueeze(0) < lens.unsqueeze(1)).to(torch.int64))
        return fn(tensor, data)

    no_padding_2_padding.__wrapped__ = fn  # type: ignore[attr-defined]
    no_padding_2_padding.__doc__ = _no_padding_2_padding_with_dense_mask.__doc__
    return no_padding_2_padding


def _attention_utils_error() -> str | None:
    """verl 0.7.1's ``verl.utils.attention_utils`` imports ``flash_attn.bert_padding`` with no
    fallback (flash-attn ships CUDA wheels only); later verl falls back to plain torch."""
    try:
        from verl.utils.attention_utils import _get_attention_functions

        _get_attention_functions()
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - an unexpected layout: let the helper run and show what happens
        return None
    return None


def _needs_dense_mask(fn: Callable) -> bool:
    """Whether ``no_padding_2_padding`` reads ``attention_mask`` even for nested input (0.7.1)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    head = source.split("if prompt_ids.is_nested", 1)[0]
    return 'data["attention_mask"]' in head


# Known, documented discrepancies (docs/verl-conformance.md has a counterexample for each).
# Keyed by invariant ID; the runner applies an entry to every mode of that invariant, so an
# entry is only listed where the invariant fails in every mode it runs in.
_KNOWN_ALL = {
    "INV-MUT-003": "verl's left_right_2_no_padding pops input_ids and writes position_ids/loss_mask/"
                   "max_seq_len/... into the TensorDict it is given (by design: it converts in place); "
                   "contract ambiguity, see docs/verl-conformance.md",
    "INV-DENSE-002": "verl's left_right_2_no_padding builds mRoPE position_ids with "
                     "torch.nested.as_nested_tensor, which makes the axis dim ragged when all lengths are "
                     "equal or B = 1 ((B, j, n) instead of (B, 4, j)); verl bug (issue #7899)",
}
_KNOWN_IN_PLACE = {
    "INV-MUT-002": "this verl divides the model's logits by temperature in place (logits.div_), in both "
                   "modes; verl bug, fixed in later verl (out-of-place _scale_logits_by_temperature)",
}
_KNOWN_NO_SUM_PI_SQUARED = {
    "INV-VAL-003": "this verl has no sum_pi_squared output: calculate_sum_pi_squared is ignored "
                   "(feature added in later verl)",
}
_KNOWN_NO_PROCESSOR = {
    "INV-KEYS-001": "this verl ignores calculate_sum_pi_squared and distillation_use_topk (no "
                    "logits_processor_func, no sum_pi_squared): those keys are missing in both modes",
}
_KNOWN_OLD_HELPERS = {
    "INV-SLICE-003": "this verl's no_padding_2_padding handles (total_nnz,) values only: with trailing "
                     "dims F.pad pads the last (feature) axis instead of the response axis",
    "INV-DENSE-004": "this verl's left_right_2_no_padding predates top-K distillation: teacher_ids/"
                     "teacher_logprobs stay dense (B, S, K)",
}


class VerlEngine(EngineUnderTest):
    """The installed verl's FSDP engines (0.7.1 and 0.9.1 are what CI runs)."""

    name = "verl"

    def __init__(self) -> None:
        try:
            self.caps = probe_verl()
        except ImportError as exc:
            raise ImportError(f"--engine verl needs verl installed (pip install verl): {exc}") from exc
        from verl.utils import torch_functional as verl_F
        from verl.workers.engine.fsdp import transformer_impl
        from verl.workers.utils import padding

        self._verl_F = verl_F
        self._classes = {"lm": transformer_impl.FSDPEngineWithLMHead,
                         "value": transformer_impl.FSDPEngineWithValueHead}
        self._padding = padding
        self._attention_utils_error = _attention_utils_error()
        self.name = "verl"
        self.known_failures = self._known_failures()

    # -- what this verl lacks / supports -----------------------------------------------------
    def _known_failures(self) -> dict[str, str]:
        caps = self.caps
        known = dict(_KNOWN_ALL)
        if caps.in_place_logits:
            known.update(_KNOWN_IN_PLACE)
        if not caps.sum_pi_squared:
            known.update(_KNOWN_NO_SUM_PI_SQUARED)
        if not caps.processor or not caps.sum_pi_squared:
            known.update(_KNOWN_NO_PROCESSOR)
        if not caps.processor:  # the pre-distillation padding helpers ship with the pre-processor engine
            known.update(_KNOWN_OLD_HELPERS)
        return {k: f"verl {caps.version}: {v}" for k, v in known.items()}

    def lacks(self, feature: str) -> str | None:  # type: ignore[override]
        caps = self.caps
        if feature == "sp":
            return ("verl runs Ulysses sequence parallelism through a torch.distributed process group "
                    "(verl.utils.ulysses); the suite simulates ranks as threads with an all_gather seam "
                    "verl does not take, so sp > 1 is not run against verl")
        if feature == "bucket" and not caps.bucket:
            return f"verl {caps.version} has no static pad_to_length bucket"
        if feature in HELPERS:
            return self._helper_unusable(feature)
        if feature == "distillation" and not caps.processor:
            return f"verl {caps.version}: prepare_model_outputs takes no logits_processor_func (no top-K distillation)"
        return super().lacks(feature)  # type: ignore[misc]

    def strategy_limits(self) -> dict[str, Any]:  # type: ignore[override]
        caps = self.caps
        limits: dict[str, Any] = {"allow_sp": False, "allow_bucket": caps.bucket,
                                  "allow_distillation": caps.processor}
        if not caps.processor:
            # verl without the processor parameter predates the current fused-output contract: its padded
            # fused branch returns dense response slices (see docs/verl-conformance.md).
            limits["allow_fused"] = False
        return limits

    # -- engine objects and helpers -----------------------------------------------------------
    def make(self, head: str = "lm", **settings: Any) -> VerlEngineObject:
        sp_size = int(settings.pop("sp_size", 1) or 1)
        settings.pop("sp_rank", None)
        settings.pop("all_gather", None)
        bucket = settings.pop("pad_to_length", None)
        if settings:
            raise TypeError(f"unknown engine settings for verl: {sorted(settings)}")
        if sp_size > 1:
            raise NotImplementedError(self.lacks("sp"))
        if bucket and not self.caps.bucket:
            raise NotImplementedError(self.lacks("bucket"))
        eng = object.__new__(self._classes[head])
        eng.use_ulysses_sp = False
        eng.ulysses_sequence_parallel_size = 1
        eng.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                            entropy_from_logits_chunk_size=2048)
        eng.compute_entropy_from_logits = self._verl_F.entropy_from_logits
        # read only for sp > 1 (vision_config) and by the value head (v_head: absent = HF token classifier)
        eng.module = SimpleNamespace(config=SimpleNamespace())
        eng.pass_packed_cu_seqlens = False
        if self.caps.bucket:
            eng.pad_to_length = bool(bucket)
            eng.pad_to_length_bucket = int(bucket) if bucket else 1
        return VerlEngineObject(eng, self.caps)

    def _helper_unusable(self, name: str) -> str | None:
        """Why verl's helper ``name`` cannot run here, or None."""
        if not callable(getattr(self._padding, name, None)):
            return f"verl {self.caps.version} ships no verl.workers.utils.padding.{name}"
        if name == "left_right_2_no_padding" and self._attention_utils_error:
            return (f"verl {self.caps.version}'s left_right_2_no_padding calls verl.utils.attention_utils.unpad_input, "
                    f"which has no CPU fallback in this verl: {self._attention_utils_error}")
        return None

    def helper(self, name: str) -> Callable | None:
        if name not in HELPERS or self._helper_unusable(name):
            return None
        fn = getattr(self._padding, name)
        if name == "no_padding_2_padding" and _needs_dense_mask(fn):
            return _no_padding_2_padding_with_dense_mask(fn)
        return fn

    def __repr__(self) -> str:
        return f"<engine verl {self.caps.version}>"
