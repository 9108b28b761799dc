"""Real ranks (spec/execute/ranks.py): processes joined by torch.distributed, against the in-process runs.

Worked cases with hand-checkable structure; failures of a rank (exception, crash, hang) must
fail the call in bounded time with that rank's traceback; the CUDA (nccl) path skips without GPUs.

"Bounded time" is asserted by what the failure says, never by a wall clock (which would include process
start-up and imports on a loaded machine): an exception or a crash on one rank must come back as that
exception or as "died", not as the task timeout's "did not answer"; a hung rank as the timeout it was given.
"""

from __future__ import annotations

import pytest
import torch

import impl
from spec.execute import ranks
from spec.cases.structure import EngineCase
from spec.run.registry import load_engine
from spec.execute.harness import execute
from spec.cases.materialize import materialize
from tests.rank_engines import CRASH, HANG, RAISE

pytestmark = pytest.mark.skipif(ranks.unavailable("cpu") is not None, reason=str(ranks.unavailable("cpu")))

SEED = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=(0.5, 2.0), calculate_entropy=True)


@pytest.mark.parametrize("sp", ranks.WORLDS)
def test_impl_on_real_ranks_equals_threads_and_single_rank(sp: int) -> None:
    case = SEED.with_(sp_size=sp, calculate_sum_pi_squared=True)
    engine = load_engine("impl")
    real = ranks.execute(engine, case)
    threads = execute(engine, case)
    single = execute(engine, case.with_(sp_size=1))
    assert len(real.rank_outputs) == sp
    for r in range(sp):
        for key in ("log_probs", "entropy", "sum_pi_squared"):
            assert torch.equal(real.rank_outputs[r][key].values(), threads.rank_outputs[r][key].values()), (r, key)
            assert torch.allclose(real.rank_outputs[r][key].values(), single.outputs[key].values(), atol=1e-5)
            assert torch.equal(real.rank_outputs[r][key].offsets(), torch.tensor([0, 5, 8]))


def test_sp3_slices_a_global_row_of_eight_tokens() -> None:
    # 8 tokens on 3 ranks: pad 1, three shards of 3; the labels are the global row rolled by one.
    case = SEED.with_(sp_size=3)
    run = ranks.execute(load_engine("impl"), case, stop_after_inputs=True)
    ids = run.micro_batch["input_ids"].values()
    rolled = torch.cat([torch.roll(ids, -1), torch.zeros(1, dtype=ids.dtype)])
    assert [a["pad_size"] for a in run.output_args] == [1, 1, 1]
    for r in range(3):
        assert run.inputs[r]["input_ids"].shape == (1, 3)
        assert torch.equal(run.output_args[r]["input_ids_rmpad_rolled"], rolled[3 * r: 3 * r + 3])
    assert torch.equal(run.output_args[2]["temperature_rmpad"], torch.tensor([2.0, 2.0, 1.0]))


def test_engine_error_is_reraised_with_its_type_and_rank_traceback() -> None:
    case = SEED.with_(sp_size=2, use_fused_kernels=True)  # fused kernels with per-sample temperature
    with pytest.raises(impl.errors.TemperatureError) as info:
        ranks.execute(load_engine("impl"), case)
    assert any("raised on real rank 0" in note for note in getattr(info.value, "__notes__", []))


@pytest.fixture
def own_pool():
    """Two ranks of one's own: the misbehaving engines below kill their pool."""
    workers = ranks.RankPool("gloo", world=2)
    yield workers
    workers.close(force=True)


def test_an_error_on_one_rank_does_not_hang_the_others(own_pool) -> None:
    # the other rank waits in a collective: without the error being shared it would hit the 60 s task timeout
    # and come back as a RankFailure ("did not answer"), not as rank one's ValueError
    with pytest.raises(ValueError, match="rank one refuses") as info:
        ranks.execute(RAISE, SEED.with_(sp_size=2), timeout=60, workers=own_pool)
    assert any("rank_engines.py" in note and "in misbehave" in note for note in info.value.__notes__)


