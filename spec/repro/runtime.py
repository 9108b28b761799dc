"""The runtime of a standalone reproducer, the file's plumbing: the micro-batch rebuilt with plain torch +
tensordict, one run of the engine around the suite's stand-in model, the float64 reference (the suite's oracle and
its tolerance rule), which of the invariants' checks runs on which run, who raised a rejection, and ``main``. The
checks themselves are the invariants' own (spec/truth/*_checks.py, written into ``repro_suite.py``); this module
re-states none. A real module, imported by nothing of the suite: the writer (:mod:`.writer`) copies this file beside every
reproducer it writes, as ``repro_runtime.py``, and the reproducer loads it from its own folder.

It imports only the standard library, numpy, torch and tensordict (``tests/test_repro_runtime.py`` runs it with
``spec`` and ``impl`` unimportable). What differs per file it does not hold: the engine (the file's engine block:
``make_engine``, ``helper``, and where the engine gives them ``view_inputs``, ``view_outputs``,
``logits_processor``), the case (:data:`BOUND`'s constants) and the suite's own stand-in model, hand-off, flags,
oracle and checks (``repro_suite.py``, written beside the file from the suite's source by :func:`.templates.suite_module`)
are bound into this module by :func:`share`, which the file calls once before ``main``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

#: the names the file binds here (:func:`share`): its engine block's, its case's, and the suite module's it loads
FROM_FILE = ("make_engine", "helper", "INVARIANT", "CHECK_NAMES", "POISON", "PADDED_LAYOUT", "OUTPUT_SPAN", "RUNS",
             "DATA", "KEYS", "INT32_ATTENTION_MASK", "TAIL_MULTIPLE", "REFUSES", "HEAD_INPUT", "SETTINGS_OFFERED", "MEDIA_MARKS")
#: the engine block's names read only where it defines them
OPTIONAL = ("view_inputs", "view_outputs", "view_recorded_routes", "logits_processor")
#: the suite's pieces (``repro_suite.py``, written out from spec/truth/toy_model.py, spec/execute/handoff.py,
#: harness.py, spec/invariants/settings.py, spec/truth/rules.py and oracle.py)
FROM_SUITE = ("ToyCausalLM", "POISONS", "ThreadedAllGather", "_settings", "_call_model", "_in_threads",
              "execution_context", "BAD_FLAGS", "recode_flags", "bad_settings",
              "TopKProcessor",
              "Expected", "expected_loop",
              # the checks of the hand-off, as the invariants run them (spec/truth/handoff_checks.py)
              "padded_mask", "padded_mask_shape", "mask_dtype_device", "padded_rows", "padding_fill", "packed_inputs",
              "next_token_labels", "rolled_row", "packed_tail", "packed_tail_rule", "tail_fill", "per_token_temperature",
              "padded_temperature", "fused_inputs", "fused_return_dict", "cu_seqlens", "cu_seqlens_host",
              # the checks of what prepare_model_outputs returns (spec/truth/outputs_checks.py), and what they read
              "read_positions", "expected_keys", "output_keys", "oracle_values", "outputs_device_dtype",
              "outputs_carry_grad", "mask_helper",
              # the response slice's checks (spec/truth/slice_checks.py) and the consumers' view they read
              "slice_shape", "slice_values", "slice_reads_only_responses", "response_from_nested_rows",
              "response_round_trip", "slice_dtypes", "consumer_response_view", "response_view",
              # what a call leaves alone (spec/truth/state_checks.py)
              "held", "batch_items", "micro_batch_unchanged", "model_output_unchanged", "output_args_unchanged",
              "handoff_as_fresh", "earlier_kept",
              # the flags and settings (spec/truth/settings_checks.py)
              "same_run", "defaulted_flags", "flag_value", "slice_without_width", "slice_with_width",
              # images and videos: what a model takes of them (spec/protocol/engine.py, spec/truth/vision.py) and the
              # check of what it is handed (spec/truth/media_checks.py)
              "MEDIA_INPUT_KEYS", "media_view", "media_token_ids", "audio_token_id", "samples_media",
              "joined_ids", "media_inputs_handed",
              # an MoE rollout's routed experts: the check of what is handed on, and a micro-batch's routes
              # (spec/truth/routes.py)
              "routes_handed", "routes_record", "routes_of", "without_last_routes", "ROUTES_SWITCH", "ROUTES_RECORDED", "drawn_config")
BOUND = FROM_FILE + OPTIONAL + FROM_SUITE


def share(suite, names):
    """Bind the suite module ``suite``'s names and the file's ``names`` (its globals) here, and every name of this
    module the file does not define into ``names`` (so that code the file adds, the real-rank or end-to-end main,
    reads this module's functions as its own)."""
    mine = globals()
    for source in (vars(suite), names):  # never over a name of this module's own (a private name of the engine's)
        mine.update({k: v for k, v in source.items() if k not in OWN and not (k.startswith("__") and k.endswith("__"))})
    for key, value in list(mine.items()):
        if not (key.startswith("__") and key.endswith("__")) and key not in names:
            names[key] = value
    missing = [name for name in FROM_FILE + FROM_SUITE if name not in mine]
    if missing:
        raise NameError(f"the reproducer binds no {', '.join(missing)} (see repro_runtime.BOUND)")


# ---- the micro-batch, rebuilt with plain torch + tensordict ----
class PadMode(str, Enum):  # verl's DatasetPadMode is a str Enum too
    NO_PADDING = "no_padding"
    RIGHT = "right"
    LEFT_RIGHT = "left_right"


def _tensor(values, dtype, shape):
    if isinstance(values, torch.Tensor):
        return values.to(getattr(torch, dtype)).reshape(shape)
    return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)


