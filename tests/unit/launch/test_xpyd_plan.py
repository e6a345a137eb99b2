"""xPyD planning: --prefill N --decode M, the port layout, cores divided among instances."""

import json
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.errors import ConfigError
from pdserve.launch import UpOptions, plan
from pdserve.launch.cli import instance_lines, options_from
from pdserve.launch.cores import divide_cores, split
from pdserve.launch.pd_modes import PortLayout, pd_deployment


def config_of(instance) -> dict:
    args = instance.extra_args
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def shape(n: int, m: int, mode: str = "write", cores=(0, 1), port: int = 29000):
    return plan(UpOptions(mode=mode, model="/m", port=port, cores=cores, num_prefill=n, num_decode=m))


def test_one_prefill_one_decode_keeps_the_1p1d_layout():
    d = shape(1, 1)
    assert [(i.name, i.role, i.port, i.cores) for i in d.instances] == [
        ("prefill", "prefill", 29001, (0,)), ("decode", "decode", 29002, (1,))]
    assert d.router.prometheus_port == 29003 and d.extra_ports == (29004, 29005, 29006, 29007, 29008, 29009)
    assert d.router.port == 29010 and d.front.port == 29000 and d.warnings == ()
    p, dec = (config_of(i)["kv_connector_extra_config"] for i in d.instances)
    assert (p["handshake_port"], p["notify_port"], dec["handshake_port"], dec["notify_port"]) == (29005, 29006, 29007, 29008)


@pytest.mark.parametrize("n, m", [(2, 1), (1, 2), (2, 2), (3, 4), (16, 16)])
@pytest.mark.parametrize("mode", ["write", "read"])
def test_every_instance_has_its_own_ports_and_registers_with_the_router(mode, n, m):
    d = shape(n, m, mode, cores=tuple(range(64)), port=29000)
    assert [i.role for i in d.instances] == ["prefill"] * n + ["decode"] * m
    assert len(set(d.ports)) == len(d.ports) and min(d.ports) == 29000
    assert sorted(d.ports) == list(range(29000, 29000 + 3 * (n + m) + 5))  # consecutive, none twice
    layout = PortLayout(29000, n, m)
    configs = [config_of(i) for i in d.instances]
    for index, (instance, config) in enumerate(zip(d.instances, configs)):
        extra = config["kv_connector_extra_config"]
        assert config["kv_role"] == ("kv_producer" if instance.role == "prefill" else "kv_consumer")
        assert extra["http_port"] == instance.port == layout.http(index)
        assert (extra["handshake_port"], extra["notify_port"]) == (layout.handshake(index), layout.notify(index))
        assert (extra["proxy_ip"], extra["proxy_ping_port"]) == ("127.0.0.1", layout.discovery)
        assert extra["read_mode"] is (mode == "read")
    router_args = " ".join(d.router.extra_args)
    argv = " ".join(d.router.process_spec(Path("/r")).argv)  # the registrar, vllm-router its child
    assert f"--listen 127.0.0.1:{layout.discovery} " in argv and f"--router-port {layout.router_discovery} " in argv
    assert argv.endswith(f"--vllm-discovery-address 127.0.0.1:{layout.router_discovery}")
    assert "--prefill-policy round_robin --decode-policy power_of_two" in router_args
    names = [i.name for i in d.instances]
    assert len(set(names)) == len(names)
    assert names[0] == ("prefill" if n == 1 else "prefill0") and names[-1] == ("decode" if m == 1 else f"decode{m - 1}")


def test_cores_are_divided_among_instances_when_there_are_enough():
    d = shape(2, 1, cores=tuple(range(7)))
    assert [i.cores for i in d.instances] == [(0, 1, 2), (3, 4), (5, 6)] and d.warnings == ()
    for instance in d.instances:
        spec = instance.process_spec(Path("/r"))
        cpu_list = ",".join(map(str, instance.cores))
        assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list and ("-c", cpu_list) == spec.argv[
            spec.argv.index("taskset") + 1: spec.argv.index("taskset") + 3]


