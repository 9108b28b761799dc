"""The adapter kit: what adapting a real trainer takes beyond the protocol (docs/writing-an-adapter.md, "The kit").

* :func:`inputs_seen_by_model` and :func:`replaying`: for an engine that calls the model inside its own
  ``forward`` (OpenRLHF's ``Actor.forward``). The suite runs the model between its two steps, so such a forward
  runs twice: once with a model that records what it is handed and stops the forward (the input step), once
  with a model that returns the harness's output (the output step); :func:`calls_seen_by_model` records every call
  of a forward that calls the model a chunk of rows at a time.
* :func:`stub_imports`: heavy module-level imports stubbed strictly (:mod:`spec.engines.kit.stubs`): a stub's name
  that nobody declared raises when the code under test calls it or tests its truth, so a stub cannot change
  the code under test unnoticed; the names libraries call at import time have well-known values, declared once
  (:data:`spec.engines.kit.stubs.WELL_KNOWN`: availability probes False, JIT/remote decorators that return what they
  decorate, ...), and :attr:`ThirdPartyEngine.stub_values` declares a library's own.
* :class:`ThirdPartyEngine`: the engine class of a library that offers one LM head and no engine settings:
  ``lacks`` from one table of reasons, ``strategy_limits`` derived from it, ``make`` refusing any setting.
* :class:`HiddenStatesModel`: for a library that patches a Hugging Face model's LM head (a fused head), a model
  whose backbone returns the hidden states the harness's model computed and whose LM head holds its weight wherever
  such heads look for it (``model.model.lm_head.weight`` too, inside a :class:`GatheredParameters` no-op gather).
* :func:`refuse_flags`: the micro-batch flags a library has no option for, refused with a clear error;
  :func:`require`: a library imported, or an ImportError saying how to install it.
* :func:`import_library` (:meth:`ThirdPartyEngine.load`): a library's modules imported with its heavy imports
  stubbed (:func:`spec.engines.kit.stubs.library_imports`), packages imported without their ``__init__``
  (:func:`spec.engines.kit.stubs.without_init`), flash-attn's pure-torch ``bert_padding`` installed first where asked
  (:func:`install_bert_padding`); whatever fails, one ImportError naming the wheel and the CI step installing it.
* :func:`rows_view`: the hand-off of an engine that hands the model dense rows and scores them shifted by one
  (OpenRLHF's and SkyRL's forward); :func:`in_logits_dtype`: the precision of an engine computing in the logits'
  dtype.

Known-failure records that match on structured fields (``output``, ``position``, ``mechanism``) rather than
message regexes are :class:`spec.protocol.known.KnownFailure`'s own.
"""

from __future__ import annotations

import importlib
import sys
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, Callable, Mapping
from unittest import mock

import torch

from ...protocol import EngineUnderTest, Feature, InputsView, Precision
from ...protocol.engine import media_view
from ...protocol.errors import ModelNotCalled, StopForward
from .stubs import GatheredParameters, StubReport, import_with_stubs, library_imports, without_init

__all__ = ["inputs_seen_by_model", "calls_seen_by_model", "replaying", "ModelOutput", "stub_imports", "ThirdPartyEngine", "refuse_flags",
           "ModelNotCalled", "require", "HiddenStatesModel", "import_library", "install_bert_padding", "rows_view",
           "in_logits_dtype", "GatheredParameters", "stub_values"]


