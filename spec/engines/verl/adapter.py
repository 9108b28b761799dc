"""verl's FSDP engines as an engine under test (``--engine verl``).

Builds ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead`` /
``FSDPEngineWithValueHead`` without their constructor (no model, no process group,
no device mesh): only the attributes that ``prepare_model_inputs`` and
``prepare_model_outputs`` read are set. Nothing of verl's code is copied here; the
adapter sets attributes and adapts the calling convention, nothing else.

What the installed verl *has* is probed (signatures, attributes, module members), not
read off its version string:

* ``prepare_model_outputs(..., logits_processor_func)``: verl 0.9 takes the top-K
  distillation processor as a 4th positional argument; verl 0.7.1 has no such parameter
  and no distillation.
* ``FSDPEngine._get_packed_pad_size``: the static bucket (``pad_to_length`` /
  ``pad_to_length_bucket`` engine attributes).
* whether ``prepare_model_outputs`` reads the ``calculate_sum_pi_squared`` flag at all
  (verl 0.7.1 ships ``calculate_sum_pi_squared_from_logits`` but its engine never reads
  the flag).
* ``verl.workers.utils.padding.<helper>``, and whether ``verl.utils.attention_utils`` works
  without flash-attn (verl 0.7.1's does not, so its ``left_right_2_no_padding`` cannot run
  on CPU).

What is known to be *wrong* in a verl release is a fact about that release, so
:data:`KNOWN_BUGS` is keyed by version (plus ``"*"`` for every version): a new release
gets no excuse it has not earned, and a fixed bug shows up as "unexpectedly passed".
Each entry has a minimal counterexample in ``spec/engines/verl/README.md``.

Sequence parallelism runs on real ranks (:mod:`spec.execute.ranks`): verl's Ulysses path slices and
all-gathers through a ``torch.distributed`` process group (``verl.utils.ulysses``), so an
``sp > 1`` engine object is built with ``use_ulysses_sp=True``, ``ulysses_sequence_parallel_size``
and ``ulysses_parallel_group`` (the group is read off the ``all_gather`` the suite hands every
engine: :class:`impl.sequence_parallel.TorchDistributedAllGather` has it), and verl's module-level
Ulysses group is set around each call the way verl's ``EngineEvalModeCtx``/``EngineTrainModeCtx``
set it. The harness sends every ``sp > 1`` case of this engine to the real ranks
(:attr:`VerlEngine.sp_on_real_ranks`); the generic strategies still do not draw ``sp > 1`` for verl
(cost), the sequence-parallel invariants force it.

The padded attention mask of verl < 0.8 (built from the response-only ``loss_mask``,
verl issue #6278) is deliberately *not* a known failure: a run against such a verl must
fail, on exactly the invariants of :data:`MASK_INVARIANTS` that apply to it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ...cases.structure import DISTILLATION_KEYS
from ...truth.oracle import LOG_PROB_MIN_CLAMP
from ...protocol.engine import CONTRACT_PRECISION, HELPERS, EngineUnderTest, Precision, ReproSnippet, sp_process_group
from ...protocol.microbatch import MicroBatchLayer
from ...protocol.profile import drawn_config
from ...protocol.step import StepLayer
from ...protocol.vendor import assignments, source
from .microbatch_layer import verl_microbatch_layer
from .profile import PROCESSOR_SWITCHES, PROFILE, release_profile
from .records import known_failures, verl_precision
from .step import STEP_RECORDS, verl_step_layer

__all__ = ["VerlEngine", "VerlEngineObject", "VerlCapabilities", "probe_verl"]



@dataclass(frozen=True)
class VerlCapabilities:
    version: str
    processor: bool  # prepare_model_outputs takes logits_processor_func (top-K distillation)
    bucket: bool  # static pad_to_length bucket
    sum_pi_squared: bool  # calculate_sum_pi_squared is read by prepare_model_outputs
    cu_seqlens: bool  # the engine reads pass_packed_cu_seqlens (packed cu_seqlens in the model inputs)
    helpers: tuple[str, ...]  # padding helpers verl ships
    attention_utils_error: str | None  # why verl.utils.attention_utils cannot run here (0.7.1 without flash-attn)
    #: why verl's own top-K distillation processor (verl.trainer.distillation: distillation_ppo_loss and its
    #: fsdp compute_forward_kl_topk) cannot be the companion here (None: it can; verl 0.7.1 ships no such module)
    own_processor_error: str | None = "not probed"
    #: prepare_model_outputs scales the logits out of place (_scale_logits_by_temperature, after verl 0.7.1,
    #: which divides them in place): the LOGITS_UNTOUCHED convention holds
    logits_untouched: bool = True
    #: extract_multi_modal_inputs pads an audio model's variable-length keys to the longest sample's frames
    #: (_VARLEN_MULTI_MODAL_KEYS, after verl 0.7.1, which concatenates them as they are): audio micro-batches drawn
    pads_audio: bool = True


def _attention_utils_error() -> str | None:
    try:
        from verl.utils.attention_utils import _get_attention_functions

        _get_attention_functions()
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - an unexpected layout: let the helper run and show what happens
        return None
    return None


def probe_verl() -> VerlCapabilities:
    """What the installed verl offers (ImportError when verl is not installed)."""
    import verl
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.utils import padding

    lm = transformer_impl.FSDPEngineWithLMHead
    try:
        source = inspect.getsource(lm.prepare_model_outputs)
    except (OSError, TypeError):  # no source: assume the flag is read, so a missing key is reported
        source = "calculate_sum_pi_squared"
    return VerlCapabilities(
        version=str(getattr(verl, "__version__", "?")),
        processor="logits_processor_func" in inspect.signature(lm.prepare_model_outputs).parameters,
        bucket=hasattr(transformer_impl.FSDPEngine, "_get_packed_pad_size"),
        sum_pi_squared="calculate_sum_pi_squared" in source,
        cu_seqlens="pass_packed_cu_seqlens" in _module_source(transformer_impl),
        helpers=tuple(name for name in HELPERS if callable(getattr(padding, name, None))),
        attention_utils_error=_attention_utils_error(),
        own_processor_error=_own_processor_error(),
        logits_untouched=hasattr(transformer_impl, "_scale_logits_by_temperature"),
        pads_audio=hasattr(importlib.import_module("verl.utils.model"), "_VARLEN_MULTI_MODAL_KEYS"),
    )


#: where verl keeps the top-K distillation processor a real run hands prepare_model_outputs
#: (verl.workers.engine_workers: partial(distillation_ppo_loss, config=actor_config, distillation_config=...))
OWN_PROCESSOR_MODULES = ("verl.trainer.distillation.losses", "verl.trainer.distillation.fsdp.losses")


def _own_processor_error() -> str | None:
    """Why the installed verl's own top-K processor cannot run (its modules and names probed), or None."""
    try:
        losses = importlib.import_module(OWN_PROCESSOR_MODULES[0])
        fsdp = importlib.import_module(OWN_PROCESSOR_MODULES[1])
        from verl.workers.config import DistillationConfig, DistillationLossConfig  # noqa: F401
    except ImportError as exc:
        return f"no verl.trainer.distillation ({type(exc).__name__}: {exc})"
    missing = [name for module, name in ((losses, "distillation_ppo_loss"), (fsdp, "compute_forward_kl_topk"))
               if not callable(getattr(module, name, None))]
    return f"verl.trainer.distillation lacks {missing}" if missing else None