@pytest.mark.parametrize("n, m, expected", [
    (2, 1, [(0,), (0,), (1,)]),  # P share core 0, D keeps core 1
    (1, 2, [(0,), (1,), (1,)]),
    (2, 2, [(0,), (0,), (1,), (1,)]),
])
def test_fewer_cores_than_instances_share_them_with_one_warning(n, m, expected):
    d = shape(n, m, cores=(0, 1))
    assert [i.cores for i in d.instances] == expected
    (warning,) = d.warnings
    assert f"{n + m} instances on 2 cores" in warning and "share" in warning
    assert all(f"{i.name} on {i.cores[0]}" in warning for i in d.instances)


def test_one_core_is_shared_by_all():
    d = shape(1, 1, cores=(5,))
    assert [i.cores for i in d.instances] == [(5,), (5,)] and "2 instances on 1 core:" in d.warnings[0]


def test_split_and_divide():
    assert split((0, 1, 2, 3, 4), 2) == ((0, 1, 2), (3, 4))
    assert split((0, 1), 3) == ((0,), (1,), (0,))
    assert divide_cores((0, 1, 2), 1, 3).shared
    plan_ = divide_cores((0, 1, 2, 3), 3, 1)
    assert plan_.prefill == ((0,), (1,), (2,)) and plan_.decode == ((3,),) and not plan_.shared
    shared = divide_cores((0, 1, 2), 3, 2)  # 3 cores for 5: prefill 2 cores, decode 1
    assert shared.prefill == ((0,), (1,), (0,)) and shared.decode == ((2,), (2,))


def test_pd_deployment_keeps_its_signature_and_honours_the_shape():
    options = UpOptions(mode="write", model="/m", port=29100, cores=(0, 1, 2), num_prefill=1, num_decode=2)
    d = pd_deployment(options, "write", {"transfer_timeout": 5}, by_name=True)
    assert [i.role for i in d.instances] == ["prefill", "decode", "decode"]
    for instance in d.instances:
        config = config_of(instance)
        assert config["kv_connector_extra_config"]["transfer_timeout"] == 5 and "kv_connector_module_path" not in config


def test_modes_of_a_fixed_shape_refuse_other_numbers():
    with pytest.raises(ConfigError, match="mode 'collocated' runs 0 prefill and 0 decode.*--prefill 2"):
        plan(UpOptions(mode="collocated", model="/m", num_prefill=2))
    with pytest.raises(ConfigError, match="round-robin"):
        plan(UpOptions(mode="round-robin", model="/m", cores=(0, 1), num_decode=3))


@pytest.mark.parametrize("count", [0, 17, -1])
def test_instance_counts_are_checked(count):
    with pytest.raises(ConfigError, match=f"{count} prefill instances: give 1..16"):
        UpOptions(num_prefill=count)


def test_ports_past_the_last_one_are_refused():
    with pytest.raises(ConfigError, match="need ports up to 65552: choose a lower --port"):
        shape(8, 8, port=65500)


def test_cli_flags():
    parser = build_parser()
    args = parser.parse_args(["up", "--mode", "read", "--prefill", "2", "--decode", "3", "--prefill-budget", "256"])
    options = options_from(args)
    assert (options.num_prefill, options.num_decode, options.prefill_budget) == (2, 3, 256)
    defaults = options_from(parser.parse_args(["up"]))
    assert (defaults.num_prefill, defaults.num_decode) == (1, 1)
    subparsers = next(a for a in parser._actions if a.dest == "command")
    text = subparsers.choices["up"].format_help()
    assert "--prefill N" in text and "--decode M" in text


def test_up_prints_every_instance_with_its_role_and_cores():
    assert instance_lines(shape(2, 1)) == [
        "  instance prefill0: http://127.0.0.1:29001 (prefill, cores 0)",
        "  instance prefill1: http://127.0.0.1:29002 (prefill, cores 0)",
        "  instance decode: http://127.0.0.1:29003 (decode, cores 1)",
    ]
