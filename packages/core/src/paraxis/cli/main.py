"""The ``paraxis`` command line: ``validate``, ``train`` and ``plan``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from paraxis.cli.checkpoint import add_checkpoint_commands
from paraxis.cli.data import add_data_commands
from paraxis.cli.prelaunch import model_problems, saved_model_config, warm_workers
from paraxis.config.errors import ConfigError
from paraxis.config.rules import validate
from paraxis.config.run import RunConfig
from paraxis.config.shape import ModelShape
from paraxis.engine.plugins import axis_table, make_plugin_manager
from paraxis.engine.precision import precision_problems
from paraxis.engine.resolve import resolve
from paraxis.parallel.optimizers import optimizer_problems
from paraxis.planner.cli import add_plan_parser
from paraxis.train.build import lora_problems
from paraxis.train.data import check_data, load_tokenizer
from paraxis.train.launcher import add_launch_arguments
from paraxis.train.lifecycle import LOCK_ENV, DirectoryLock, LockedError, die_with_parent

__all__ = ["main"]


def _load_checked(args: argparse.Namespace) -> RunConfig:
    """Load the config and check everything that can be checked without processes."""
    config = RunConfig.load(args.config, getattr(args, "overrides", ()))
    model = ModelShape.from_file(args.model) if getattr(args, "model", None) else None
    if model is not None:  # what is split and counted is the trained length
        model = dataclasses.replace(model, seq_length=config.train.seq_length)
    saved = saved_model_config(config)  # model.pretrained's config.json, read as JSON
    if model is None and (config.model.config or saved):
        model = ModelShape.from_hf_config({**saved, **config.model.config,
                                           "max_position_embeddings": config.train.seq_length})
        model = model if model.hidden_size and model.num_attention_heads else None
    pm = make_plugin_manager()
    config = config.with_axes(axis_table(pm))
    missing = resolve(config, pm, has_experts=bool(model and model.num_experts)).missing
    data = check_data(config)
    extra = [*config.check_run(), *missing, *data, *optimizer_problems(config.train, config),
             *precision_problems(config.train), *lora_problems(config, pm)]
    if "RANK" not in os.environ and not any(p.field == "data.tokenizer" for p in data):
        # Before any rank starts: the pretrained weights and the checkpoint resumed from
        # against the run's model (a rank under torchrun alone meets them when it loads).
        extra += model_problems(config, pm, lambda: load_tokenizer(
            config.data.tokenizer).vocab_size)
    validate(config, world_size=getattr(args, "world_size", None), model=model,
             plugin_manager=pm, extra=extra)
    return config


def _load_or_report(args: argparse.Namespace) -> RunConfig | None:
    """The checked config, or None after printing every problem to stderr."""
    try:
        return _load_checked(args)
    except (ConfigError, ImportError, OSError) as exc:
        _report(args.config, exc)
        return None


def _report(config: str, exc: BaseException) -> None:
    """One error on stderr, prefixed by the config's path unless it names it already."""
    text = str(exc)
    print(text if text.startswith(str(config)) else f"{config}: {text}", file=sys.stderr)


def _cmd_validate(args: argparse.Namespace) -> int:
    """Check a config (and optionally a model config) without starting any process."""
    config = _load_or_report(args)
    if config is None:
        return 1
    strategies = resolve(config, make_plugin_manager()).require()
    degrees = " x ".join(f"{a}={d}" for a, d in config.degrees.items())
    names = ", ".join(f"{s.axis} ({s.phase.name.lower()})" for s in strategies) or "none"
    print(f"{args.config}: valid. world size {config.world_size} ({degrees}); "
          f"strategies: {names}")
    if args.device_memory:
        return _warn_if_too_big(config, args)
    return 0


def _warn_if_too_big(config: RunConfig, args: argparse.Namespace) -> int:
    """Warn (exit 0) when the planner says the layout will not fit the device."""
    from paraxis.planner.run_checks import fit_warning
    from paraxis.planner.units import PlanInputError

    try:
        warning = fit_warning(config, device_memory=args.device_memory, model=args.model)
    except PlanInputError as exc:
        if "--device-memory" in str(exc):
            print(f"{args.config}: {exc}", file=sys.stderr)
            return 1
        warning = f"cannot plan memory: {exc}"
    if warning:
        print(f"{args.config}: warning: {warning}", file=sys.stderr)
    return 0


def _too_big(config: RunConfig, args: argparse.Namespace) -> str | None:
    """Why ``paraxis train --device-memory`` refuses the layout (the plan says a rank
    would not fit), or None."""
    from paraxis.planner.run_checks import fit_warning
    from paraxis.planner.units import PlanInputError

    try:
        warning = fit_warning(config, device_memory=args.device_memory)
    except PlanInputError as exc:
        return str(exc)
    return None if warning is None else (
        f"refused: {warning}. Training starts nothing that would not fit; drop "
        "--device-memory to run it anyway")


