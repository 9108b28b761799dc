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
BOUND = ("CASE", "WHOLE", "MINI", "INVARIANT", "POISON", "OUTPUT_SPAN", "cut", "context", "micro_batch_rows",
         "postprocess_batch_func", "concat_nested_tensors", "restore_dynamic_batch", "execute", "verdict", "ToyCausalLM",
         "reference", "read_positions", "check_index_lists", "check_partition", "end_to_end_keys", "end_to_end_outputs",
         "origin", "_own_error")


def subset(whole, rows):
    """The engine case of the samples ``rows`` (in that order): a micro-batch's case (spec's EngineCase.subset)."""
    part = dict(whole)
    for key in ("prompt_lens", "response_lens", "seq_lens", "temperatures"):
        part[key] = [whole[key][i] for i in rows]
    part.update(batch_size=len(rows), total_nnz=sum(part["seq_lens"]), response_width=max(part["response_lens"]))
    return SimpleNamespace(**part)


def end_to_end(mini):
    """Every sample's outputs after the cut, the engine and postprocess vs the reference, as INV-MB-015 checks them
    (spec/truth/microbatch_checks.py): a failed check raises."""
    micro, indices = cut(mini)
    rows = micro_batch_rows(micro, indices)
    check_index_lists(micro, rows, indices)
    check_partition(CASE["batch_size"], rows)
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
    keys = end_to_end_keys(c.calculate_entropy, c.distillation_keys)
    end_to_end_outputs(outputs, keys, {key: [e for e, _ in want[key]] for key in keys},
                       {key: [t for _, t in want[key]] for key in keys}, c.seq_lens,
                       read_positions(c.prompt_lens, c.response_lens, OUTPUT_SPAN), [len(part) for part in rows])


def main():
    mini = torch.load(MINI, weights_only=False)
    try:
        end_to_end(mini)
        problem = None
    except AssertionError as exc:  # a failed check (spec/truth/failing.py), or an assertion of the layer's or engine's
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
