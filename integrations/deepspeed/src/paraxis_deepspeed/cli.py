"""``paraxis validate --show-deepspeed``: print the generated DeepSpeed config.

Added through ``paraxis_cli_commands``: the flag joins core's ``validate`` parser, whose
command runs first (every problem reported as usual); when it passes, the dict is
printed as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_show_deepspeed"]


def add_show_deepspeed(subparsers: Any) -> None:
    validate = subparsers.choices.get("validate")
    if validate is None:
        return
    validate.add_argument("--show-deepspeed", action="store_true",
                          help="print the DeepSpeed config the offload bridge generates")
    core_validate = validate.get_default("func")

    def run(args: argparse.Namespace) -> int:
        code = int(core_validate(args))
        if code == 0 and args.show_deepspeed:
            code = _show(args)
        return code

    validate.set_defaults(func=run)


def _show(args: argparse.Namespace) -> int:
    from paraxis.config.run import RunConfig
    from paraxis.config.shape import ModelShape, config_size
    from paraxis_deepspeed.translate import deepspeed_config

    config = RunConfig.load(args.config, args.overrides)
    hidden = config_size(config.model.config, "hidden_size")
    if args.model:
        hidden = ModelShape.from_file(args.model).hidden_size
    if not config.parallelism.offload.enabled:
        print("no offload asked (parallelism.offload): the DeepSpeed bridge is not used; "
              "the config it would generate:")
    if hidden is None:
        print("no model hidden size known: bucket sizes are left to DeepSpeed's defaults")
    print(json.dumps(deepspeed_config(config, config.train, hidden_size=hidden), indent=2))
    return 0