def test_a_crashed_rank_fails_in_bounded_time_with_its_traceback(own_pool) -> None:
    with pytest.raises(ranks.RankFailure, match=r"rank\(s\) \[1\] died") as info:  # not "did not answer"
        ranks.execute(CRASH, SEED.with_(sp_size=2), timeout=60, workers=own_pool)
    message = str(info.value)
    assert "exit code -11" in message and "in misbehave" in message  # SIGSEGV, and faulthandler's stack
    # the engine's failure on that example (a failed check), not the suite's
    assert isinstance(info.value, ranks.RankFault) and isinstance(info.value, AssertionError)
    assert not own_pool.alive()


def test_a_hung_rank_fails_in_bounded_time_with_its_traceback(own_pool) -> None:
    with pytest.raises(ranks.RankFailure, match="did not answer within 8 s") as info:
        ranks.execute(HANG, SEED.with_(sp_size=2), timeout=8, workers=own_pool)
    message = str(info.value)
    assert "--- rank 1" in message and "misbehave" in message  # rank 1's stack: asleep in the engine
    assert isinstance(info.value, ranks.RankFault)


def test_sharded_processor_matches_the_whole_row_processor() -> None:
    case = SEED.with_(distillation_keys=("distillation_losses", "overlap_count"), topk=3)
    mb = materialize(case)
    logits = torch.randn(1, case.total_nnz, case.vocab, generator=torch.Generator().manual_seed(1))
    whole = ranks.ShardedTopKProcessor(case.distillation_keys, 1, 0)(student_logits=logits, data=mb)
    for sp in ranks.WORLDS:
        local = -(-case.total_nnz // sp)
        padded = torch.cat([logits, torch.zeros(1, local * sp - case.total_nnz, case.vocab)], dim=1)
        parts = [ranks.ShardedTopKProcessor(case.distillation_keys, sp, r)(
            student_logits=padded[:, r * local:(r + 1) * local], data=mb) for r in range(sp)]
        for key in case.distillation_keys:
            joined = torch.cat([p[key] for p in parts], dim=1)[:, : case.total_nnz]
            assert torch.allclose(joined, whole[key]), (sp, key)


def test_backend_follows_the_device() -> None:
    assert ranks.backend_for("cpu") == "gloo"
    assert ranks.backend_for("cuda") == "nccl"


@pytest.mark.skipif(ranks.unavailable("cuda", 2) is not None, reason=str(ranks.unavailable("cuda", 2)))
def test_nccl_ranks_on_cuda_match_cpu() -> None:
    case = SEED.with_(sp_size=2)
    engine = load_engine("impl")
    gpu = ranks.execute(engine, case, "cuda")
    cpu = ranks.execute(engine, case, "cpu")
    for key, value in cpu.outputs.items():
        assert gpu.outputs[key].values().device.type == "cuda"
        assert torch.allclose(gpu.outputs[key].values().cpu(), value.values(), atol=1e-4)


def test_a_mutant_runs_on_the_real_ranks_as_in_this_process() -> None:
    """spec mutate's probe (spec.execute.probe): the mutant the parent sets runs on every real rank (the task
    carries it) as it runs here; set back to none, the ranks run the engine's own code again."""
    from spec.execute import probe
    from spec.mutate import mutants_of

    engine = load_engine("impl")
    case = SEED.with_(sp_size=2, calculate_entropy=True)
    plain = ranks.execute(engine, case).rank_outputs[0]["entropy"].values()

    def entropy_with(mutant):
        probe.set_mutant(mutant.mutation)
        try:
            return execute(engine, case).rank_outputs[0]["entropy"].values(), \
                ranks.execute(engine, case).rank_outputs[0]["entropy"].values()
        finally:
            probe.set_mutant(None)

    for mutant in (m for m in mutants_of(("impl.logits:_statistics",)) if m.operator == "arith"):  # defined values
        here, there = entropy_with(mutant)
        if here.isfinite().all() and not torch.equal(here, plain):  # a mutant the entropy shows (defined values)
            assert torch.equal(there, here), mutant.id
            break
    else:
        pytest.fail("no mutant of _statistics changed the entropy")
    assert torch.equal(ranks.execute(engine, case).rank_outputs[0]["entropy"].values(), plain)