def _module_source(module: Any) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


class VerlEngineObject:
    """One verl engine object behind the suite's calling convention.

    ``prepare_model_outputs(output, output_args, micro_batch, logits_processor_func=None)``
    passes the processor where verl takes one; a verl without the parameter is called with
    three arguments, exactly as its own ``forward_step`` calls it (it then ignores
    ``distillation_use_topk``: the suite reports the missing keys, it does not hide them).
    """

    def __init__(self, engine: Any, caps: VerlCapabilities, ulysses: Any = None):
        self.verl_engine = engine
        self.caps = caps
        self.ulysses = ulysses  # verl.utils.ulysses

    @contextmanager
    def _ulysses_group(self):
        """verl's Ulysses group for the call, as verl's engine mode contexts set it (None when sp = 1)."""
        ulysses = self.ulysses
        if ulysses is None:
            yield
            return
        previous = ulysses.get_ulysses_sequence_parallel_group()
        ulysses.set_ulysses_sequence_parallel_group(getattr(self.verl_engine, "ulysses_parallel_group", None))
        try:
            yield
        finally:
            ulysses.set_ulysses_sequence_parallel_group(previous)

    def prepare_model_inputs(self, micro_batch):
        self._vision_config_for(micro_batch)
        with self._ulysses_group():
            return self.verl_engine.prepare_model_inputs(micro_batch)

    def _vision_config_for(self, micro_batch) -> None:
        """mRoPE position ids come from vision-language models, whose config has a ``vision_config``: verl's
        Ulysses path then pads ids and positions without slicing them (the model slices after the embedding)
        and slices only the labels and temperature. The adapter presents such a config for mRoPE batches
        (verl reads it only when sp > 1) and a text-only one otherwise."""
        config = self.verl_engine.module.config
        if micro_batch["position_ids"].dim() == 3:
            config.vision_config = SimpleNamespace()
        elif hasattr(config, "vision_config"):
            del config.vision_config

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        if hasattr(self.verl_engine.module, "v_head"):
            # a v_head value model's output, as trl's AutoModelForCausalLMWithValueHead returns it: (lm_logits, loss,
            # value), the value head's per-token values (the stand-in's one-column logits) squeezed
            output = (None, None, output.logits.squeeze(-1))
        with self._ulysses_group():
            if self.caps.processor:
                return self.verl_engine.prepare_model_outputs(output, output_args, micro_batch,
                                                              logits_processor_func)
            return self.verl_engine.prepare_model_outputs(output, output_args, micro_batch)

    def __repr__(self) -> str:
        return f"<verl {self.caps.version} {type(self.verl_engine).__name__}>"


