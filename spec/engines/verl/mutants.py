"""verl 0.9.1's equivalent mutants: mutants of its preparation surface (``spec mutate --engine verl``) that no
input tells from verl's own code, each with the reason read off the source. Keyed by the mutant's stable id
(:attr:`spec.mutate.Mutant.id`); ``spec mutate`` classifies a survivor named here as equivalent (not scored) and
reports one that a check kills as killed (the declaration was wrong).

Every other survivor is a gap of the suite: closed by a case or a check, never declared here.
"""

from __future__ import annotations

__all__ = ["VERL_EQUIVALENT_MUTANTS", "INT64_ZEROS_LIKE", "ENTROPY_CHECKPOINT"]

_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_SB = "verl.utils.seqlen_balancing"

#: reasons shared with verl's native engines (Automodel, TorchTitan), whose output steps repeat FSDP's code
INT64_ZEROS_LIKE = ("torch.zeros_like(seq_lengths, dtype=torch.int64): seq_lengths is the diff of a jagged tensor's "
                    "int64 offsets, so zeros_like already gives int64")
ENTROPY_CHECKPOINT = ("entropy_checkpointing only chooses torch.utils.checkpoint around the same entropy function: the "
                      "same values and the same gradients (it recomputes in the backward instead of storing)")

_ONE_BATCH_DIM = "the micro-batch TensorDicts have a 1-D batch size: TensorDict.cat along dim -1 is along dim 0"

