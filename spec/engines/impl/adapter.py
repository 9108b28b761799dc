"""The project's own engine, as an engine under test."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import impl
import impl.microbatch

from ...protocol.engine import HELPERS, ConfigSwitch, EngineUnderTest, ReproSnippet
from ...protocol.microbatch import MicroBatchLayer, layer_from
from ...protocol.vendor import source
from ...protocol.profile import MEDIA, VERL_CONVENTIONS
from ...protocol.step import StepLayer
from .step import impl_step_layer

__all__ = ["ImplEngine"]


_ERR = "an error path: the branch only an input the contract rejects takes (it leads to impl's error)"
_MB, _NE, _PA, _TD = "impl.microbatch.batches", "impl.microbatch.nested", "impl.microbatch.partition", \
    "impl.microbatch.tensordicts"
_TIES = ("gap: the balancer's refinement passes with no improving move left early or with the pass limit hit "
         "(many sequences of equal lengths, k_partitions near the batch size)")
#: impl's branches the suite's CPU runs do not reach (``dev`` and ``ci``), each with its reason; a ``gap:`` reason
#: names an input a real trainer sends that the case space does not draw yet (spec.run.engine_coverage)
IMPL_UNREACHABLE: dict[str, str] = {
    "*:raise": _ERR,
    "impl.layout:require_jagged": _ERR + " (the fast path returns every jagged tensor of the expected ragged dim)",
    "impl.layout:SequenceLayout.expect_same_lengths": _ERR, "impl.layout:SequenceLayout.mask": _ERR,
    "impl.padding:254": _ERR, "impl.padding:261": _ERR, "impl.padding:264": _ERR, "impl.padding:268": _ERR,
    "impl.padding:_report": _ERR, "impl.padding:156": _ERR, "impl.padding:96": _ERR, "impl.padding:99": _ERR,
    "impl.outputs:68": _ERR, "impl.outputs:132": _ERR, "impl.outputs:TokenRoute.check": _ERR,
    f"{_MB}:85": _ERR, f"{_MB}:188": _ERR, f"{_TD}:173": _ERR, f"{_TD}:93": _ERR, f"{_NE}:72": _ERR,
    "impl.dense:22->23": "this torch has the aten op (the branch is for a torch without it)",
    "impl.dense:38->39": "this torch has the aten op (the branch is for a torch without it)",
    "impl.dense:83->85": "needs the op's CPU kernel: torch 2.4 has _jagged_to_padded_dense_forward for CUDA only "
    "(torch >= 2.5 has a CPU kernel, and there the branch is reached)",
    "impl.dense:97->99": "needs the op's CPU kernel: torch 2.4 has _padded_dense_to_jagged_forward for CUDA only "
    "(torch >= 2.5 has a CPU kernel, and there the branch is reached)",
    "impl.layout:129->132": "needs CUDA: offsets on an accelerator", f"{_NE}:170": "gap: a row index over more than "
    "BLOCK_TOKENS tokens (a mini-batch of over a million tokens)", f"{_NE}:181": "gap: as 170 (several blocks)",
    f"{_NE}:189": "gap: as 170 (several blocks)",
    "impl.dense:57->61": "gap: a per-sample tensor that requires grad or has trailing dims expanded per token",
    "impl.dense:83->88": "gap: a bool per-token key padded from its jagged values (values a loss backpropagates through take it "
    "too: the step's critic, not run by the preparation's cases)",
    "impl.layout:84->86": "gap: a nested tensor whose values()/offsets() are not plain tensors (a tensor subclass)",
    "impl.layout:110->111": "gap: int32 offsets (a jagged tensor built with int32 offsets)",
    f"{_NE}:37->38": "gap: int32 offsets (as impl.layout:110)",
    "impl.logits:36->39": "gap: statistics without labels (entropy only, no log-probs asked)",
    "impl.logits:117->119": "gap: a 0-d tensor temperature", "impl.logits:sample_temperature": "gap: per-sample "
    "temperatures as a list or a 0-d tensor (a trainer's NonTensorData)",
    "impl.batch:MicroBatchView.of": "gap: a micro-batch as a plain dict or with missing optional keys",
    "impl.batch:get_key": "gap: a micro-batch as a plain dict", "impl.batch:MicroBatchView.position_values": _ERR,
    "impl.flags:_pad_mode": "gap: pad_mode given as a string or enum of another module",
    "impl.outputs:_field": "gap: a model output as a Mapping (a dict instead of a ModelOutput)",
    "impl.outputs:156": "gap: a call that asks for neither log-probs nor entropy (a processor-only run)",
    "impl.outputs:158": "gap: as 156", "impl.outputs:_processor_outputs": _ERR,
    "impl.outputs:TokenRoute.__init__": _ERR, "impl.outputs:TokenRoute.finish": _ERR,
    "impl.outputs:TokenRoute.labels": _ERR, "impl.outputs:TokenRoute.temperature": _ERR,
    "impl.outputs:_check_vocab": _ERR, "impl.outputs:_require_arg": _ERR, "impl.outputs:prepare_value_outputs": _ERR,
    "impl.outputs:prepare_model_outputs": _ERR, "impl.padding:_dense": _ERR,
    "impl.padding:_response_starts": _ERR, "impl.padding:response_lengths": _ERR,
    "impl.padding:response_to_nested": _ERR, "impl.padding:no_padding_2_padding": _ERR,
    "impl.padding:93->96": "gap: a dense (not nested) tensor handed to no_padding_2_padding",
    "impl.padding:242->244": "gap: nested 'prompts' whose lengths differ from the masks' (a split that disagrees)",
    "impl.padding:left_right_2_no_padding": _ERR + "; gap: the mRoPE (B, 4, S) positions of a padded batch",
    "impl.multimodal:47->48": "gap: extract_multi_modal_inputs called with indices (a caller's selection; the "
    "preparation hands every sample's entry)",
    "impl.sequence_parallel:RowPlan.make": _ERR, "impl.sequence_parallel:RowPlan.unshard": _ERR
    + "; gap: the sp > 1 unshard without an all-gather", "impl.sequence_parallel:RowPlan.shard": "gap: a pad-free "
    "row under sequence parallelism",
    f"{_MB}:_sequence_lengths": "gap: a padded (dense input_ids + attention_mask) mini-batch cut by the layer",
    f"{_MB}:277": "gap: micro-batch outputs mixing nested and dense tensors of one key",
    f"{_MB}:280": "gap: dense (padded) micro-batch outputs", f"{_MB}:288": "gap: micro-batch outputs carrying "
    "metrics (the training step's); the suite hands model_output only", f"{_MB}:289": "gap: as 288",
    f"{_MB}:291": "gap: as 288", f"{_MB}:postprocess_batch_func": "gap: the training step's outputs (loss, metrics) "
    "and padded outputs", f"{_MB}:_restore_nested": "gap: restoring dense or empty outputs", f"{_MB}:_inverse": _ERR,
    f"{_MB}:prepare_micro_batches": "gap: a mini-batch cut without use_dynamic_bsz and a micro-batch size that "
    "does not divide it", f"{_MB}:rearrange_micro_batches": "gap: dynamic batching with a data-parallel group or "
    "a same_micro_num_in_dp setting",
    f"{_NE}:41->44": "gap: an empty batch of rows (zero samples in a micro-batch)",
    f"{_NE}:141->142": "gap: a row index selecting no token", f"{_NE}:163->166": "gap: as 141",
    f"{_NE}:take_rows": "gap: selecting rows without a precomputed index", f"{_NE}:_check_offsets": _ERR,
    f"{_NE}:_parts": _ERR, f"{_NE}:concat_nested_tensors": "gap: concatenating nested tensors ragged at dim 2 or "
    "of mixed dtypes", f"{_NE}:nested_tensor_from_tensor_list": "gap: building from an empty list or 1-D parts",
    f"{_NE}:jagged": _ERR, f"{_NE}:RowIndex.__init__": "gap: as 141", f"{_NE}:RowIndex.apply": "gap: as 170",
    f"{_NE}:token_index": "gap: as 141",
    f"{_PA}:_paired_passes": _TIES, f"{_PA}:_pair_sets": _TIES, f"{_PA}:_heaviest_passes": _TIES,
    f"{_PA}:_pair_exchange": _TIES, f"{_PA}:fit_budget": "gap: a token budget the first balanced split misses "
    "(max_token_len close to the longest sequences)", f"{_PA}:balanced_bins": _TIES,
    f"{_PA}:get_seqlen_balanced_partitions": "gap: fewer sequences than partitions, or equal_size=True",
    f"{_TD}:_as_index": "gap: negative or empty indices in index_select_tensor_dict",
    f"{_TD}:Selector.select": "gap: index_select_tensor_dict over a NonTensorData entry (scalar metadata kept whole)",
    f"{_TD}:index_select_tensor_dict": "gap: index_select_tensor_dict of None or with a tensor of indices",
    f"{_TD}:_nested_batch_size": "gap: a TensorDict with no batch size whose first entry is no tensor",
    f"{_TD}:concat_tensordict": "gap: concatenating TensorDicts without nested tensors or metadata-only ones",
    f"{_TD}:chunk_tensordict": "gap: chunking a nested tensor with holes, or chunks that do not divide the batch",
    f"{_TD}:_ragged_dim": "gap: an explicit ragged_idx override", f"{_TD}:list_of_dict_to_tensordict": "gap: "
    "list_of_dict_to_tensordict with non-tensor values or ragged lists",
    f"{_TD}:maybe_fix_3d_position_ids": "gap: mRoPE position ids that lost their ragged dim (a pickle round trip) "
    "or a batch without position_ids",
}


#: impl's settings that change its preparation's path (``impl.EngineSettings``), each drawn as the suite's setting of
#: that name
IMPL_CONFIG_SPACE = (
    ConfigSwitch("entropy_chunk_size", setting="entropy_chunk_size", needs=("chunking",),
                 text="rows per chunk of the log-prob/entropy temporaries (None: about 1 MiB of float32 logits, "
                      "impl.logits.CHUNK_BYTES)"),
    ConfigSwitch("pad_to_length", setting="pad_to_length", needs=("bucket",),
                 text="the static bucket of the packed length"),
    ConfigSwitch("pass_cu_seqlens", setting="pass_cu_seqlens", needs=("cu_seqlens",),
                 text="cu_seqlens in the packed model inputs"),
)


class ImplEngine(EngineUnderTest):
    name = "impl"
    #: the preparation code spec verify measures (spec.run.engine_coverage): every function of impl/ and impl.microbatch
    profile = replace(EngineUnderTest.profile, surface=tuple(
        f"impl.{m}" for m in ("batch", "dense", "engines", "flags", "inputs", "layout", "logits", "multimodal", "outputs", "padding",
                              "sequence_parallel", "settings", "microbatch.batches", "microbatch.nested",
                              "microbatch.partition", "microbatch.tensordicts")), unreachable=IMPL_UNREACHABLE,
        conventions=VERL_CONVENTIONS,  # a drop-in keeps verl's conventions
        media=MEDIA,  # multi_modal_inputs handed to the model (impl.multimodal)
        refuses={"pad_mode": "impl prepares nested (no_padding) micro-batches only: UnsupportedConfigError",
                 "bucket_distillation": "a static bucket would misalign the teacher tensors: UnsupportedConfigError"},
        config_space=IMPL_CONFIG_SPACE)
    engine_classes = {"lm": impl.LMHeadEngine, "value": impl.ValueHeadEngine}

    def make(self, head: str = "lm", **settings: Any) -> Any:
        return self.engine_classes[head](**settings)

    def helper(self, name: str) -> Callable | None:
        return getattr(impl, name) if name in HELPERS else None

    def microbatch_layer(self) -> MicroBatchLayer | None:
        """``impl.microbatch``: a drop-in with verl 0.9.1's names."""
        return layer_from("impl", [impl.microbatch])

    def step_layer(self) -> StepLayer:
        """impl's training step (spec/engines/impl/step.py): impl.step's losses over impl's micro-batch layer."""
        return impl_step_layer()

    def repro_snippet(self, settings: Any) -> ReproSnippet | None:
        """impl's own entry points (a subclass with other engine classes, e.g. a planted bug, keeps the default)."""
        if type(self) is not ImplEngine:
            return super().repro_snippet(settings)
        return ReproSnippet(source("spec.engines.impl.repro_snippet"), requires="rl-ioprep (this project's impl/)", standalone=True)