def require(module_name: str, how: str) -> Any:
    """``module_name`` imported, or an ImportError that says what the adapter needs and ``how`` to install it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"this adapter needs {module_name}: {how} ({exc})") from exc


class _Recorder:
    def __init__(self, positional: tuple[str, ...]):
        self.positional, self.inputs = positional, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > len(self.positional):
            raise TypeError(f"the model was called with {len(args)} positional arguments; name them: "
                            f"inputs_seen_by_model(..., positional=(...))")
        self.inputs = {**dict(zip(self.positional, args)), **kwargs}
        raise StopForward


def inputs_seen_by_model(forward: Callable[[Callable[..., Any]], Any],
                         positional: tuple[str, ...] = ("input_ids",)) -> dict[str, Any]:
    """Run ``forward(model)`` (the engine's own forward, given a model) with a model that records the keyword
    arguments it is handed (positional ones under the names ``positional``) and stops the forward there: the
    model inputs exactly as the engine builds them. Nothing of the forward after the model call runs."""
    recorder = _Recorder(positional)
    try:
        forward(recorder)
    except StopForward:
        return recorder.inputs
    raise ModelNotCalled("the engine's forward returned without calling the model")


class _CallRecorder(_Recorder):
    def __init__(self, positional: tuple[str, ...], reply: Callable[[dict[str, Any]], Any]):
        super().__init__(positional)
        self.reply, self.calls = reply, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            super().__call__(*args, **kwargs)
        except StopForward:
            self.calls.append(self.inputs)
        return self.reply(self.inputs)


def calls_seen_by_model(forward: Callable[[Callable[..., Any]], Any], reply: Callable[[dict[str, Any]], Any],
                        positional: tuple[str, ...] = ("input_ids",)) -> list[dict[str, Any]]:
    """As :func:`inputs_seen_by_model`, for an engine that calls the model more than once (a chunk of rows at a time,
    TRL's GRPO scoring): run ``forward(model)`` to its end with a model that records each call's keyword arguments
    and answers ``reply(inputs)``; every call's inputs, in order."""
    recorder = _CallRecorder(positional, reply)
    forward(recorder)
    if not recorder.calls:
        raise ModelNotCalled("the engine's forward returned without calling the model")
    return recorder.calls


class ModelOutput(dict):
    """A ``transformers.ModelOutput``-like result: ``output["logits"]`` and ``output.logits`` both work, and an
    engine may set fields either way."""

    def __getattr__(self, key: str) -> Any:
        return self.get(key)

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def replaying(output: Any) -> Callable[..., ModelOutput]:
    """A model for the second run of the engine's forward: whatever it is handed, it returns the harness's
    ``output`` (the toy model's, run on the recorded inputs) as a :class:`ModelOutput`."""
    result = ModelOutput(vars(output))
    return lambda *args, **kwargs: result


def stub_imports(module_name: str, packages: tuple[str, ...],
                 values: Mapping[str, Mapping[str, object]] | None = None) -> Any:
    """``module_name`` imported with the modules of ``packages`` it imports at module level stubbed where they do
    not import here, strictly (:class:`spec.engines.kit.stubs.StrictModule`): ``values[module][name]`` declares what
    the code under test may use (``{"transformers": {"is_npu_available": lambda: False}}``); any other name raises
    :class:`spec.engines.kit.stubs.StubError` when used. Returns the module."""
    report: StubReport = import_with_stubs(module_name, packages, {k: dict(v) for k, v in (values or {}).items()},
                                           strict=True)
    return report.module


def install_bert_padding(engine: str) -> None:
    """flash-attn 2.8.3's pure-torch ``bert_padding.py`` (installed as ``flash_attn_bert_padding``,
    .ci/steps/bert_padding.py) as ``flash_attn.bert_padding``; ``flash_attn`` itself stays an empty package stub
    (its CUDA kernels do not import: ``import flash_attn.ops...`` still fails, as on a machine without them)."""
    try:
        import flash_attn_bert_padding
    except ImportError as exc:
        raise ImportError(f"--engine {engine} needs flash-attn 2.8.3's bert_padding.py installed as the module "
                          "flash_attn_bert_padding (.ci/steps/bert_padding.py)") from exc
    if not isinstance(sys.modules.get("flash_attn.bert_padding"), type(flash_attn_bert_padding)):
        sys.modules.setdefault("flash_attn", mock.MagicMock(name="flash_attn", __path__=[], __spec__=None))
        sys.modules["flash_attn.bert_padding"] = flash_attn_bert_padding


@lru_cache(maxsize=None)
def import_library(engine: str, modules: tuple[str, ...], heavy: tuple[str, ...], *, wheel: str, ci_step: str,
                   without: tuple[str, ...] = (), bert_padding: bool = False, strict: bool = True,
                   values: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()) -> tuple[Any, ...]:
    """The library of ``--engine engine``: ``modules`` imported in order (``"module"`` or ``"module:attribute"``,
    :func:`spec.engines.kit.stubs.library_imports`), the packages of ``heavy`` stubbed where they do not import here
    (``strict``: :class:`spec.engines.kit.stubs.StrictModule` stubs, else ``MagicMock``), the packages ``without``
    imported without their ``__init__`` (:func:`spec.engines.kit.stubs.without_init`), flash-attn's ``bert_padding``
    installed first if ``bert_padding`` (:func:`install_bert_padding`), ``values`` (``((module, ((name, value),
    ...)), ...)``, hashable: :func:`stub_values`) declared on the stubs beside the well-known ones
    (:data:`spec.engines.kit.stubs.WELL_KNOWN`). Any ImportError or AttributeError on the way becomes one ImportError:
    ``--engine engine needs <wheel> (<ci_step>): <why>``. Cached once it succeeds."""
    if bert_padding:
        install_bert_padding(engine)
    try:
        for package in without:
            without_init(package)
        return tuple(library_imports(modules, heavy, strict=strict,
                                     values={module: dict(names) for module, names in values}))
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"--engine {engine} needs {wheel} ({ci_step}): {exc}") from exc


def stub_values(values: Mapping[str, Mapping[str, object]]) -> tuple[tuple[str, tuple[tuple[str, object], ...]], ...]:
    """``{module: {name: value}}`` as the hashable form :func:`import_library` caches on."""
    return tuple(sorted((module, tuple(sorted(names.items()))) for module, names in values.items()))


def rows_view(model_inputs: Mapping[str, Any], output_args: Mapping[str, Any]) -> InputsView:
    """The hand-off of an engine whose ``output_args`` hold the dense rows it runs (``sequences``, ``attention_mask``:
    OpenRLHF's and SkyRL's forward take them so) and that scores each real token's next column: the model's inputs
    as handed, the labels those rows rolled by one, token by token (``view_inputs = staticmethod(rows_view)``), and
    the routed experts it collated for router replay (``output_args["routes"]``, one tensor per sample), where any."""
    labels = torch.roll(output_args["sequences"], -1, 1)[output_args["attention_mask"].bool()]
    return InputsView(model_inputs["input_ids"], model_inputs.get("position_ids"), model_inputs["attention_mask"],
                      labels=labels, media=media_view(model_inputs), routes=output_args.get("routes"))


def in_logits_dtype(key: str, case: Any) -> Precision:
    """The precision of an engine that takes every output from the logits in their own dtype and returns it so
    (``precision = staticmethod(in_logits_dtype)``; the value checks then hold it to that dtype's rounding)."""
    return Precision(case.logits_dtype, case.logits_dtype)


#: strategy limits of :meth:`ThirdPartyEngine.strategy_limits`: the feature each key of the case strategy draws
_LIMITS = {"allow_sp": Feature.SP, "allow_bucket": Feature.BUCKET, "allow_fused": Feature.FUSED,
           "allow_distillation": Feature.DISTILLATION, "allow_cu_seqlens": Feature.CU_SEQLENS,
           "allow_chunking": Feature.CHUNKING, "allow_sum_pi_squared": Feature.SUM_PI_SQUARED}


class ThirdPartyEngine(EngineUnderTest):
    """A library's LM-head preparation with no engine settings. Set ``library`` (for messages), ``offers`` (the
    features it has beyond running at all, on CUDA and the media its profile lists), ``reasons`` (why not, for features it lacks; the rest get
    "<library> has no <feature>"), and implement :meth:`engine_object`."""

    library = "this library"
    offers: frozenset[Feature] = frozenset()
    reasons: Mapping[Feature, str] = {}
    #: what :meth:`load` imports (:func:`import_library`): the pip requirement and the CI step installing it (for
    #: the ImportError), the modules in order, the heavy packages stubbed, the packages whose ``__init__`` is not
    #: run, whether flash-attn's ``bert_padding`` is installed first, strict or ``MagicMock`` stubs
    wheel, ci_step = "", ""
    modules: tuple[str, ...] = ()
    heavy: tuple[str, ...] = ()
    without_init: tuple[str, ...] = ()
    bert_padding, strict_stubs = False, True
    #: values of stub names the library uses at import time, beyond the well-known ones the kit declares for every
    #: adapter (:data:`spec.engines.kit.stubs.WELL_KNOWN`: availability probes False, JIT/remote decorators that return
    #: what they decorate, ...): ``{"lib.module": {"name": value}}``
    stub_values: Mapping[str, Mapping[str, object]] = {}
    #: the value model a training step's value loss runs (``make("value")``), where the library has one apart from its
    #: LM engine (OpenRLHF's critic forward); None: ``make`` refuses a value head
    value_model: Callable[[], Any] | None = None

    def engine_object(self, **config: Any) -> Any:
        """The library's engine object; ``config``: the values of its own switches drawn for the case
        (:meth:`config_space`), where it declares any."""
        raise NotImplementedError

    def load(self) -> tuple[Any, ...]:
        """The library's :attr:`modules` (each the module, or its attribute for ``"module:attribute"``), imported
        once by :func:`import_library` with this class's settings."""
        return import_library(self.name, self.modules, self.heavy, wheel=self.wheel, ci_step=self.ci_step,
                              without=self.without_init, bert_padding=self.bert_padding, strict=self.strict_stubs,
                              values=stub_values(self.stub_values))

    def load_library(self) -> None:
        """:meth:`load` (a reply from a real rank may name the library's objects: the parent imports them so)."""
        self.load()

    def make(self, head: str = "lm", **settings: Any) -> Any:
        """The engine object, handed the library's own switches drawn for the case (:meth:`config_space`: each by its
        name, ``engine_object(**{name: value})``); any suite setting is refused. A value head with no settings is
        :attr:`value_model`'s, where the adapter declares one."""
        if head == "value" and not settings and self.value_model is not None:
            return self.value_model()
        switches = {switch.name for switch in self.config_space() if switch.setting is None}
        config = {key: settings.pop(key) for key in list(settings) if key in switches}
        if head != "lm" or any(v not in (None, False, 0, 1) for k, v in settings.items() if k != "sp_rank"):
            raise NotImplementedError(f"{self.name}: an LM head, no engine settings (asked {head}, {settings})")
        return self.engine_object(**config)

    def lacks(self, feature: "str | Feature") -> str | None:
        feature = Feature.parse(feature)
        # media, a tail rule, routed experts: what its profile (and its switches) declare
        declared = {Feature.ENGINE, Feature.CUDA, Feature.MEDIA, Feature.AUDIO, Feature.TAIL_RULE, Feature.ROUTES}
        if feature in declared | set(self.offers):
            return super().lacks(feature)
        return self.reasons.get(feature, f"{self.library} has no {feature.value}")

    def strategy_limits(self) -> dict[str, Any]:
        """Draw only what it offers (per-sample temperatures: both kinds where offered, else one float)."""
        per_sample = None if self.lacks(Feature.PER_SAMPLE_TEMPERATURE) is None else False
        return {**{key: self.lacks(feature) is None for key, feature in _LIMITS.items()},
                "per_sample_temperature": per_sample}


def refuse_flags(flags: Any, library: str,
                 names: tuple[str, ...] = ("use_fused_kernels", "distillation_use_topk", "calculate_sum_pi_squared")
                 ) -> Any:
    """Raise NotImplementedError for each of ``names`` set in ``flags`` (``impl.flags.BatchFlags``): options
    ``library`` does not have. Returns ``flags``."""
    for name in names:
        if getattr(flags, name):
            raise NotImplementedError(f"{name}: {library} has no such option")
    return flags


class _Head(torch.nn.Module):
    """An LM head holding the fused-head protocol's weight (``weight``, ``bias=None``), as ``nn.Linear`` reads."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight, self.bias = weight, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)


class _Backbone(torch.nn.Module):
    """The backbone a fused head calls (``model.base_model(...)``, ``model.model(...)``): it returns the harness's
    hidden states as ``last_hidden_state``; it also holds the LM head, for heads that look for it there
    (``model.model.lm_head.weight``, where ``model`` is a trainer's wrapper whose ``.model`` is the causal LM)."""

    def __init__(self, hidden: torch.Tensor, head: _Head):
        super().__init__()
        self.hidden, self.lm_head, self.served = hidden, head, 0

    def forward(self, *args, **kwargs):
        ids, rows = kwargs.get("input_ids", args[0] if args else None), self.hidden.shape[0]
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] < rows:
            # a library scoring its rows a chunk at a time, in order (TRL's GRPO): the next chunk's hidden states
            start, self.served = self.served % rows, self.served + ids.shape[0]
            return SimpleNamespace(last_hidden_state=self.hidden[start:start + ids.shape[0]])
        return SimpleNamespace(last_hidden_state=self.hidden)

    def get_output_embeddings(self) -> _Head:
        return self.lm_head


class HiddenStatesModel(torch.nn.Module):
    """What a library's fused LM head patches (TRL's ``add_fused_lm_head``), in the shape of a Hugging Face causal
    LM: ``base_model(...)`` and ``model(...)`` (the backbone) return ``last_hidden_state=hidden``; the LM head holding
    ``weight`` (the harness's ``hidden_states`` and ``lm_head_weight``, the fused-head protocol) is wherever such
    heads look for it: ``get_output_embeddings()``, ``lm_head``, ``model.lm_head`` (a wrapper's ``.model``: the
    head read as ``model.model.lm_head.weight``), an ``nn.Module`` whose weight may be gathered in a context manager
    (deepspeed's ``GatheredParameters``: :class:`GatheredParameters`, a no-op here, where nothing is partitioned).
    ``backbone``, where given, is the backbone instead (a recorder of what the library hands it). Its own
    ``forward`` (what a patched head falls back to unpatched: TRL's without ``fused_lm_head``) returns the head's
    logits of the backbone's hidden states, as a causal LM does."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, backbone: Callable[..., Any] | None = None):
        super().__init__()
        self.config = SimpleNamespace(get_text_config=lambda: self.config, model_type="stand-in")
        self.lm_head = _Head(weight)
        self.model = self.base_model = backbone or _Backbone(hidden, self.lm_head)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, *args, **kwargs):
        return SimpleNamespace(logits=self.lm_head(self.base_model(*args, **kwargs).last_hidden_state))
