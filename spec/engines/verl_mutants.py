"""verl 0.9.1's equivalent mutants: mutants of its preparation surface (``spec mutate --engine verl``) that no
input tells from verl's own code, each with the reason read off the source. Keyed by the mutant's stable id
(:attr:`spec.mutate.Mutant.id`); ``spec mutate`` classifies a survivor named here as equivalent (not scored) and
reports one that a check kills as killed (the declaration was wrong).

Every other survivor is a gap of the suite: closed by a case or a check, never declared here.
"""

from __future__ import annotations

__all__ = ["VERL_EQUIVALENT_MUTANTS"]

_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_SB = "verl.utils.seqlen_balancing"

VERL_EQUIVALENT_MUTANTS: dict[str, str] = {
    f"{_FSDP}:FSDPEngineWithLMHead.prepare_model_outputs:1501 dtype: dtype= dropped":
        "torch.zeros_like(seq_lengths, dtype=torch.int64): seq_lengths is the diff of a jagged tensor's int64 "
        "offsets, so zeros_like already gives int64",
    f"{_SB}:karmarkar_karp:127 compare: Gt -> GtE":
        "State.__lt__ returns self.spread > other.spread only after the spreads were found to differ: > and >= "
        "agree there",
    f"{_SB}:karmarkar_karp:80 accumulator: += -> =":
        "Set.add is called only on a fresh Set (sum 0) in State.__init__, once per set: 0 + val == val",
    f"{_SB}:karmarkar_karp:90 compare: NotEq -> Eq":
        "Set.__lt__'s tie-break between sets of equal sums (by item count, then items): the mutant orders such "
        "sets by their items instead; the heap then merges other equal-sum sets, and the partition is still every "
        "sample once within the budget: the contract asks no particular partition among equally balanced ones",
    f"{_SB}:rearrange_micro_batches:478 compare: Gt -> GtE":
        "with force_group_size == 1 the grouped sort key sums workloads[idx // 1] over partition[::1]: the same "
        "key as the ungrouped branch",
    f"{_SB}:rearrange_micro_batches:476 branch: condition negated":
        "use_dynamic_bsz_balance only orders the micro-batches (smallest at both ends, for pipeline bubbles); "
        "restore_dynamic_batch puts every sample back whatever the order (INV-MB-007), and no output depends on it",
    "verl.utils.torch_functional:logprobs_from_logits_v2:203 dim: dim -> other dim":
        "the engine hands logprobs_from_logits its packed logits, (total_nnz, V) (logits_rmpad, also in the padded "
        "mode: the rows concatenated), so each row_logits is 1-D and dim=0 is dim=-1 (a caller with 3-D logits "
        "would tell them apart; none on this surface does)",
    f"{_FSDP}:FSDPEngineWithLMHead.prepare_model_inputs:1192 dtype: dtype= dropped":
        "input_ids.offsets() of a jagged tensor are int64 already: .to(dtype=torch.long) changes nothing",
    "verl.utils.torch_functional:logprobs_from_logits:95 compare: NotEq -> Eq":
        "needs flash-attn: without it FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE is False and the `and` never reads "
        "VERL_DISABLE_FLASH_ATTN_CE (the CUDA branch is declared unreachable)",
    f"{_SB}:restore_dynamic_batch:578 dtype: dtype= dropped":
        "torch.tensor of a list of Python ints is int64 without dtype=torch.long",
    "verl.utils.tensordict_utils:chunk_tensordict:354 dim: dim -> other dim":
        "a jagged nested tensor unbinds along dim 0 only: unbind(dim=-1) raises RuntimeError and verl's own "
        "fallback (to_padded_tensor, chunk, each part cut back to its length from the offsets) builds the same chunks",
    "verl.utils.tensordict_utils:nested_tensor_from_tensor_list:163 compare: Gt -> GtE":
        "the assert only guards an empty list, which raises either way (IndexError at tensors[0] instead of "
        "AssertionError); every non-empty list passes both",
    "verl.utils.ulysses:ulysses_pad:288 compare: LtE -> Lt":
        "with sp_size == 1 the fall-through pads (1 - n % 1) % 1 = 0 tokens and returns the same tensors and a pad "
        "of 0, as the early return does",
}
