"""``train --config run.toml``: a run's file (:mod:`ops_transformer.training.config`) under the
command line — flags > file > defaults, as torchtitan's ``ConfigManager`` orders them."""

from __future__ import annotations

import argparse
import dataclasses

from ..training.config import load_toml
from ..training.loop import TrainConfig

# the argparse destinations that are not named as their TrainConfig field
DEST_FIELDS = {"lr_warmup": "warmup", "no_progress": "progress"}
PLAN_FIELDS = ("tp", "dp", "ep", "attention", "sequence_parallel", "recompute", "zero")


def flag_fields(args, cfg: TrainConfig, add_parser) -> set[str]:
    """The ``TrainConfig`` fields the command line set: ``args.argv`` parsed again by the parser
    ``add_parser`` builds, with every default suppressed (abbreviated flags count); without
    ``argv``, the fields where ``cfg`` (the flags over the defaults) is not the default."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    argv, command = getattr(args, "argv", None), getattr(args, "command", "train")
    if argv is None or command not in argv:
        changed = {n for n in names - {"out"} if getattr(cfg, n) != getattr(TrainConfig, n)}
        return changed | ({"out"} if getattr(args, "out", None) else set())
    parser = argparse.ArgumentParser(add_help=False)
    add_parser(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv[argv.index(command) + 1:])
    fields = {DEST_FIELDS.get(dest, dest) for dest in vars(given)}
    if "plan" in fields:  # a plan sets the layout (and cp, where it has one)
        fields |= set(PLAN_FIELDS) | ({"cp", "cp_strategy"} if cfg.cp > 1 else set())
    return fields & names


def with_config_file(args, cfg: TrainConfig, add_parser) -> tuple[TrainConfig, set[str]]:
    """``cfg`` (the flags over the defaults) laid over the file ``args.config``: the file's
    fields, then those the command line gave; and the fields the file sets. ``--preset`` or
    ``--model`` given replaces the file's model whichever way it names it; the file's ``out``
    unset and no ``--out``: ``cfg``'s (a new ``runs/train-<timestamp>``)."""
    run, in_file = load_toml(args.config)
    given = flag_fields(args, cfg, add_parser)
    if "preset" in given or "model" in given:
        given |= {"preset", "model"}
    if "out" not in in_file:
        given.add("out")
    return dataclasses.replace(TrainConfig.from_run_config(run),
                               **{name: getattr(cfg, name) for name in given}), in_file