def _each_value(items, value):
    """A per-sample stack (``multi_modal_inputs``) of ``items``, each dict's values mapped by ``value``."""
    return NonTensorStack.from_list([NonTensorData({k: value(v) for k, v in item.items()} if isinstance(item, dict)
                                                   else item) for item in items])


def _stack(entries, values):
    """A per-sample stack (``multi_modal_inputs``) from its entries: each dict's tensors rebuilt from ``values``."""
    return _each_value(entries, lambda v: _tensor(values[v["tensor"]], v["dtype"], v["shape"])
                       if isinstance(v, dict) and "tensor" in v else v)


def build_micro_batch(run):
    data, c = run["data"], run["case"]
    values = run["values"] if run["values"] is not None else torch.load(DATA)[run["label"]]
    out = {}
    for key, meta in data["nested"].items():
        vals = _tensor(values[key], meta["dtype"], meta["shape"])
        offsets = torch.tensor(meta["offsets"], dtype=torch.int64)
        axis = meta["ragged_dim"] - 1
        if c["split_view"]:  # a micro-batch split from a mini-batch: the values are a view into a bigger buffer
            buffer = torch.cat([vals.flip(axis), vals], dim=axis)
            vals = buffer.narrow(axis, vals.shape[axis], vals.shape[axis])
        out[key] = torch.nested.nested_tensor_from_jagged(vals, offsets, jagged_dim=meta["ragged_dim"])
    for key, meta in data["dense"].items():
        out[key] = _tensor(values[key], meta["dtype"], meta["shape"])
    td = TensorDict(out, batch_size=[c["batch_size"]])
    for key, entries in data.get("stacks", {}).items():
        td.set(key, _stack(entries, values))
    for key, value in data["flags"].items():
        td.set_non_tensor(key, PadMode(value) if key == "pad_mode" else value)
    return td


# ---- one run: engine inputs -> the stand-in model -> poisoned padding -> engine outputs ----
#: what one rank hands the model and its own output step (the suite's InputsView fields); a key a snippet's
#: view_inputs leaves out reads as None (pad_size as 0; media as the model takes them of the model inputs)
VIEW_KEYS = ("input_ids", "position_ids", "attention_mask", "cu_seqlens", "cu_seqlens_host", "labels", "temperature",
             "pad_size", "model_temperature", "model_labels", "return_dict", "media", "routes")


def _views_in(model_inputs, output_args):
    if "view_inputs" in globals():
        view = dict(view_inputs(model_inputs, output_args))
    else:  # verl's FSDP convention
        labels = output_args.get("input_ids_rmpad_rolled")
        view = {"attention_mask": model_inputs.get("attention_mask"), "input_ids": model_inputs.get("input_ids"),
                "position_ids": model_inputs.get("position_ids"), "cu_seqlens": model_inputs.get("cu_seqlens"),
                "cu_seqlens_host": model_inputs.get("cu_seqlens_cpu"),
                "labels": None if labels is None else labels.reshape(-1),
                "temperature": output_args.get("temperature_rmpad", output_args.get("temperature")),
                "pad_size": int(output_args.get("pad_size", 0) or 0),
                "model_temperature": model_inputs.get("temperature"), "model_labels": model_inputs.get("shift_labels"),
                "return_dict": model_inputs.get("return_dict"), "routes": output_args.get("routes")}
    if view.get("media") is None:  # the images' and videos' keys the model takes, as handed (the suite's media_view)
        view["media"] = media_view(model_inputs)
    return {key: view.get(key, 0 if key == "pad_size" else None) for key in VIEW_KEYS}


def _views_out(outputs):
    """The per-token outputs (the engine block's view, or verl's convention less the recorded routes)."""
    if "view_outputs" in globals():
        return view_outputs(outputs)
    return {key: value for key, value in outputs.items() if key != ROUTES_SWITCH}


def _routes_out(outputs):
    """The routes the engine recorded (router replay's R2: ``routed_experts``), per sample, or None: the engine
    block's ``view_recorded_routes`` where it defines one, else verl's convention."""
    if "view_recorded_routes" in globals():
        return view_recorded_routes(outputs)
    routes = outputs.get(ROUTES_SWITCH)
    return None if routes is None else list(routes.unbind())


#: who raised each exception seen leaving a call (by id): "engine" (the engine's own calls) or "suite" (the
#: stand-in model, the processor handed to the engine); the innermost call's word stands
ORIGINS = {}


def _tag(exc, who):
    ORIGINS.setdefault(id(exc), (exc, who))
    return exc


def origin(exc):
    """Who raised ``exc``: a suite-side exception anywhere in its cause/context chain wins (an engine that re-raises
    the processor's error under its own type has rejected nothing by itself)."""
    seen, link = set(), exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if ORIGINS.get(id(link), (None, None))[1] == "suite":
            return "suite"
        link = link.__cause__ or link.__context__
    return ORIGINS.get(id(exc), (None, None))[1]


def _side(who, fn):
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise _tag(exc, who)
    return call


def _processor(c, r):
    """The logits_processor_func rank r hands its engine: the engine's own (its snippet's logits_processor) where it
    gives one, else the suite's top-K stand-in written out above; what either raises is the suite side's."""
    if not c.distillation_use_topk:
        return None
    own = logits_processor(c, c.sp_size, r) if "logits_processor" in globals() else None
    return _side("suite", own if own is not None else TopKProcessor(tuple(c.distillation_keys)))


