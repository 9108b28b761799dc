"""The standalone reproducer of INV-MB-015 (end to end: the micro-batch layer's cut, the engine on every
micro-batch, the layer's ``postprocess_batch_func``, against the per-sequence float64 reference).

The file is the engine-case reproducer's runtime (:mod:`.runtime` and the suite's stand-in model and hand-off,
written beside it by :func:`.templates.write_beside`; the engine built as its adapter does, the float64 reference)
joined with the micro-batch reproducer's (:mod:`.minibatch`: the shrunk mini-batch saved as a ``.pt`` beside it, the layer's own functions imported by module
and name, or a planted wrapper's factory written out). It cuts the mini-batch with the layer's
``prepare_micro_batches``, runs every micro-batch through one engine object (as a trainer keeps it) with the
micro-batch's samples as its case, joins the outputs with ``postprocess_batch_func`` (or the layer's
``concat_nested_tensors`` and ``restore_dynamic_batch``), and compares every sample's outputs with the reference of
the whole mini-batch in its own place. It exits 1 printing got vs expected (or what the layer or engine raised), 0
when right.
"""

from __future__ import annotations

import inspect
import pprint
from pathlib import Path
from typing import Any, Callable

import torch

from ..cases.microbatch import MiniBatchCase, materialize_minibatch, micro_batch_rows
from ..engines.impl.adapter import ImplEngine
from ..execute.pickling import save
from ..invariants.microbatch import refusable_case
from ..protocol.engine import OutputSpan, PaddedLayout, ReproSnippet
from .micro_batch import case_data
from .minibatch import COMMON, case_dict, layer_imports, plain_minibatch
from .templates import LOADER, PREAMBLE, SHARE, engine_block, write_beside

__all__ = ["END_TO_END", "layer_bug_only", "write_end_to_end_reproducer"]

END_TO_END = "INV-MB-015"


def layer_bug_only(engine: Any) -> bool:
    """Whether ``engine`` is impl with a bug planted in its micro-batch layer alone (its engine is impl's own)."""
    bug = getattr(engine, "bug", None)
    return isinstance(engine, ImplEngine) and bug is not None and bug.microbatch is not None and not (
        bug.lm or bug.value or bug.helpers or bug.packer or bug.config or bug.precision or bug.companion)


def write_end_to_end_reproducer(path: Path, header: str, engine: Any, snippet: ReproSnippet | None,
                                functions: dict[str, Callable[..., Any]], case: MiniBatchCase,
                                factory: Any = None) -> str | None:
    """Write ``path`` (and its ``.pt``); returns why it is not standalone, or None."""
    if snippet is None:
        return f"engine {engine.name} cannot be built standalone for the mini-batch's engine case"
    if refusable_case(case):
        return "the layer may refuse this mini-batch (INV-MB-003/004/006 check that), INV-MB-015 does not run it"
    names = ("prepare_micro_batches", "postprocess_batch_func") if functions.get("postprocess_batch_func") else (
        "prepare_micro_batches", "concat_nested_tensors", "restore_dynamic_batch")
    imports, why = layer_imports(functions, names, factory)
    if why:
        return why
    save(plain_minibatch(materialize_minibatch(case, "cpu")), path.with_suffix(".pt"))
    layout = PaddedLayout(getattr(engine, "padded_layout", PaddedLayout.RIGHT)).value
    span = OutputSpan(getattr(engine, "output_span", OutputSpan.SEQUENCE)).value
    write_beside(path.parent)
    path.write_text("\n".join([
        header, PREAMBLE, "import pickle", LOADER, engine_block(snippet),
        "# ---- the engine's micro-batch layer ----", imports, "",
        f"INVARIANT = {END_TO_END!r}", "CHECK_NAMES = []", "POISON = 'nan'", "KEYS = []",
        f"PADDED_LAYOUT = {layout!r}  # where the engine puts each sequence in its padded (B, L) model input",
        f"OUTPUT_SPAN = {span!r}  # which positions of each sequence its per-token outputs cover",
        "DATA = None", "RUNS = []", "",
        "# the mini-batch's settings (the cut) and its samples as one engine case (the reference)",
        "CASE = " + pprint.pformat(case_dict(case), width=120, sort_dicts=False),
        "WHOLE = " + pprint.pformat(case_data(case.engine_case()), width=120, sort_dicts=False),
        "MINI = Path(__file__).with_suffix('.pt')", "", SHARE, "",
        inspect.getsource(micro_batch_rows), COMMON, _MAIN]))
    return None


_MAIN = r'''

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
    if problem:
        print(f"FAIL {INVARIANT}: {problem}")
        return 1
    print(f"PASS: {INVARIANT} holds on this mini-batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
