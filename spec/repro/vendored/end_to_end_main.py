"""The end-to-end reproducer's main (INV-MB-015; :mod:`spec.repro.end_to_end`): the saved mini-batch cut by the
layer's ``prepare_micro_batches``, every micro-batch through one engine object (the engine-case runtime's
``execute``), the outputs joined by ``postprocess_batch_func`` (or the layer's ``concat_nested_tensors`` and
``restore_dynamic_batch``), every sample against the float64 reference of the whole mini-batch in its own place.
Vendored after the engine-case file's code (its runtime's names, bound by ``share``) and the layer's call
(:mod:`.layer_call`)."""

from __future__ import annotations

import sys
import traceback
from types import SimpleNamespace

import torch

#: what the file binds for this module: the mini-batch's settings and whole case, the saved mini-batch, the layer's
#: functions and call, the suite's micro_batch_rows, and the engine-case runtime's names (bound by share)
BOUND = ("CASE", "WHOLE", "MINI", "INVARIANT", "POISON", "cut", "context", "Wrong", "micro_batch_rows",
         "postprocess_batch_func", "concat_nested_tensors", "restore_dynamic_batch", "execute", "verdict", "ToyCausalLM",
         "reference", "expected_keys", "read_span", "_first_bad", "origin", "_own_error")


def subset(whole, rows):
    """The engine case of the samples ``rows`` (in that order): a micro-batch's case (spec's EngineCase.subset)."""
    part = dict(whole)
    for key in ("prompt_lens", "response_lens", "seq_lens", "temperatures"):
        part[key] = [whole[key][i] for i in rows]
    part.update(batch_size=len(rows), total_nnz=sum(part["seq_lens"]), response_width=max(part["response_lens"]))
    return SimpleNamespace(**part)


def end_to_end(mini):
    """Every sample's outputs after the cut, the engine and postprocess vs the reference: None, or what is wrong."""
    micro, indices = cut(mini)
    rows = micro_batch_rows(micro, indices)
    if len(rows) != len(micro):
        return f"{len(micro)} micro-batches but {len(rows)} index lists"
    flat = sorted(i for part in rows for i in part)
    if flat != list(range(CASE["batch_size"])):
        return f"micro-batch indices {rows}: no partition of the {CASE['batch_size']} samples"
    kept, output_lst = [], []  # one engine object for the whole mini-batch, as a trainer keeps it
    for part, mb in zip(rows, micro):
        run = execute(subset(WHOLE, part), mb, POISON, engines=kept)
        output_lst.append({"model_output": dict(run.rank_outputs[0])})
    with context():
        if "postprocess_batch_func" in globals():
            outputs = postprocess_batch_func(output_lst=output_lst, indices=indices, data=mini)["model_output"]
        else:
            outputs = {}
            for key in output_lst[0]["model_output"]:
                joined = concat_nested_tensors([o["model_output"][key] for o in output_lst])
                outputs[key] = joined if indices is None else restore_dynamic_batch(joined, indices)
    c = SimpleNamespace(**WHOLE)
    model = ToyCausalLM(c.vocab, seed=c.seed, out_dim=1 if c.head == "value" else None, dtype=c.logits_dtype)
    want = reference(c, mini, model)
    sizes = [len(part) for part in rows]
    keys = expected_keys(c)
    for key in [k for k in ("log_probs", "entropy") if k in keys] + sorted(keys - {"log_probs", "entropy"}):
        if key not in outputs:
            return f"output key {key!r} missing after postprocess (keys {sorted(outputs)})"
        got = outputs[key]
        if not isinstance(got, torch.Tensor) or not got.is_nested or int(got.size(0)) != c.batch_size:
            return (f"{key!r} after postprocess: {getattr(got, 'shape', type(got).__name__)}, expected nested over "
                    f"{c.batch_size} samples")
        for i, (seq, (exp, tol)) in enumerate(zip(got.unbind(), want[key])):
            seq = seq.detach().to("cpu", torch.float64)
            if seq.shape[0] != c.seq_lens[i]:
                return f"{key!r} of sample {i}: {seq.shape[0]} tokens, expected {c.seq_lens[i]} (another sample's?)"
            lo, hi = read_span(c, i)
            bad = _first_bad(seq[lo:hi], exp[lo:hi], tol[lo:hi])
            if bad is not None:
                t = lo + bad[0]
                return (f"{key!r} of sample {i} (micro-batches of {sizes} samples) at token {t}: got "
                        f"{seq[t].item():.8g}, expected {exp[t].item():.8g} (allowed {tol[t].item():.3g}; "
                        f"{bad[1]} of its {hi - lo} tokens differ)")
    return None


def main():
    mini = torch.load(MINI, weights_only=False)
    try:
        problem = end_to_end(mini)
    except Wrong as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - the layer or the engine failed on a valid mini-batch
        if isinstance(exc, NameError) and origin(exc) is None:
            return _own_error(exc)
        print(f"FAIL {INVARIANT}: got {type(exc).__name__}: {exc} (raised by the layer, the engine, or the stand-in "
              "model fed what the engine handed it: traceback below), expected outputs (the mini-batch is valid)")
        traceback.print_exc()
        return 1
    return verdict(problem, "this mini-batch")


if __name__ == "__main__":
    sys.exit(main())
