"""``train --config run.toml``: a run's file (:mod:`ops_transformer.training.config`, whose
:func:`~ops_transformer.training.config.load_toml` reads it) under the command line — flags >
file > defaults, as torchtitan's ``ConfigManager`` orders them. Torch-free: the run's fields as a
dict (``TrainConfig``'s keywords)."""

from __future__ import annotations

import argparse

from ..training.config import RunConfig, load_toml

# the argparse destinations that are not named as their TrainConfig field
DEST_FIELDS = {"lr_warmup": "warmup", "no_progress": "progress"}
PLAN_FIELDS = ("tp", "dp", "ep", "attention", "sequence_parallel", "recompute", "zero")


def flag_fields(args, fields: dict, add_parser) -> set[str]:
    """The ``TrainConfig`` fields the command line set: ``args.argv`` parsed again by the parser
    ``add_parser`` builds, with every default suppressed (abbreviated flags count); without
    ``argv``, the fields where ``fields`` (the flags over the defaults) is not the default."""
    defaults = RunConfig().train_fields()
    given = given_dests(args, add_parser)
    if given is None:
        changed = {n for n in set(defaults) - {"out"} if fields.get(n, defaults[n]) != defaults[n]}
        return changed | ({"out"} if getattr(args, "out", None) else set())
    names = {DEST_FIELDS.get(dest, dest) for dest in given}
    if "plan" in names:  # a plan sets the layout (and cp, where it has one)
        names |= set(PLAN_FIELDS) | ({"cp", "cp_strategy"} if fields.get("cp", 1) > 1 else set())
    return names & set(defaults)


def given_dests(args, add_parser) -> set[str] | None:
    """The argparse destinations of the flags in ``args.argv`` (after the command), as the parser
    that ``add_parser`` builds reads them with every default suppressed (abbreviated flags
    count); ``None`` without ``argv`` (a caller that built ``args`` itself)."""
    argv, command = getattr(args, "argv", None), getattr(args, "command", "train")
    if argv is None or command not in argv:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    add_parser(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv[argv.index(command) + 1:])
    return set(vars(given))


def with_config_file(args, fields: dict, add_parser) -> tuple[dict, set[str]]:
    """``fields`` (the flags over the defaults) laid over the file ``args.config``: the file's
    fields, then those the command line gave; and the fields the file sets. ``--preset`` or
    ``--model`` given replaces the file's model whichever way it names it; the file's ``out``
    unset and no ``--out``: ``fields``' (a new ``runs/train-<timestamp>``)."""
    run, in_file = load_toml(args.config)
    given = flag_fields(args, fields, add_parser)
    if "preset" in given or "model" in given:
        given |= {"preset", "model"}
    if "out" not in in_file:
        given.add("out")
    return run.train_fields() | {name: fields[name] for name in given if name in fields}, in_file
