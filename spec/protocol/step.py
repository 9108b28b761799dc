"""The training step in framework-neutral terms: from a trainer's mini-batch to the loss and its gradient.

A step (issue 49) cuts the mini-batch over data-parallel ranks and, on each rank, into micro-batches (by a sample
count or a token budget; ranks that need fewer micro-batches get more or padding ones so that every rank runs the
same number); hands each micro-batch some *global facts* (the mini-batch's token count over every rank, the DP size,
the global batch size, the accumulation steps); runs the engine's preparation and the model on it; turns the per-token
loss into the scalar that micro-batch backpropagates; and puts the per-sample outputs back in mini-batch order.
Gradients accumulate over a rank's micro-batches and DDP/FSDP averages them over the ranks.

What a framework declares is data where it can be (:class:`StepLayer`: the cuts it allows, the facts it hands, every
aggregation mode of every loss it offers, each as an :class:`Aggregation` formula) and its own functions where it
must, under the neutral names of :data:`STEP_FUNCTIONS` (any framework binds its own callables to them: verl's
``prepare_micro_batches``/``ppo_loss``/``postprocess_batch_func``, TRL's ``GRPOTrainer._compute_loss``, ...):

======================= ===========================================================================================
``cut``                 ``(minis: list[TensorDict], plan: CutPlan) -> list[(micro_batches, index lists | None)]``:
                        every rank's mini-batch cut into its micro-batches (the ranks agree on one count)
``facts``               ``(minis: list[TensorDict], plan: CutPlan) -> list[dict]``: per rank, the global facts its
                        micro-batches are handed (:class:`Fact` names; what the framework all-reduces)
``loss``                ``(outputs: dict, micro_batch: TensorDict, facts: dict, setting: LossSetting) -> 0-d tensor``:
                        the scalar one micro-batch backpropagates, from the engine's per-token outputs (nested over
                        the full sequences) and the micro-batch's step keys (:data:`STEP_KEYS`)
``restore``             ``(outputs: list[dict], indices, mini: TensorDict) -> dict``: one rank's per-micro-batch
                        outputs back in its mini-batch's sample order
``forward_backward``    optional: ``(obj, model, mini, plan, setting, group, loss_function, processor) -> dict``:
                        one rank's whole step as the framework's own step function runs it on a real data-parallel
                        rank (verl's ``forward_backward_batch``): the cut, the global facts (the framework's own
                        collectives over ``group``, the DP group), every micro-batch through the engine object ``obj``'s
                        preparation and ``model``, ``loss_function(model_output, micro_batch) -> 0-d tensor``
                        backpropagated, the outputs restored (returned, the framework's ``model_output``). The facts a
                        micro-batch is handed are its non-tensor entries of the :class:`Fact` names
======================= ===========================================================================================

A layer with ``forward_backward`` runs its DP > 1 steps on real ranks (spec/execute/step_rank.py): the suite restates
no fact and simulates no collective there; at DP = 1 the four functions above run in one process.

The oracle (spec/truth/step_oracle.py) evaluates each :class:`Aggregation` on the uncut mini-batch in float64; the
invariants (spec/invariants/step.py) compare the step with it over every cut the layer allows. A mode a library
documents as local (TRL's ``bnpo``: each micro-batch normalised by its own tokens) says so (``scope=MICRO_BATCH``,
``documented=``), and the invariant checks that documented normalisation instead. This module imports nothing of
``spec``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable, Iterable, Mapping

__all__ = ["STEP_FUNCTIONS", "REQUIRED_STEP_FUNCTIONS", "STEP_KEYS", "PROMPT_KEY", "Cut", "Fact", "Weighting", "Divisor", "Scope", "PerToken", "Aggregation",
           "PER_TOKEN_PARAMETERS", "LossDeclaration", "LossSetting", "CutPlan", "StepLayer"]

#: the functions a step layer offers, by neutral name (a framework binds its own callables)
STEP_FUNCTIONS = ("cut", "facts", "loss", "restore", "forward_backward")
#: the functions every step layer must offer (``forward_backward`` is optional: a framework with a collective step)
REQUIRED_STEP_FUNCTIONS = STEP_FUNCTIONS[:4]
#: the per-sample step keys every micro-batch carries besides the preparation's (nested over each response):
#: the loss mask, the old policy's log-probs, the advantages, the old values and the returns
STEP_KEYS = ("response_mask", "old_log_probs", "advantages", "values", "returns")
#: the per-sample prompt id (int64 ``(B,)``: consecutive samples sampled from one prompt share it, GRPO's
#: ``n_samples_per_prompt`` responses; verl's and SkyRL's ``uid``), carried where an aggregation reads the prompt groups
PROMPT_KEY = "uid"


class Cut(str, Enum):
    """How a rank's share of the mini-batch becomes micro-batches."""

    COUNT = "count"  #: micro_batch_size samples each (the fixed-size path, TRL's per_device_train_batch_size)
    TOKENS = "tokens"  #: a token budget per micro-batch (verl's use_dynamic_bsz, balanced)


