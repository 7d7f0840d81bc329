"""A run as typed data: :class:`RunConfig`, seven frozen sections — ``model``, ``layout``,
``parallel`` (the :class:`~ops_transformer.parallelize.ParallelOptions`), ``optim``, ``data``,
``checkpoint``, ``run`` — each validating itself once with messages that name its command-line
flag; a TOML file of the same sections (:func:`load_toml`, :func:`to_toml`); and the flat
:class:`~ops_transformer.training.loop.TrainConfig` the loop runs, field for field
(:meth:`RunConfig.train_fields`, :func:`from_train_fields`; ``TrainConfig.from_run_config`` and
``TrainConfig.run_config`` use them).

Each section field says which ``TrainConfig`` field it is (``train_field`` in its metadata, the
field's own name by default); a flag is that field's name with dashes (``--no-progress`` for
``run.progress``); ``model.layers`` and ``run.sample_*`` have none (the file sets them). The
defaults are defined here, once: ``TrainConfig``'s fields and the command line's flags take
theirs from the sections."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..schema.choices import PIPELINE_SCHEDULES as SCHEDULES
from ..schema.choices import PRECISIONS, ZERO_STAGES
from ..schema.parallel_options import ParallelOptions
from .schedule import LR_SCHEDULES

PACKS = ("docs", "naive")  # train --model: how documents share a packed row
REBALANCE = ("auto", "off")  # train --rebalance: re-plan a resume on another size, or not


def _f(default, *, train_field: str | None = None, flag: str | None = None,
       choices: tuple | None = None, least: float | None = None, positive: bool = False,
       below: float | None = None):
    """A section field: its default, the ``TrainConfig`` field and flag it stands for, and what
    values are valid (``choices``; ``least`` ≤ value; ``positive``: > 0; value < ``below``)."""
    return field(default=default, metadata={"train_field": train_field, "flag": flag,
                                            "choices": choices, "least": least,
                                            "positive": positive, "below": below})


def train_field(f: dataclasses.Field) -> str:
    """The ``TrainConfig`` field that section field ``f`` stands for."""
    return f.metadata.get("train_field") or f.name


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of section field ``f``."""
    return f.metadata.get("flag") or "--" + train_field(f).replace("_", "-")


class _Section:
    """Validation shared by the sections: the type of each field (from its annotation: an int is
    no bool, an int is taken as a float, a list as a tuple of strings), its choices and range;
    every message names the flag."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = _checked(getattr(self, f.name), hints[f.name], flag_of(f))
            object.__setattr__(self, f.name, value)
            _check_range(value, f, flag_of(f))


def _checked(value, hint, flag: str):
    """``value`` as the type ``hint`` (``int``, ``float``, ``str``, ``bool``, ``tuple[str, ...]``,
    a union of them with ``None``), or a ``ValueError`` naming ``flag``."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union,
                                                                     types.UnionType) else (hint,)
    for kind in options:
        if kind is type(None) and value is None:
            return None
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is tuple and isinstance(value, (list, tuple)) \
                and all(isinstance(v, str) for v in value):
            return tuple(value)
    names = " or ".join(_type_name(k) for k in options)
    raise ValueError(f"{flag} must be {names}, got {value!r}")


def _type_name(kind) -> str:
    if kind is type(None):
        return "unset"
    if typing.get_origin(kind) is tuple:
        return "a list of strings"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}[kind]


def _check_range(value, f: dataclasses.Field, flag: str) -> None:
    meta = f.metadata
    if meta.get("choices") is not None and value is not None and not any(
            value is c or (type(value) is type(c) and value == c) for c in meta["choices"]):
        valid = ", ".join(str(c).lower() if isinstance(c, bool) else str(c)
                          for c in meta["choices"])
        raise ValueError(f"{flag} must be one of {valid}, got {value!r}")
    if value is None or isinstance(value, (str, bool, tuple)):
        return
    if meta.get("least") is not None and value < meta["least"]:
        raise ValueError(f"{flag} must be at least {meta['least']}, got {value!r}")
    if meta.get("positive") and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{flag} must be positive, got {value!r}")
    if meta.get("below") is not None and not value < meta["below"]:
        raise ValueError(f"{flag} must be below {meta['below']}, got {value!r}")


@dataclass(frozen=True)
class ModelSection(_Section):
    """What is trained: a reference preset, or a Hugging Face directory (``dir``, ``--model``),
    and its LoRA adapters."""

    preset: str = "tiny"
    dir: str | None = _f(None, train_field="model")
    layers: int | None = _f(None, least=1, flag="[model] layers")  # no flag: the file
    dropout: float | None = _f(None, least=0.0, below=1.0)
    lora_rank: int | None = _f(None, least=1)
    lora_alpha: float | None = _f(None, positive=True)
    lora_targets: tuple[str, ...] | None = None
    lora_dropout: float = _f(0.0, least=0.0, below=1.0)


