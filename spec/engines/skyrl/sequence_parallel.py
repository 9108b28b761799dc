"""SkyRL's Ulysses sequence parallelism on real ranks (both versions: ``HFModelWrapper(sequence_parallel_size=sp)``).

``HFModelWrapper.forward`` slices its row with its own ``ulysses_pad_and_slice_inputs`` (pads the row to a multiple of
``sp``, then keeps this rank's ``1/sp``; the rolled ids likewise, rolled on the whole row first) and gathers the
log-probs and entropy back with ``gather_outputs_and_unpad``, both through SkyRL's module-level Ulysses group
(``skyrl_train.distributed.ulysses.utils``: ``set_ulysses_sequence_parallel_group``, as its FSDP workers set it).
So an ``sp > 1`` engine object runs on the suite's real ranks (:mod:`spec.execute.ranks`), built with the
``all_gather`` the rank worker hands every engine, whose ``.group`` is the rank's process group
(:class:`impl.sequence_parallel.TorchDistributedAllGather`): :func:`ulysses_rank` checks it (the protocol's
:func:`~spec.protocol.engine.sp_process_group`, verl's check too), and :class:`OnRank` runs
the engine object's calls with SkyRL's group set (:func:`ulysses_group`) and keeps what SkyRL's own slicing returned
(:func:`recording_slices`), so the view reads the labels this rank scores (the rolled ids' shard) as SkyRL cut them,
not as the suite would. :class:`UlyssesOnRealRanks` is what the engine class adds.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

from ...protocol import Feature, InputsView
from ...protocol.engine import media_view, sp_process_group
from ..kit import rows_view

__all__ = ["UlyssesRank", "ulysses_rank", "ulysses_group", "recording_slices", "sharded_rows_view", "AloneOnItsRank",
           "OnRank", "UlyssesOnRealRanks"]


class UlyssesRank(NamedTuple):
    """This rank's Ulysses group: its size and the process group (``None``: no sequence parallelism)."""

    size: int
    group: Any


def ulysses_rank(sp_size: Any, sp_rank: Any, all_gather: Any, library: str) -> UlyssesRank:
    """The rank's group from the suite's settings (:func:`spec.protocol.engine.sp_process_group`: none for
    ``sp_size`` 1; above 1 the ``all_gather``'s real process group, its world size and rank checked)."""
    group = sp_process_group(sp_size, sp_rank, all_gather, library)
    return UlyssesRank(1, None) if group is None else UlyssesRank(int(sp_size), group)


def _ulysses_utils(wrapper_class: type) -> Any:
    """SkyRL's Ulysses module, the one the wrapper's module imported its gather from (its slicing may be
    :func:`recording_slices`' while it runs)."""
    gather = sys.modules[wrapper_class.__module__].gather_outputs_and_unpad
    return sys.modules[gather.__module__]


@contextmanager
def ulysses_group(wrapper_class: type, rank: UlyssesRank) -> Iterator[None]:
    """SkyRL's module-level Ulysses group set to ``rank.group`` for the block (where there is one), then put back."""
    if rank.group is None:
        yield
        return
    utils = _ulysses_utils(wrapper_class)
    before = utils.get_ulysses_sequence_parallel_group()
    utils.set_ulysses_sequence_parallel_group(rank.group)
    try:
        yield
    finally:
        utils.set_ulysses_sequence_parallel_group(before)


@contextmanager
def recording_slices(wrapper_class: type) -> Iterator[list]:
    """The results of every ``ulysses_pad_and_slice_inputs`` call the wrapper's forward makes in the block, in order
    (its first slices the ids, positions and mask; its second the rolled ids: the labels this rank scores)."""
    module = sys.modules[wrapper_class.__module__]
    original, calls = module.ulysses_pad_and_slice_inputs, []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        calls.append(result)
        return result

    module.ulysses_pad_and_slice_inputs = recorded
    try:
        yield calls
    finally:
        module.ulysses_pad_and_slice_inputs = original


