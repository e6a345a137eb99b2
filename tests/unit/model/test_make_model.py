import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.errors import ConfigError
from pdserve.model.build import MODEL_FILES, make_model, resolve_model
from pdserve.model.spec import SIZES, spec_for

PROMPTS = ["The river flows", "Once upon a time the king", "def compute_tensor(cache):", "| name | item |",
           "Lodi said: where is the bread", "A quiet morning in the village", "1 + 2 =", "The old sailor carried the rope"]


def digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_same_seed_gives_identical_files_across_processes(tmp_path):
    make_model(tmp_path / "a", "tiny", seed=7)
    subprocess.run([sys.executable, "-m", "pdserve.cli", "make-model", str(tmp_path / "b"), "--size", "tiny",
                    "--seed", "7"], check=True, capture_output=True)
    assert sorted(digests(tmp_path / "a")) == sorted(MODEL_FILES)
    assert digests(tmp_path / "a") == digests(tmp_path / "b")


def test_other_seed_changes_only_the_weights(tmp_path):
    a, b = digests(make_model(tmp_path / "a", "tiny", seed=1)), digests(make_model(tmp_path / "b", "tiny", seed=2))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {k: v for k, v in b.items() if k != "model.safetensors"}


def test_config_is_bf16_llama_with_4k_context(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16"
    assert config["max_position_embeddings"] >= 4096


def test_sizes():
    assert 2e6 < spec_for("tiny").num_params < 10e6
    assert 80e6 < spec_for("small").num_params < 130e6
    with pytest.raises(ConfigError, match="unknown model size 'huge'"):
        spec_for("huge")
    assert set(SIZES) == {"tiny", "small"}


def test_refuses_non_empty_dir_and_missing_model(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        make_model(tmp_path / "x", "tiny")
    assert (tmp_path / "x" / "f").read_text() == "keep me"
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_tokenizer_loads_in_transformers_with_specials_and_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == spec_for("tiny").vocab_size
    ids = tok("The river flows").input_ids
    assert ids[0] == tok.bos_token_id and tok.eos_token == "<|end_of_text|>"
    assert tok.decode(ids, skip_special_tokens=True) == "The river flows"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith(tok.bos_token) and chat.endswith("<|assistant|>\n")


def test_greedy_decoding_is_not_degenerate(tiny_model_dir):
    """Continuations differ across prompts and top-1 beats top-2 by > 0.05 nats at most steps."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gaps, continuations = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=24, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            for scores in out.scores:
                top = torch.log_softmax(scores[0].float(), -1).topk(2).values
                gaps.append(float(top[0] - top[1]))
            continuations.append(tuple(out.sequences[0, ids.shape[1]:].tolist()))
    assert len(set(continuations)) == len(PROMPTS)
    assert sum(g > 0.05 for g in gaps) / len(gaps) > 0.75
    # the prompt, not only its last token, matters: same last word, different continuation
    same_tail = [tok(p + " river", return_tensors="pt").input_ids for p in ("A cold", "The king saw the")]
    firsts = [model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)[0, -6:].tolist()
              for ids in same_tail]
    assert firsts[0] != firsts[1]
