"""`pdserve up` as `vllm serve` takes it: --host, vLLM's flags after --, a YAML --config equal to the flags."""

from dataclasses import replace

import pytest

from pdserve.cli import parse_args
from pdserve.launch.cli import options_from
from pdserve.launch.modes import plan
from pdserve.launch.options import UpOptions

FLAGS = ["up", "--host", "0.0.0.0", "--mode", "write", "--port", "18700", "--kv-cache", "512MiB",
         "--max-model-len", "2048", "--enforce-eager", "--restart", "never", "--drain-timeout", "5",
         "--", "--max-num-seqs", "8"]
CONFIG = """
host: 0.0.0.0
mode: write
port: 18700
kv_cache: 512MiB
max-model-len: 2048
enforce_eager: true
restart: never
drain-timeout: 5
vllm_args: [--max-num-seqs, 8]
"""


def options(argv: list[str]) -> UpOptions:
    return replace(options_from(parse_args(argv)), cores=(0, 1))


def test_vllm_flags_after_the_separator_reach_every_instance_and_the_front_listens_on_host():
    deployment = plan(options(FLAGS))
    assert deployment.front.host == "0.0.0.0" and deployment.front.port == 18700
    assert len(deployment.instances) == 2
    for instance in deployment.instances:
        assert instance.vllm_args[-2:] == ("--max-num-seqs", "8")
        assert instance.url.startswith("http://127.0.0.1:")
    assert deployment.router.url.startswith("http://127.0.0.1:")


def test_a_config_file_gives_the_same_deployment_as_the_flags(tmp_path):
    config = tmp_path / "up.yaml"
    config.write_text(CONFIG)
    from_file = options(["up", "--config", str(config)])
    assert from_file == options(FLAGS)
    assert plan(from_file) == plan(options(FLAGS))


def test_flags_override_the_file_and_vllm_flags_add_to_it(tmp_path):
    config = tmp_path / "up.yaml"
    config.write_text(CONFIG)
    merged = options(["up", "--config", str(config), "--port", "18800", "--vllm-args", "--seed 1", "--", "--max-num-seqs",
                      "4"])
    assert merged.port == 18800 and merged.mode == "write" and merged.host == "0.0.0.0"
    assert merged.extra_vllm_args == ("--max-num-seqs", "8", "--seed", "1", "--max-num-seqs", "4")


def test_an_empty_config_file_leaves_the_defaults(tmp_path):
    config = tmp_path / "empty.yaml"
    config.write_text("")
    assert options(["up", "--config", str(config)]) == options(["up"])


def test_defaults_are_plain_collocated_serving_on_loopback():
    default = options(["up"])
    assert (default.mode, default.host, default.model, default.kv_cache_bytes) == ("collocated", "127.0.0.1", "tiny",
                                                                                   1 << 30)
    assert default.extra_vllm_args == ()


@pytest.mark.parametrize("model, expected", [("tiny", "tiny"), ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B")])
def test_a_hugging_face_id_and_a_built_in_model_pass_as_given(model, expected):
    assert options(["up", "--model", model]).model == expected


def test_a_model_directory_is_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert options(["up", "--model", "m"]).model == str(tmp_path / "m")


def test_a_hugging_face_model_runs_online_a_local_one_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "config.json").write_text("{}")
    hub = plan(options(["up", "--model", "org/name"])).instances[0].process_spec(tmp_path)
    assert hub.env["HF_HUB_OFFLINE"] == "0" and hub.env["HF_HOME"] == str(tmp_path / "hf")
    local = plan(options(["up", "--model", str(tmp_path)])).instances[0].process_spec(tmp_path)
    assert local.env["HF_HUB_OFFLINE"] == "1" and local.env["HF_HOME"] != str(tmp_path / "hf")
