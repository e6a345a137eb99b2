"""Tensor parallelism in the launchers: each rank its ports and its cores, the flags checked at the edge."""

import itertools
import json
import os
import re
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.bench.hosts.two_host import TwoHostPD
from pdserve.errors import ConfigError
from pdserve.launch import UpOptions, plan
from pdserve.launch.cli import instance_lines
from pdserve.launch.cores import divide_cores, omp_threads_bind
from pdserve.launch.nixl_mode import nixl
from pdserve.launch.pd_modes import PortLayout
from pdserve.launch.per_host import Endpoint, InstanceOptions, instance_command


def extra_config(instance) -> dict:
    args = instance.extra_args
    return json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def launched(instance) -> tuple[tuple[str, ...], dict[str, str]]:
    """The instance's command from taskset on (inside the private-/dev/shm wrapper) and its environment."""
    spec = instance.process_spec(Path("/r"))
    return spec.argv[spec.argv.index("taskset"):], spec.env


def deployment(n=1, m=1, prefill_tp=1, decode_tp=1, cores=(0, 1), mode="write", port=29000):
    return plan(UpOptions(mode=mode, model="/m", port=port, cores=cores, num_prefill=n, num_decode=m,
                          prefill_tp=prefill_tp, decode_tp=decode_tp))


@pytest.mark.parametrize("n, m", [(1, 1), (2, 1), (1, 2), (3, 2)])
@pytest.mark.parametrize("prefill_tp, decode_tp", list(itertools.product(range(1, 5), repeat=2)))
def test_every_rank_has_its_own_handshake_and_notify_port(n, m, prefill_tp, decode_tp):
    d = deployment(n, m, prefill_tp, decode_tp, cores=tuple(range(64)))
    ranks = n * prefill_tp + m * decode_tp
    rank_ports = []
    for instance in d.instances:
        extra = extra_config(instance)
        assert instance.tp == (prefill_tp if instance.role == "prefill" else decode_tp)
        rank_ports += [extra["handshake_port"] + r for r in range(instance.tp)]
        rank_ports += [extra["notify_port"] + r for r in range(instance.tp)]
    assert len(set(rank_ports)) == len(rank_ports) == 2 * ranks
    assert set(rank_ports) <= set(d.extra_ports)  # checked free before the launch, as every port of it
    assert len(set(d.ports)) == len(d.ports) and sorted(d.ports) == list(range(29000, 29000 + n + m + 2 * ranks + 5))
    layout = PortLayout(29000, n, m, prefill_tp, decode_tp)
    assert layout.last == max(d.ports) - 1 == d.router.port - 1  # the front moved the router past them


def test_the_1p1d_layout_with_a_two_rank_prefill():
    d = deployment(prefill_tp=2)
    prefill, decode = (extra_config(i) for i in d.instances)
    assert (prefill["handshake_port"], prefill["notify_port"]) == (29005, 29007)
    assert (decode["handshake_port"], decode["notify_port"]) == (29009, 29010)
    assert d.extra_ports == (29004, 29005, 29006, 29007, 29008, 29009, 29010, 29011) and d.router.port == 29012


