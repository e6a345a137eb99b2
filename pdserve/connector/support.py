"""What PDConnector serves today, checked when vLLM creates it: anything else is refused at startup
with a line naming the setting, before vLLM allocates a KV cache.

Supported: KV cache groups of full attention, sliding window and mamba/linear-attention state
(kv_groups.py; state needs P and D of one tensor-parallel size, and static placement), any
tensor-parallel size (each rank moves its own heads, ranks.py; adaptive placement only at size 1),
pipeline and data parallel size 1 per instance. Models without any attention layer are refused:
not tried.

MLA is refused: in a trial with this refusal lifted (and its KV cache group let through) every
block of a DeepSeek-V2-style model moved, yet its answers through PD parted from plain serving from
the first token on, one request at a time. On vLLM's CPU reference MLA backend (the
one without AMX) plain serving does not repeat itself either once requests share batches, so
nothing here yet tells a numeric difference (D computes the last prompt token through the
weight-absorbed decode kernel, plain serving through prefill) from a defect: until something
does, MLA is not served.
"""

from __future__ import annotations

from pdserve.errors import ConfigError

PARALLEL_SIZES = ("pipeline_parallel_size", "data_parallel_size")


def unsupported(vllm_config) -> list[str]:
    """Why PDConnector cannot serve this configuration: one line per reason, empty if it can."""
    reasons = []
    parallel = vllm_config.parallel_config
    for name in PARALLEL_SIZES:
        size = getattr(parallel, name, 1) or 1
        if size != 1:
            reasons.append(f"{name} is {size}; PDConnector moves KV between instances of {name} 1 only")
    model = vllm_config.model_config
    if model is not None and getattr(model, "is_attention_free", False):
        reasons.append(f"model {model.model!r} has no attention layer (mamba or linear attention only), "
                       "which PDConnector has not been tried with")
    if model is not None and getattr(model, "use_mla", False):
        reasons.append(f"model {model.model!r} uses multi-head latent attention (MLA), whose answers through "
                       "PDConnector are not yet shown equal to plain serving")
    return reasons


def check_supported(vllm_config, adaptive: bool = False) -> None:
    """ConfigError naming every setting PDConnector cannot serve (`adaptive`: placement is adaptive)."""
    reasons = unsupported(vllm_config)
    tp = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1
    if adaptive and tp != 1:
        reasons.append(f"tensor_parallel_size is {tp}; adaptive placement runs at tensor_parallel_size 1 only "
                       "(use mode write or read)")
    model = vllm_config.model_config
    if adaptive and model is not None and getattr(model, "is_hybrid", False):
        reasons.append(f"model {model.model!r} has mamba or linear-attention layers; adaptive placement has not "
                       "been tried with them (use mode write or read)")
    if reasons:
        raise ConfigError("PDConnector cannot serve this configuration: " + "; ".join(reasons))
