"""Reproducer: INV-VAL-002 (padded) on engine verl.

entropy equals the oracle's entropy of softmax(logits / T) [known failure INV-VAL-002: F01]

Shrunk case: EngineCase(p=[1] r=[1] V=64 T=0.05 padded entropy seed=0)
What the suite saw: AssertionError: 'entropy' of sequence 0: at (1,) got 0.0018920898, expected 0.0019236603 (spec/engines/verl/README.md)

Needs: pip install torch tensordict verl==0.9.1
Exit 1: the engine is wrong on this case (got vs expected printed); 0: it is right; 2: not reproducible standalone.
Written by `python -m spec verify` (spec/repro/); edit freely.
"""

from __future__ import annotations

import math
import sys
import threading
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import torch
from tensordict import TensorDict

# ---- engine under test (begin) ----
import warnings
from types import SimpleNamespace

warnings.filterwarnings("ignore")
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402
from verl.workers.utils import padding  # noqa: E402


class _Engine:
    """verl's FSDP engine without its constructor (no model, no process group): only the attributes
    prepare_model_inputs / prepare_model_outputs read are set."""

    def __init__(self, engine):
        self.engine = engine

    def prepare_model_inputs(self, micro_batch):
        return self.engine.prepare_model_inputs(micro_batch)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        return self.engine.prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)


def make_engine(head, sp_size=1, pad_to_length=None, pass_cu_seqlens=False, entropy_chunk_size=None):
    cls = {"lm": transformer_impl.FSDPEngineWithLMHead, "value": transformer_impl.FSDPEngineWithValueHead}[head]
    eng = object.__new__(cls)
    eng.use_ulysses_sp = False
    eng.ulysses_sequence_parallel_size = 1
    eng.ulysses_parallel_group = None
    chunk = entropy_chunk_size
    eng.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=bool(chunk),
                                        entropy_from_logits_chunk_size=int(chunk or 2048))
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits_with_chunking if chunk else verl_F.entropy_from_logits
    eng.module = SimpleNamespace(config=SimpleNamespace())
    eng.pass_packed_cu_seqlens = pass_cu_seqlens
    eng.pad_to_length = bool(pad_to_length)
    eng.pad_to_length_bucket = int(pad_to_length) if pad_to_length else 1
    return _Engine(eng)


def helper(name):
    return getattr(padding, name, None)
# ---- engine under test (end) ----

# ---- the stand-in model (the suite's spec/truth/toy_model.py, written out) ----
from functools import lru_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@lru_cache(maxsize=16)
def _weights(vocab: int, seed: int, out_dim: int, hidden: int, max_pos: int, device: str):
    """The model's (read-only) weights: a case's runs and its oracle share them (152k-id heads are
    worth drawing once)."""
    gen = torch.Generator().manual_seed(10_007 + seed)
    embed = torch.randn(vocab, hidden, generator=gen).to(device)
    pos_embed = (0.5 * torch.randn(4, max_pos, hidden, generator=gen)).to(device)
    proj = (2.0 * torch.randn(hidden, out_dim, generator=gen)).to(device)
    return embed, pos_embed, proj, proj.double()


