"""What PDConnector serves today, checked when vLLM creates it: anything else is refused at startup
with a line naming the setting, before vLLM allocates a KV cache.

Supported: KV cache groups of full attention, sliding window and mamba/linear-attention state
(kv_groups.py; state needs P and D of one tensor-parallel size, and static placement), any
tensor-parallel size (each rank moves its own heads, ranks.py; adaptive placement only at size 1),
pipeline and data parallel size 1 per instance. Models without any attention layer are refused:
not tried.

MLA is refused: vLLM's CPU MLA backend (the one without AMX) does not agree with itself. In
collocated serving at float32, one request at a time, the token after the first, computed by its
decode path (weight-absorbed attention over the cached latents), and the same token computed by
its prefill path (over the prompt and the first token), differ by up to 1.29 in logprob and are
different tokens for 10 of 12 prompts (scripts/mla_paths.py); 4 requests at a time part from 1 at
a time at the first token. D computes a prompt's last token by the decode path where plain
serving uses prefill, so PD's answers part from plain serving (measured, float32, 1P1D WRITE and
READ: every block of 40 prompts moved, none failed, answers parted at the first token). Nothing
on this backend can tell a transfer defect from that, so MLA is not served until a backend whose
two paths agree (AMX, a GPU) shows it.
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