class Fact(str, Enum):
    """A global fact a micro-batch is handed (what the framework computes over the whole mini-batch)."""

    BATCH_NUM_TOKENS = "batch_num_tokens"  #: valid loss tokens of the mini-batch on every rank
    DP_SIZE = "dp_size"  #: the data-parallel world size
    GLOBAL_BATCH_SIZE = "global_batch_size"  #: samples of the mini-batch on every rank
    ACCUMULATION_STEPS = "accumulation_steps"  #: micro-batches per rank (gradient accumulation)
    RESPONSE_WIDTH = "response_width"  #: the longest response of the mini-batch on every rank (a global horizon)
    #: the mini-batch's prompt groups (each one's loss tokens on every rank, and their count: SkyRL's
    #: ``prompt_boundaries``, computed from the samples' :data:`PROMPT_KEY`)
    PROMPT_GROUPS = "prompt_groups"


class Weighting(str, Enum):
    """How one sequence's valid token losses enter the sum."""

    TOKEN = "token"  #: each token as it is (a token sum)
    SEQUENCE_MEAN = "sequence_mean"  #: each token divided by its sequence's valid-token count (a token mean)
    #: each token divided by its prompt group's valid-token count over the mini-batch (a token mean per prompt:
    #: SkyRL's prompt_mean)
    PROMPT_MEAN = "prompt_mean"


class Divisor(str, Enum):
    """A factor of what the weighted sum is divided by."""

    TOKENS = "tokens"  #: valid loss tokens (of the scope)
    SEQUENCES = "sequences"  #: samples (of the scope)
    #: samples with at least one loss token (of the scope): OpenRLHF's aggregate_loss leaves fully masked ones out
    VALID_SEQUENCES = "valid_sequences"
    PROMPTS = "prompts"  #: prompt groups (of the scope; one counted wherever any of its samples is)
    HORIZON = "horizon"  #: a constant length: the mode's setting (verl's loss_scale_factor, TRL's max_completion_length)


class Scope(str, Enum):
    """Where a divisor is counted."""

    GLOBAL = "global"  #: the whole mini-batch on every rank: the loss is the uncut mini-batch's
    MICRO_BATCH = "micro_batch"  #: each micro-batch's own (documented local): the micro-batches' losses averaged


class PerToken(str, Enum):
    """The per-token loss before aggregation, as the step's inputs make it (spec/truth/step_oracle.py evaluates it)."""

    RATIO = "ratio"  #: -A * exp(log_prob - old_log_prob) (PPO/GRPO inside the clip range)
    #: -A * exp(the sequence's mean masked (log_prob - old_log_prob)) (GSPO/LUSPO's sequence-level ratio, unclipped)
    SEQUENCE_RATIO = "sequence_ratio"
    VALUE = "value"  #: 0.5 * (value - return)^2 (a critic inside its value clip range)
    NLL = "nll"  #: -log_prob (SFT)
    #: max(0, sum_j exp(p_j) (p_j - q_j)) over the teacher's top-K ids (verl's forward_kl_topk distillation, clamped at 0)
    TOPK_FORWARD_KL = "topk_forward_kl"
    #: -clamp(ratio, low, high).detach() * A * log_prob (CISPO: the importance weight clipped and stopped, times the
    #: log-prob; parameters ``low``, ``high``)
    CLIPPED_WEIGHT = "clipped_weight"
    #: -A * exp(log_prob - sg(log_prob) + sg(the sequence's mean masked log-ratio)) (GSPO-token: the sequence's ratio
    #: as the value, each token's own log-prob carrying the gradient)
    SEQUENCE_RATIO_TOKEN = "sequence_ratio_token"
    #: -sigmoid(tau * (ratio - 1)) * 4 / tau * A, tau = ``tau_pos`` where A > 0, else ``tau_neg`` (SAPO's soft gate)
    SOFT_GATE = "soft_gate"
    #: -phi(w).detach() * A * log_prob with w the sequence's importance ratio exp(sum of masked log-ratios, each
    #: clamped to +-20, the sum to [log 1e-8, 20]) and phi(w) = exp(lam + k log w - lam w), (k, lam) = (``k_pos``,
    #: ``lambda_pos``) where A >= 0, else (``k_neg``, ``lambda_neg``) (VESPO's Gamma weight)
    GAMMA_WEIGHT = "gamma_weight"
    #: -A * log_prob (the plain policy gradient, no ratio: GPG, REINFORCE)
    POLICY_GRADIENT = "policy_gradient"
    #: -(A * log_prob - beta / 2 * (log_prob - old_log_prob)^2) (DRO: the policy gradient with a quadratic log-ratio
    #: penalty; parameter ``beta``)
    QUADRATIC_PENALTY = "quadratic_penalty"