def sharded_rows_view(model_inputs: dict, output_args: dict) -> InputsView:
    """The rows' labels rolled by one (the kit's :func:`rows_view`); under sequence parallelism this rank's shard of
    them and the row's pad as SkyRL's own slicing returned them (``shard_labels``, ``pad_size``: :class:`OnRank`
    keeps them), at the mask's positions where the rank has a mask (padded)."""
    if "shard_labels" not in output_args:
        return rows_view(model_inputs, output_args)
    shard, mask = output_args["shard_labels"], model_inputs.get("attention_mask")
    labels = shard[mask.bool()] if mask is not None else shard.reshape(-1)
    return InputsView(model_inputs["input_ids"], model_inputs.get("position_ids"), mask, labels=labels,
                      pad_size=output_args["pad_size"], media=media_view(model_inputs), routes=output_args.get("routes"))


class AloneOnItsRank:
    """A SkyRL engine object's Ulysses group (``sp``) where it runs without sequence parallelism; :class:`OnRank`
    sets the rank's own."""

    sp = UlyssesRank(1, None)


class OnRank:
    """A SkyRL engine object (its ``wrapper``: ``HFModelWrapper``, built with ``sequence_parallel_size=obj.sp.size``)
    on one rank: each call runs with SkyRL's Ulysses group set (:func:`ulysses_group`), and ``prepare_model_inputs``
    keeps, under sequence parallelism, the labels' shard and the row's pad SkyRL's own slicing returned (its second
    ``ulysses_pad_and_slice_inputs`` call slices the rolled ids; its first returns the pad) in the ``output_args``
    (``shard_labels``, ``pad_size``: :func:`sharded_rows_view` reads them)."""

    def __init__(self, obj: Any, rank: UlyssesRank):
        self.obj, self.rank = obj, rank
        obj.sp = rank

    def prepare_model_inputs(self, mb: Any) -> tuple[dict, dict]:
        with ulysses_group(self.obj.wrapper, self.rank), recording_slices(self.obj.wrapper) as slices:
            inputs, args = self.obj.prepare_model_inputs(mb)
        if self.rank.size > 1:
            args["shard_labels"], args["pad_size"] = slices[1][0], slices[0][3]
        return inputs, args

    def prepare_model_outputs(self, output: Any, output_args: dict, mb: Any, logits_processor_func: Any = None) -> Any:
        with ulysses_group(self.obj.wrapper, self.rank):
            return self.obj.prepare_model_outputs(output, output_args, mb, logits_processor_func)

    def __getattr__(self, name: str) -> Any:  # the engine object's other attributes, as they are
        if name == "obj":  # not set yet (a copy being built): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.obj, name)


class UlyssesOnRealRanks:
    """What a SkyRL engine adds to the kit's :class:`~spec.engines.kit.ThirdPartyEngine` (listed before it): Ulysses
    sequence parallelism offered on real ranks, its engine object's group from the settings, the sharded view."""

    offers = frozenset({Feature.SP, Feature.REAL_RANKS})
    sp_on_real_ranks = True  # sp > 1 needs SkyRL's process group: spec.execute.harness sends those cases to real ranks
    view_inputs = staticmethod(sharded_rows_view)  # the rows rolled by one; under SP this rank's shard of them

    def make(self, head: str = "lm", **settings: Any) -> Any:
        """The kit's engine object on this rank (:class:`OnRank`), its Ulysses group from ``sp_size``, ``sp_rank``
        and the ``all_gather``'s process group (:func:`ulysses_rank`)."""
        rank = ulysses_rank(settings.pop("sp_size", 1), settings.pop("sp_rank", 0), settings.pop("all_gather", None),
                            self.library)
        return OnRank(super().make(head, **settings), rank)

    def strategy_limits(self) -> dict[str, Any]:
        """The kit's, with no ``sp > 1`` drawn by the generic strategies (a real-rank pool per example): the
        sequence-parallel invariants force it, as for verl."""
        return {**super().strategy_limits(), "allow_sp": False}
