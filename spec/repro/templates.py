"""The code blocks a standalone reproducer is made of.

The stand-in model, the hand-off around it (the padding poisoned, sequence-parallel ranks in threads) and
the top-K processor are the suite's own code, written out from their source (:func:`suite_blocks`), so a
reproducer's model is the model the suite ran. The reference (float64, per sequence, with the oracle's
tolerance rule), the micro-batch builder, the checks and ``main`` are :data:`RUNTIME`, written for the file
and importing nothing of the suite.
"""

from __future__ import annotations

import inspect
import re

from ..execute import handoff, harness
from ..protocol.engine import PaddedLayout
from ..truth import oracle, rules, toy_model

__all__ = ["suite_blocks", "RUNTIME", "PREAMBLE"]

PREAMBLE = '''from __future__ import annotations

import contextlib
import math
import sys
import threading
import traceback
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import torch
from tensordict import TensorDict
'''


def _module_body(module) -> str:
    """A module's source without its docstring, ``__future__`` import, ``__all__`` and imports (the preamble
    has them)."""
    source = inspect.getsource(module)
    source = re.sub(r'^""".*?"""\n', "", source, count=1, flags=re.S)
    keep = [line for line in source.splitlines()
            if not line.startswith(("from __future__", "__all__", "import ", "from "))]
    return "\n".join(keep).strip() + "\n"


def suite_blocks() -> str:
    """The suite's stand-in model, hand-off and processor, as source."""
    parts = ["# ---- the stand-in model (the suite's spec/truth/toy_model.py, written out) ----",
             "from functools import lru_cache", "", _module_body(toy_model),
             "# ---- the hand-off around the model (spec/execute/handoff.py, harness.py), written out ----",
             "POISONS = {" + ", ".join(f"{k!r}: float({str(v)!r})" for k, v in handoff.POISONS.items()) + "}", ""]
    for fn in (PaddedLayout, rules.layout_width, rules.layout_mask, handoff.ThreadedAllGather, handoff._settings,
               handoff._poison_padded, handoff._poison_tail, handoff._fields, handoff._per_token, handoff._shared,
               handoff.check_model_inputs, handoff.execution_context, handoff._tracked, handoff._call_model,
               handoff.rank_outputs, harness._in_threads):
        parts += [inspect.getsource(fn), ""]
    parts += ["# ---- the top-K distillation processor the suite hands the engine (spec/truth/oracle.py) ----"]
    for fn in (oracle._overlap, oracle._overlap_terms, oracle.topk_terms, oracle.TopKProcessor):
        parts += [inspect.getsource(fn), ""]
    return "\n".join(parts)