def _tensor_fields(output):
    """The model output's tensors by name: its logits, or (a fused head's model) its hidden states and LM-head
    weight."""
    return {k: v for k, v in vars(output).items() if isinstance(v, torch.Tensor)}


def execute(c, mb, poison, inputs_only=False, engines=None, device="cpu"):
    """The engine's calls and the model in the case's autograd context (grad, no_grad or inference_mode), as a
    trainer's policy update or log-prob pass runs them; the micro-batch and the model made outside it.
    ``inputs_only``: prepare_model_inputs alone (what an input check reads); ``engines``: engine objects kept
    across calls (an empty list is filled with the ones built here)."""
    model = ToyCausalLM(c.vocab, seed=c.seed, out_dim=1 if c.head == "value" else None, dtype=c.logits_dtype,
                        device=device, head_input=HEAD_INPUT if c.head == "lm" else "logits")
    with execution_context(c):
        return _execute(c, mb, poison, model, inputs_only, engines)


def _execute(c, mb, poison, model, inputs_only=False, kept=None):
    gather = ThreadedAllGather(c.sp_size) if c.sp_size > 1 else None
    engines = kept if kept else [_side("engine", make_engine)(c.head, **_settings(c, r, gather)) for r in range(c.sp_size)]
    if kept is not None and not kept:
        kept.extend(engines)
    handed = [_side("engine", eng.prepare_model_inputs)(mb) for eng in engines]
    inputs = [mi for mi, _ in handed]
    output_args = [args for _, args in handed]
    views = [_views_in(mi, args) for mi, args in handed]
    if inputs_only:
        return SimpleNamespace(model=model, inputs=inputs, output_args=output_args, views=views, rank_outputs=None)
    args_before = [held(args) for args in output_args]
    model_outputs = _side("suite", _call_model)(model, inputs, c, POISONS[poison], PADDED_LAYOUT)
    outputs_before = [{k: v.detach().clone() for k, v in _tensor_fields(o).items()} for o in model_outputs]
    processors = [_processor(c, r) for r in range(len(engines))]

    def call(eng, r):
        with execution_context(c):  # autograd's mode is per thread: each rank's thread enters it again
            return _side("engine", eng.prepare_model_outputs)(model_outputs[r], output_args[r], mb, processors[r])

    calls = [(lambda eng=eng, r=r: call(eng, r)) for r, eng in enumerate(engines)]
    raw = [calls[0]()] if gather is None else _in_threads(calls, gather)
    return SimpleNamespace(model=model, inputs=inputs, output_args=output_args, views=views, args_before=args_before,
                           model_outputs=model_outputs, outputs_before=outputs_before,
                           rank_outputs=[_views_out(o) for o in raw], rank_routes=[_routes_out(o) for o in raw])


# ---- the reference: the suite's oracle, float64, each sequence alone, with its tolerance rule ----
class OracleCase(SimpleNamespace):
    """The file's case as the oracle reads it (spec/truth/oracle.py reads an EngineCase's ``temperatures()``)."""

    def temperatures(self):
        return tuple(self.per_sample_temperatures)


def reference(c, mb, model):
    """key -> per sequence (expected float64 values, allowed absolute error per token): the suite's oracle on the
    micro-batch (``expected_loop``, written out into repro_suite.py), each key at the precision the engine declares
    for it on this run's path (c.precision: key -> (returns, scaled_in); float32 where absent), by the oracle's rule
    (``Expected.at_precision``), as the suite compares it."""
    case = OracleCase(**{k: v for k, v in vars(c).items() if k != "temperatures"},
                      per_sample_temperatures=c.temperatures)
    exp = expected_loop(case, mb, model)
    declared = getattr(c, "precision", None) or {}
    return {key: list(zip(*exp.at_precision(key, *declared.get(key, ("float32", "float32")))))
            for key, tols in exp.tolerance.items() if tols}


# ---- the checks: each fails (an AssertionError: spec/truth/failing.py) or returns what is wrong, else None ----
def _wanted_keys(c):
    return expected_keys(c.head, c.distillation_only, c.calculate_entropy, c.calculate_sum_pi_squared,
                         c.distillation_keys)


def _rank(run, r):
    return f"(rank {r})" if len(run.rank_outputs) > 1 else ""


def check_keys(c, mb, run):
    """INV-KEYS-001: the output keys the flags ask for; with KEYS, those the invariant asserts among them."""
    for r, outputs in enumerate(run.rank_outputs):
        if not (KEYS and set(KEYS) <= set(outputs)):
            output_keys(outputs, _wanted_keys(c), f"the outputs{' of rank ' + str(r) if r else ''}")


def check_values(c, mb, run):
    """Every output the invariant asserts (KEYS; none given: every key the reference has) against the reference, at
    the positions a consumer reads (the oracle-match loop the invariants run: spec/truth/outputs_checks.py)."""
    want = reference(c, mb, run.model)
    read = read_positions(c.prompt_lens, c.response_lens, OUTPUT_SPAN)
    for r, outputs in enumerate(run.rank_outputs):
        for key in sorted(k for k in want if not KEYS or k in KEYS):
            if key in outputs:  # else check_keys reports it
                wants, tols = zip(*want[key])
                oracle_values(key, outputs[key], list(wants), list(tols), c.seq_lens, read, _rank(run, r))


def check_float32(c, mb, run):
    """INV-DEV-001: on the batch's device, as float32."""
    for outputs in run.rank_outputs:
        outputs_device_dtype(outputs, mb["input_ids"].device)


def _parts(run, key):
    """What every rank's view holds under ``key``, in rank order."""
    return [v[key] for v in run.views]