class ToyCausalLM:
    def __init__(self, vocab: int, *, seed: int, out_dim: int | None = None, hidden: int = 8,
                 max_pos: int = 97, device: torch.device | str = "cpu", dtype: str | None = None) -> None:
        self.vocab = vocab
        self.max_pos = max_pos
        #: the logits' dtype: given, else carried by the case's seed (spec.cases.ModelSeed), else float32
        self.dtype = DTYPES[dtype or getattr(seed, "logits_dtype", "float32")]
        self.embed, self.pos_embed, self.proj, self._proj64 = _weights(
            vocab, int(seed), out_dim or vocab, hidden, max_pos, str(torch.device(device)))

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(R, n, out)`` logits in :attr:`dtype` for ids ``(R, n)`` and positions ``(R, n)`` / ``(C, R, n)``.

        Computed in float64 and rounded once, so the logits of a sequence do not depend on
        how it was batched (packed, padded or alone) beyond that rounding.
        """
        x = self.embed[input_ids].double()
        axes = position_ids if position_ids.dim() == 3 else position_ids.unsqueeze(0)
        pos = sum(self.pos_embed[a][axes[a] % self.max_pos] for a in range(axes.shape[0])).double()
        keep = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(x.dtype).unsqueeze(-1)
        total = torch.cumsum(x * keep, dim=1)
        count = torch.cumsum(keep, dim=1)
        if attention_mask is None:  # packed: a sequence starts where the position restarts at 0
            steps = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            start = torch.cummax(torch.where(axes[0] == 0, steps, torch.zeros_like(steps)), dim=1).values
            before = (start - 1).clamp(min=0).unsqueeze(-1)
            has_before = (start > 0).unsqueeze(-1).to(x.dtype)
            total = total - has_before * torch.gather(total, 1, before.expand_as(total))
            count = count - has_before * torch.gather(count, 1, before.expand_as(count))
        ctx = total / count.clamp(min=1.0)
        return (torch.tanh(x + pos + ctx) @ self._proj64).to(self.dtype)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, *, temperature: float | None = None,
                 shift_labels: torch.Tensor | None = None, return_dict: bool = True,
                 **_ignored: object) -> SimpleNamespace:
        """HF-style call. With ``temperature`` (fused kernels) it also returns float32 ``log_probs`` and
        ``entropy``, scoring ``shift_labels`` or, when absent, the next id of each row."""
        logits = self.logits(input_ids, position_ids, attention_mask)
        out = SimpleNamespace(logits=logits)
        if temperature is not None:
            labels = shift_labels if shift_labels is not None else torch.roll(input_ids, -1, dims=-1)
            scaled = logits.float() / max(float(temperature), 1e-8)
            lsm = torch.log_softmax(scaled, dim=-1)
            out.log_probs = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            out.entropy = -(lsm.exp() * lsm).sum(-1)
        return out

# ---- the hand-off around the model (spec/execute/handoff.py, harness.py), written out ----
POISONS = {'nan': float('nan'), 'huge': float('3e+38'), 'neg': float('-3e+38')}

class ThreadedAllGather:
    """An in-process all-gather among ``world`` ranks running in threads."""

    def __init__(self, world: int, timeout: float = 60.0):
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)

    def member(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_gather(local: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = local
            self.barrier.wait()
            gathered = torch.cat([s for s in self.slots], dim=0)  # type: ignore[misc]
            self.barrier.wait()
            return gathered
        return all_gather


def _settings(case: EngineCase, rank: int, gather: ThreadedAllGather | None) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if case.sp_size > 1:
        settings.update(sp_size=case.sp_size, sp_rank=rank, all_gather=gather.member(rank))
    if case.pad_to_length:
        settings["pad_to_length"] = case.pad_to_length
    if case.pass_cu_seqlens:
        settings["pass_cu_seqlens"] = True
    if case.entropy_chunk_size:
        settings["entropy_chunk_size"] = case.entropy_chunk_size
    return settings


def _poison_padded(tensor: torch.Tensor, case: EngineCase, value: float) -> torch.Tensor:
    lens = torch.tensor(case.seq_lens, device=tensor.device)
    cols = torch.arange(tensor.shape[1], device=tensor.device)
    pad = (cols.unsqueeze(0) >= lens.unsqueeze(1))
    pad = pad.view(*pad.shape, *([1] * (tensor.dim() - 2)))
    return tensor.masked_fill(pad, value)


def _poison_tail(tensor: torch.Tensor, total: int, value: float) -> torch.Tensor:
    out = tensor.clone()
    out[:, total:] = value
    return out


def _fields(out: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(out).items() if isinstance(v, torch.Tensor)}


def _call_model(model: ToyCausalLM, inputs: list[dict[str, Any]], case: EngineCase,
                poison: float) -> list[SimpleNamespace]:
    """Run the model once over the whole batch; hand each rank its slice with the padding poisoned."""
    if not case.use_remove_padding:
        (mi,) = inputs
        out = model(**mi)
        return [SimpleNamespace(**{k: _poison_padded(v, case, poison) for k, v in _fields(out).items()})]
    joined = dict(inputs[0])
    for key in ("input_ids", "position_ids", "shift_labels"):
        if key in joined:
            joined[key] = torch.cat([mi[key] for mi in inputs], dim=-1)
    out = model(**joined)
    fields = {k: _poison_tail(v, case.total_nnz, poison) for k, v in _fields(out).items()}
    widths = [mi["input_ids"].shape[-1] for mi in inputs]
    per_rank = {k: v.split(widths, dim=1) for k, v in fields.items()}
    return [SimpleNamespace(**{k: parts[r] for k, parts in per_rank.items()}) for r in range(len(inputs))]


def _in_threads(calls: list[Callable[[], Any]], gather: ThreadedAllGather) -> list[Any]:
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            gather.barrier.abort()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return results


# ---- the top-K distillation processor the suite hands the engine (spec/truth/oracle.py) ----
def topk_terms(student_logits: torch.Tensor, teacher_ids: torch.Tensor,
               teacher_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token top-K distillation terms from ``(n, V)`` logits and ``(n, K)`` teacher top-K.

    The student's top-K (for ``overlap_count``) is ranked on the logits as given (float32 in the
    processor and the oracle alike), so near-ties break the same way in both."""
    student = torch.log_softmax(student_logits.double(), dim=-1)
    at_teacher = student.gather(-1, teacher_ids)
    teacher_logprobs = teacher_logprobs.double()
    teacher_p = teacher_logprobs.exp()
    k = teacher_ids.shape[-1]
    student_top = student_logits.topk(min(k, student_logits.shape[-1]), dim=-1).indices
    overlap = (teacher_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)
    return {
        "distillation_losses": (teacher_p * (teacher_logprobs - at_teacher)).sum(-1),
        "student_mass": at_teacher.exp().sum(-1),
        "teacher_mass": teacher_p.sum(-1),
        "overlap_count": overlap.to(student.dtype).sum(-1),
        "overlap_token_advantage": (at_teacher - teacher_logprobs).mean(-1),
    }


