import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.errors import ConfigError
from pdserve.model.archs import ARCHS
from pdserve.model.build import MODEL_FILES, make_model, resolve_model

# sha256 of `make-model --size tiny --seed 0` (llama), recorded before other architectures were added
LLAMA_TINY_SEED0 = {
    "config.json": "ea43a2883b104b9cf04196a5c20a085d0b070ba78dd014db035f6b6ae3888609",
    "generation_config.json": "407e309076e3a2b1ebbfc51a2e3388ba44c4dad59bf906b7b23b6b4791f5489e",
    "model.safetensors": "6c8f4ffa599881bed3a466df1e3b27be27443da979bcfc998f3d01412ab1d1e9",
    "special_tokens_map.json": "a6c50e47d6be38122150959f2660600afb8d32c1c1fb2a2190efcae548c4b838",
    "tokenizer.json": "5f517b0790ee2c1dc41fcc70edccd349de9f7ba26e7b72e18dc9ce4fca3ba51c",
    "tokenizer_config.json": "29107955a3478bc8dd278c73e335239bebb906ca338d205b30c0cfcb73133b06",
}


def digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_llama_tiny_is_byte_identical_to_its_pinned_files(tmp_path):
    assert digests(make_model(tmp_path / "m", "tiny", seed=0)) == LLAMA_TINY_SEED0


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
    assert list(ARCHS["llama"].sizes) == ["tiny", "small"]
    assert all(list(a.sizes) == ["tiny"] for name, a in ARCHS.items() if name != "llama")
    with pytest.raises(ConfigError, match="--size: --arch gemma2 is built in tiny"):
        ARCHS["gemma2"].spec_for("small")


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
    assert len(tok) == ARCHS["llama"].sizes["tiny"].vocab_size
    ids = tok("The river flows").input_ids
    assert ids[0] == tok.bos_token_id and tok.eos_token == "<|end_of_text|>"
    assert tok.decode(ids, skip_special_tokens=True) == "The river flows"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith(tok.bos_token) and chat.endswith("<|assistant|>\n")


@pytest.mark.parametrize(("argv", "says"), [
    (["--size", "tiny", "--arch", "gpt2"], "--arch: invalid choice: 'gpt2'"),
    (["--size", "huge"], "--size: invalid choice: 'huge'"),
    (["--size", "small", "--arch", "gemma2"], "--size: --arch gemma2 is built in tiny (got 'small')"),
    (["--size", "tiny", "--seed", "-1"], "--seed: a whole number in 0..4294967295 (got '-1')"),
    (["--size", "tiny", "--seed", "x"], "--seed: a whole number in 0..4294967295 (got 'x')"),
])
def test_bad_flags_are_refused_in_one_line_with_status_2(argv, says, tmp_path, capsys):
    assert refused(["make-model", str(tmp_path / "m"), *argv], capsys).startswith(says)
    assert not (tmp_path / "m").exists()


def test_bad_directory_is_refused_in_one_line_with_status_2(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("keep me")
    assert refused(["make-model", str(tmp_path / "file"), "--size", "tiny"], capsys).startswith(
        "dir: a new or empty directory (this path is a file)")
    assert refused(["make-model", str(tmp_path / "full"), "--size", "tiny"], capsys).startswith(
        "dir: a new or empty directory (this one holds files)")
    assert (tmp_path / "full" / "f").read_text() == "keep me"


def refused(argv: list[str], capsys) -> str:
    """The rule `pdserve` states for `argv`, after checking it exits 2 with one line on stderr."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, (status, err)
    return err.strip().split(": error: ", 1)[1]
