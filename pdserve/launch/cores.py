"""Dividing a launch's CPU cores among its prefill and decode instances."""

from __future__ import annotations

from typing import NamedTuple


class CorePlan(NamedTuple):
    """Cores per prefill instance and per decode instance; `shared` when some instances share a
    core (fewer cores than instances)."""

    prefill: tuple[tuple[int, ...], ...]
    decode: tuple[tuple[int, ...], ...]
    shared: bool = False


def split(cores: tuple[int, ...], num_parts: int) -> tuple[tuple[int, ...], ...]:
    """`cores` in `num_parts` contiguous groups of near-equal size (the first ones one larger);
    with fewer cores than parts, part i gets core i mod len(cores)."""
    if len(cores) < num_parts:
        return tuple((cores[i % len(cores)],) for i in range(num_parts))
    size, extra = divmod(len(cores), num_parts)
    groups, start = [], 0
    for i in range(num_parts):
        end = start + size + (i < extra)
        groups.append(cores[start:end])
        start = end
    return tuple(groups)


def divide_cores(cores: tuple[int, ...], num_prefill: int, num_decode: int) -> CorePlan:
    """Every instance its own cores where there are enough (all cores used, near-equal shares).
    Otherwise prefill and decode keep separate cores while there are at least two (split in
    proportion to their numbers), and instances of one role share theirs."""
    total = num_prefill + num_decode
    if len(cores) >= total:
        groups = split(cores, total)
        return CorePlan(groups[:num_prefill], groups[num_prefill:])
    if len(cores) >= 2:
        num_prefill_cores = min(len(cores) - 1, max(1, round(len(cores) * num_prefill / total)))
        prefill = split(cores[:num_prefill_cores], num_prefill)
        decode = split(cores[num_prefill_cores:], num_decode)
    else:
        prefill, decode = split(cores, num_prefill), split(cores, num_decode)
    return CorePlan(prefill, decode, shared=True)


def sharing_warning(placement: dict[str, tuple[int, ...]], num_cores: int) -> str:
    """The one warning of a launch whose instances (name -> cores) share cores."""
    listing = ", ".join(f"{name} on {','.join(map(str, c))}" for name, c in placement.items())
    return (f"{len(placement)} instances on {num_cores} core{'s' * (num_cores != 1)}: they share cores and run "
            f"slower ({listing}); give the launch more cores (taskset) or fewer --prefill/--decode instances")