def test_tp2_on_two_cores_keeps_prefill_and_decode_apart_with_one_warning():
    d = deployment(prefill_tp=2, cores=(0, 1))
    (prefill_argv, prefill_env), (decode_argv, decode_env) = (launched(i) for i in d.instances)
    assert prefill_argv[:3] == ("taskset", "-c", "0") and prefill_env["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"
    assert decode_argv[:3] == ("taskset", "-c", "1") and decode_env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert prefill_argv[prefill_argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in decode_argv
    (warning,) = d.warnings
    assert "3 tensor-parallel ranks on 2 cores: ranks share cores" in warning
    assert "correctness checks only" in warning and "prefill on 0|0, decode on 1" in warning
    assert instance_lines(d)[0].endswith("(prefill, tp 2, cores 0|0)")
    assert prefill_env["OMP_WAIT_POLICY"] == decode_env["OMP_WAIT_POLICY"] == "PASSIVE"  # no spinning on a shared core


@pytest.mark.parametrize("prefill_tp, decode_tp, binds", [
    (2, 1, ["0,1|2", "3"]),  # near-equal shares of all the cores
    (2, 2, ["0|1", "2|3"]),
    (1, 2, ["0,1", "2|3"]),
])
def test_tp_on_four_cores_gives_every_rank_its_own(prefill_tp, decode_tp, binds):
    d = deployment(prefill_tp=prefill_tp, decode_tp=decode_tp, cores=(0, 1, 2, 3))
    for instance, bind in zip(d.instances, binds):
        argv, env = launched(instance)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == bind
        assert argv[2] == bind.replace("|", ",")  # taskset: every core its ranks use
        assert "OMP_WAIT_POLICY" not in env
    assert d.warnings == ()


@pytest.mark.parametrize("num_cores", range(1, 13))
@pytest.mark.parametrize("n, m, prefill_tp, decode_tp", [(1, 1, 2, 1), (1, 1, 4, 2), (2, 1, 2, 2), (2, 3, 3, 1)])
def test_ranks_own_cores_where_there_are_enough_and_taskset_covers_them(num_cores, n, m, prefill_tp, decode_tp):
    cores = tuple(range(10, 10 + num_cores))
    d = deployment(n, m, prefill_tp, decode_tp, cores=cores)
    ranks = [tuple(map(int, group.split(","))) for i in d.instances for group in i.cpu_binding.split("|")]
    assert len(ranks) == n * prefill_tp + m * decode_tp
    for instance in d.instances:
        argv, _ = launched(instance)
        assert {int(c) for c in argv[2].split(",")} == {c for group in instance.cpu_binding.split("|")
                                                        for c in map(int, group.split(","))}
    used = [c for group in ranks for c in group]
    assert set(used) == set(cores) or len(ranks) > num_cores  # all cores used
    if len(ranks) <= num_cores:
        assert len(used) == len(set(used)) and d.warnings == ()  # no core twice
    else:
        assert len(d.warnings) == 1 and "ranks share cores" in d.warnings[0]
    if num_cores >= 2:  # prefill and decode never share a core
        prefill_cores = {c for i in d.instances if i.name.startswith("prefill") for c in ranks_of(i)}
        assert prefill_cores.isdisjoint(c for i in d.instances if i.name.startswith("decode") for c in ranks_of(i))
    if num_cores >= prefill_tp + decode_tp:  # then the ranks of one instance never share a core
        for instance in d.instances:
            groups = instance.cpu_binding.split("|")
            assert len(set(groups)) == len(groups)


def ranks_of(instance) -> set[int]:
    return {int(c) for group in instance.cpu_binding.split("|") for c in group.split(",")}


@pytest.mark.parametrize("mode", ["collocated", "round-robin"])
def test_modes_without_prefill_and_decode_instances_refuse_a_size(mode):
    for flag, options in (("--prefill-tp", {"prefill_tp": 2}), ("--decode-tp", {"decode_tp": 3})):
        with pytest.raises(ConfigError, match=f"{flag}: a tensor-parallel size other than 1 is for the"):
            plan(UpOptions(mode=mode, model="/m", cores=(0, 1), **options))
    with pytest.raises(ConfigError, match="--decode-tp: a tensor-parallel size in 1..64"):
        UpOptions(mode="write", decode_tp=65)


def test_tp1_keeps_prefill_and_decode_on_separate_cores():
    plan_ = divide_cores((0, 1), 2, 1)
    assert plan_ == (((0,), (0,)), ((1,),), True)
    assert divide_cores((0, 1, 2), 1, 1, prefill_tp=2, decode_tp=1) == (((0, 1),), ((2,),), False)
    assert divide_cores((0, 1, 2), 2, 1, prefill_tp=2) == (((0, 1), (0, 1)), ((2,),), True)
    assert omp_threads_bind((4,), 3) == "4|4|4" and omp_threads_bind((0, 1, 2, 3, 4), 2) == "0,1,2|3,4"


def test_the_kv_cache_of_an_instance_is_divided_among_its_ranks():
    options = UpOptions(mode="write", model="/m", port=29000, cores=(0, 1), kv_cache_bytes=1 << 30, prefill_tp=4)
    prefill, decode = plan(options).instances
    for instance, per_rank in ((prefill, 256 << 20), (decode, 1 << 30)):
        args = instance.vllm_args
        assert args[args.index("--kv-cache-memory-bytes") + 1] == str(per_rank)
    assert prefill.shm_limit_bytes > decode.shm_limit_bytes > 1 << 30  # every rank's KV and segments


def test_nixl_gives_each_rank_a_core_from_the_first_ones(monkeypatch):
    monkeypatch.setattr("pdserve.launch.nixl_mode.nixl_installed", lambda: True)
    d = nixl(UpOptions(mode="nixl", model="/m", port=29000, cores=(0, 1, 2, 3, 4), prefill_tp=2))
    assert [i.cpu_binding for i in d.instances] == ["0|1", "2"] and d.warnings == ()
    assert "--tensor-parallel-size" in launched(d.instances[0])[0]
    shared = nixl(UpOptions(mode="nixl", model="/m", port=29000, cores=(0, 1), decode_tp=2))
    assert [i.cpu_binding for i in shared.instances] == ["0", "1|1"] and len(shared.warnings) == 1


def test_two_host_passes_the_size_and_the_cores_of_each_role(tmp_path):
    options = UpOptions(mode="write", model="/models/tiny", cores=(0, 1, 2), prefill_tp=2)
    pd = TwoHostPD(options=options, connector_extra={}, log_dir=tmp_path)
    for role, tp, cores in (("prefill", "2", "0,1"), ("decode", "1", "2")):
        argv = pd.instance_argv(role, Path("/nonexistent/secret"))
        assert (argv[argv.index("--tp") + 1], argv[argv.index("--cores") + 1]) == (tp, cores)


def instance_options(tmp_path: Path, **kwargs) -> InstanceOptions:
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32)
    return InstanceOptions(role="prefill", router=Endpoint("10.0.0.1", 8002), host_ip="10.0.0.2", model="/m",
                           secret_file=secret, port=8100, **kwargs)


@pytest.mark.parametrize("tp", range(1, 5))
def test_a_per_host_instance_takes_consecutive_port_ranges(tmp_path, tp):
    options = instance_options(tmp_path, tp=tp, cores=(0, 1))
    argv, env = instance_command(options)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert (extra["handshake_port"], extra["notify_port"]) == (8101, 8101 + tp)  # ranks up to 8100 + 2 * tp
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == omp_threads_bind((0, 1), tp)
    assert argv[argv.index("taskset") + 2] == "0,1"
    assert ("--tensor-parallel-size" in argv) == (tp > 1)


@pytest.mark.parametrize("ports, message", [
    ({"handshake_port": 9000, "notify_port": 9001}, "--handshake-port: ports 9000..9001 (one per rank of --tp 2) "
                                                    "overlap the notify ports 9001..9002"),
    ({"handshake_port": 8103}, "--handshake-port: ports 8103..8104 (one per rank of --tp 2) overlap the notify"),
    ({"notify_port": 8099}, "--notify-port: ports 8099..8100 (one per rank of --tp 2) overlap the HTTP port 8100"),
    ({"notify_port": 65535}, "--notify-port: at most 65534, rank r of --tp 2 binding it + r (got 65535)"),
    ({"tp": 0}, "--tp: a tensor-parallel size in 1..64 (got 0)"),
    ({"vllm_args": ("--tensor-parallel-size=2",)}, "give --tp instead"),
])
def test_per_host_ports_and_sizes_are_checked(tmp_path, ports, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        instance_options(tmp_path, **{"tp": 2, **ports})


def test_a_per_host_instance_with_fewer_cores_than_ranks_warns_once(tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32)
    secret.chmod(0o600)
    core = min(os.sched_getaffinity(0))
    code = cli.main(["instance", "--role", "decode", "--router", "10.0.0.1:8002", "--host-ip", "10.0.0.2", "--model",
                     "org/m", "--secret-file", str(secret), "--tp", "2", "--cores", str(core), "--print"])
    out, err = capsys.readouterr()
    assert code == 0 and "--tensor-parallel-size 2" in out
    (line,) = err.splitlines()
    assert line.startswith("pdserve instance: warning: 2 tensor-parallel ranks on 1 core: ranks share cores")
    assert f"decode on {core}|{core}" in line
