"""What a run needs from its machine (GPUs, backends), read from its RunConfig."""

from __future__ import annotations

from engine.config import RunConfig
from engine.requirements import Requirements, run_requirements


def need(**sections: dict) -> Requirements:
    return run_requirements(RunConfig.model_validate(sections))


def test_gpus_follow_the_trainer_device_and_ranks() -> None:
    assert need() == Requirements(gpus=0, backends=frozenset({"torch"}), gpus_used=1)
    assert need(trainer={"device": "auto"}).gpus == 0  # runs anywhere, on lent GPUs if any
    assert need(trainer={"device": "cpu"}).gpus_used == 0  # takes none even where GPUs are lent
    assert need(trainer={"device": "cuda"}) == Requirements(gpus=1, gpus_used=1)
    ranks = need(trainer={"device": "cuda", "backend": "deepspeed", "num_ranks": 4})
    assert (ranks.gpus, ranks.gpus_used) == (4, 4)


def test_a_rollout_device_beside_the_trainer_takes_the_gpus_it_reaches() -> None:
    beside = need(trainer={"device": "cuda"}, rollout={"device": "cuda:1"})
    assert (beside.gpus, beside.gpus_used) == (2, 2)
    assert need(trainer={"device": "cuda"}, rollout={"device": "cuda"}).gpus == 1


def test_backends_and_their_description() -> None:
    full = need(
        rollout={"backend": "vllm"},
        trainer={"device": "cuda", "backend": "deepspeed", "num_ranks": 4, "logprob_impl": "triton"},
    )
    assert full.backends == {"torch", "vllm", "deepspeed", "triton"}
    assert full.describe() == "4 GPUs and backends deepspeed, triton, vllm"
    assert need(trainer={"logprob_impl": "fused"}).backends == {"torch"}
    assert Requirements().describe() == "no GPU"
    assert Requirements(gpus=1).describe() == "1 GPU"
