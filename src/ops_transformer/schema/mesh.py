"""The degrees of a ``pp × dp × ep × cp × tp`` rank grid, checked against the world size: pure
arithmetic, torch-free (``parallel.context.init_parallel`` and the checks before any rank starts
run it)."""

from __future__ import annotations


def check_mesh_degrees(world_size: int, *, tp: int, dp: int | None, ep: int, cp: int,
                       pp: int = 1) -> tuple[int, int, int, int]:
    """Validate every degree of the ``pp × dp × ep × cp × tp`` grid against the world size,
    naming each factor in the error (``pp`` and ``cp`` only when above 1); returns ``(dp, ep, cp,
    tp)`` (``dp=None``: the rest of the ranks)."""
    for name, value in (("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep), ("dp", dp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    fixed = pp * tp * ep * cp
    pp_part = f"pp ({pp}) × " if pp > 1 else ""
    cp_part = f" × cp ({cp})" if cp > 1 else ""
    if dp is None:
        if world_size % fixed != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by {pp_part}tp ({tp}) × ep ({ep})"
                f"{cp_part} = {fixed}, so dp cannot be inferred; choose degrees whose product "
                f"divides {world_size}")
        dp = world_size // fixed
    if dp * fixed != world_size:
        raise ValueError(
            f"{pp_part}dp ({dp}) × ep ({ep}){cp_part} × tp ({tp}) = {dp * fixed} must equal the "
            f"world size ({world_size})")
    return dp, ep, cp, tp