def check_mask(c, mb, run):
    """INV-MASK-001 (spec/truth/handoff_checks.py, as the invariant runs it)."""
    if not c.use_remove_padding:
        padded_mask(c.prompt_lens, c.response_lens, PADDED_LAYOUT, run.views[0]["attention_mask"])


def check_mask_shape(c, mb, run):
    """INV-MASK-003."""
    if not c.use_remove_padding:
        padded_mask_shape(c.prompt_lens, c.response_lens, PADDED_LAYOUT, run.views[0]["attention_mask"])


def check_mask_dtype(c, mb, run):
    """INV-MASK-002: on the batch's device, int32 where the engine's profile declares it."""
    if not c.use_remove_padding:
        view = run.views[0]
        mask_dtype_device(view["attention_mask"], view["input_ids"], mb["input_ids"].device, INT32_ATTENTION_MASK)


def check_labels(c, mb, run):
    """INV-LABEL-001."""
    next_token_labels(_parts(run, "labels"), mb["input_ids"].values(), c.seq_lens, "inside a sequence")


def check_shard_labels(c, mb, run):
    """INV-LABEL-002, INV-RANK-002."""
    next_token_labels(_parts(run, "labels"), mb["input_ids"].values(), c.seq_lens, f"sp={c.sp_size}: a shard edge")


def check_unchanged(c, mb, run, fresh):
    """INV-MUT-001/002/004 (spec/truth/state_checks.py): the micro-batch (``fresh``: the same built again), the
    model's output (its logits, or hidden states and LM-head weight) and output_args as they were before the engine
    ran."""
    micro_batch_unchanged(batch_items(fresh), batch_items(mb))
    model_output_unchanged([_tensor_fields(out) for out in run.model_outputs], run.outputs_before)
    output_args_unchanged(run.output_args, run.args_before)


def check_slice(c, mb, run):
    """INV-SLICE-001/002: no_padding_2_padding(log_probs) is (B, R), each response token's log-prob (the reference's)."""
    fn = helper("no_padding_2_padding")
    lp = run.rank_outputs[0].get("log_probs")
    if fn is None or lp is None:
        return
    sliced = fn(lp, mb)
    slice_shape(sliced, c.batch_size, c.response_width, c.response_lens, _flag_value(mb, "max_response_len"))
    slice_values(sliced, *_response_log_probs(c, mb, run))


def _response_log_probs(c, mb, run):
    """The reference's (B, R) log-prob of each response token and its tolerance (the oracle's rule)."""
    wants, tols = zip(*reference(c, mb, run.model)["log_probs"])
    return Expected().response_log_probs(c, list(wants), list(tols))


def check_padded_ids(c, mb, run):
    """INV-INPUT-001."""
    if not c.use_remove_padding:
        padded_rows(c.prompt_lens, c.response_lens, PADDED_LAYOUT, mb["input_ids"].unbind(), run.views[0]["input_ids"],
                    "input_ids", "sequence")


def check_padded_positions(c, mb, run):
    """INV-POS-001."""
    if not c.use_remove_padding:
        padded_rows(c.prompt_lens, c.response_lens, PADDED_LAYOUT, mb["position_ids"].unbind(),
                    run.views[0]["position_ids"], "position_ids", "positions")


def check_packed_inputs(c, mb, run):
    """INV-POS-002, INV-RANK-004."""
    if c.use_remove_padding:
        packed_inputs(_parts(run, "attention_mask"), _parts(run, "input_ids"), _parts(run, "position_ids"),
                      mb["position_ids"].values().dim() > 1, mb["input_ids"].values(), mb["position_ids"].values())


def check_media_handed(c, mb, run, fresh):
    """INV-MM-001, INV-MM-003 (spec/truth/media_checks.py): every rank handed the samples' features and grids (audio
    clips: the frames under their masks) in sample order, beside as many media tokens as their merged groups; the samples' own dicts read off the micro-batch built afresh
    (as the suite reads them off the case's draws: what the engine did to its micro-batch cannot move them)."""
    entries = fresh.get("multi_modal_inputs").tolist() if "multi_modal_inputs" in fresh.keys() else []
    groups = {kind: sum(m["tokens"] for items in c.media for m in items if m["kind"] == kind)
              for kind in (*MEDIA_INPUT_KEYS, "audio")}
    joined = joined_ids(_parts(run, "input_ids"), c.total_nnz, run.views[0]["pad_size"])
    media_inputs_handed([(v["input_ids"], v["media"]) for v in run.views], samples_media(entries),
                        *media_token_ids(c.vocab), joined, groups,
                        own_positions=[v["position_ids"] is None for v in run.views],
                        audio_id=audio_token_id(c.vocab) if c.has_audio else None, marks=MEDIA_MARKS)


def check_routes_handed(c, mb, run, fresh):
    """INV-ROUTE-001 (spec/truth/routes.py): every rank hands on each sample's captured routes at its own first tokens,
    in sample order, the others routed to distinct experts; the samples' ids read off the micro-batch built afresh."""
    dtype = drawn_config(c).get(ROUTES_SWITCH)
    if dtype is None:
        print("NOT EXERCISED: the case carries no routed experts")
        return
    for view in run.views:
        routes_handed(view["routes"], list(fresh["input_ids"].unbind()), dtype)


def check_routes_recorded(c, mb, run, fresh):
    """INV-ROUTE-002 (spec/truth/routes.py): under router replay's R2 record, every rank returns each sample's routes
    as its own tokens were routed, in token order; the samples' ids read off the micro-batch built afresh."""
    if drawn_config(c).get(ROUTES_SWITCH) != ROUTES_RECORDED:
        print("NOT EXERCISED: the case records no routes")
        return
    for routes in run.rank_routes:
        routes_record(routes, list(fresh["input_ids"].unbind()))


