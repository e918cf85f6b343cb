"""What a run trains: the model (``model``) and the prompts (``data``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config.section import Section
from engine.config.stages import StageConfig, check_stage_list


class ModelConfig(Section):
    path: str = Field(
        "starter",
        title="Model",
        description="Local directory of a causal LM and its tokenizer (transformers format), or "
        "'starter' for the built-in starter policy of the built-in task (built locally on first use).",
        min_length=1,
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        title="Parameter dtype",
        description="Training precision. Use float32 on CPUs without bf16 support (bf16 is ~30x slower there).",
    )
    gradient_checkpointing: bool = Field(
        False, title="Gradient checkpointing", description="Trade compute for activation memory."
    )


class FieldMapping(Section):
    prompt: str = Field("prompt", title="Prompt field", description="Column holding the prompt text.")
    answer: str | None = Field(
        "answer", title="Answer field", description="Column holding the reference answer (None if unused)."
    )
    metadata: list[str] = Field(
        default_factory=list, title="Metadata fields", description="Columns passed to reward functions."
    )


class SelectionOptions(Section):
    """``data.selection_options``: how the weighted selections of ``data.selection`` draw
    (``engine/data/selection.py`` has the formulas and the papers)."""

    explore: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        title="Exploration floor",
        description="Share of each batch (rounded up: at least one prompt) drawn by the uniform epoch sampler, "
        "whatever the weights: with N prompts and m of them a batch, any (2N - 1) / m consecutive batches draw "
        "every prompt, so none starves.",
    )
    temperature: float = Field(
        0.05,
        gt=0.0,
        title="Temperature (difficulty_targeted)",
        description="tau in w = exp(-P0 / tau), P0 the predicted chance that a group's completions all succeed "
        "or all fail (the beta-binomial E[p^n + (1 - p)^n] of the prompt's Beta predictive, least for pass rates "
        "near 0.5): a prompt whose P0 is higher by tau weighs e times less; smaller concentrates on the lowest P0.",
    )
    alpha: float = Field(
        1.0, ge=0.0, title="Alpha (pace)", description="alpha in w(p) = p^alpha (1 - p)^beta."
    )
    beta: float = Field(1.0, ge=0.0, title="Beta (pace)", description="beta in w(p) = p^alpha (1 - p)^beta.")
    pool: int = Field(
        1024,
        ge=1,
        title="Candidates per batch",
        description="Prompts drawn uniformly each batch for the weights to choose from (all of them when "
        "there are fewer); larger concentrates more and costs more. With predictor 'answer_likelihood': the "
        "most scored candidates kept between draws.",
    )
    references: int = Field(
        256,
        ge=1,
        title="Reference prompts",
        description="The most recently measured prompts from which a prompt never sampled gets its estimate.",
    )
    half_life: int = Field(
        25,
        ge=0,
        title="Half-life of a prompt's record (steps)",
        description="A measured prompt's own outcomes weigh half as much every this many steps since its last "
        "group (the policy has moved since): its estimate widens back towards its neighbours' and it is not "
        "chosen again on a stale record. 0 keeps every outcome at full weight.",
    )
    bandwidth: float = Field(
        0.1,
        gt=0.0,
        title="Similarity bandwidth",
        description="h in the kernel exp((cos - 1) / h) over character n-grams: smaller trusts only closer prompts.",
    )
    predictor: Literal["neighbours", "answer_likelihood"] = Field(
        "neighbours",
        title="Pass-rate predictor",
        description="How a prompt's pass rate is predicted before its own rollouts say: 'neighbours' pools the "
        "measured pass rates of textually similar prompts; 'answer_likelihood' asks the policy for the chance it "
        "writes the reference answer (one forward, no generation; best where a correct completion is the short "
        "answer itself, and it needs reference answers). See engine/data/likelihood.py.",
    )
    likelihood_strength: float = Field(
        20.0,
        gt=0.0,
        le=1e6,
        title="Likelihood strength (answer_likelihood)",
        description="c in the prior Beta(c q, c (1 - q)) of a prompt whose answer the policy writes with chance q: "
        "how many completions' worth of evidence a score counts for against the prompt's own record.",
    )
    likelihood_candidates_per_pick: float = Field(
        2.0,
        gt=0.0,
        le=64.0,
        title="Candidates with a signal per pick (answer_likelihood)",
        description="c: a draw of k prompts scores c k / (1 - P0) fresh prompts, P0 the share of uniformly drawn "
        "groups predicted to have all-equal rewards (few early in a run, most once the policy solves most "
        "prompts), so that about c candidates a pick can carry a learning signal. Scoring is one forward a "
        "prompt, no generation; larger concentrates more and costs more.",
    )
    likelihood_max_candidates_per_pick: float = Field(
        32.0,
        gt=0.0,
        le=1024.0,
        title="Most fresh candidates per pick (answer_likelihood)",
        description="The cap on c / (1 - P0): once most prompts are solved the count above would score "
        "hundreds of prompts a step, a forward each, which can cost more than the generation it saves "
        "(bench/README.md). Smaller bounds scoring's cost late in a run, at a weaker choice then.",
    )
    likelihood_max_age: int = Field(
        0,
        ge=0,
        title="Score lifetime in policy versions (answer_likelihood)",
        description="A scored candidate a draw did not pick waits in the pool (of at most 'pool', the best "
        "kept) for later draws, for at most this many policy versions after it was scored (the policy moves "
        "on). 0: only draws under the same weights reuse it (DAPO's later rounds of a step).",
    )
    likelihood_precision: Literal["auto", "full"] = Field(
        "auto",
        title="Scoring precision (answer_likelihood)",
        description="auto: the torch rollout backend scores a float32 model in bfloat16 where the device "
        "multiplies it natively (CPUs with AVX512-BF16 or AMX, CUDA GPUs with bf16): a third to half less time "
        "on the starter, with log-probs ~0.015 off on average; elsewhere, and with vLLM, the rollout's own "
        "precision. full: always the rollout's own precision, the log-probs sampling would give.",
    )


def scores_answers(selection: str, options: SelectionOptions) -> bool:
    """Whether a run's selection scores prompts with the policy (``predictor: answer_likelihood``; the
    uniform selection never weighs its prompts, so it keeps the neighbours' estimates for its metrics)."""
    return selection != "uniform" and options.predictor == "answer_likelihood"


