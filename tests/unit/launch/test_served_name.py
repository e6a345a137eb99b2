"""`pdserve up --model NAME` serves the model under NAME, as `vllm serve NAME` does: a built-in model
is asked for as "tiny", not by the directory it was built in; a user's own --served-model-name wins."""

from __future__ import annotations

from pathlib import Path

import pytest

import pdserve.launch as launch
from pdserve.launch import UpOptions
from pdserve.launch.instance import served_name_args


class _Started:
    """Stands in for the Cluster: keeps the deployment `up` would start."""

    def __init__(self, deployment, **kwargs):
        self.deployment = deployment

    def start(self) -> None:
        pass


@pytest.fixture
def started(monkeypatch, tmp_path):
    built = tmp_path / "models" / "tiny"
    built.mkdir(parents=True)
    monkeypatch.setattr("pdserve.model.build.resolve_model", lambda name: built if name == "tiny" else Path(name))
    monkeypatch.setattr(launch, "Cluster", _Started)
    return built


def instance_argvs(options: UpOptions) -> list[list[str]]:
    deployment = launch.up(options).deployment
    return [list(i.process_spec(Path("/run")).argv) for i in deployment.instances]


def served_names(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--served-model-name"]


@pytest.mark.parametrize("mode", ["collocated", "round-robin", "write", "read"])
def test_a_built_in_model_is_served_under_the_name_given(started, mode):
    for argv in instance_argvs(UpOptions(mode=mode, model="tiny", cores=(0, 1))):
        assert str(started) in argv  # vLLM loads the built model
        assert served_names(argv) == ["tiny"]


def test_the_users_own_served_model_name_comes_later_and_wins(started):
    (argv,) = instance_argvs(UpOptions(model="tiny", cores=(0, 1), extra_vllm_args=("--served-model-name", "mine")))
    assert served_names(argv) == ["tiny", "mine"]  # vLLM takes the last


def test_a_directory_or_a_hub_id_keeps_vllms_own_name(started, tmp_path):
    assert served_name_args(str(tmp_path)) == ()
    assert served_name_args("org/name") == ()
    (argv,) = instance_argvs(UpOptions(model=str(tmp_path), cores=(0, 1)))
    assert served_names(argv) == []