@dataclass(frozen=True)
class LayoutSection(_Section):
    """The rank grid: ``pp × dp × ep × cp × tp`` (``dp`` unset: what the processes leave), the
    ranks per node and PCIe island, and the pipeline's schedule."""

    tp: int = _f(1, least=1)
    dp: int | None = _f(None, least=1)
    ep: int = _f(1, least=1)
    cp: int = _f(1, least=1)
    pp: int = _f(1, least=1)
    ranks_per_node: int | None = _f(None, least=1)
    ranks_per_island: int | None = _f(None, least=1)
    pp_schedule: str = _f("1f1b", choices=tuple(sorted(SCHEDULES)))
    microbatches: int = _f(1, least=1)
    stages_per_rank: int | None = _f(None, least=1)


@dataclass(frozen=True)
class OptimSection(_Section):
    """AdamW's learning rate and its schedule, gradient clipping, the compute precision and the
    ZeRO stage."""

    lr: float = _f(3e-3, positive=True)
    schedule: str = _f("constant", train_field="lr_schedule", choices=LR_SCHEDULES)
    warmup: int = _f(0, least=0)
    clip: float | None = _f(None, train_field="clip_grad", positive=True)
    precision: str = _f("fp32", choices=PRECISIONS)
    zero: int = _f(0, choices=ZERO_STAGES)


@dataclass(frozen=True)
class DataSection(_Section):
    """The corpus (``path``, ``--data``; unset: the standard library's sources) and how
    ``--model`` packs documents."""

    path: str | None = _f(None, train_field="data")
    pack: str = _f("docs", choices=PACKS)


@dataclass(frozen=True)
class CheckpointSection(_Section):
    """Sharded checkpoints (``dir``, ``--ckpt-dir``), resuming and restarts."""

    dir: str | None = _f(None, train_field="ckpt_dir")
    save_every: int = _f(0, least=0)
    keep_checkpoints: int = _f(3, least=1)
    resume: bool | str = _f(False, choices=(False, True, "strict"))
    on_save_error: str = _f("stop", choices=("stop", "continue"))
    rebalance: str = _f("auto", choices=REBALANCE)
    max_restarts: int = _f(0, least=0)
    elastic: bool = False


@dataclass(frozen=True)
class RunSection(_Section):
    """Steps, the global batch (in ``grad_accum`` micro-batches), the sequence length, the seed,
    the output directory and what the run prints and logs."""

    steps: int = _f(200, least=1)
    batch: int = _f(8, least=1)
    grad_accum: int = _f(1, least=1)
    seq: int = _f(64, least=1)
    seed: int = 0
    out: str | None = None
    progress: bool = _f(True, flag="--no-progress")
    tensorboard: str | None = None
    log_every: int = _f(10, least=1)  # the loss read from the device once per this many steps
    sample_tokens: int = _f(160, least=0, flag="[run] sample_tokens")  # no flag: the file
    sample_prompt: str = _f("def ", flag="[run] sample_prompt")  # no flag: the file


# ParallelOptions' fields a run sets (the rest — vocab, buckets, precision — follow from other
# sections or keep parallelize's defaults), and the TrainConfig field of each.
PARALLEL_FIELDS = {"attention": "attention", "sequence_parallel": "sequence_parallel",
                   "recompute": "recompute", "activation_cache": "activation_cache",
                   "overlap": "overlap", "chunks": "chunks", "moe_statistics": "moe_statistics",
                   "context_parallel": "cp_strategy", "compile": "compile",
                   "compile_backend": "compile_backend", "fp8_backward": "fp8_backward"}

SECTIONS = {"model": ModelSection, "layout": LayoutSection, "optim": OptimSection,
            "data": DataSection, "checkpoint": CheckpointSection, "run": RunSection}
SECTION_ORDER = ("model", "layout", "parallel", "optim", "data", "checkpoint", "run")


def parallel_options(**values) -> ParallelOptions:
    """``ParallelOptions(**values)``, its message naming the flag (``chunks must …`` →
    ``--chunks must …``)."""
    try:
        return ParallelOptions(**values)
    except ValueError as exc:
        name, _, rest = str(exc).partition(" ")
        train = PARALLEL_FIELDS.get(name, name)
        raise ValueError(f"--{train.replace('_', '-')} {rest}") from None


@dataclass(frozen=True)
class RunConfig:
    """One run, in sections (whose defaults :class:`~ops_transformer.training.loop.TrainConfig`
    takes).
    Each section checked itself when built; the rules across sections are here, once:
    ``parallel.precision`` follows ``optim.precision`` (``fp8`` is the layers'; 16-bit autocast is
    the loop's)."""

    model: ModelSection = field(default_factory=ModelSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)

    def __post_init__(self):
        for name in SECTION_ORDER:
            kind = ParallelOptions if name == "parallel" else SECTIONS[name]
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"RunConfig.{name} must be a {kind.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")
        layers = "fp8" if self.optim.precision == "fp8" else "fp32"
        if self.parallel.precision != layers:
            object.__setattr__(self, "parallel",
                               dataclasses.replace(self.parallel, precision=layers))

    def train_fields(self) -> dict:
        """The keyword arguments of the flat ``TrainConfig`` the loop runs
        (``TrainConfig.from_run_config`` builds it; ``TrainConfig.run_config`` goes back)."""
        out = {}
        for name, kind in SECTIONS.items():
            section = getattr(self, name)
            out.update({train_field(f): getattr(section, f.name) for f in fields(kind)})
        return out | {train: getattr(self.parallel, name)
                      for name, train in PARALLEL_FIELDS.items()}


