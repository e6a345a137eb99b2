"""pdserve: prefill/decode disaggregation for vLLM."""

__version__ = "0.1.0"
