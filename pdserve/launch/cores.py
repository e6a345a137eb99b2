"""Dividing a launch's CPU cores among its prefill and decode instances and their tensor-parallel ranks."""

from __future__ import annotations

from typing import NamedTuple


class CorePlan(NamedTuple):
    """Cores per prefill instance and per decode instance (every core its ranks use; omp_threads_bind
    says which rank takes which); `shared` when some ranks share a core (fewer cores than ranks)."""

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


def omp_threads_bind(cores: tuple[int, ...], tp: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for an instance of `tp` ranks on `cores`: each rank's cores,
    ranks separated by '|' (vllm/utils/ompmultiprocessing.py), e.g. '0|1' for two ranks on cores 0
    and 1. Each rank has cores of its own where the instance has `tp` cores or more, else they take
    them round-robin."""
    return "|".join(",".join(map(str, group)) for group in split(cores, tp))


def divide_cores(cores: tuple[int, ...], num_prefill: int, num_decode: int, prefill_tp: int = 1,
                 decode_tp: int = 1) -> CorePlan:
    """Every rank its own cores where there are enough (all cores used, near-equal shares).
    Otherwise, given two cores or more, prefill and decode still keep separate cores (split in
    proportion to their numbers of ranks, at least one each) and the ranks of one role share that
    role's cores: a rank of D beside P on one core would slow P's prefill to a fraction of the core
    (measured: vLLM's engine loop steps without pause while a request waits for its KV, and its
    workers spin waiting for each step), which is the stall PD exists to avoid. With one core,
    every rank takes it."""
    num_prefill_ranks, num_decode_ranks = num_prefill * prefill_tp, num_decode * decode_tp
    total = num_prefill_ranks + num_decode_ranks
    if len(cores) >= total or len(cores) < 2:
        ranks = split(cores, total)
        prefill, decode = ranks[:num_prefill_ranks], ranks[num_prefill_ranks:]
    else:
        wanted = round(len(cores) * num_prefill_ranks / total)
        num_prefill_cores = min(len(cores) - min(decode_tp, len(cores) - 1), max(min(prefill_tp, len(cores) - 1), wanted))
        prefill = split(cores[:num_prefill_cores], num_prefill_ranks)
        decode = split(cores[num_prefill_cores:], num_decode_ranks)
    return CorePlan(_by_instance(prefill, prefill_tp), _by_instance(decode, decode_tp), shared=len(cores) < total)


def _by_instance(ranks: tuple[tuple[int, ...], ...], tp: int) -> tuple[tuple[int, ...], ...]:
    """Every `tp` consecutive ranks' cores, as the cores of one instance (which omp_threads_bind
    divides among its ranks again: the same cores, and a core per rank wherever the ranks had one)."""
    return tuple(tuple(sorted({core for group in ranks[i:i + tp] for core in group})) for i in range(0, len(ranks), tp))


def sharing_warning(placement: dict[str, tuple[tuple[int, ...], int]], num_cores: int) -> str:
    """The one warning of a launch whose ranks share cores; `placement`: instance name -> (cores, tp)."""
    listing = ", ".join(f"{name} on {omp_threads_bind(cores, tp)}" for name, (cores, tp) in placement.items())
    plural = "s" * (num_cores != 1)
    num_ranks = sum(tp for _, tp in placement.values())
    if num_ranks == len(placement):
        return (f"{len(placement)} instances on {num_cores} core{plural}: they share cores and run slower ({listing}); "
                "give the launch more cores (taskset) or fewer --prefill/--decode instances")
    return (f"{num_ranks} tensor-parallel ranks on {num_cores} core{plural}: ranks share cores, which is for "
            f"correctness checks only (cores by rank, '|' between ranks: {listing}); give {num_ranks} cores or "
            "smaller tensor-parallel sizes")