#: the parameters each per-token form reads (:attr:`LossDeclaration.parameters`)
PER_TOKEN_PARAMETERS: dict[PerToken, tuple[str, ...]] = {
    PerToken.CLIPPED_WEIGHT: ("low", "high"), PerToken.SOFT_GATE: ("tau_pos", "tau_neg"),
    PerToken.GAMMA_WEIGHT: ("k_pos", "lambda_pos", "k_neg", "lambda_neg"), PerToken.QUADRATIC_PENALTY: ("beta",)}


@dataclass(frozen=True)
class Aggregation:
    """One aggregation mode: the loss is ``sum_i sum_t w_i m_it l_it / prod(divisors)``, counted over ``scope``.

    ``name``: the library's own name of the mode. ``horizon``: for a :attr:`Divisor.HORIZON` mode, the setting that
    gives the constant (None: the mini-batch's longest response, :attr:`Fact.RESPONSE_WIDTH`). ``documented``: for a
    :attr:`Scope.MICRO_BATCH` mode, where the library documents its local normalisation."""

    name: str
    weighting: Weighting = Weighting.TOKEN
    divisors: tuple[Divisor, ...] = (Divisor.TOKENS,)
    scope: Scope = Scope.GLOBAL
    documented: str = ""

    @property
    def reads_prompts(self) -> bool:
        """Whether the mode reads the samples' prompt groups (:data:`PROMPT_KEY`)."""
        return self.weighting is Weighting.PROMPT_MEAN or Divisor.PROMPTS in self.divisors

    def __post_init__(self) -> None:
        if self.scope is Scope.MICRO_BATCH and not self.documented:
            raise ValueError(f"aggregation {self.name!r}: a micro-batch (local) scope must say where the library "
                             "documents it")


@dataclass(frozen=True)
class LossDeclaration:
    """One loss a framework's step offers: its per-token form, the head it trains (``lm`` or ``value``), its
    aggregation modes (every one the library offers), and the constant horizons it may be given."""

    name: str
    per_token: PerToken
    modes: tuple[Aggregation, ...]
    head: str = "lm"
    #: horizon settings drawn for a HORIZON mode (None: the library's default)
    horizons: tuple[int | None, ...] = (None,)
    #: modes the library offers that the suite does not draw, each with why
    undrawn: Mapping[str, str] = field(default_factory=dict)
    #: the teacher's top-K the loss reads (distillation: the engine's top-K processor computes its per-token terms)
    topk: int = 0
    #: the per-token form's parameters (:data:`PER_TOKEN_PARAMETERS`), as the library is configured for the step
    parameters: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        wanted = set(PER_TOKEN_PARAMETERS.get(PerToken(self.per_token), ()))
        if set(self.parameters) != wanted:
            raise ValueError(f"loss {self.name!r}: per-token form {PerToken(self.per_token).value!r} reads the parameters "
                             f"{sorted(wanted)}, got {sorted(self.parameters)}")

    def mode(self, name: str) -> Aggregation:
        for mode in self.modes:
            if mode.name == name:
                return mode
        raise ValueError(f"loss {self.name!r} has no aggregation mode {name!r}; it offers "
                         f"{[m.name for m in self.modes]}")


