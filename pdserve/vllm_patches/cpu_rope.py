"""Rotary embedding on CPU for 3-D query and key. vLLM's CPU rotary kernel (`ops.rotary_embedding`,
called by `RotaryEmbedding.forward_cpu`) reads query and key as 2-D rows, one row of heads × head
size per token, stepping from token to token by the second-to-last stride. Llama-style models hand it
2-D tensors and are served right. DeepSeek-style multi-head latent attention (vLLM's MLA layer)
hands it 3-D views: the rotary slice of every query head (`[tokens, heads, 64]` inside
`[tokens, heads, 128]`) and the rotary key (`[tokens, 1, 64]` inside each token's 576-wide latent
row). The kernel then steps by a head instead of a token and rotates other numbers than each token's
own, with other positions: the model's answers are wrong, differ between the prefill and decode
paths and with the batch a request shares (measured on the DeepSeek-V2-style test model in float32:
up to 1.29 in logprob between the two paths, 1.59 between a request served alone and in a batch of
4, and against a plain PyTorch reference of the model the first token already parts).

The patch hands the kernel each 3-D tensor as 2-D rows (a view where the memory allows, else a
copy that is written back), so it rotates exactly what `forward_native` does; 2-D tensors go to the
kernel as before. Where the patch does not fit the vLLM it meets, pdserve refuses MLA models on CPU
at startup (connector/support.py, admission.py) instead.
"""

from __future__ import annotations

import functools
import inspect
import logging

from pdserve.vllm_logging import route_logs_to_vllm
from pdserve.vllm_patches.target import find_class, import_class, vllm_version

NAME = "cpu_rope"
MODULE = "vllm.model_executor.layers.rotary_embedding.base"
CLASS = "RotaryEmbedding"
KERNEL_CALL = "ops.rotary_embedding("
PATCHED_MARK = "_pdserve_rotates_3d_rows"

logger = logging.getLogger("pdserve.vllm_patches")


def patch(module) -> bool:
    rope_class, missing = find_class(module, CLASS)
    if rope_class is None:
        left_out(missing)
        return False
    return patch_rotary_embedding(rope_class)


def patch_rotary_embedding(rope_class: type) -> bool:
    """Make `rope_class.forward_cpu` rotate 3-D query and key as 2-D rows; False if its code is not
    the code this patch was written for (then it is left alone, with a warning)."""
    if getattr(rope_class, PATCHED_MARK, False):
        return True
    mismatch = _unexpected(rope_class)
    if mismatch is not None:
        left_out(mismatch)
        return False
    forward_cpu = rope_class.forward_cpu

    @functools.wraps(forward_cpu)
    def forward_cpu_by_rows(self, positions, query, key=None):
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return forward_cpu(self, positions, query, key)
        query_rows = _rows(query)
        key_rows = None if key is None else _rows(key)
        forward_cpu(self, positions, query_rows, key_rows)
        _write_back(query, query_rows)
        if key is not None:
            _write_back(key, key_rows)
        return query, key

    rope_class.forward_cpu = forward_cpu_by_rows
    setattr(rope_class, PATCHED_MARK, True)
    route_logs_to_vllm()
    logger.info("pdserve: rotary embedding on CPU patched: 3-D query and key reach vLLM's kernel as "
                "2-D rows (MLA's rotary slices were rotated at the wrong places)")
    return True


def applied() -> bool:
    """Whether vLLM's RotaryEmbedding in this process carries the patch (importing it runs the patch
    where `install` has set it to, as the plugin does in every vLLM process); False where the module
    or the class is not there."""
    rope_class, _ = import_class(MODULE, CLASS)
    return rope_class is not None and bool(getattr(rope_class, PATCHED_MARK, False))


def problem() -> str | None:
    """Why the patch is not in place in this process, or None when it is."""
    rope_class, missing = import_class(MODULE, CLASS)
    if rope_class is None:
        return missing
    if getattr(rope_class, PATCHED_MARK, False):
        return None
    return _unexpected(rope_class) or "pdserve's plugin did not install it in this process"


def left_out(why: str) -> None:
    """Say why the patch is left out (its module, class or code is not what it was written for)."""
    route_logs_to_vllm()
    logger.warning("pdserve: vLLM %s: patch %s left out: %s. MLA models on CPU are refused at startup, since "
                   "vLLM's CPU rotary kernel rotates their query and key at the wrong places", vllm_version(), NAME, why)


def _rows(tensor):
    """`tensor` as [tokens, everything else]: a view of it where its strides allow, else a copy."""
    return tensor if tensor.dim() <= 2 else tensor.reshape(tensor.shape[0], -1)


def _write_back(tensor, rows) -> None:
    if rows.data_ptr() != tensor.data_ptr():
        tensor.copy_(rows.view(tensor.shape))


def _unexpected(rope_class: type) -> str | None:
    """Why the patch does not fit `rope_class`, or None when it does."""
    if not callable(getattr(rope_class, "forward_cpu", None)):
        return f"{rope_class.__name__}.forward_cpu is missing"
    try:
        source = inspect.getsource(rope_class.forward_cpu)
    except (OSError, TypeError) as error:
        return f"the source of forward_cpu is unavailable ({error})"
    if KERNEL_CALL not in source:
        return f"forward_cpu no longer calls {KERNEL_CALL!r}"
    return None
