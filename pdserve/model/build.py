"""`pdserve make-model`: a model of one architecture (config, tokenizer, seeded weights) built on the spot."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from pdserve.errors import ConfigError
from pdserve.model import tokenizer as tok
from pdserve.model import weights
from pdserve.model.archs import DEFAULT_ARCH, arch_for, builtin_models
from pdserve.model.archs.base import SpecialTokens
from pdserve.model.spec import DEFAULT_SEED
from pdserve.paths import work_dir

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json")


def make_model(out_dir: Path | str, size: str, seed: int = DEFAULT_SEED, arch: str = DEFAULT_ARCH) -> Path:
    """Build the model into `out_dir` (created; refused if it holds other files). Same seed -> same bytes.

    Written to a temporary sibling and renamed, so an interrupted build never leaves a half model.
    """
    family = arch_for(arch)
    spec = family.spec_for(size)
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
        tokens = SpecialTokens(*(tokenizer.token_to_id(t) for t in (tok.BOS, tok.EOS, tok.PAD)))
        tok.write_json(tmp / "config.json", family.hf_config(spec, tokens))
        tok.write_json(tmp / "generation_config.json",
                       {"bos_token_id": tokens.bos, "eos_token_id": tokens.eos, "pad_token_id": tokens.pad})
        weights.save(family.init_weights(spec, weights.WeightDraw(seed)), tmp / "model.safetensors")
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def models_dir() -> Path:
    return work_dir() / "models"


def resolve_model(name_or_dir: str) -> Path:
    """A model directory for `pdserve up --model`: a built-in name (built under models/ on first use) or a path."""
    builtin = builtin_models()
    if name_or_dir in builtin:
        path = models_dir() / name_or_dir
        if not (path / "model.safetensors").exists():
            arch, size = builtin[name_or_dir]
            make_model(path, size, arch=arch)
        return path
    path = Path(name_or_dir)
    if not path.is_dir():
        raise ConfigError(f"model directory {path} does not exist (or use one of {', '.join(builtin)})")
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).exists()]
    if missing:
        raise ConfigError(f"model directory {path} lacks {', '.join(missing)}")
    return path.resolve()
