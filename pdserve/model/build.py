"""`pdserve make-model`: a Llama model (config, tokenizer, seeded weights) built on the spot."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from pdserve.errors import ConfigError
from pdserve.model import tokenizer as tok
from pdserve.model import weights
from pdserve.model.spec import ModelSpec, spec_for
from pdserve.paths import project_root

DEFAULT_SEED = 0
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json")


def hf_config(spec: ModelSpec, bos_id: int, eos_id: int, pad_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
    }


def make_model(out_dir: Path | str, size: str, seed: int = DEFAULT_SEED) -> Path:
    """Build the model into `out_dir` (created; refused if it holds other files). Same seed -> same bytes.

    Written to a temporary sibling and renamed, so an interrupted build never leaves a half model.
    """
    spec = spec_for(size)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = tok.train(spec.vocab_size)
        if tokenizer.get_vocab_size() != spec.vocab_size:
            raise ConfigError(f"tokenizer reached {tokenizer.get_vocab_size()} tokens, wanted {spec.vocab_size}")
        tok.save(tokenizer, tmp, spec.max_position_embeddings)
        ids = [tokenizer.token_to_id(t) for t in (tok.BOS, tok.EOS, tok.PAD)]
        tok.write_json(tmp / "config.json", hf_config(spec, *ids))
        tok.write_json(tmp / "generation_config.json",
                       {"bos_token_id": ids[0], "eos_token_id": ids[1], "pad_token_id": ids[2]})
        weights.save(weights.init_weights(spec, seed), tmp / "model.safetensors")
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def models_dir() -> Path:
    return project_root() / "models"


def resolve_model(name_or_dir: str) -> Path:
    """A model directory for `pdserve up --model`: a built-in size (built under models/ on first use) or a path."""
    if name_or_dir in ("tiny", "small"):
        path = models_dir() / name_or_dir
        if not (path / "model.safetensors").exists():
            make_model(path, name_or_dir)
        return path
    path = Path(name_or_dir)
    if not path.is_dir():
        raise ConfigError(f"model directory {path} does not exist (or use tiny|small)")
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).exists()]
    if missing:
        raise ConfigError(f"model directory {path} lacks {', '.join(missing)}")
    return path.resolve()