@dataclass(frozen=True)
class LossSetting:
    """What one step computes: the loss, its aggregation mode and (a HORIZON mode) its horizon setting."""

    loss: str
    mode: str
    horizon: int | None = None


@dataclass(frozen=True)
class CutPlan:
    """How the step cuts: the DP size, the cut, its size (samples per micro-batch, or the token budget)."""

    dp_size: int
    cut: Cut
    micro_batch_size: int = 1
    max_token_len: int = 0
    #: the mini-batch's samples on every rank, as the trainer's configuration states it (verl's
    #: ``ppo_mini_batch_size * rollout.n``, handed as ``global_batch_size``); 0: not stated
    global_batch_size: int = 0


@dataclass(frozen=True)
class StepLayer:
    """One framework's step: what it allows and offers (data) and its functions (:data:`STEP_FUNCTIONS`)."""

    name: str
    cuts: tuple[Cut, ...]
    facts: tuple[Fact, ...]
    losses: tuple[LossDeclaration, ...]
    functions: Mapping[str, Callable[..., Any]]
    dp_sizes: tuple[int, ...] = (1, 2)
    #: a COUNT cut whose micro-batches must all hold the same number of samples (TRL's per-device batch)
    equal_micro_batches: bool = False
    #: where a rank that needs fewer micro-batches gets padding micro-batches (rather than a finer cut)
    padding_micro_batches: bool = False
    #: a ``forward_backward`` that reads its DP group and size off the whole world (verl's FSDP engine without a
    #: device mesh: ``torch.distributed.group.WORLD``, ``get_world_size() // sp``): its ranks run in a world of
    #: exactly ``dp`` ranks. Otherwise the DP group is handed to it, a subgroup of the suite's rank pool (the other
    #: ranks idle), so a size or count read off another group than the one handed shows
    world_is_dp: bool = False
    #: a layer without ``forward_backward`` whose DP > 1 steps run their ranks one after the other in one process: why
    #: that is the library's step (no collective in it, or where the collective it has lives and what it computes)
    in_process: str = ""
    #: functions of the layer that state the library's behaviour in the suite's code (the library's own cannot take
    #: the suite's batches), each with what it states: checks that would read only such a function are not the
    #: library's and are skipped with this reason (spec/invariants/microbatch_step.py)
    restated: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.functions) - set(STEP_FUNCTIONS)
        if unknown:
            raise ValueError(f"step layer {self.name!r}: unknown functions {sorted(unknown)}; known: {STEP_FUNCTIONS}")
        if set(self.restated) - set(self.functions):
            raise ValueError(f"step layer {self.name!r}: restated functions {sorted(set(self.restated) - set(self.functions))} "
                             "it does not offer")
        if "forward_backward" not in self.functions and max(self.dp_sizes) > 1 and not self.in_process:
            raise ValueError(f"step layer {self.name!r}: DP sizes {self.dp_sizes} without the library's own step "
                             "function (forward_backward): say why its ranks may run in one process (in_process=...)")

    def get(self, name: str) -> Callable[..., Any]:
        if name not in STEP_FUNCTIONS:
            raise ValueError(f"unknown step function {name!r}; known: {STEP_FUNCTIONS}")
        return self.functions[name]

    def lacks(self, names: Iterable[str] = REQUIRED_STEP_FUNCTIONS) -> str | None:
        absent = [n for n in names if n not in self.functions]
        return None if not absent else f"{self.name}'s step layer has no {', '.join(absent)}"

    def loss(self, name: str) -> LossDeclaration:
        for loss in self.losses:
            if loss.name == name:
                return loss
        raise ValueError(f"step layer {self.name!r} has no loss {name!r}; it offers {[x.name for x in self.losses]}")

    def with_functions(self, name: str, **replaced: Callable[..., Any]) -> "StepLayer":
        """The same layer with some functions replaced (planted bugs, wrappers)."""
        for key in replaced:
            self.get(key)
        return replace(self, name=name, functions={**self.functions, **replaced})

    @property
    def collective(self) -> bool:
        """Whether the framework's own step function runs on real ranks (``forward_backward`` offered)."""
        return "forward_backward" in self.functions
