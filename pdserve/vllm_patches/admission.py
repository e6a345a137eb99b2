"""Where a patch did not fit the vLLM it met, pdserve refuses what that patch protects, and serves the
rest. vLLM's `InputProcessor` (in the API server, which turns each request into the engine's) is
wrapped so that:

- at startup, an MLA model on CPU is refused when `cpu_rope` is not in place (vLLM would serve it
  wrong); PDConnector refuses it too (connector/support.py), this covers plain serving;
- per request, on CPU, a seeded request that vLLM may split across steps is refused with HTTP 400
  when `seeded_sampling` is not in place: vLLM's rewind of its CPU generator would kill the engine
  (and every request in it). vLLM splits a prompt whenever the step's token budget runs short: one
  longer than a chunk (`--max-num-batched-tokens`, `--long-prefill-token-threshold`), or any prompt
  of more than one token that arrives while other requests take the budget, so with more than one
  sequence per step (`--max-num-seqs`) every seeded prompt but a one-token one is refused.

If this wrapping itself does not fit and `seeded_sampling` is not in place either, nothing could
refuse those requests one by one: the instance refuses to start (PatchRefusal), naming both.
"""

from __future__ import annotations

import functools
import inspect
import logging

from pdserve.errors import ConfigError
from pdserve.vllm_logging import route_logs_to_vllm
from pdserve.vllm_patches import cpu_rope, seeded_sampling
from pdserve.vllm_patches.target import find_class, vllm_version

NAME = "admission"
MODULE = "vllm.v1.engine.input_processor"
CLASS = "InputProcessor"
PATCHED_MARK = "_pdserve_refuses_unprotected"
GREEDY_BELOW = 1e-5  # vLLM samples greedily (no generator) below this temperature

logger = logging.getLogger("pdserve.vllm_patches")


class PatchRefusal(ConfigError):
    """This vLLM cannot serve what a patch of pdserve protects, and pdserve cannot refuse it request by request."""


def patch(module) -> bool:
    processor_class, missing = find_class(module, CLASS)
    if processor_class is None:
        left_out(missing)
        return False
    return patch_input_processor(processor_class)


def patch_input_processor(processor_class: type) -> bool:
    """Wrap `processor_class` (vLLM's InputProcessor) to refuse what a missing patch protects; False
    if its code is not the code this was written for (then `left_out` decides)."""
    if getattr(processor_class, PATCHED_MARK, False):
        return True
    mismatch = _unexpected(processor_class)
    if mismatch is not None:
        left_out(mismatch)
        return False
    init, process_inputs = processor_class.__init__, processor_class.process_inputs
    from vllm.exceptions import VLLMValidationError  # _unexpected checked it is there

    @functools.wraps(init)
    def __init__(self, vllm_config, *args, **kwargs):
        refuse_at_startup(vllm_config)
        init(self, vllm_config, *args, **kwargs)

    @functools.wraps(process_inputs)
    def checked_process_inputs(self, *args, **kwargs):
        request = process_inputs(self, *args, **kwargs)
        refusal = seeded_refusal(self.vllm_config, request.sampling_params, _num_prompt_tokens(request))
        if refusal is not None:  # vLLM answers its validation error with HTTP 400 (anything else: 500)
            raise VLLMValidationError(refusal, parameter="seed", value=request.sampling_params.seed)
        return request

    processor_class.__init__ = __init__
    processor_class.process_inputs = checked_process_inputs
    setattr(processor_class, PATCHED_MARK, True)
    return True


def left_out(why: str) -> None:
    """This vLLM's InputProcessor cannot be wrapped (`why`): refuse to start where seeded requests
    would then go unprotected, else say so and go on."""
    route_logs_to_vllm()
    if _on_cpu() and (sampling := seeded_sampling.problem()) is not None:
        raise PatchRefusal(
            f"pdserve refuses to start on vLLM {vllm_version()}: its patch {seeded_sampling.NAME} does not apply "
            f"({sampling}), so a seeded request that vLLM splits across steps would kill the engine on CPU, and "
            f"its patch {NAME}, which would refuse such requests one by one, does not apply either ({why})")
    logger.warning("pdserve: vLLM %s: patch %s left out: %s (not needed while %s is in place)", vllm_version(), NAME,
                   why, seeded_sampling.NAME)