def check_grad(c, mb, run):
    """INV-GRAD-001: in the policy update (grad enabled, the model's logits require grad) what a loss differentiates
    carries grad."""
    if c.context == "grad":
        outputs_carry_grad(run.rank_outputs)


# ---- the hand-off checks (what prepare_model_inputs hands the model and its own output step) ----
def _flag_value(mb, key, default=None):
    return flag_value(mb, key) if key in mb.keys() else default


def check_ids_fill(c, mb, run):
    """INV-INPUT-002."""
    if not c.use_remove_padding:
        padding_fill(c.prompt_lens, c.response_lens, PADDED_LAYOUT, run.views[0]["input_ids"],
                     int(_flag_value(mb, "pad_token_id", 0)), "input_ids")


def check_positions_fill(c, mb, run):
    """INV-POS-003."""
    if not c.use_remove_padding:
        padding_fill(c.prompt_lens, c.response_lens, PADDED_LAYOUT, run.views[0]["position_ids"], 0, "position_ids")


def check_tail(c, mb, run):
    """INV-PAD-001."""
    if c.use_remove_padding:
        packed_tail(_parts(run, "input_ids"), _parts(run, "position_ids"), run.views[0]["pad_size"], c.total_nnz,
                    c.pad_to_length, c.sp_size, TAIL_MULTIPLE, mb["position_ids"].values().dim() > 1)


def check_tail_rule(c, mb, run):
    """INV-PAD-003."""
    if c.use_remove_padding and TAIL_MULTIPLE is not None:
        packed_tail_rule(_parts(run, "input_ids"), c.total_nnz, c.pad_to_length, c.sp_size, TAIL_MULTIPLE)


def check_tail_fill(c, mb, run):
    """INV-PAD-002."""
    if c.use_remove_padding:
        tail_fill(_parts(run, "input_ids"), _parts(run, "temperature"), c.total_nnz, c.pad_to_length, c.sp_size,
                  TAIL_MULTIPLE)


def check_rolled_row(c, mb, run):
    """INV-LABEL-003."""
    if c.use_remove_padding:
        rolled_row(_parts(run, "labels"), mb["input_ids"].values())


def _token_temperatures_of(c):
    return torch.repeat_interleave(torch.tensor(c.temperatures, dtype=torch.float32), torch.tensor(c.seq_lens))


def check_token_temperature(c, mb, run):
    """INV-TEMP-004."""
    if c.use_remove_padding:
        per_token_temperature(_parts(run, "temperature"), _token_temperatures_of(c))


def check_padded_temperature(c, mb, run):
    """INV-TEMP-005."""
    if not c.use_remove_padding:
        padded_temperature(run.views[0]["temperature"], torch.tensor(c.temperatures, dtype=torch.float32),
                           _token_temperatures_of(c))


def check_fused_inputs(c, mb, run):
    """INV-FUSED-001."""
    fused_inputs(_parts(run, "model_temperature"), _parts(run, "model_labels"), _parts(run, "labels"),
                 c.temperatures[0], c.use_remove_padding)


def check_return_dict(c, mb, run):
    """INV-FUSED-002."""
    fused_return_dict(_parts(run, "return_dict"))


def check_cu_seqlens(c, mb, run):
    """INV-CU-001."""
    if c.use_remove_padding:
        cu_seqlens(_parts(run, "cu_seqlens"), _parts(run, "input_ids"), c.seq_lens)


def check_cu_seqlens_cpu(c, mb, run):
    """INV-CU-002."""
    if c.use_remove_padding:
        cu_seqlens_host(_parts(run, "cu_seqlens_host"), _parts(run, "input_ids"), c.seq_lens)


# ---- the response-slice helpers, on per-token tensors built from the seed (spec/truth/slice_checks.py) ----
def _need(name):
    fn = helper(name)
    if fn is None:
        raise RuntimeError(f"the engine snippet's helper({name!r}) is None: this reproducer needs it")
    return _side("engine", fn)


def _drawn(c):
    return {"seed": c.seed, "prompt_lens": c.prompt_lens, "response_lens": c.response_lens, "width": c.response_width}


def check_slice_reads(c, mb, run):
    """INV-SLICE-003."""
    slice_reads_only_responses(_need("no_padding_2_padding"), mb, **_drawn(c))


def check_from_nested(c, mb, run):
    """INV-SLICE-004."""
    response_from_nested_rows(_need("response_from_nested"), mb["response_mask"], **_drawn(c))


def check_round_trip(c, mb, run):
    """INV-SLICE-005."""
    response_round_trip(_need("no_padding_2_padding"), _need("response_to_nested"), _need("response_from_nested"), mb,
                        mb["response_mask"], **_drawn(c))


def check_slice_dtypes(c, mb, run):
    """INV-DTYPE-001."""
    slice_dtypes(_need("no_padding_2_padding"), _need("response_to_nested"), _need("response_from_nested"), mb,
                 mb["response_mask"], **_drawn(c))


def check_mask_helper(c, mb, run):
    """INV-MASK-004 (spec/truth/handoff_checks.py)."""
    mask_helper(_need("build_attention_mask_from_nested"), mb["input_ids"], c.seq_lens, INT32_ATTENTION_MASK)


#: every framework's consumer view of a per-token output (spec/protocol/engine.py: completion_view and action_view
#: are response_view)
VIEW_NAMES = ("response_view", "completion_view", "action_view")