class TopKProcessor:
    """A ``logits_processor_func`` returning ``keys`` of :func:`topk_terms`, ``(1, total_nnz)`` float32 each.

    It aligns the teacher tensors with the whole packed row, so it refuses logits of
    any other length (a static bucket or a shard would misalign them).
    """

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys

    def __call__(self, student_logits: torch.Tensor, data: TensorDict, **_: object) -> dict[str, torch.Tensor]:
        teacher_ids = data["teacher_ids"].values()
        teacher_lp = data["teacher_logprobs"].values()
        if student_logits.dim() != 3 or student_logits.shape[:2] != (1, teacher_ids.shape[0]):
            raise ValueError(f"student_logits {tuple(student_logits.shape)} do not align with teacher "
                             f"tensors of {teacher_ids.shape[0]} tokens")
        terms = topk_terms(student_logits[0].float(), teacher_ids, teacher_lp)
        return {key: terms[key].float().unsqueeze(0) for key in self.keys}


INVARIANT = 'INV-VAL-002'
CHECK_NAMES = ['keys', 'values']
POISON = 'nan'
RUNS = [{'label': 'the case',
  'case': {'prompt_lens': [1],
           'response_lens': [1],
           'seq_lens': [2],
           'total_nnz': 2,
           'batch_size': 1,
           'vocab': 64,
           'seed': 0,
           'logits_dtype': 'float32',
           'head': 'lm',
           'temperatures': [0.05],
           'use_remove_padding': False,
           'calculate_entropy': True,
           'calculate_sum_pi_squared': False,
           'distillation_keys': [],
           'distillation_use_topk': False,
           'distillation_only': False,
           'use_fused_kernels': False,
           'topk': 2,
           'sp_size': 1,
           'pad_to_length': None,
           'pass_cu_seqlens': False,
           'entropy_chunk_size': None,
           'response_width': 1,
           'split_view': False},
  'data': {'nested': {'input_ids': {'dtype': 'int64', 'shape': [2], 'offsets': [0, 2], 'ragged_dim': 1},
                      'position_ids': {'dtype': 'int64', 'shape': [2], 'offsets': [0, 2], 'ragged_dim': 1},
                      'prompts': {'dtype': 'int64', 'shape': [1], 'offsets': [0, 1], 'ragged_dim': 1},
                      'responses': {'dtype': 'int64', 'shape': [1], 'offsets': [0, 1], 'ragged_dim': 1},
                      'loss_mask': {'dtype': 'int64', 'shape': [1], 'offsets': [0, 1], 'ragged_dim': 1},
                      'response_mask': {'dtype': 'int64', 'shape': [1], 'offsets': [0, 1], 'ragged_dim': 1}},
           'dense': {},
           'flags': {'temperature': 0.05,
                     'use_remove_padding': False,
                     'pad_mode': 'no_padding',
                     'use_fused_kernels': False,
                     'pad_token_id': 0,
                     'calculate_entropy': True,
                     'calculate_sum_pi_squared': False,
                     'distillation_use_topk': False,
                     'distillation_only': False}},
  'values': {'input_ids': [44, 47],
             'position_ids': [0, 1],
             'prompts': [44],
             'responses': [47],
             'loss_mask': [0],
             'response_mask': [0]}}]


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
    return {"attention_mask": model_inputs.get("attention_mask"),
            "labels": None if labels is None else labels.reshape(-1)}


def _views_out(outputs):
    return view_outputs(outputs) if "view_outputs" in globals() else dict(outputs)


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def execute(c, mb, poison):
    model = ToyCausalLM(c.vocab, seed=c.seed, out_dim=1 if c.head == "value" else None, dtype=c.logits_dtype)
    gather = ThreadedAllGather(c.sp_size) if c.sp_size > 1 else None
    engines = [make_engine(c.head, **_settings(c, r, gather)) for r in range(c.sp_size)]
    handed = [eng.prepare_model_inputs(mb) for eng in engines]
    inputs = [mi for mi, _ in handed]
    output_args = [args for _, args in handed]
    views = [_views_in(mi, args) for mi, args in handed]
    args_before = [_copy(args) for args in output_args]
    model_outputs = _call_model(model, inputs, c, POISONS[poison])
    logits_before = [o.logits.clone() for o in model_outputs]
    processor = TopKProcessor(tuple(c.distillation_keys)) if c.distillation_use_topk else None
    calls = [(lambda eng=eng, r=r: eng.prepare_model_outputs(model_outputs[r], output_args[r], mb, processor))
             for r, eng in enumerate(engines)]
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


CHECKS = {"keys": check_keys, "values": check_values, "float32": check_float32, "mask": check_mask,
          "labels": check_labels, "slice": check_slice}


def main():
    for run in RUNS:
        c = SimpleNamespace(**run["case"])
        mb, fresh = build_micro_batch(run), build_micro_batch(run)
        try:
            result = execute(c, mb, POISON)
        except Exception as exc:  # noqa: BLE001 - the engine rejected a valid micro-batch
            print(f"FAIL {INVARIANT} on {run['label']}: got the engine raising {type(exc).__name__}: {exc}, "
                  "expected outputs (the micro-batch is valid)")
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