def refuse_at_startup(vllm_config) -> None:
    """PatchRefusal for a model this vLLM serves wrong without a patch that did not apply. (Seeded
    requests are checked one by one, the patch's state probed at the first that needs it: the API
    server does not import the model runner otherwise, and the worker that does says at startup
    when the patch is left out.)"""
    if not _on_cpu():
        return
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "use_mla", False) and (rope := cpu_rope.problem()) is not None:
        raise PatchRefusal(
            f"pdserve refuses model {model.model!r} on vLLM {vllm_version()}: it uses multi-head latent attention "
            f"(MLA), which vLLM's CPU rotary kernel rotates at the wrong places, and pdserve's patch "
            f"{cpu_rope.NAME} does not apply ({rope})")


def seeded_refusal(vllm_config, params, num_prompt_tokens: int) -> str | None:
    """Why this request is refused (a seeded request vLLM may split, on CPU, without `seeded_sampling`
    in place), or None."""
    if getattr(params, "seed", None) is None or getattr(params, "temperature", 0.0) < GREEDY_BELOW:
        return None
    limit = max_unsplit_tokens(vllm_config.scheduler_config)
    if num_prompt_tokens <= limit or not _on_cpu():
        return None
    sampling = _seeded_sampling_problem()
    if sampling is None:
        return None
    _say_seeded_requests_are_refused(sampling, limit)
    return (f"pdserve refuses seeded sampling for this request: on vLLM {vllm_version()} pdserve's patch "
            f"{seeded_sampling.NAME} does not apply ({sampling}), and without it a seeded request whose "
            f"{num_prompt_tokens}-token prompt vLLM splits across steps (this instance may split any prompt of more "
            f"than {limit} tokens) kills the engine on CPU. Send it without a seed, or with temperature 0.")


def max_unsplit_tokens(scheduler_config) -> int:
    """The longest prompt vLLM never splits across steps under `scheduler_config`."""
    if not getattr(scheduler_config, "enable_chunked_prefill", True):
        return 1 << 62  # a prompt waits for a step with room for all of it
    chunk = scheduler_config.max_num_batched_tokens
    threshold = getattr(scheduler_config, "long_prefill_token_threshold", 0) or 0
    if 0 < threshold < chunk:
        chunk = threshold
    return chunk if scheduler_config.max_num_seqs == 1 else 1


@functools.cache
def _say_seeded_requests_are_refused(why: str, limit: int) -> None:
    route_logs_to_vllm()
    logger.warning("pdserve: vLLM %s: patch %s does not apply (%s): seeded requests of more than %d prompt tokens "
                   "are refused (HTTP 400)", vllm_version(), seeded_sampling.NAME, why, limit)


def _num_prompt_tokens(request) -> int:
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    embeds = getattr(request, "prompt_embeds", None)
    return 0 if embeds is None else len(embeds)


@functools.cache
def _seeded_sampling_problem() -> str | None:
    return seeded_sampling.problem()


@functools.cache
def _on_cpu() -> bool:
    from vllm.platforms import (
        current_platform,  # lazy: vLLM, which this module must not import (sitecustomize imports it)
    )

    return current_platform.is_cpu()


def _unexpected(processor_class: type) -> str | None:
    """Why the wrapping does not fit `processor_class`, or None when it does."""
    try:
        from vllm.exceptions import VLLMValidationError  # noqa: F401 - what vLLM answers with HTTP 400
    except ImportError as error:
        return f"vllm.exceptions.VLLMValidationError does not import ({error})"
    if not callable(getattr(processor_class, "process_inputs", None)):
        return f"{processor_class.__name__}.process_inputs is missing"
    try:
        parameters = list(inspect.signature(processor_class.__init__).parameters)
    except (TypeError, ValueError) as error:
        return f"the signature of {processor_class.__name__}.__init__ is unavailable ({error})"
    if parameters[1:2] != ["vllm_config"]:
        return f"{processor_class.__name__}.__init__ no longer takes vllm_config first"
    try:
        source = inspect.getsource(processor_class.__init__)
    except (OSError, TypeError) as error:
        return f"the source of {processor_class.__name__}.__init__ is unavailable ({error})"
    if "self.vllm_config = vllm_config" not in source:
        return f"{processor_class.__name__} no longer keeps its vllm_config"
    return None