def check_response_values(c, mb, run):
    """INV-SLICE-006: the (B, R) log-probs a PPO/GRPO loss reads, in every framework's consumer view."""
    lp = run.rank_outputs[0].get("log_probs")
    if lp is None:
        return "got no 'log_probs', expected them (the flags ask for them)"
    views = [(name, response_view) for name in VIEW_NAMES]
    consumer_response_view(lp, mb, views, *_response_log_probs(c, mb, run), c.response_lens, c.total_nnz, c.prompt_lens)


# ---- flags and settings: defaults, other spellings (spec/truth/settings_checks.py), bad values ----
def _same_run(got, want, what):
    same_run(got.inputs, got.output_args, got.rank_outputs[0], want.inputs, want.output_args, want.rank_outputs[0],
             what)


def _sliced(mb, run):
    fn = helper("no_padding_2_padding")
    lp = run.rank_outputs[0].get("log_probs")
    return None if fn is None or lp is None else fn(lp, mb)


def check_flags_default(c, mb, run):
    """INV-FLAG-001: without the flags at their defaults, the same hand-off and outputs (and the reference's)."""
    dropped = defaulted_flags(mb, c.response_lens)
    if not dropped:
        print("NOT EXERCISED: no flag holds its default")
        return None
    bare = mb.copy()
    for key in dropped:
        del bare[key]
    other = execute(c, bare, POISON)
    _same_run(other, run, f"without the flags {dropped} (at their defaults)")
    problem = check_keys(c, bare, other) or check_values(c, bare, other)
    if problem or "max_response_len" not in dropped or _sliced(mb, run) is None:
        return problem
    slice_without_width(_sliced(bare, run), _sliced(mb, run))


def check_flags_recoded(c, mb, run):
    """INV-FLAG-002: the flags spelled as 0/1 ints, numpy scalars, a plain str: the same hand-off and outputs."""
    recoded = mb.copy()
    written = recode_flags(recoded, c.seed % 2)
    other = execute(c, recoded, POISON)
    _same_run(other, run, f"flags spelled as {', '.join(f'{k}={v!r}' for k, v in written.items())}")
    width = flag_value(mb, "max_response_len") if "max_response_len" in mb.keys() else None
    if width is not None and _sliced(recoded, run) is not None:
        slice_with_width(_sliced(recoded, run), c.batch_size, int(width), written["max_response_len"])


def _says(exc):
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _refused_by(call, what):
    """None when the engine's own call (``call``) raised, else what happened instead: it returned (no exception), or
    only the stand-in model or processor failed on what the engine accepted (the suite's attribution:
    spec/execute/attribution.py)."""
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - classified
        if origin(exc) == "engine":
            print(f"  ok: {what}: the engine raised {_says(exc)}")
            return None
        return (f"{what}: the engine accepted it; only the stand-in model or processor then failed ({_says(exc)}); "
                "expected the engine to raise")
    got = f"outputs {sorted(result.rank_outputs[0])}" if getattr(result, "rank_outputs", None) else "a result"
    return f"{what}: got {got} (no exception), expected the engine to raise a clear exception"


def _rejected(c, mb, what):
    """The whole run of ``mb`` refused by the engine (:func:`_refused_by`)."""
    return _refused_by(lambda: execute(c, mb, POISON), what)


def check_bad_flags(c, mb, run):
    for key, bad in BAD_FLAGS:
        copy = mb.copy()
        copy.set_non_tensor(key, bad)
        problem = _rejected(c, copy, f"flag {key}={bad!r}")
        if problem:
            return problem
    return None


def check_rejects_pad_mode(c, mb, run):
    copy = mb.copy()
    copy.set_non_tensor("pad_mode", PadMode.RIGHT if c.seed % 2 else PadMode.LEFT_RIGHT)
    return _rejected(c, copy, f"pad_mode={copy['pad_mode']!r}")


def check_rejects(c, mb, run):
    what = ("use_fused_kernels with a per-sample temperature tensor" if c.use_fused_kernels
            else f"bucket={c.pad_to_length} with top-K distillation" if c.distillation_use_topk and c.pad_to_length
            else "this micro-batch")
    return _rejected(c, mb, what)


def check_refused(c, mb, run):
    """INV-FLAG-004/005: each setting the engine's profile declares unsupported (REFUSES) is refused by every call
    that reads it: the whole preparation, and prepare_model_outputs alone handed a valid run's model output and
    output_args (the micro-batch layer's postprocess_batch_func is the suite's to try)."""
    if not REFUSES:
        print("NOT EXERCISED: the engine's profile declares no unsupported setting")
        return None
    engines = []
    valid = execute(c, mb, POISON, engines=engines)
    eng = engines[0]
    problem = None
    if "pad_mode" in REFUSES:
        with execution_context(c):
            _, output_args = _side("engine", eng.prepare_model_inputs)(mb)
        for mode in (PadMode.LEFT_RIGHT, PadMode.RIGHT):
            bad = mb.copy()
            bad.set_non_tensor("pad_mode", mode)
            what = f"pad_mode={mode.value}"
            problem = problem or _refused_by(lambda: _side("engine", eng.prepare_model_inputs)(bad),
                                             f"prepare_model_inputs with {what}")
            with execution_context(c):
                problem = problem or _refused_by(lambda: _side("engine", eng.prepare_model_outputs)(
                    valid.model_outputs[0], output_args, bad, _processor(c, 0)),
                    f"prepare_model_outputs (a valid run's model output and output_args) with {what}")
    if "sum_pi_squared_fused" in REFUSES and c.head == "lm":
        bad = mb.copy()
        bad.set_non_tensor("use_fused_kernels", True)
        bad.set_non_tensor("calculate_sum_pi_squared", True)
        problem = problem or _rejected(c, bad, "use_fused_kernels with calculate_sum_pi_squared")
    if "temperature_nonpositive" in REFUSES:
        for value in (0.0, -1.0):
            bad = mb.copy()
            bad.set_non_tensor("temperature", value)
            problem = problem or _rejected(c, bad, f"temperature={value}")
    if "routes_misaligned" in REFUSES and routes_of(mb) is not None and len(c.prompt_lens) > 1:
        problem = problem or _rejected(c, without_last_routes(mb), "routed experts missing the last sample's")
    if "bucket_distillation" in REFUSES and c.head == "lm" and c.use_remove_padding:
        bad = mb.copy()
        bad.set_non_tensor("distillation_use_topk", True)
        bucket = c.total_nnz + 1
        problem = problem or _refused_by(_side("engine", lambda: make_engine(c.head, pad_to_length=bucket)
                                               .prepare_model_inputs(bad)),
                                         f"pad_to_length={bucket} with distillation_use_topk")
    return problem


