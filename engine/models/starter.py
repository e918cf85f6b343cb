"""Starter policies: a small model warmed up by supervised fine-tuning on a built-in task.

RL on a random model never sees a reward, so each built-in task gets a *starter policy*:
the ``small`` (~1M parameter) Qwen2 model of ``make_model``, trained briefly with SFT on
the task's train split until it *sometimes* succeeds (the recipe's ``target_accuracy``),
which leaves RL room to improve. What a build took (steps, seconds) and the accuracy it
reached are measured by the build itself and recorded in its ``starter.json``.

The starter's tokenizer has no chat template, so prompts are the raw task text
(``"12+34="``). They are built with ``engine.data.load_prompts`` and the default
``DataConfig`` of the task, i.e. exactly as the RL pipeline formats them; the completion is
the reference answer followed by eos. Training stops at the first validation check (on
train-split problems held out of the SFT data) that reaches ``target_accuracy``, or at
``max_steps``. It runs on one thread: the result is then the same on every machine with the
same kernels, and an oversubscribed machine (tests running in parallel) does not slow it
down by an order of magnitude, as two spinning OpenMP threads do.

The result is cached in ``data_dir()/starter/<task>-d<difficulty>-<recipe hash>/`` and
built atomically (in a temporary directory renamed into place, under a file lock), with
the recipe and the measured eval accuracy in ``starter.json``.

A run of several stages on different built-in tasks (``data.stages``) needs a starter that
sometimes succeeds on *each* of them: a single-task starter scores 0 on the other task, so
every group of that stage is all-wrong and DAPO's filter leaves it no gradient. Its *mixture
starter* is trained the same way on the union of the tasks' train splits (each task at its own
difficulty, formatted by the task's default data config as a single-task starter's), validated on each task's held-out
problems separately, and stops at the first check where *every* task has reached its own
recipe's ``target_accuracy`` (or at the summed step caps). It is cached in
``data_dir()/starter/mix-<task>-d<difficulty>+...-<hash>/``, the hash over the sorted
(task, difficulty) set and the recipes; ``starter.json`` records the accuracy per task.

A task may name *companions* (``COMPANIONS``): tasks whose data its starter is trained on as well,
so that its runs start from the mixture starter. Arithmetic's is countdown: from starters trained on
arithmetic alone, RL on arithmetic stalled (0.64 greedy accuracy) or crept, where from the mixture
it reached 95% in a few hundred steps.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.paths import starter_dir

STARTER_VERSION = 1
"""Bump when the starter recipe or code changes in a way the recipe hash does not capture."""

ProgressFn = Callable[[int, int, float, float | None], None]
"""``progress(step, total, loss, accuracy)`` of a build: ``accuracy`` is the last validation
check's (None before the first), which is what a watcher needs to judge how far the build is
(it stops early once it reaches the recipe's ``target_accuracy``)."""


@dataclass(frozen=True)
class StarterRecipe:
    """How a starter policy is trained (all of it goes into the cache key and ``starter.json``)."""

    arch: str = "qwen2"
    size: str = "small"
    chat_template: bool = False
    threads: int = 1
    model_seed: int = 0
    data_seed: int = 0
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    batch_size: int = 128
    max_steps: int = 450
    eval_every: int = 25
    val_size: int = 256
    target_accuracy: float = 0.2
    max_new_tokens: int = 8


RECIPES: dict[str, StarterRecipe] = {
    # Stopped at 40% greedy accuracy rather than the default 20%: most groups then mix right and
    # wrong answers, so group-relative advantages are rarely all zero, and RL still has room
    # (bench/learning_curve.py measures what it adds).
    "arithmetic": StarterRecipe(target_accuracy=0.4, max_steps=1500),
    "countdown": StarterRecipe(max_new_tokens=16),
}


COMPANIONS: dict[str, tuple[tuple[str, int], ...]] = {
    # Arithmetic's starter is trained on countdown as well (the mixture starter of the two): DAPO
    # from it reached 85% greedy accuracy in 150-450 steps and 95% in 300-900 (3 seeds of the
    # starter), while from arithmetic-only starters of the same seeds, at the same 47-52% start, it
    # plateaued at 0.64 (seed 0) or crept to 0.80 by step 900 (seed 1). Expressions over the same
    # digits and operators are what it takes from countdown (an arithmetic-only starter trained as
    # many steps learnt nothing more). The companion's difficulty stays 1 at every arithmetic
    # difficulty: it teaches the form of expressions, not the arithmetic level.
    "arithmetic": (("countdown", 1),),
}
"""Built-in tasks (task, difficulty) whose train splits join a task's starter SFT data: its starter is
the mixture starter of the task and these (``starter_tasks``), each validated against its own target."""


def recipe_for(task: str) -> StarterRecipe:
    from engine.data.tasks import get_task

    get_task(task)  # validates the name
    return RECIPES[task]


def _recipe_hash(task: str, difficulty: int, recipe: StarterRecipe) -> str:
    """Fingerprint of everything the starter depends on: the recipe, the model size, the
    tokenizer corpus and a sample of the task's generated data (so a changed generator or
    corpus gives a new cache entry, while unrelated code edits keep the cached one)."""
    from engine.data.tasks import generate_eval, generate_train
    from engine.models.build import SIZES, default_corpus

    corpus = hashlib.sha256("\n".join(default_corpus()).encode()).hexdigest()
    sample = [(it.prompt, it.answer, it.solution) for it in generate_eval(task, difficulty, 32)]
    sample += [(it.prompt, it.answer, it.solution) for it in generate_train(task, difficulty, 32, set())]
    blob = json.dumps(
        {
            "version": STARTER_VERSION,
            "task": task,
            "difficulty": difficulty,
            "recipe": asdict(recipe),
            "spec": asdict(SIZES[recipe.size]),
            "corpus": corpus,
            "sample": sample,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def _single_path(task: str, difficulty: int) -> Path:
    """Where the starter trained on ``task`` at ``difficulty`` alone is (or will be) cached."""
    recipe = recipe_for(task)
    return starter_dir() / f"{task}-d{difficulty}-{_recipe_hash(task, difficulty, recipe)}"


def starter_path(task: str, difficulty: int) -> Path:
    """Where the starter policy of ``task`` at ``difficulty`` (with its companions) is (or will be) cached."""
    return starter_location(starter_pairs(task, difficulty))


Pair = tuple[str, int]
"""A built-in task and its difficulty."""


def _pairs(tasks: Sequence[Pair]) -> list[Pair]:
    """The sorted, distinct (task, difficulty) pairs, validated."""
    from engine.data.tasks import check_difficulty

    pairs = sorted({(str(t), int(d)) for t, d in tasks})
    for task, difficulty in pairs:
        recipe_for(task)
        check_difficulty(difficulty)
    if len(pairs) < 2:
        raise ValueError(f"a mixture starter needs at least two (task, difficulty) pairs, got {pairs}")
    return pairs


def mixture_recipe(tasks: Sequence[Pair]) -> StarterRecipe:
    """The recipe of a mixture starter: the default recipe with the tasks' step caps added up (each
    batch holds every task, so each gets about its share of the steps), room for the longest
    completion, and the lowest of the tasks' targets (each task still has to reach its own
    recipe's target, see ``build_mixture_starter``)."""
    recipes = [recipe_for(t) for t, _ in _pairs(tasks)]
    return StarterRecipe(
        max_steps=sum(r.max_steps for r in recipes),
        max_new_tokens=max(r.max_new_tokens for r in recipes),
        target_accuracy=min(r.target_accuracy for r in recipes),
    )


def _mixture_hash(pairs: list[Pair], recipe: StarterRecipe) -> str:
    """As ``_recipe_hash``, over the sorted (task, difficulty) set, the mixture recipe and each task's
    own recipe (its target and completion length) and data sample."""
    from engine.data.tasks import generate_eval, generate_train
    from engine.models.build import SIZES, default_corpus

    corpus = hashlib.sha256("\n".join(default_corpus()).encode()).hexdigest()
    samples = {}
    for task, difficulty in pairs:
        sample = [(it.prompt, it.answer, it.solution) for it in generate_eval(task, difficulty, 32)]
        sample += [(it.prompt, it.answer, it.solution) for it in generate_train(task, difficulty, 32, set())]
        samples[f"{task}-d{difficulty}"] = sample
    blob = json.dumps(
        {
            "version": STARTER_VERSION,
            "mixture": [list(p) for p in pairs],
            "recipe": asdict(recipe),
            "task_recipes": {t: asdict(recipe_for(t)) for t, _ in pairs},
            "spec": asdict(SIZES[recipe.size]),
            "corpus": corpus,
            "samples": samples,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def mixture_starter_path(tasks: Sequence[Pair]) -> Path:
    """Where the mixture starter of several (task, difficulty) pairs is (or will be) cached."""
    pairs = _pairs(tasks)
    name = "+".join(f"{t}-d{d}" for t, d in pairs)
    return starter_dir() / f"mix-{name}-{_mixture_hash(pairs, mixture_recipe(pairs))}"


def starter_tasks(data_cfg: Any) -> list[Pair]:
    """The (task, difficulty) pairs a run's ``'starter'`` policy is trained on.

    ``data.task`` at ``data.difficulty``, unless ``data.stages`` trains a task other than
    ``data.task``: then every stage's (task, difficulty), so that each stage starts from a policy
    with some success on its task. Stages on ``data.task`` alone (e.g. harder difficulties later)
    keep ``data.task``'s pair. Then each task's ``COMPANIONS`` whose task is not there yet; sorted
    and distinct. One pair is a single-task starter, several a mixture starter."""
    stages = getattr(data_cfg, "stages", None) or []
    merged = [s.data_config(data_cfg) for s in stages]
    if not merged or all(m.task == data_cfg.task for m in merged):
        return starter_pairs(data_cfg.task, data_cfg.difficulty)
    return _with_companions({(m.task, m.difficulty) for m in merged})


def starter_pairs(task: str, difficulty: int) -> list[Pair]:
    """The (task, difficulty) pairs the starter policy of one built-in task is trained on: the task and
    its ``COMPANIONS``, sorted."""
    from engine.data.tasks import check_difficulty

    recipe_for(task)  # validates the name
    check_difficulty(difficulty)
    return _with_companions({(task, difficulty)})


def _with_companions(pairs: set[Pair]) -> list[Pair]:
    """``pairs`` and the companions of their tasks whose task is not among them yet, sorted."""
    tasks = {t for t, _ in pairs}
    companions = {c for t in tasks for c in COMPANIONS.get(t, ()) if c[0] not in tasks}
    return sorted(pairs | companions)


def starter_location(tasks: Sequence[Pair]) -> Path:
    """Where the starter trained on ``tasks`` is cached: a single-task starter's directory for one pair,
    ``mixture_starter_path`` for several."""
    pairs = sorted(set(tasks))
    return _single_path(*pairs[0]) if len(pairs) == 1 else mixture_starter_path(pairs)


def read_starter_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``starter.json`` of a built starter policy."""
    return json.loads((Path(path) / "starter.json").read_text())


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads (restored afterwards); 0 keeps the current setting."""
    before = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def starter_policy(task: str, difficulty: int = 1, *, progress: ProgressFn | None = None) -> Path:
    """The directory of the starter policy for a built-in task (trained with its companions), building
    it on first use.

    ``progress(step, total, loss, accuracy)`` is called during a build (``total`` is the step
    cap; the build may stop earlier, see ``ProgressFn``). Safe to call from several processes at once: one builds,
    the others wait for it and reuse the result.
    """
    return starter_for(starter_pairs(task, difficulty), progress=progress)


def starter_for(tasks: Sequence[Pair], *, progress: ProgressFn | None = None) -> Path:
    """The directory of the starter trained on ``tasks`` (``starter_location``: one pair, a single-task
    starter; several, the mixture starter, whose ``progress`` reports the lowest task's validation
    accuracy), built on first use."""
    pairs = sorted(set(tasks))

    def build(tmp: Path) -> Any:
        if len(pairs) > 1:
            return build_mixture_starter(tmp, pairs, progress=progress)
        task, difficulty = pairs[0]
        return build_starter(tmp, task, difficulty, recipe=recipe_for(task), progress=progress)

    return _cached_build(starter_location(pairs), build)


def _cached_build(final: Path, build: Callable[[Path], Any]) -> Path:
    """``final``, built by ``build(tmp)`` into a temporary directory renamed into place under a lock."""
    from engine.models.build import publish_dir

    if (final / "starter.json").is_file():
        return final
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / "starter.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp)
            if final.exists():  # a stale partial directory cannot exist (rename is atomic), but be safe
                shutil.rmtree(final)
            publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# ----------------------------------------------------------------------------- build


def _sft_examples(prompts: Sequence[Any], task: Any, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + eos) pairs, prompts tokenised exactly as the rollout sees them."""
    from engine.data.prompts import encode_texts

    completions = [task.reference_completion(p.answer, p.metadata) for p in prompts]
    comp_ids = encode_texts(tokenizer, completions, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return [(list(p.token_ids), [*c, eos]) for p, c in zip(prompts, comp_ids)]


def _collate(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(p) + len(c) for p, c in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for i, (p, c) in enumerate(batch):
        seq = p + c
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(c)
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def greedy_completions(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 256,
) -> list[str]:
    """Greedy completions (decoded, special tokens skipped) with transformers' ``generate``."""
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id
    out: list[str] = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding
            ids[i, width - len(p) :] = torch.tensor(list(p))
            mask[i, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
        out.extend(tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True))
    model.train(was_training)
    return out


def greedy_accuracy(model: Any, tokenizer: Any, prompts: Sequence[Any], max_new_tokens: int) -> float:
    """Mean task score of greedy completions of built-in-task prompts (``metadata["task"]``)."""
    from engine.data.tasks import get_task

    if not prompts:
        return 0.0
    texts = greedy_completions(model, tokenizer, [p.token_ids for p in prompts], max_new_tokens)
    scores = [get_task(p.metadata["task"]).score(t, p.answer, p.metadata) for p, t in zip(prompts, texts)]
    return sum(scores) / len(scores)


@dataclass
class _Part:
    """One task of a build: its prompts (SFT examples, validation, eval) and when it is good enough."""

    task: str
    difficulty: int
    target: float
    max_new_tokens: int
    data: Any  # its DataConfig
    examples: list[tuple[list[int], list[int]]]
    val: list[Any]
    eval: list[Any]


def _part(task_name: str, difficulty: int, target: float, max_new_tokens: int, tokenizer: Any, seed: int,
          val_size: int) -> _Part:  # fmt: skip
    """A task's data as a run with the default data config of the task formats it."""
    from engine.config import DataConfig
    from engine.data.prompts import load_prompts
    from engine.data.tasks import get_task

    cfg = DataConfig(source="builtin", task=task_name, difficulty=difficulty)
    splits = load_prompts(cfg, tokenizer, seed=seed)
    # Validation: distinct train-split problems, held out of the SFT data (eval stays untouched).
    val, seen = [], set()
    for p in reversed(splits.train):
        if p.raw not in seen:
            seen.add(p.raw)
            val.append(p)
            if len(val) == val_size:
                break
    sft = [p for p in splits.train if p.raw not in seen]
    examples = _sft_examples(sft, get_task(task_name), tokenizer)
    return _Part(task_name, difficulty, target, max_new_tokens, cfg, examples, val, splits.eval)


def _train(
    out: Path,
    tasks: Sequence[tuple[str, int, float, int]],
    recipe: StarterRecipe,
    progress: ProgressFn | None,
) -> tuple[dict[str, Any], list[_Part], list[float], list[float]]:
    """Make the model in ``out``, SFT it on the tasks' (name, difficulty, target, max_new_tokens)
    mixed train splits until every task's validation accuracy reaches its target (or
    ``recipe.max_steps``), evaluate each task and save. Returns the run's facts, the parts, and the
    last validation and the eval accuracy per part."""
    from engine.models.build import make_model_info, quiet_progress
    from engine.models.loading import load_model, load_tokenizer

    t0 = time.perf_counter()
    made = make_model_info(
        out,
        arch=recipe.arch,
        size=recipe.size,
        seed=recipe.model_seed,
        chat_template=recipe.chat_template,
        overwrite=True,
    )
    tokenizer = load_tokenizer(out)
    with quiet_progress():
        model = load_model(out)
    parts = [_part(t, d, tgt, mnt, tokenizer, recipe.data_seed, recipe.val_size) for t, d, tgt, mnt in tasks]
    examples = [e for part in parts for e in part.examples]

    rng = random.Random(recipe.data_seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.98)
    )

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        frac = (step - recipe.warmup_steps) / max(1, recipe.max_steps - recipe.warmup_steps)
        return recipe.min_lr + 0.5 * (recipe.lr - recipe.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))

    history: list[dict[str, Any]] = []
    pad = tokenizer.pad_token_id
    order: list[int] = []
    step = 0
    loss_value = float("nan")
    val_accs = [0.0] * len(parts)
    t_train = time.perf_counter()
    with torch.random.fork_rng(devices=[]), _torch_threads(recipe.threads):
        torch.manual_seed(recipe.data_seed)
        model.train()
        while step < recipe.max_steps:
            if len(order) < recipe.batch_size:
                fresh = list(range(len(examples)))
                rng.shuffle(fresh)
                order.extend(fresh)
            idx, order = order[: recipe.batch_size], order[recipe.batch_size :]
            batch = _collate([examples[i] for i in idx], pad)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            loss_value = float(loss.detach())
            checked = step % recipe.eval_every == 0 or step == recipe.max_steps
            if checked:
                val_accs = [greedy_accuracy(model, tokenizer, p.val, p.max_new_tokens) for p in parts]
                row: dict[str, Any] = {"step": step, "loss": round(loss_value, 4)}
                if len(parts) == 1:
                    row["val_accuracy"] = round(val_accs[0], 4)
                else:
                    row["val_accuracy"] = {_label(p): round(a, 4) for p, a in zip(parts, val_accs)}
                history.append(row)
            if progress is not None:
                progress(step, recipe.max_steps, loss_value, min(val_accs) if history else None)
            if checked and all(a >= p.target for p, a in zip(parts, val_accs)):
                break
    model.eval()
    train_seconds = time.perf_counter() - t_train
    with _torch_threads(recipe.threads):
        eval_accs = [greedy_accuracy(model, tokenizer, p.eval, p.max_new_tokens) for p in parts]

    with quiet_progress():
        model.save_pretrained(out)
    facts = {
        "num_parameters": made.num_parameters,
        "steps": step,
        "final_loss": round(loss_value, 4),
        "t0": t0,
        "train_seconds": round(train_seconds, 1),
        "history": history,
    }
    return facts, parts, val_accs, eval_accs


def _label(part: _Part) -> str:
    return f"{part.task}-d{part.difficulty}"


def build_starter(
    out_dir: str | os.PathLike[str],
    task_name: str,
    difficulty: int,
    *,
    recipe: StarterRecipe | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Build a starter policy into the (empty or new) ``out_dir``; returns the ``starter.json`` record."""
    from engine.data.tasks import get_task

    recipe = recipe or recipe_for(task_name)
    get_task(task_name)
    out = Path(out_dir)
    facts, parts, val_accs, eval_accs = _train(
        out, [(task_name, difficulty, recipe.target_accuracy, recipe.max_new_tokens)], recipe, progress
    )
    info = {
        "task": task_name,
        "difficulty": difficulty,
        "version": STARTER_VERSION,
        "recipe": asdict(recipe),
        "num_parameters": facts["num_parameters"],
        "steps": facts["steps"],
        "final_loss": facts["final_loss"],
        "val_accuracy": round(val_accs[0], 4),
        "eval_accuracy": round(eval_accs[0], 4),
        "eval_size": len(parts[0].eval),
        "eval_max_new_tokens": recipe.max_new_tokens,
        "build_seconds": round(time.perf_counter() - facts["t0"], 1),
        "train_seconds": facts["train_seconds"],
        "history": facts["history"],
        "data": parts[0].data.model_dump(),
    }
    (out / "starter.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def build_mixture_starter(
    out_dir: str | os.PathLike[str],
    tasks: Sequence[Pair],
    *,
    recipe: StarterRecipe | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Build the mixture starter of several (task, difficulty) pairs into ``out_dir``: SFT on the union
    of their train splits until each task reaches its own recipe's ``target_accuracy`` on its held-out
    validation problems (or ``recipe.max_steps``, default ``mixture_recipe``); returns the
    ``starter.json`` record, with the accuracies per task under ``tasks``."""
    pairs = _pairs(tasks)
    recipe = recipe or mixture_recipe(pairs)
    specs = [(t, d, recipe_for(t).target_accuracy, recipe_for(t).max_new_tokens) for t, d in pairs]
    out = Path(out_dir)
    facts, parts, val_accs, eval_accs = _train(out, specs, recipe, progress)
    info = {
        "mixture": [list(p) for p in pairs],
        "version": STARTER_VERSION,
        "recipe": asdict(recipe),
        "num_parameters": facts["num_parameters"],
        "steps": facts["steps"],
        "final_loss": facts["final_loss"],
        "tasks": [
            {
                "task": p.task,
                "difficulty": p.difficulty,
                "target_accuracy": p.target,
                "sft_examples": len(p.examples),
                "val_accuracy": round(v, 4),
                "eval_accuracy": round(e, 4),
                "eval_size": len(p.eval),
                "eval_max_new_tokens": p.max_new_tokens,
                "data": p.data.model_dump(),
            }
            for p, v, e in zip(parts, val_accs, eval_accs)
        ],
        "eval_accuracy": round(min(eval_accs), 4),
        "build_seconds": round(time.perf_counter() - facts["t0"], 1),
        "train_seconds": facts["train_seconds"],
        "history": facts["history"],
    }
    (out / "starter.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def resolve_model_path(model_cfg: Any, data_cfg: Any, *, progress: ProgressFn | None = None) -> Path:
    """The model directory of a run: ``model.path``, or the starter policy of the built-in task
    (built on first use) when ``model.path`` is ``'starter'``: trained on the pairs ``starter_tasks``
    names (the task and its companions, or the stages' tasks)."""
    from engine.models.loading import ModelLoadError

    if model_cfg.path == "starter":
        if data_cfg.source != "builtin":
            raise ModelLoadError(
                "model.path 'starter' is the built-in task's policy; set model.path to a model directory "
                "when data.source is not 'builtin'"
            )
        return starter_for(starter_tasks(data_cfg), progress=progress)
    return Path(model_cfg.path).expanduser()
