"""The result of a parity check: :class:`ParityReport` (data, a table, one JSON document)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..utils.progress import format_table


@dataclass
class ParityReport:
    """``ok``; ``first_mismatch``: the module blamed (``None`` when ``ok``, or when only the loss
    of a later step differs), with its plan ``style`` and the ``reason``; ``first_differing``:
    the first row, in execution order, beyond its tolerance; ``rows``: one per module call in
    forward-finish order (``kind: "module"``: output ``max_abs``/``max_rel``, ``input_rel``,
    ``grad_rel`` of its output's gradient, what was ``compared``), then one per parameter
    (``kind: "parameter"``: its gradient in dense coordinates); ``loss``, ``kl`` (logits),
    ``steps`` (the loss of each optimizer step, side by side); ``reference``: how the dense model
    ran; ``error``: what a plan that could not run raised, and where."""

    ok: bool
    first_mismatch: str | None
    style: str | None = None
    reason: str = ""
    first_differing: str | None = None
    rows: list[dict] = field(default_factory=list)
    loss: dict | None = None
    kl: float | None = None
    steps: list[dict] = field(default_factory=list)
    weights: list[dict] = field(default_factory=list)  # initial weights that differ
    reference: str = ""
    precision: str = "fp32"
    tolerance: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)
    error: dict | None = None

    @property
    def modules(self) -> list[dict]:
        return [r for r in self.rows if r["kind"] == "module"]

    @property
    def parameters(self) -> list[dict]:
        return [r for r in self.rows if r["kind"] == "parameter"]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ParityReport:
        return cls(**data)

    def verdict(self) -> str:
        if self.ok:
            return (f"OK: the parallel model matches the dense one within the {self.precision} "
                    f"tolerance (output {self.tolerance.get('output', 0):g} relative)")
        where = self.first_mismatch or "(no module)"
        style = f" [plan style: {self.style}]" if self.style else " [no plan rule of its own]" \
            if self.first_mismatch else ""
        return f"MISMATCH at {where}{style}: {self.reason}"

    def table(self) -> str:
        """The rows as text: modules, parameters, loss and logits, steps, then the verdict."""
        parts = [f"reference: {self.reference}"]
        if self.error:
            parts.append(f"error on rank {self.error['rank']} in {self.error['module']} "
                         f"({self.error['phase']}): {self.error['type']}: "
                         f"{self.error['message']}")
        fixed = self.tolerance.get("output")
        measured = any(r.get("bound") not in (None, fixed) for r in self.modules)
        modules = [{"#": i + 1, "module": r["name"], "style": _short(r.get("style")),
                    "compared": r.get("compared"), "max abs": _e(r.get("max_abs")),
                    "rel": _e(r.get("max_rel")),
                    **({"bound": _e(r.get("bound"))} if measured else {}),
                    "input rel": _e(r.get("input_rel")), "grad rel": _e(r.get("grad_rel")),
                    "status": r["status"]} for i, r in enumerate(self.modules)]
        if modules:
            note = (" (bound: the precision's tolerance or the dense model's own 16-bit rounding "
                    "there, whichever is larger)" if measured else "")
            parts.append(f"module outputs, in forward-finish order{note}:\n"
                         + format_table(modules))
        params = [{"parameter": r["name"], "shape": "×".join(map(str, r["shape"])),
                   "grad max abs": _e(r.get("max_abs")), "grad rel": _e(r.get("max_rel")),
                   "status": r["status"]} for r in self.parameters]
        if params:
            parts.append("parameter gradients, in dense coordinates:\n" + format_table(params))
        if self.weights:
            parts.append("initial weights that differ:\n" + format_table(
                [{"parameter": w["name"], "rel": _e(w.get("max_rel"))} for w in self.weights]))
        if self.loss:
            kl = "" if self.kl is None else f"; logits KL(dense ‖ parallel) {self.kl:.3e}"
            parts.append(f"loss: dense {self.loss['reference']:.6f}, parallel "
                         f"{self.loss['parallel']:.6f} (relative difference "
                         f"{self.loss['rel']:.1e}){kl}")
        if self.steps:
            parts.append("loss per optimizer step:\n" + format_table(
                [{"step": s["step"], "dense": f"{s['reference']:.6f}",
                  "parallel": f"{s['parallel']:.6f}",
                  "rel": _e(s["rel"]), "status": s["status"]} for s in self.steps]))
        parts.append(self.verdict())
        return "\n\n".join(parts)

    __str__ = table


def _short(style: str | None, width: int = 28) -> str | None:
    if style is None or len(style) <= width:
        return style
    return style[:width - 1] + "…"


def _e(value: float | None) -> str | None:
    return None if value is None else f"{value:.1e}"