def check_bad_settings(c, mb, run):
    """INV-SET-001: each impossible setting the invariant tries rejected, by the constructor or the first call."""
    for bad in bad_settings(c, tuple(SETTINGS_OFFERED)):
        problem = _refused_by(_side("engine", lambda: make_engine(c.head, **bad).prepare_model_inputs(mb)),
                              f"engine settings {bad}")
        if problem:
            return problem
    return None


# ---- on a GPU ----
def check_on_cuda(c, mb, run):
    """The same micro-batch on a CUDA device: what the CPU run gives, each output against the reference (the
    stand-in model's weights are drawn on the CPU, so both devices run the same model)."""
    if not torch.cuda.is_available():
        raise NotStandalone("INV-DEV-002 compares a CUDA run with the CPU's: this machine has no CUDA device")
    try:
        on_device = mb.to("cuda")
        for key in ("multi_modal_inputs",) if "multi_modal_inputs" in mb.keys() else ():  # its dicts' tensors too
            on_device.set(key, _each_value(mb.get(key).tolist(),
                                           lambda v: v.to("cuda") if isinstance(v, torch.Tensor) else v))
    except Exception as exc:  # noqa: BLE001 - the file's own copy failed, not the engine
        raise NotStandalone(f"could not copy the micro-batch to cuda ({type(exc).__name__}: {exc})") from exc
    on_cuda = execute(c, on_device, POISON, device="cuda")
    for r, outputs in enumerate(on_cuda.rank_outputs):
        for key, value in outputs.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cuda":
                return f"rank {r}: {key!r} of the CUDA run: got it on {value.device}, expected it on the batch's device"
    on_cuda.rank_outputs = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in o.items()}
                            for o in on_cuda.rank_outputs]
    on_cuda.model = run.model  # the reference reads the CPU copy of the same weights
    try:
        check_keys(c, mb, on_cuda)
        check_values(c, mb, on_cuda)
    except AssertionError as exc:  # a failed check of the CUDA run
        return f"on cuda: {exc}"
    return None


# ---- an engine object kept across micro-batches, as a trainer keeps it (spec/truth/state_checks.py) ----
def run_reused(before, case_run):
    """The micro-batch ``before`` then the case through one engine object; what the first returned, held as it was
    then; the case's run through a fresh engine object."""
    c0, c = SimpleNamespace(**before["case"]), SimpleNamespace(**case_run["case"])
    engines = []
    first = execute(c0, build_micro_batch(before), POISON, engines=engines)
    kept = {"outputs": held(first.rank_outputs[0]), "inputs": held(first.views[0])}
    second = execute(c, build_micro_batch(case_run), POISON, engines=engines)
    fresh = execute(c, build_micro_batch(case_run), POISON)
    return c, first, kept, second, fresh


def check_reused(c, mb, runs):
    """INV-BATCH-003: the hand-off as a fresh engine's; the outputs the reference's."""
    first, kept, second, fresh = runs
    handoff_as_fresh(second.views[0], fresh.views[0], second.rank_outputs[0], fresh.rank_outputs[0])
    return check_keys(c, mb, second) or check_values(c, mb, second)


def check_earlier_kept(c, mb, runs):
    """INV-MUT-005."""
    first, kept, second, fresh = runs
    earlier_kept(first.rank_outputs[0], kept["outputs"], first.views[0], kept["inputs"])


CHECKS = {"padded_ids": check_padded_ids, "padded_positions": check_padded_positions,
          "packed_inputs": check_packed_inputs, "keys": check_keys, "values": check_values, "float32": check_float32,
          "mask": check_mask, "mask_shape": check_mask_shape, "mask_dtype": check_mask_dtype,
          "labels": check_labels, "shard_labels": check_shard_labels, "slice": check_slice, "grad": check_grad, "ids_fill": check_ids_fill,
          "positions_fill": check_positions_fill, "tail": check_tail, "tail_rule": check_tail_rule, "tail_fill": check_tail_fill,
          "rolled_row": check_rolled_row, "token_temperature": check_token_temperature,
          "padded_temperature": check_padded_temperature, "fused_inputs": check_fused_inputs,
          "return_dict": check_return_dict, "cu_seqlens": check_cu_seqlens, "cu_seqlens_cpu": check_cu_seqlens_cpu,
          "slice_reads": check_slice_reads, "from_nested": check_from_nested, "round_trip": check_round_trip,
          "slice_dtypes": check_slice_dtypes, "mask_helper": check_mask_helper, "response_values": check_response_values,
          "flags_default": check_flags_default, "flags_recoded": check_flags_recoded, "bad_flags": check_bad_flags,
          "rejects_pad_mode": check_rejects_pad_mode, "rejects": check_rejects, "bad_settings": check_bad_settings, "refused": check_refused,
          "reused": check_reused, "earlier_kept": check_earlier_kept, "on_cuda": check_on_cuda,
          "routes_handed": check_routes_handed, "routes_recorded": check_routes_recorded}
