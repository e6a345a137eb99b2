"""Seeded sampling on CPU. vLLM samples a token for every scheduled request, also for a prompt whose
prefill this step only partly covers (a chunk), and throws that token away. So that a seeded request
draws the numbers it would have drawn had that step not sampled for it,
`GPUModelRunner._bookkeeping_sync` rewinds the request's generator with
`set_offset(get_offset() - 4)`, which fits the Philox generators of GPUs. PyTorch's CPU generator (a
Mersenne Twister) has no offset and raises, and the engine dies. The patch saves each such CPU
generator's state before sampling, restores it afterwards, and keeps vLLM's rewind away from it: a
seeded request draws the same numbers whether or not its prompt was chunked. Generators that have an
offset are left to vLLM. Where the patch does not fit the vLLM it meets, pdserve refuses seeded
requests that vLLM may split (admission.py) instead.
"""

from __future__ import annotations

import functools
import inspect
import logging

from pdserve.vllm_logging import route_logs_to_vllm
from pdserve.vllm_patches.target import find_class, import_class, vllm_version

NAME = "seeded_sampling"
MODULE = "vllm.v1.worker.gpu_model_runner"
CLASS = "GPUModelRunner"
REWIND = "gen.set_offset(gen.get_offset() - 4)"
PATCHED_MARK = "_pdserve_keeps_cpu_generators"

logger = logging.getLogger("pdserve.vllm_patches")


def patch(module) -> bool:
    runner_class, missing = find_class(module, CLASS)
    if runner_class is None:
        left_out(missing)
        return False
    return patch_model_runner(runner_class)


def problem() -> str | None:
    """Why the patch does not fit this process's vLLM (importing the model runner if it is not yet),
    or None when it is in place or would apply."""
    runner_class, missing = import_class(MODULE, CLASS)
    if runner_class is None:
        return missing
    if getattr(runner_class, PATCHED_MARK, False):
        return None
    return _unexpected(runner_class)


def patch_model_runner(runner_class: type) -> bool:
    """Make `runner_class` keep CPU generators of discarded samples; False if its code is not the
    code this patch was written for (then it is left alone, with a warning)."""
    if getattr(runner_class, PATCHED_MARK, False):
        return True
    mismatch = _unexpected(runner_class)
    if mismatch is not None:
        left_out(mismatch)
        return False
    sample, bookkeeping = runner_class._sample, runner_class._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self, *args, **kwargs):
        saved = [(generator, generator.get_state()) for generator in _offsetless_discarded(self).values()]
        try:
            return sample(self, *args, **kwargs)
        finally:
            for generator, state in saved:
                generator.set_state(state)

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):
        kept = _offsetless_discarded(self)
        generators = self.input_batch.generators
        for index in kept:
            del generators[index]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(kept)

    runner_class._sample = _sample
    runner_class._bookkeeping_sync = _bookkeeping_sync
    setattr(runner_class, PATCHED_MARK, True)
    route_logs_to_vllm()
    logger.info(
        "pdserve: seeded sampling on CPU patched: a request's CPU generator is restored after a "
        "step that discards its sample (vLLM's offset rewind works on GPU generators only)")
    return True


def left_out(why: str) -> None:
    """Say why the patch is left out (its module, class or code is not what it was written for)."""
    route_logs_to_vllm()
    logger.warning("pdserve: vLLM %s: patch %s left out: %s. On CPU, seeded requests that vLLM may split across "
                   "steps are refused (HTTP 400), since vLLM's own rewind of their generator kills the engine",
                   vllm_version(), NAME, why)


def _offsetless_discarded(runner) -> dict:
    """Batch index -> generator, for this step's discarded samples whose generator has no offset."""
    batch = runner.input_batch
    if not batch.generators:
        return {}
    discarded = runner.discard_request_mask.np[: batch.num_reqs].nonzero()[0]
    found = {}
    for index in discarded.tolist():
        generator = batch.generators.get(index)
        if generator is not None and not _has_offset(generator):
            found[index] = generator
    return found


def _has_offset(generator) -> bool:
    try:
        generator.get_offset()
    except RuntimeError:
        return False
    return True


def _unexpected(runner_class: type) -> str | None:
    """Why the patch does not fit `runner_class`, or None when it does."""
    for name in ("_sample", "_bookkeeping_sync"):
        if not callable(getattr(runner_class, name, None)):
            return f"{runner_class.__name__}.{name} is missing"
    try:
        source = inspect.getsource(runner_class._bookkeeping_sync)
    except (OSError, TypeError) as error:
        return f"the source of _bookkeeping_sync is unavailable ({error})"
    for expected in (REWIND, "self.input_batch.generators", "self.discard_request_mask.np"):
        if expected not in source:
            return f"_bookkeeping_sync no longer contains {expected!r}"
    return None
