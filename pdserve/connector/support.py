"""What PDConnector serves today, checked when vLLM creates it: anything else is refused at startup
with a line naming the setting, before vLLM allocates a KV cache.

Supported: KV cache groups of full attention, MLA, sliding window and mamba/linear-attention state
(kv_groups.py; state needs P and D of one tensor-parallel size, and static placement), any
tensor-parallel size (each rank moves its own heads, ranks.py; adaptive placement only at size 1),
pipeline and data parallel size 1 per instance. Models without any attention layer are refused:
not tried.

MLA (one latent per token, every rank holding it whole) moves as full attention does. On CPU it is
served only with pdserve's patch of vLLM's rotary kernel in place (vllm_patches/cpu_rope.py):
without it vLLM's own answers for an MLA model are wrong and its prefill and decode paths disagree
(up to 1.29 in logprob at float32), and D computes a prompt's last token by the decode path where
plain serving uses prefill, so no PD answer could equal plain serving. MLA with adaptive placement
has not been tried and is refused.
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
    if model is not None and getattr(model, "use_mla", False) and not _mla_rope_sound():
        reasons.append(f"model {model.model!r} uses multi-head latent attention (MLA), and vLLM's CPU rotary "
                       "kernel, which rotates MLA's query and key at the wrong places, is not patched "
                       "(pdserve.vllm_patches.cpu_rope did not apply to this vLLM)")
    return reasons


def _mla_rope_sound() -> bool:
    """True unless this is a CPU whose vLLM rotary kernel pdserve's patch did not fix."""
    from vllm.platforms import current_platform  # lazy: heavy, MLA models only

    if not current_platform.is_cpu():
        return True
    from pdserve.vllm_patches import cpu_rope  # lazy: on CPU only

    return cpu_rope.applied()


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
    if adaptive and model is not None and getattr(model, "use_mla", False):
        reasons.append(f"model {model.model!r} uses multi-head latent attention (MLA); adaptive placement has not "
                       "been tried with it (use mode write or read)")
    if reasons:
        raise ConfigError("PDConnector cannot serve this configuration: " + "; ".join(reasons))