class DataConfig(Section):
    source: Literal["builtin", "jsonl", "parquet", "disk"] = Field(
        "builtin",
        title="Prompt source",
        description="A built-in verifiable task, a JSONL or Parquet file, or a dataset saved with "
        "datasets.save_to_disk.",
    )
    task: Literal["arithmetic", "countdown"] = Field(
        "arithmetic", title="Built-in task", description="Used when source is 'builtin'."
    )
    difficulty: int = Field(
        1, ge=1, le=5, title="Difficulty", description="Built-in task difficulty (1 = easiest)."
    )
    train_size: int = Field(
        50_000,
        ge=1,
        title="Train prompts",
        description="Number of generated training prompts (built-in tasks).",
    )
    eval_size: int = Field(
        256, ge=0, title="Eval prompts", description="Held-out prompts for evaluation (0 disables eval)."
    )
    path: str | None = Field(
        None, title="Train file", description="Path of the JSONL/Parquet file or dataset dir."
    )
    eval_path: str | None = Field(
        None,
        title="Eval file",
        description="Held-out file/dir; if unset, eval_size prompts are held out of path.",
    )
    split: str | None = Field(
        None, title="Split", description="Split to use from a DatasetDict saved to disk."
    )
    fields: FieldMapping = Field(default_factory=FieldMapping, title="Field mapping")
    prompt_template: str = Field(
        "{prompt}",
        title="Prompt template",
        description="Python format string applied to the prompt before the chat template; may use {prompt}.",
    )
    system_prompt: str | None = Field(None, title="System prompt", description="Used with chat templates.")
    chat_template: Literal["auto", "none"] = Field(
        "auto",
        title="Chat template",
        description="'auto' applies the tokenizer's chat template when it has one; 'none' uses raw text.",
    )
    max_prompt_length: int = Field(
        256,
        ge=1,
        title="Max prompt tokens",
        description="Longer prompts are skipped (and counted in a metric).",
    )
    shuffle: bool = Field(True, title="Shuffle", description="Shuffle the training prompts each epoch.")
    selection: Literal["uniform", "difficulty_targeted", "pace"] = Field(
        "uniform",
        title="Prompt selection",
        description="'uniform': every prompt once per epoch. 'difficulty_targeted' (DOTS): prefer prompts whose "
        "estimated pass rate is near 0.5. 'pace' (PACED): weight prompts by p^alpha (1 - p)^beta. Pass rates are "
        "measured per prompt and estimated from similar prompts for those never sampled.",
    )
    selection_options: SelectionOptions = Field(default_factory=SelectionOptions, title="Selection options")
    stages: list[StageConfig] = Field(
        default_factory=list,
        title="Stages (continual training)",
        description="An ordered list of stages trained one after another in this run (empty: one stage, the "
        "fields above). Each sets the data fields it changes (task, difficulty, source, path, ...) and its steps; "
        "the steps add up to trainer.total_steps. Every eval point evaluates every stage seen so far "
        "(eval/<stage>/accuracy, forgetting/<stage>); see engine/config/stages.py.",
    )
    stage_reference: Literal["initial", "previous_stage"] = Field(
        "initial",
        title="KL reference across stages",
        description="With data.stages and a KL term (algorithm.use_kl_loss or use_kl_in_reward): 'initial' keeps "
        "the starting model as the reference; 'previous_stage' replaces it at each stage's first step by the "
        "policy as the previous stage left it, so the KL term holds the policy near what it had learnt (a "
        "guard against forgetting; torch trainer only).",
    )

    @model_validator(mode="after")
    def _selection_weights(self) -> DataConfig:
        o = self.selection_options
        if self.selection == "pace" and o.alpha == 0 and o.beta == 0:
            raise ValueError(
                "data.selection_options: alpha and beta are both 0, which gives every prompt the same weight "
                "under data.selection 'pace'; raise one of them, or use data.selection 'uniform'"
            )
        return self

    @property
    def scores_answers(self) -> bool:
        return scores_answers(self.selection, self.selection_options)

    @model_validator(mode="after")
    def _likelihood_needs_answers(self) -> DataConfig:
        if self.scores_answers and self.source != "builtin" and not self.fields.answer:
            raise ValueError(
                "data.selection_options.predictor: 'answer_likelihood' scores the policy on each prompt's "
                "reference answer, and data.fields.answer is unset; name the answer column in data.fields.answer, "
                "or use predictor 'neighbours'"
            )
        return self

    @model_validator(mode="after")
    def _stages(self) -> DataConfig:
        if self.stages:
            check_stage_list(self.stages, self)
        return self

    @model_validator(mode="after")
    def _path_for_files(self) -> DataConfig:
        if self.source != "builtin" and not self.path:
            raise ValueError(
                f"data.path: required when data.source is '{self.source}'; set it to the file or directory"
            )
        return self