VERL_EQUIVALENT_MUTANTS: dict[str, str] = {
    f"{_FSDP}:FSDPEngineWithLMHead.prepare_model_outputs:1501 dtype: dtype= dropped": INT64_ZEROS_LIKE,
    "verl.utils.model:_pad_last_dim_and_cat:744 compare: Eq -> NotEq":
        "the shortcut `if all(value.shape[-1] == max_len ...): return torch.cat(values)`: the mutant never takes it "
        "(some value always has max_len), and the padding path below pads only the narrower values, so it returns "
        "the same concatenation",
    f"{_SB}:rearrange_micro_batches:430 dtype: dtype= dropped":
        "torch.tensor([max_group_token_len, -num_groups], dtype=torch.long): both are Python ints, so the tensor is "
        "int64 without the dtype",
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
    "verl.utils.ulysses:ulysses_pad:292 compare: Gt -> GtE":
        "with pad_size == 0 the mutant pads by (0, 0) (a copy with the same values) and appends arange(0) to the "
        "position ids (nothing: the packed positions are int64, as the micro-batch's are, so the concatenation keeps "
        "their dtype): the same ids, positions and pad of 0 as the skipped branch",
    "verl.utils.ulysses:ulysses_pad:288 compare: LtE -> Lt":
        "with sp_size == 1 the fall-through pads (1 - n % 1) % 1 = 0 tokens and returns the same tensors and a pad "
        "of 0, as the early return does",
    f"{_SB}:karmarkar_karp:89 compare: Lt -> LtE":
        "Set.__lt__ returns self.sum < other.sum only after the sums were found to differ: < and <= agree there",
    f"{_SB}:karmarkar_karp:91 compare: Lt -> LtE":
        "Set.__lt__ returns len(self.items) < len(other.items) only after the counts were found to differ",
    f"{_SB}:karmarkar_karp:90 branch: condition negated":
        "the tie-break between sets of equal sums (see karmarkar_karp:90 NotEq -> Eq): another order among equally "
        "summed sets, the partition still every sample once within the budget",
    f"{_SB}:rearrange_micro_batches:414 compare: Gt -> GtE":
        "with force_group_size == 1 the grouped path sums the workloads and token counts of groups of one sample: "
        "the per-sample values the ungrouped path uses",
    f"{_SB}:get_seqlen_balanced_partitions:246 compare: Gt -> GtE":
        "the assert only guards an empty part, which karmarkar_karp never yields: the function asserts "
        "len(seqlen_list) >= k_partitions first, and every part starts with one of the k largest items",
    "verl.utils.torch_functional:logprobs_from_logits_v2:197 dim: dim -> other dim":
        "as logprobs_from_logits_v2:203: each row of the engine's (total_nnz, V) logits is 1-D, so logsumexp over "
        "dim 0 is over dim -1",
    "verl.utils.torch_functional:expand_as_nested:1009 dim: dim -> other dim":
        "the function asserts a 1-D tensor first: repeat_interleave along dim 0 is along dim -1",
    "verl.utils.tensordict_utils:concat_nested_tensors:217 arith: Sub -> Add":
        "getattr's default for _ragged_idx: every jagged nested tensor has _ragged_idx, so the default is never used",
    "verl.utils.tensordict_utils:chunk_tensordict:371 arith: Sub -> Add":
        "getattr's default for _ragged_idx: every jagged nested tensor has _ragged_idx, so the default is never used",
    "verl.workers.utils.padding:no_padding_2_padding:118 compare: Lt -> LtE":
        "max_response_len is -1 (unset) or the batch's longest response, at least 1: < 0 and <= 0 agree on both",
    "verl.workers.engine.utils:pad_packed_inputs:78 compare: LtE -> Lt":
        "the engine calls pad_packed_inputs only with a positive pad (its 78->79 branch is declared unreachable for "
        "that reason): <= 0 and < 0 agree on every call",
    f"{_FSDP}:FSDPEngineWithLMHead.prepare_model_inputs:1180 dict key: key 'temperature_is_one' dropped":
        "an optimisation flag: prepare_model_outputs reads it with .get(..., False), and without it the fused "
        "kernel divides the logits by the temperature 1.0, which leaves every value as it is",
    "verl.utils.ulysses:slice_input_tensor:134 cast: .contiguous() removed":
        "contiguity is memory layout: the sliced shard holds the same values, and every reader of the model inputs "
        "(the model, the checks) reads values",
    f"{_FSDP}:FSDPEngineWithLMHead.prepare_model_outputs:1426 branch: condition negated":
        "no effect without flash-attn: inplace_backward is read only by flash-attn's Triton cross-entropy "
        "(logprobs_from_logits' CUDA branch, declared unreachable here); the pure-torch path ignores it",
    "verl.workers.engine.utils:pad_packed_inputs:84 dtype: dtype= dropped":
        "torch.arange(pad_size) is int64 without dtype=, and position_ids are int64 (as every trainer's collator "
        "and the suite make them)",
    f"{_SB}:rearrange_micro_batches:464 compare: Gt -> GtE":
        "with force_group_size == 1 the group-to-sample conversion maps group i to range(i, i + 1): the same indices",
    "verl.utils.torch_functional:logprobs_from_logits_v2:204 dim: dim -> other dim":
        "as logprobs_from_logits_v2:203: each row is 1-D, so gather along dim 0 is along dim -1",
    "verl.utils.torch_functional:logprobs_from_logits_v2:194 branch: condition negated":
        "both branches compute log_softmax at the label (a gather minus a logsumexp, or a per-row log_softmax): "
        "they differ only in rounding, within the bound of the precision verl declares for each logits dtype",
    "verl.utils.tensordict_utils:concat_tensordict:292 dim: dim -> other dim": _ONE_BATCH_DIM,
    "verl.utils.tensordict_utils:concat_tensordict:279 dim: dim -> other dim": _ONE_BATCH_DIM,
    f"{_SB}:karmarkar_karp:151 arith: Add -> Sub":
        "equal_size's seeding takes sorted[offset - i] for sorted[offset + i]: over the offsets 0, k, 2k, ... that is "
        "every sample once, k to a partition, other samples grouped together; the contract asks every sample once in "
        "partitions of equal count, no particular grouping among them (the balance is the heuristic's)",
    "verl.utils.tensordict_utils:list_of_dict_to_tensordict:927 compare: Gt -> GtE":
        "the assert only guards an empty list, which raises either way (IndexError at list_of_dicts[0])",
    f"{_SB}:karmarkar_karp:92 compare: Lt -> LtE":
        "Set.__lt__ compares the items lists only after the sums and the counts were found equal; the items are "
        "(index, length) pairs and no sample is in two sets, so two sets' lists are never equal: < and <= agree",
    f"{_SB}:rearrange_micro_batches:411 cast: .long() removed":
        "seq_len_effective is int64 already: the offsets' diff of a jagged tensor, or an attention mask's sum "
        "(torch sums bool and int masks to int64)",
    "verl.utils.tensordict_utils:index_select_tensor_dict:498 arith: Sub -> Add":
        "getattr's default for _ragged_idx: every jagged nested tensor has _ragged_idx, so the default is never used",
    "verl.utils.tensordict_utils:nested_tensor_from_tensor_list:178 dim: dim -> other dim":
        "lengths is 1-D (one length a tensor): cumsum along dim 0 is along dim -1",
    "verl.utils.tensordict_utils:concat_tensordict:270 compare: Gt -> GtE":
        "the assert only guards an empty list, which raises either way (IndexError at data[0] instead of "
        "AssertionError); every non-empty list passes both",
}