@functools.lru_cache(maxsize=None)
def _reads_attention_mask_before_branching(fn: Callable) -> bool:
    """Whether ``no_padding_2_padding`` reads ``data["attention_mask"]`` even for nested input (read from its source
    once per function: :meth:`VerlEngine.helper` asks on every call, and ``inspect.getsource`` re-reads the file)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return 'data["attention_mask"]' in source.split("if prompt_ids.is_nested", 1)[0]


def _with_dense_attention_mask(fn: Callable) -> Callable:
    """Calls verl 0.7.1's ``no_padding_2_padding``, which reads ``data["attention_mask"]`` before
    it branches although its nested branch never uses the value (lengths come from the nested
    ``prompts``/``responses``). In verl's own flow the key is always there: the dense mask that
    ``left_right_2_no_padding`` keeps. The suite's micro-batches are nested from the start, so
    the dense full-length mask is added to a shallow copy when the key is missing. The caller's
    TensorDict is not touched and no value verl computes is changed
    (tests/test_verl_conformance.py checks that the mask's value does not matter)."""

    def no_padding_2_padding(tensor, data):
        if "attention_mask" not in data.keys() and data["prompts"].is_nested:
            lens = (data["input_ids"].offsets().diff() if "input_ids" in data.keys()
                    else data["prompts"].offsets().diff() + data["responses"].offsets().diff())
            cols = torch.arange(int(lens.max()), device=lens.device)
            data = data.copy()
            data.set("attention_mask", (cols.unsqueeze(0) < lens.unsqueeze(1)).to(torch.int64))
        return fn(tensor, data)

    no_padding_2_padding.__wrapped__ = fn  # type: ignore[attr-defined]
    no_padding_2_padding.__doc__ = _with_dense_attention_mask.__doc__
    return no_padding_2_padding


class VerlEngine(EngineUnderTest):
    """The installed verl's FSDP engines (CI runs 0.9.1; 0.7.1 is the pre-#6345 reference)."""

    name = "verl"
    profile = PROFILE  # verl 0.9.1's (a release that divides the logits in place: __init__, release_profile)
    #: sp > 1 needs a real process group: spec.execute.harness sends those cases to real ranks
    sp_on_real_ranks = True
    #: what make() builds around verl's engine object (VeOmni's adds its model type per micro-batch)
    object_class = VerlEngineObject

    def __init__(self) -> None:
        with warnings.catch_warnings():  # verl's engine registry warns about every optional backend it lacks
            warnings.simplefilter("ignore", UserWarning)
            try:
                self.caps = probe_verl()
            except ImportError as exc:
                raise ImportError(f"--engine verl needs verl installed (pip install verl): {exc}") from exc
        from verl.utils import torch_functional as verl_F
        from verl.utils import ulysses
        from verl.workers.engine.fsdp import transformer_impl
        from verl.workers.utils import padding

        self._verl_F = verl_F
        self._ulysses = ulysses
        self._classes = {"lm": transformer_impl.FSDPEngineWithLMHead,
                         "value": transformer_impl.FSDPEngineWithValueHead}
        self._padding = padding
        self.profile = release_profile(self.profile, self.caps)
        self.known_failures = known_failures(self.caps)
        if self.step_layer() is not None:  # the training step's records (spec/engines/verl/step.py)
            self.known_failures = (*self.known_failures, *STEP_RECORDS)

    # -- what this verl lacks, supports, and is known to get wrong ---------------------------
    def _helper_unusable(self, name: str) -> str | None:
        """Why verl's helper ``name`` cannot run here, or None."""
        if name not in self.caps.helpers:
            return f"verl {self.caps.version} ships no verl.workers.utils.padding.{name}"
        if name == "left_right_2_no_padding" and self.caps.attention_utils_error:
            return (f"verl {self.caps.version}'s left_right_2_no_padding calls verl.utils.attention_utils.unpad_input,"
                    f" which needs flash-attn (CUDA only) in this verl: {self.caps.attention_utils_error}")
        return None

    def lacks(self, feature: str) -> str | None:  # type: ignore[override]
        caps = self.caps
        if feature == "chunking" and getattr(self._verl_F, "entropy_from_logits_with_chunking", None) is None:
            return f"verl {caps.version} has no entropy_from_logits_with_chunking"
        if feature == "cu_seqlens" and not caps.cu_seqlens:
            return f"verl {caps.version} never passes cu_seqlens to the model (no pass_packed_cu_seqlens)"
        if feature == "bucket" and not caps.bucket:
            return f"verl {caps.version} has no static pad_to_length bucket"
        if feature == "distillation" and not caps.processor:
            return f"verl {caps.version}: prepare_model_outputs takes no logits_processor_func (no top-K distillation)"
        if feature in HELPERS:
            return self._helper_unusable(feature)
        return super().lacks(feature)  # type: ignore[misc]

    def strategy_limits(self) -> dict[str, Any]:  # type: ignore[override]
        """What a release does not offer, as probed; never what it gets wrong (bf16/fp16 logits and 0.7.1's fused
        kernels, once limited here, are drawn, their differences records of KNOWN_BUGS)."""
        caps = self.caps
        return {"allow_sp": False, "allow_bucket": caps.bucket, "allow_distillation": caps.processor,
                "allow_cu_seqlens": caps.cu_seqlens}

    def precision(self, key: str, case: Any) -> Precision:  # type: ignore[override]
        """:func:`verl_precision`: outputs in the logits' dtype except the packed chunked entropy, the distillation
        terms and fused kernels' values (float32); with verl's own top-K processor (:meth:`logits_processor`)
        student_mass comes back in the logits' dtype (the mass of log-probs taken in it), the KL terms float32 from
        log-probs in it, teacher_mass float32 (the teacher's alone)."""
        low = getattr(case, "logits_dtype", "float32")
        if key in DISTILLATION_KEYS and low != "float32" and self.caps.own_processor_error is None:
            if key == "teacher_mass":
                return CONTRACT_PRECISION
            return Precision(low, low) if key == "student_mass" else Precision("float32", low)
        return verl_precision(key, case)

    # -- companions: verl's own top-K distillation processor --------------------------------------
    def logits_processor(self, case: Any, sp_size: int = 1, sp_rank: int = 0) -> Callable | None:  # type: ignore[override]
        """What a real verl 0.9 run hands ``prepare_model_outputs`` (``verl.workers.engine_workers``):
        ``partial(distillation_ppo_loss, config=<actor config, strategy fsdp>, distillation_config=...)``, its
        ``distillation_loss`` the top-K forward KL with the case's drawn switches (:data:`PROCESSOR_SWITCHES`).
        verl slices the teacher tensors itself under Ulysses SP, reading verl's module-level group, which
        :class:`VerlEngineObject` sets around the call on real ranks (verl never runs SP on the suite's threads:
        :meth:`make` refuses an SP engine without a process group). ``enabled=False``: the processor path reads
        ``distillation_loss`` only (``enabled`` needs teacher models and a resource pool). None where this verl has
        no such processor (the suite's stand-in)."""
        if self.caps.own_processor_error is not None:
            return None
        from functools import partial

        from verl.trainer.distillation.losses import distillation_ppo_loss

        drawn = drawn_config(case)
        switches = (bool(drawn.get("use_chunked_topk", False)), int(drawn.get("chunked_topk_chunk_size", 4096)),
                    drawn.get(LOG_PROB_MIN_CLAMP))
        return partial(distillation_ppo_loss, config=self._actor_config(),
                       distillation_config=self._distillation_config(int(case.topk), *switches))

    def processor_keys(self, case: Any) -> tuple[str, ...] | None:  # type: ignore[override]
        """verl's processor returns all five keys (compute_forward_kl_topk), whatever the case asks."""
        return DISTILLATION_KEYS if self.caps.own_processor_error is None else None

    def companions(self) -> dict[str, str]:  # type: ignore[override]
        why = self.caps.own_processor_error
        return {"logits_processor": "own: verl.trainer.distillation.losses.distillation_ppo_loss (fsdp "
                                    "compute_forward_kl_topk), on one rank and on real ranks (verl's Ulysses group); never on the "
                                    "suite's SP threads: verl's SP runs on real ranks only (one process-global group)"
                if why is None else f"stand-in: verl {self.caps.version} ships no top-K processor of its own ({why})"}

    def _actor_config(self) -> Any:
        if getattr(self, "_actor", None) is None:
            from verl.workers.config import FSDPActorConfig

            self._actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
        return self._actor

    def _distillation_config(self, topk: int, chunked: bool, chunk_size: int, clamp: Any) -> Any:
        cache = self.__dict__.setdefault("_distillation_configs", {})
        key = (topk, chunked, chunk_size, clamp)
        if key not in cache:
            from verl.workers.config import DistillationConfig, DistillationLossConfig

            loss = DistillationLossConfig(loss_mode="forward_kl_topk", topk=topk, use_policy_gradient=False,
                                          log_prob_min_clamp=clamp, use_chunked_topk=chunked,
                                          chunked_topk_chunk_size=chunk_size)
            cache[key] = DistillationConfig(enabled=False, distillation_loss=loss)
        return cache[key]

    # -- engine objects and helpers -----------------------------------------------------------
    def make(self, head: str = "lm", **settings: Any) -> VerlEngineObject:
        sp_size = int(settings.pop("sp_size", 1) or 1)
        sp_rank = settings.pop("sp_rank", 0)
        all_gather = settings.pop("all_gather", None)
        bucket = settings.pop("pad_to_length", None)
        cu_seqlens = bool(settings.pop("pass_cu_seqlens", False))
        chunk = settings.pop("entropy_chunk_size", None)
        checkpointing = bool(settings.pop("entropy_checkpointing", False))
        v_head = bool(settings.pop("v_head", False))
        for switch in PROCESSOR_SWITCHES:  # the processor's (logits_processor reads them off the case), not the engine's
            settings.pop(switch, None)
        for unseen in ("use_torch_compile", "flash_attn_cross_entropy", "tensor_parallel_logits"):
            if settings.pop(unseen, False):
                raise NotImplementedError(f"verl adapter: {unseen}=True is not run by the suite")
        if settings:
            raise TypeError(f"unknown engine settings for verl: {sorted(settings)}")
        group = sp_process_group(sp_size, sp_rank, all_gather, "verl's Ulysses")  # None for sp_size 1
        if bucket and not self.caps.bucket:
            raise NotImplementedError(self.lacks("bucket"))
        eng = object.__new__(self._classes[head])
        # what FSDPEngine.__init__ derives from ulysses_sequence_parallel_size (the group: its device mesh's "sp")
        eng.use_ulysses_sp = sp_size > 1
        eng.ulysses_sequence_parallel_size = sp_size
        eng.ulysses_parallel_group = group
        chunked = getattr(self._verl_F, "entropy_from_logits_with_chunking", None)
        if chunk and chunked is None:
            raise NotImplementedError(self.lacks("chunking"))
        # verl's entropy chunking (engine_config.entropy_from_logits_with_chunking), packed path
        eng.engine_config = SimpleNamespace(entropy_checkpointing=checkpointing,
                                            entropy_from_logits_with_chunking=bool(chunk),
                                            entropy_from_logits_chunk_size=int(chunk or 2048), use_torch_compile=False)
        eng.compute_entropy_from_logits = chunked if chunk else self._verl_F.entropy_from_logits
        # read only for sp > 1 (vision_config: see VerlEngineObject._vision_config_for) and by the value head
        # (v_head absent: an HF token classifier)
        eng.module = SimpleNamespace(config=SimpleNamespace())
        if v_head and head == "value":  # trl's AutoModelForCausalLMWithValueHead: VerlEngineObject hands output[2]
            eng.module.v_head = SimpleNamespace()
        if cu_seqlens and not self.caps.cu_seqlens:
            raise NotImplementedError(self.lacks("cu_seqlens"))
        eng.pass_packed_cu_seqlens = cu_seqlens
        if self.caps.bucket:
            eng.pad_to_length = bool(bucket)
            eng.pad_to_length_bucket = int(bucket) if bucket else 1
        return self.object_class(eng, self.caps, self._ulysses)

    def step_layer(self) -> StepLayer | None:
        """verl's training step: its cut, loss functions and restore (spec/engines/verl/step.py). Declared for the FSDP
        engine only: VeOmni's adapter (a subclass) shares verl's losses and cut, so its step would repeat these checks
        (CI time) on another preparation that its own value invariants already check."""
        if self.name != VerlEngine.name:
            return None
        if not hasattr(self, "_step"):
            self._step = verl_step_layer()
        return self._step

    def microbatch_layer(self) -> MicroBatchLayer | None:
        if not hasattr(self, "_microbatch"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._microbatch = verl_microbatch_layer()
        return self._microbatch

    def helper(self, name: str) -> Callable | None:
        if name not in HELPERS or self._helper_unusable(name):
            return None
        fn = getattr(self._padding, name)
        if name == "no_padding_2_padding" and _reads_attention_mask_before_branching(fn):
            return _with_dense_attention_mask(fn)
        return fn

    def repro_snippet(self, settings: Any) -> ReproSnippet | None:
        """The attribute setup of :meth:`make`, written out against verl's own classes (sequence parallelism
        needs a process group: a snippet only for a reproducer that starts its own ranks, ``real_ranks`` in the
        settings, whose all-gather carries the group). Where this verl ships its own top-K processor (0.9:
        :meth:`logits_processor`), the snippet builds it the same way (:mod:`.repro_processor`) and the file
        hands it the engine; verl 0.7.1 ships none, so its file hands the stand-in it writes out, as the suite does.
        A subclass (VeOmni) keeps the default."""
        if type(self) is not VerlEngine:
            return super().repro_snippet(settings)
        if int(settings.get("sp_size", 1) or 1) > 1 and not settings.get("real_ranks"):
            return None  # verl's Ulysses path needs a process group: only a reproducer that starts real ranks has one
        # verl's own top-K processor where this verl ships it (logits_processor); else the file's stand-in
        own = self.caps.processor and self.caps.own_processor_error is None
        code = "\n".join([
            assignments({"TAKES_PROCESSOR": bool(self.caps.processor), "HAS_BUCKET": bool(self.caps.bucket)}),
            source("spec.engines.verl.repro_snippet"), *([source("spec.engines.verl.repro_processor")] if own else [])])
        return ReproSnippet(code, requires=f"verl=={self.caps.version}")

    def __repr__(self) -> str:
        return f"<engine verl {self.caps.version}>"
