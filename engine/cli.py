"""``python -m engine``: run, validate and inspect configs, build models.

Errors a user can fix (a bad config, a missing model or data file) print one line per
problem and exit non-zero without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from engine.config import PRESETS, ConfigError, load_config
from engine.contracts import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_NAMES, EXIT_SUCCEEDED

USER_ERRORS = (ConfigError, FileNotFoundError, ValueError, OSError)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help=f"a YAML/JSON file or a preset name ({', '.join(PRESETS)})")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set trainer.total_steps=20 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine", description="Tributary's RL post-training engine."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="train a policy")
    _add_config_args(p)
    p.add_argument(
        "--events", help="event log: a JSONL path or '-' for stdout (default: <run dir>/events.jsonl)"
    )
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint (or a run dir: its latest)")
    p.add_argument("--run-id", help="the run id written into every event (default: random)")
    p.add_argument(
        "--start-seq",
        type=int,
        default=None,
        metavar="N",
        help="number events after N (a consumer's stored cursor; default: after the checkpoint's)",
    )
    p.add_argument(
        "--progress", choices=["auto", "on", "off"], help="progress bar (default: logging.progress)"
    )

    p = sub.add_parser("validate", help="check a config; list every bad field with its fix")
    _add_config_args(p)

    p = sub.add_parser("show", help="print the resolved config (preset + file + overrides) as YAML")
    _add_config_args(p)

    sub.add_parser("schema", help="print the config's JSON Schema")
    sub.add_parser("presets", help="list the named presets")

    p = sub.add_parser("make-model", help="build a small model and tokenizer locally")
    p.add_argument("dir")
    p.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    p.add_argument("--size", default="small", help="tiny, small or base")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser(
        "export-checkpoint",
        help="write a DeepSpeed checkpoint's fp32 weights as a transformers model directory",
    )
    p.add_argument("checkpoint", help="a checkpoint (step_* directory) or a run dir (its latest checkpoint)")
    p.add_argument("out_dir")

    p = sub.add_parser("starter", help="build (or find) the starter policy of a built-in task")
    p.add_argument("task", choices=["arithmetic", "countdown"])
    p.add_argument("--difficulty", type=int, default=1)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a multi-rank run starts its ranks with
    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "schema":
        from engine.config import json_schema

        print(json.dumps(json_schema(), indent=2))
        return EXIT_SUCCEEDED
    if args.command == "presets":
        for name, values in PRESETS.items():
            print(f"{name}: {json.dumps(values.get('algorithm', {}))}")
        return EXIT_SUCCEEDED
    if args.command == "make-model":
        from engine.models import make_model_cli

        make_model_cli(args.dir, arch=args.arch, size=args.size, seed=args.seed)
        return EXIT_SUCCEEDED
    if args.command == "export-checkpoint":
        from engine.checkpoint import resolve_checkpoint
        from engine.trainer.deepspeed_backend import export_checkpoint

        print(export_checkpoint(resolve_checkpoint(args.checkpoint), Path(args.out_dir)))
        return EXIT_SUCCEEDED
    if args.command == "starter":
        from engine.models import starter_policy

        print(starter_policy(args.task, args.difficulty, progress=_print_progress))
        return EXIT_SUCCEEDED

    cfg = load_config(args.config, args.overrides)
    if args.command == "validate":
        print(
            f"ok: {args.config} is a valid run config ({cfg.algorithm.adv_estimator}/{cfg.algorithm.policy_loss})"
        )
        return EXIT_SUCCEEDED
    if args.command == "show":
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return EXIT_SUCCEEDED
    from engine.ranks import is_rank_process, launch_ranks, rank_info

    if cfg.trainer.backend == "deepspeed" and cfg.trainer.num_ranks > 1 and not is_rank_process():
        # N copies of this very command as the ranks of one job (engine/ranks.py says why not torchrun).
        return launch_ranks([sys.executable, "-m", "engine", *args.argv], cfg.trainer.num_ranks)
    from engine.run import execute

    if args.progress:
        cfg.logging.progress = args.progress
    code = execute(cfg, events=args.events, resume=args.resume, run_id=args.run_id, start_seq=args.start_seq)
    if is_rank_process() and rank_info()[0] != 0:
        return code  # rank 0 speaks for the run
    events = args.events or cfg.run_dir / "events.jsonl"
    print(
        f"{EXIT_NAMES[code]}: events in {events}, checkpoints in {cfg.run_dir / 'checkpoints'}",
        file=sys.stderr,
    )
    return code


def _print_progress(step: int, total: int, loss: float, accuracy: float | None) -> None:
    if step == total or step % max(1, total // 20) == 0:
        checked = f" accuracy {accuracy:.0%}" if accuracy is not None else ""
        print(f"  warm-up {step}/{total} loss {loss:.3f}{checked}", file=sys.stderr)