def _cmd_train(args: argparse.Namespace) -> int:
    """Train from a config; outside torchrun, launch the workers under torchrun's agent."""
    config = _load_or_report(args)
    if config is None:
        return 1
    if args.dry_run:
        return _dry_run(config, args)
    if args.device_memory and "RANK" not in os.environ:  # refuse before any rank starts
        refusal = _too_big(config, args)
        if refusal:
            print(f"{args.config}: {refusal}", file=sys.stderr)
            return 1
    ckpt = config.train.checkpoint_dir
    try:
        if args.print_sbatch:
            from paraxis.train.launcher import sbatch_script

            argv = sys.argv[1:] if args.argv is None else args.argv
            print(sbatch_script(config.world_size, args.gpus_per_node, argv), end="")
            return 0
        if "RANK" not in os.environ:
            from paraxis.train.launcher import LaunchOptions, run_workers

            argv = sys.argv[1:] if args.argv is None else args.argv
            return run_workers(config.world_size, LaunchOptions.from_args(args), argv, ckpt,
                               entry=main, warm=lambda: warm_workers(
                                   config, make_plugin_manager()))
        return _train_here(config)
    except (ConfigError, LockedError) as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 1


def _dry_run(config: RunConfig, args: argparse.Namespace) -> int:
    """``train --dry-run``: the run's own layout planned and built on the meta device in a
    fake process group (paraxis.planner.dryrun); nothing is launched or trained."""
    from paraxis.planner.run_checks import train_dry_run
    from paraxis.train.build import build_model, model_spec

    if "RANK" in os.environ:
        print(f"{args.config}: --dry-run builds its own fake world; run it outside "
              "torchrun", file=sys.stderr)
        return 1
    spec = model_spec(config, load_tokenizer(config.data.tokenizer).vocab_size)
    pm = make_plugin_manager()

    def build() -> object:  # as the run builds it (train.loop.start), deferred
        return build_model(spec, pm, seed=config.train.seed, deferred=True,
                           lora=config.lora)

    return train_dry_run(config, build=build, as_json=args.json)


def _train_here(config: RunConfig) -> int:
    """A worker: train on the current world (torchrun's environment)."""
    from paraxis.runtime.grid import shutdown
    from paraxis.train.failures import RankRecord
    from paraxis.train.loop import train

    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # never outlive the launcher (it may be killed outright)
    lock = None
    ckpt = config.train.checkpoint_dir
    if ckpt and os.environ.get("RANK") == "0" and LOCK_ENV not in os.environ:
        lock = DirectoryLock(ckpt).acquire()  # launched by torchrun directly
    try:
        train(config)
        shutdown()
    except Exception as exc:
        if RankRecord().failed(exc):  # every rank meets it alike: the launcher says it once
            return 1
        raise
    finally:
        if lock is not None:
            lock.release()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paraxis", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    val = sub.add_parser("validate", help=_cmd_validate.__doc__)
    val.add_argument("--config", required=True, help="YAML run configuration")
    val.add_argument("--model", help="model config: config.json, or YAML with a model: section")
    val.add_argument("--world-size", type=int, default=None,
                     help="check against this many processes")
    val.add_argument("--device-memory", help="warn when the plan says a rank needs more "
                     "than this, e.g. 80GB")
    val.add_argument("overrides", nargs="*", help="section.key=value")
    val.set_defaults(func=_cmd_validate)
    tr = sub.add_parser("train", help=_cmd_train.__doc__)
    tr.add_argument("--config", required=True, help="YAML run configuration")
    tr.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=50")
    tr.add_argument("--device-memory", help="refuse, before any rank starts, a layout the "
                    "plan says needs more than this per rank, e.g. 80GB")
    tr.add_argument("--dry-run", action="store_true", help="train nothing: plan the "
                    "config's layout and build it for the first and last rank of each "
                    "pipeline stage on the meta device in a fake process group, compare "
                    "(exit 1 when they disagree)")
    tr.add_argument("--world-size", type=int, default=None, help="with --dry-run: the "
                    "world the layout must fill (checked against the degrees)")
    tr.add_argument("--json", action="store_true", help="with --dry-run: one JSON object")
    add_launch_arguments(tr)
    tr.set_defaults(func=_cmd_train)
    add_plan_parser(sub)
    add_data_commands(sub)
    pm = make_plugin_manager()
    add_checkpoint_commands(sub, pm)
    pm.hook.paraxis_cli_commands(subparsers=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
