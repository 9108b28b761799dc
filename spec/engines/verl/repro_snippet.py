"""verl's FSDP engine object built as :meth:`spec.engines.verl.VerlEngine.make` builds it, for a standalone
reproducer (:meth:`~spec.engines.verl.VerlEngine.repro_snippet`): the engine block a file carries, vendored from
this module (read from its file, not imported: it imports verl) after the two lines that say what this verl offers.
Imported only where verl is installed."""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

#: what the file binds for this module: whether this verl's prepare_model_outputs takes the logits processor (0.9)
#: and whether it has the static bucket of the packed length
BOUND = ("TAKES_PROCESSOR", "HAS_BUCKET")

warnings.filterwarnings("ignore")
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402
from verl.workers.utils import padding  # noqa: E402
from verl.utils import ulysses  # noqa: E402


class _Engine:
    """verl's FSDP engine without its constructor (no model, no process group): only the attributes
    prepare_model_inputs / prepare_model_outputs read are set."""

    def __init__(self, engine):
        self.engine = engine

    @contextlib.contextmanager
    def _ulysses_group(self):  # verl's Ulysses group for the call, as its engine mode contexts set it
        previous = ulysses.get_ulysses_sequence_parallel_group()
        ulysses.set_ulysses_sequence_parallel_group(self.engine.ulysses_parallel_group)
        try:
            yield
        finally:
            ulysses.set_ulysses_sequence_parallel_group(previous)

    def prepare_model_inputs(self, micro_batch):
        config = self.engine.module.config  # a vision-language config for mRoPE positions (read only when sp > 1)
        if micro_batch["position_ids"].dim() == 3:
            config.vision_config = SimpleNamespace()
        elif hasattr(config, "vision_config"):
            del config.vision_config
        with self._ulysses_group():
            return self.engine.prepare_model_inputs(micro_batch)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        if hasattr(self.engine.module, "v_head"):  # trl's AutoModelForCausalLMWithValueHead: (lm_logits, loss, value)
            output = (None, None, output.logits.squeeze(-1))
        with self._ulysses_group():
            if TAKES_PROCESSOR:  # verl 0.9: prepare_model_outputs takes the logits processor
                return self.engine.prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            return self.engine.prepare_model_outputs(output, output_args, micro_batch)


def make_engine(head, sp_size=1, pad_to_length=None, pass_cu_seqlens=False, entropy_chunk_size=None,
                entropy_checkpointing=False, v_head=False, sp_rank=0, all_gather=None, use_chunked_topk=False,
                chunked_topk_chunk_size=4096, log_prob_min_clamp=None):
    # use_chunked_topk, chunked_topk_chunk_size, log_prob_min_clamp configure verl's top-K processor (logits_processor
    # below, where this verl ships one), not the engine
    cls = {"lm": transformer_impl.FSDPEngineWithLMHead, "value": transformer_impl.FSDPEngineWithValueHead}[head]
    eng = object.__new__(cls)
    # sp > 1 on real ranks: verl's Ulysses path all-gathers over the process group the all-gather carries
    eng.use_ulysses_sp = sp_size > 1
    eng.ulysses_sequence_parallel_size = sp_size
    eng.ulysses_parallel_group = getattr(all_gather, "group", None) if sp_size > 1 else None
    chunk = entropy_chunk_size
    eng.engine_config = SimpleNamespace(entropy_checkpointing=entropy_checkpointing,
                                        entropy_from_logits_with_chunking=bool(chunk),
                                        entropy_from_logits_chunk_size=int(chunk or 2048), use_torch_compile=False)
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits_with_chunking if chunk else verl_F.entropy_from_logits
    eng.module = SimpleNamespace(config=SimpleNamespace())
    if v_head and head == "value":
        eng.module.v_head = SimpleNamespace()
    eng.pass_packed_cu_seqlens = pass_cu_seqlens
    if HAS_BUCKET:  # a verl with the static bucket of the packed length
        eng.pad_to_length = bool(pad_to_length)
        eng.pad_to_length_bucket = int(pad_to_length) if pad_to_length else 1
    return _Engine(eng)


def helper(name):
    return getattr(padding, name, None)