#: checks that need no run of the case (the helpers on tensors built here; the rejections run the engine themselves)
NO_RUN = {"slice_reads", "from_nested", "round_trip", "slice_dtypes", "mask_helper", "bad_flags", "rejects_pad_mode",
          "rejects", "bad_settings", "refused"}
#: checks that read what prepare_model_inputs handed over, and nothing after it
INPUTS_ONLY = {"padded_ids", "padded_positions", "packed_inputs", "mask", "mask_shape", "mask_dtype", "labels",
               "shard_labels", "ids_fill", "positions_fill", "tail", "tail_rule", "tail_fill", "rolled_row",
               "token_temperature", "padded_temperature", "fused_inputs", "return_dict", "cu_seqlens", "cu_seqlens_cpu",
               "media_handed", "routes_handed"}
#: checks that also read the micro-batch built afresh (what the engine was handed, untouched)
WITH_FRESH = {"unchanged": check_unchanged, "media_handed": check_media_handed, "routes_handed": check_routes_handed,
              "routes_recorded": check_routes_recorded}
#: checks of one engine object kept across RUNS[0] and then RUNS[1] (the case)
REUSED = {"reused", "earlier_kept"}


class NotStandalone(Exception):
    """This reproducer cannot check the property standalone (exit 2)."""


def _fail(name, label, problem):
    print(f"FAIL {INVARIANT} ({name}) on {label}: {problem}")
    return 1


def _own_error(exc):
    """The file's own mistake (a name it lacks), not the engine's: exit 3, never a reproduction."""
    print(f"REPRODUCER ERROR: {type(exc).__name__}: {exc} (in this file's own code, not the engine's)")
    traceback.print_exc()
    return 3


def _raised(label, exc, what):
    if isinstance(exc, ImportError):  # this environment lacks a module the engine needs: never a reproduction
        print(f"{INVARIANT} on {label}: not run: {type(exc).__name__}: {exc} (install what Needs above says)",
              file=sys.stderr)
        raise exc
    print(f"FAIL {INVARIANT} on {label}: got {type(exc).__name__}: {exc} ({what}: traceback below), expected outputs "
          "(the micro-batch is valid)")
    traceback.print_exc()
    return 1


def _run_checks(c, mb, result, fresh, label):
    """Each check on the run; 0 when all hold, 1 at the first that fails, 3 on the file's own error."""
    for name in CHECK_NAMES:
        try:
            problem = WITH_FRESH[name](c, mb, result, fresh) if name in WITH_FRESH else CHECKS[name](c, mb, result)
        except NotStandalone:
            raise
        except AssertionError as exc:  # the check's own failure (spec/truth/failing.py), not the engine's assertion
            if origin(exc) is None:
                return _fail(name, label, str(exc))
            return _raised(label, exc, f"raised in the check {name!r}: by the engine or a helper of it")
        except (NameError, UnboundLocalError) as exc:
            if origin(exc) is None:
                return _own_error(exc)
            return _raised(label, exc, f"raised in the check {name!r}: by the engine or a helper of it")
        except RuntimeError as exc:
            if "this reproducer needs it" in str(exc):
                raise NotStandalone(str(exc)) from exc
            return _raised(label, exc, f"raised in the check {name!r}: by the engine or a helper of it")
        except Exception as exc:  # noqa: BLE001 - the engine (or its helper) failed on a valid input
            return _raised(label, exc, f"raised in the check {name!r}: by the engine or a helper of it")
        if problem:
            return _fail(name, label, problem)
    print(f"ok: {label}: {', '.join(CHECK_NAMES)}")
    return 0


def _main():
    names = set(CHECK_NAMES)
    if names & REUSED:
        before, case_run = RUNS
        label = f"{case_run['label']} after {before['label']} through the same engine object"
        try:
            c, *runs = run_reused(before, case_run)
        except Exception as exc:  # noqa: BLE001 - the engine rejected a valid micro-batch
            if isinstance(exc, NameError) and origin(exc) is None:
                return _own_error(exc)
            return _raised(label, exc, "raised by the engine, or by the stand-in model fed what the engine handed it")
        code = _run_checks(c, build_micro_batch(case_run), runs, None, label)
        if code:
            return code
    else:
        for run in RUNS:
            c = SimpleNamespace(**run["case"])
            mb, fresh = build_micro_batch(run), build_micro_batch(run)
            result = None
            if not names <= NO_RUN:
                try:
                    result = execute(c, mb, POISON, inputs_only=names <= NO_RUN | INPUTS_ONLY)
                except Exception as exc:  # noqa: BLE001 - the engine rejected a valid micro-batch
                    if isinstance(exc, NameError) and origin(exc) is None:
                        return _own_error(exc)
                    return _raised(run["label"], exc, "raised by the engine, or by the stand-in model fed what the "
                                   "engine handed it")
            code = _run_checks(c, mb, result, fresh, run["label"])
            if code:
                return code
    print(f"PASS: {INVARIANT} holds on this case")
    return 0


def main():
    try:
        return _main()
    except NotStandalone as exc:
        print(f"NOT STANDALONE: {exc}")
        return 2


#: this module's own names: :func:`share` binds none of the file's over them
OWN = frozenset(globals())