def from_train_fields(values: dict) -> RunConfig:
    """A :class:`RunConfig` from ``TrainConfig`` field values (absent ones: the defaults)."""
    sections = {}
    for name, kind in SECTIONS.items():
        sections[name] = kind(**{f.name: values[train_field(f)] for f in fields(kind)
                                 if train_field(f) in values})
    precision = "fp8" if values.get("precision") == "fp8" else "fp32"
    sections["parallel"] = parallel_options(precision=precision, **{
        name: values[train] for name, train in PARALLEL_FIELDS.items() if train in values})
    return RunConfig(**sections)


def section_flags() -> dict[str, str]:
    """Every command-line flag a section field has → its section's name (``--tp`` → ``layout``);
    the fields only a file sets (``[model] layers``, ``[run] sample_*``) have none."""
    flags = {"--" + train.replace("_", "-"): "parallel" for train in PARALLEL_FIELDS.values()}
    for name, kind in SECTIONS.items():
        flags.update({flag_of(f): name for f in fields(kind) if flag_of(f).startswith("--")})
    return flags


def section_summary(name: str) -> str:
    """The first sentence of section ``name``'s docstring (the heading of its flags in
    ``--help``)."""
    if name == "parallel":
        return "how parallelize prepares the model (ParallelOptions)"
    doc = " ".join((SECTIONS[name].__doc__ or "").replace("``", "").split())
    return doc.split(". ")[0].rstrip(".")


YAML_SUFFIXES = (".yaml", ".yml")


def _yaml_sections(text: str, where: str) -> dict:
    """A YAML file's sections (PyYAML's ``safe_load``: plain values only); one line when PyYAML
    is missing, the text is not YAML or its top level is not a mapping of sections."""
    try:
        import yaml
    except ImportError:
        raise ValueError(f"{where}: reading YAML needs PyYAML (pip install pyyaml), or write the "
                         f"file as TOML") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where} is not a YAML file: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a YAML run configuration is a mapping of sections "
                         f"({', '.join(SECTION_ORDER)}), got a {type(data).__name__}")
    return data


def section_keys(name: str) -> tuple[str, ...]:
    """The keys a TOML file may give in section ``[name]``."""
    if name == "parallel":
        return tuple(PARALLEL_FIELDS)
    return tuple(f.name for f in fields(SECTIONS[name]))


def key_flags() -> dict[tuple[str, str], str]:
    """``(section, key)`` → the ``TrainConfig`` field it sets."""
    keys = {("parallel", n): t for n, t in PARALLEL_FIELDS.items()}
    for name, kind in SECTIONS.items():
        keys.update({(name, f.name): train_field(f) for f in fields(kind)})
    return keys


def load_toml(path: str | Path) -> tuple[RunConfig, set[str]]:
    """The run of a TOML file (or a YAML one, by its suffix ``.yaml`` / ``.yml``: the same
    sections as mappings), and the ``TrainConfig`` fields the file sets. Any fault — not a file,
    not TOML (YAML), an unknown section or key, a wrong type, a value out of range — is one
    ``ValueError`` line naming the file, the key, the value and what is valid."""
    where = f"--config {str(path)!r}"
    kind = "YAML" if Path(path).suffix in YAML_SUFFIXES else "TOML"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{where} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not a {kind} file: {exc}") from None
    data = _yaml_sections(text, where) if kind == "YAML" else None
    if data is None:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{where} is not a TOML file: {exc}") from None
    values, keys = {}, key_flags()
    for name, table in data.items():
        if name not in SECTION_ORDER or not isinstance(table, dict):
            raise ValueError(f"{where}: unknown section [{name}]; the sections are "
                             f"{', '.join(f'[{s}]' for s in SECTION_ORDER)}")
        for key, value in table.items():
            if key not in section_keys(name):
                raise ValueError(f"{where}: unknown key {key!r} in [{name}]; valid keys: "
                                 f"{', '.join(section_keys(name))}")
            values[keys[name, key]] = value
            try:  # this one value, alone: the message names it
                from_train_fields({keys[name, key]: value})
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where}: [{name}] {key} = {_toml_value(value)}: {exc}") \
                    from None
    try:
        return from_train_fields(values), set(values)
    except (ValueError, TypeError) as exc:  # a rule across keys (e.g. compile with chunked)
        raise ValueError(f"{where}: {exc}") from None


def to_toml(config: RunConfig) -> str:
    """``config`` as TOML, every section and every set field (an unset one — ``None`` — is left
    out: TOML has no null, and the default of each such field is ``None``). ``load_toml`` reads
    it back equal."""
    lines = []
    for name in SECTION_ORDER:
        section = getattr(config, name)
        lines.append(f"[{name}]")
        for key in section_keys(name):
            value = getattr(section, key)
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else
                                                          ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))