RUNTIME = r'''
# ---- the micro-batch, rebuilt with plain torch + tensordict ----
class PadMode(str, Enum):  # verl's DatasetPadMode is a str Enum too
    NO_PADDING = "no_padding"


def _tensor(values, dtype, shape):
    if isinstance(values, torch.Tensor):
        return values.to(getattr(torch, dtype)).reshape(shape)
    return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)


def build_micro_batch(run):
    data, c = run["data"], run["case"]
    values = run["values"] if run["values"] is not None else torch.load(Path(__file__).with_suffix(".pt"))[run["label"]]
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
    for key, value in data["flags"].items():
        td.set_non_tensor(key, PadMode(value) if key == "pad_mode" else value)
    return td


# ---- one run: engine inputs -> the stand-in model -> poisoned padding -> engine outputs ----
def _views_in(model_inputs, output_args):
    if "view_inputs" in globals():
        return view_inputs(model_inputs, output_args)
    labels = output_args.get("input_ids_rmpad_rolled")
    return {"attention_mask": model_inputs.get("attention_mask"), "input_ids": model_inputs.get("input_ids"),
            "position_ids": model_inputs.get("position_ids"), "labels": None if labels is None else labels.reshape(-1)}


def _views_out(outputs):
    return view_outputs(outputs) if "view_outputs" in globals() else dict(outputs)


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def execute(c, mb, poison):
    """The engine's calls and the model in the case's autograd context (grad, no_grad or inference_mode), as a
    trainer's policy update or log-prob pass runs them; the micro-batch and the model made outside it."""
    model = ToyCausalLM(c.vocab, seed=c.seed, out_dim=1 if c.head == "value" else None, dtype=c.logits_dtype)
    with execution_context(c):
        return _execute(c, mb, poison, model)


def _execute(c, mb, poison, model):
    gather = ThreadedAllGather(c.sp_size) if c.sp_size > 1 else None
    engines = [make_engine(c.head, **_settings(c, r, gather)) for r in range(c.sp_size)]
    handed = [eng.prepare_model_inputs(mb) for eng in engines]
    inputs = [mi for mi, _ in handed]
    output_args = [args for _, args in handed]
    views = [_views_in(mi, args) for mi, args in handed]
    args_before = [_copy(args) for args in output_args]
    model_outputs = _call_model(model, inputs, c, POISONS[poison])
    logits_before = [o.logits.detach().clone() for o in model_outputs]
    processor = TopKProcessor(tuple(c.distillation_keys)) if c.distillation_use_topk else None

    def call(eng, r):
        with execution_context(c):  # autograd's mode is per thread: each rank's thread enters it again
            return eng.prepare_model_outputs(model_outputs[r], output_args[r], mb, processor)

    calls = [(lambda eng=eng, r=r: call(eng, r)) for r, eng in enumerate(engines)]
    raw = [calls[0]()] if gather is None else _in_threads(calls, gather)
    return SimpleNamespace(model=model, inputs=inputs, output_args=output_args, views=views, args_before=args_before,
                           model_outputs=model_outputs, logits_before=logits_before,
                           rank_outputs=[_views_out(o) for o in raw])


# ---- the reference: float64, each sequence alone, with the suite's tolerance rule ----
EPS = torch.finfo(torch.float32).eps
SAFETY = 32.0


def _bound(cond, value, vocab):
    return SAFETY * EPS * (cond + (1.0 + value.abs()) * math.log2(vocab + 1))


def reference(c, mb, model):
    """key -> per sequence (expected float64 values, allowed absolute error per token)."""
    ids, positions = mb["input_ids"].unbind(), mb["position_ids"].unbind()
    want = {}
    for i in range(c.batch_size):
        seq_pos = positions[i]
        pos = seq_pos.unsqueeze(-2) if seq_pos.dim() == 2 else seq_pos.unsqueeze(0)
        logits = model.logits(ids[i].unsqueeze(0), pos).squeeze(0)
        if c.head == "value":
            v = logits[:, 0].double()
            want.setdefault("values", []).append((v, _bound(v.abs(), v, 1)))
            continue
        temp = torch.tensor(c.temperatures[i], dtype=torch.float32).clamp(min=1e-8)
        z32 = logits.float() / temp
        z = z32.double()
        vocab = z.shape[-1]
        lsm = torch.log_softmax(z, dim=-1)
        p = lsm.exp()
        absz = z.abs()
        labels = ids[i][1:]
        lp = lsm[:-1].gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        cond = absz[:-1].gather(-1, labels.unsqueeze(-1)).squeeze(-1) + (p * absz).sum(-1)[:-1]
        if not c.distillation_only:
            want.setdefault("log_probs", []).append((lp, _bound(cond, lp, vocab)))
        if c.calculate_entropy:
            ent = -(p * lsm).sum(-1)
            cond = (p * (lsm + ent.unsqueeze(-1)).abs() * absz).sum(-1)
            want.setdefault("entropy", []).append((ent, _bound(cond, ent, vocab)))
        if c.calculate_sum_pi_squared:
            spq = (p * p).sum(-1)
            cond = (2 * p * (p - spq.unsqueeze(-1)).abs() * absz).sum(-1)
            want.setdefault("sum_pi_squared", []).append((spq, _bound(cond, spq, vocab)))
        if c.distillation_use_topk:
            terms = topk_terms(z32, mb["teacher_ids"].unbind()[i], mb["teacher_logprobs"].unbind()[i])
            cond = (absz.max(-1).values + 1.0) * (1 + c.topk)
            for key in c.distillation_keys:
                want.setdefault(key, []).append((terms[key], _bound(cond, terms[key], vocab)))
    return want


# ---- the checks: each returns None when right, else what is wrong (got vs expected) ----
def expected_keys(c):
    if c.head == "value":
        return {"values"}
    keys = set() if c.distillation_only else {"log_probs"}
    keys |= {"entropy"} if c.calculate_entropy else set()
    keys |= {"sum_pi_squared"} if c.calculate_sum_pi_squared else set()
    return keys | set(c.distillation_keys)


def _first_bad(got, want, tol):
    bad = ~((got == want) | ((got - want).abs() <= tol))
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        return t, int(bad.sum())
    return None


def check_keys(c, mb, run):
    for r, outputs in enumerate(run.rank_outputs):
        got, want = set(outputs), expected_keys(c)
        if got != want:
            return f"rank {r}: got output keys {sorted(got)}, expected {sorted(want)} (what the flags ask for)"
    return None


def check_values(c, mb, run):
    want = reference(c, mb, run.model)
    for r, outputs in enumerate(run.rank_outputs):
        for key in sorted(want):
            if key not in outputs:
                continue  # check_keys reports it
            value = outputs[key]
            if not (isinstance(value, torch.Tensor) and value.is_nested):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                return f"rank {r}: {key!r}: got {shape}, expected a nested tensor of {c.batch_size} sequences"
            seqs = value.unbind()
            if len(seqs) != c.batch_size:
                return f"rank {r}: {key!r}: got {len(seqs)} sequences, expected {c.batch_size}"
            for i, (seq, (exp, tol)) in enumerate(zip(seqs, want[key])):
                seq = seq.detach().to("cpu", torch.float64)
                if seq.dim() != 1 or seq.shape[0] != c.seq_lens[i]:
                    return f"rank {r}: {key!r} of sequence {i}: got shape {tuple(seq.shape)}, expected ({c.seq_lens[i]},)"
                bad = _first_bad(seq[: exp.shape[0]], exp, tol)
                if bad is not None:
                    t, count = bad
                    return (f"rank {r}: {key!r} of sequence {i} at token {t}: got {seq[t].item():.8g}, expected "
                            f"{exp[t].item():.8g} (|diff| {abs(seq[t].item() - exp[t].item()):.3g} > allowed "
                            f"{tol[t].item():.3g}; {count} of {exp.shape[0]} tokens differ)")
    return None


def check_float32(c, mb, run):
    for r, outputs in enumerate(run.rank_outputs):
        for key, value in sorted(outputs.items()):
            if isinstance(value, torch.Tensor) and value.dtype != torch.float32:
                return f"rank {r}: {key!r}: got dtype {value.dtype}, expected torch.float32"
    return None


def check_mask(c, mb, run):
    if c.use_remove_padding:
        return None
    mask = run.views[0]["attention_mask"]
    if mask is None:
        return "padded mode: got attention_mask None, expected (B, max_seq_len) int32"
    width = max(c.seq_lens)
    if tuple(mask.shape) != (c.batch_size, width):
        return f"attention_mask: got shape {tuple(mask.shape)}, expected {(c.batch_size, width)}"
    want = (torch.arange(width).unsqueeze(0) < torch.tensor(c.seq_lens).unsqueeze(1)).to(torch.int64)
    got = mask.detach().to("cpu", torch.int64)
    for i in range(c.batch_size):
        if not torch.equal(got[i], want[i]):
            return (f"attention_mask row {i}: got {got[i].tolist()}, expected {want[i].tolist()} (sequence length "
                    f"{c.seq_lens[i]}, response length {c.response_lens[i]})")
    if mask.dtype != torch.int32:
        return f"attention_mask: got dtype {mask.dtype}, expected torch.int32"
    return None


def check_labels(c, mb, run):
    labels = [v["labels"] for v in run.views]
    if any(lab is None for lab in labels):
        return None if not c.use_remove_padding else "got no labels handed to the output step, expected the rolled ids"
    labels = torch.cat([lab.reshape(-1).cpu() for lab in labels])
    ids = mb["input_ids"].values().cpu()
    ends = torch.tensor(c.seq_lens).cumsum(0) - 1
    for k in range(ids.shape[0] - 1):
        if k in ends.tolist():
            continue
        if int(labels[k]) != int(ids[k + 1]):
            return (f"label at packed position {k}: got {int(labels[k])}, expected {int(ids[k + 1])} (the next "
                    f"token of its sequence; ids {ids.tolist()}, labels {labels[: ids.shape[0]].tolist()})")
    return None


def _same(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.is_nested or b.is_nested:
            return a.is_nested and b.is_nested and torch.equal(a.offsets(), b.offsets()) and _same(a.values(), b.values())
        return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all()
                                                                    if a.is_floating_point() else torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and (a == b if not isinstance(a, torch.Tensor) else False)


def check_unchanged(c, mb, run, fresh):
    for key in fresh.keys():
        if key not in mb.keys():
            return f"micro-batch key {key!r}: got it removed, expected it unchanged"
        a, b = mb.get(key), fresh.get(key)
        a, b = getattr(a, "data", a), getattr(b, "data", b)
        if not _same(a, b):
            return f"micro-batch key {key!r}: got it changed by the engine, expected it unchanged"
    if set(mb.keys()) != set(fresh.keys()):
        return f"micro-batch keys: got {sorted(mb.keys())}, expected {sorted(fresh.keys())}"
    for r, (out, before) in enumerate(zip(run.model_outputs, run.logits_before)):
        if not _same(out.logits, before):
            return f"rank {r}: model output 'logits': got them modified in place by prepare_model_outputs, expected them unchanged"
    for r, (args, before) in enumerate(zip(run.output_args, run.args_before)):
        for key in before:
            if key not in args or not _same(args[key], before[key]):
                return f"rank {r}: output_args[{key!r}]: got it changed or removed by prepare_model_outputs, expected it unchanged"
    return None


def check_slice(c, mb, run):
    fn = helper("no_padding_2_padding")
    if fn is None:
        return None
    lp = run.rank_outputs[0].get("log_probs")
    if lp is None:
        return None
    got = fn(lp, mb).detach().to("cpu", torch.float64)
    if tuple(got.shape) != (c.batch_size, c.response_width):
        return f"no_padding_2_padding(log_probs): got shape {tuple(got.shape)}, expected {(c.batch_size, c.response_width)}"
    want = reference(c, mb, run.model)["log_probs"]
    for i, (exp, tol) in enumerate(want):
        p, r = c.prompt_lens[i], c.response_lens[i]
        exp_row, tol_row = exp[p - 1: p - 1 + r], tol[p - 1: p - 1 + r]  # response token j is scored at p - 1 + j
        bad = _first_bad(got[i, :r], exp_row, tol_row)
        if bad is not None:
            t, count = bad
            return (f"no_padding_2_padding(log_probs)[{i}, {t}]: got {got[i, t].item():.8g}, expected "
                    f"{exp_row[t].item():.8g} (the log-prob of response token {t}; {count} of {r} differ)")
        if bool((got[i, r:] != 0).any()):
            return f"no_padding_2_padding(log_probs)[{i}, {r}:]: got {got[i, r:].tolist()}, expected zeros past the response"
    return None


def _first_row_diff(got, want):
    bad = (got != want).nonzero()
    return tuple(int(i) for i in bad[0]) if bad.numel() else None


def check_inputs(c, mb, run):
    """The ids and positions the model is handed: packed (1, n) / (1, n) or (4, 1, n), the ranks' slices joined;
    padded (B, L) / (B, L) or (4, B, L), each sample's own tokens and positions first in its row."""
    views = run.views
    if any(v.get("input_ids") is None for v in views):
        return None
    seq_ids, seq_pos = mb["input_ids"].unbind(), mb["position_ids"].unbind()
    mrope = seq_pos[0].dim() == 2
    if c.use_remove_padding:
        ids = torch.cat([v["input_ids"].cpu() for v in views], dim=-1)
        if ids.dim() != 2 or ids.shape[0] != 1:
            return f"packed input_ids: got shape {tuple(ids.shape)}, expected (1, n)"
        want = mb["input_ids"].values().cpu()
        at = _first_row_diff(ids[0, : want.shape[0]], want)
        if at is not None or ids.shape[1] < want.shape[0]:
            return f"packed input_ids: got {ids[0].tolist()}, expected {want.tolist()} first (then any tail padding)"
        if any(v.get("position_ids") is None for v in views):
            return "packed position_ids: got None, expected the packed positions"
        pos = torch.cat([v["position_ids"].cpu() for v in views], dim=-1)
        want_shape = (4, 1) if mrope else (1,)
        if tuple(pos.shape[:-1]) != want_shape:
            return f"packed position_ids: got shape {tuple(pos.shape)}, expected {(*want_shape, 'n')}"
        want_pos = torch.cat(list(seq_pos), dim=-1).cpu()
        got_pos = pos[:, 0, : want_pos.shape[-1]] if mrope else pos[0, : want_pos.shape[-1]]
        at = _first_row_diff(got_pos, want_pos)
        if at is not None:
            return f"packed position_ids at {at}: got {got_pos[at].item()}, expected {want_pos[at].item()}"
        return None
    ids, pos = views[0]["input_ids"].cpu(), views[0].get("position_ids")
    width = max(c.seq_lens)
    if tuple(ids.shape) != (c.batch_size, width):
        return f"padded input_ids: got shape {tuple(ids.shape)}, expected {(c.batch_size, width)}"
    for i, seq in enumerate(seq_ids):
        n = seq.shape[0]
        if not torch.equal(ids[i, :n], seq.cpu()):
            return f"padded input_ids row {i}: got {ids[i].tolist()}, expected {seq.tolist()} first (then padding)"
    if pos is None:
        return "padded position_ids: got None, expected (B, L) or (4, B, L)"
    pos = pos.cpu()
    want_shape = (4, c.batch_size, width) if mrope else (c.batch_size, width)
    if tuple(pos.shape) != want_shape:
        return f"padded position_ids: got shape {tuple(pos.shape)}, expected {want_shape}"
    for i, sp in enumerate(seq_pos):
        n = sp.shape[-1]
        got = pos[:, i, :n] if mrope else pos[i, :n]
        if not torch.equal(got, sp.cpu()):
            return f"padded position_ids of sample {i}: got {got.tolist()}, expected {sp.tolist()}"
    return None


def check_grad(c, mb, run):
    # the policy update (grad enabled, the model's logits require grad): what a loss differentiates carries grad
    if c.context != "grad":
        return None
    for r, outputs in enumerate(run.rank_outputs):
        for key in ("log_probs", "entropy", "sum_pi_squared", "values"):
            if key in outputs and not outputs[key].requires_grad:
                return (f"rank {r}: {key!r}: got requires_grad=False, expected True (the model's logits require "
                        "grad; detached, the loss gets no gradient through it)")
    return None


CHECKS = {"inputs": check_inputs, "keys": check_keys, "values": check_values, "float32": check_float32, "mask": check_mask,
          "labels": check_labels, "slice": check_slice, "grad": check_grad}


def main():
    for run in RUNS:
        c = SimpleNamespace(**run["case"])
        mb, fresh = build_micro_batch(run), build_micro_batch(run)
        try:
            result = execute(c, mb, POISON)
        except Exception as exc:  # noqa: BLE001 - the engine rejected a valid micro-batch
            print(f"FAIL {INVARIANT} on {run['label']}: got {type(exc).__name__}: {exc} (raised by the engine, or by the "
                  "stand-in model fed what the engine handed it: traceback below), expected outputs (the "
                  "micro-batch is valid)")
            traceback.print_exc()
            return 1
        for name in CHECK_NAMES:
            problem = check_unchanged(c, mb, result, fresh) if name == "unchanged" else CHECKS[name](c, mb, result)
            if problem:
                print(f"FAIL {INVARIANT} ({name}) on {run['label']}: {problem}")
                return 1
        print(f"ok: {run['label']}: {', '.join(CHECK_NAMES)}")
    print(f"PASS: {INVARIANT} holds on this case")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
