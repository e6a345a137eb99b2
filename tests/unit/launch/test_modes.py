import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.errors import ConfigError
from pdserve.launch import Deployment, UpOptions, plain_instance, plan, register
from pdserve.launch.cli import options_from
from pdserve.launch.modes import MODES, known_modes, mode_descriptions
from pdserve.launch.options import GIB, parse_bytes
from pdserve.launch.shm_namespace import HEADROOM_BYTES


def vllm_argv(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The command inside the private-/dev/shm wrapper (see test_shm_namespace)."""
    return argv[argv.index("taskset"):]


def test_collocated_is_one_instance_on_all_cores_with_shared_flags():
    d = plan(UpOptions(mode="collocated", model="/m", port=18500, cores=(0, 1)))
    (inst,) = d.instances
    assert d.router is None and d.endpoint == "http://127.0.0.1:18500" and inst.cores == (0, 1)
    assert d.front.upstream == ("vllm", "http://127.0.0.1:18501") and inst.port == 18501
    assert inst.shm_limit_bytes == GIB + HEADROOM_BYTES
    spec = inst.process_spec(Path("/run"))
    assert vllm_argv(spec.argv)[:3] == ("taskset", "-c", "0,1")
    args = " ".join(spec.argv)
    for flag in ("--dtype bfloat16", "--max-model-len 4096", f"--kv-cache-memory-bytes {GIB}",
                 "--host 127.0.0.1", "--port 18501", "--enable-prefix-caching"):
        assert flag in args
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and spec.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert spec.env["VLLM_RPC_BASE_PATH"] == "/run/vllm" and spec.env["HF_HUB_OFFLINE"] == "1"


def test_round_robin_pins_one_instance_per_core_behind_the_router():
    d = plan(UpOptions(mode="round-robin", model="/m", port=18500, cores=(0, 1), prefix_caching=False,
                       enforce_eager=True, extra_vllm_args=("--seed", "3")))
    assert [(i.name, i.port, i.cores) for i in d.instances] == [("vllm0", 18501, (0,)), ("vllm1", 18502, (1,))]
    assert d.endpoint == "http://127.0.0.1:18500" and d.router.policy == "round_robin"
    assert d.router.port == 18504 and d.front.upstream == ("router", "http://127.0.0.1:18504")
    assert d.router.worker_urls == ("http://127.0.0.1:18501", "http://127.0.0.1:18502")
    args = vllm_argv(d.instances[1].process_spec(Path("/r")).argv)
    assert args[:3] == ("taskset", "-c", "1")
    assert {"--no-enable-prefix-caching", "--enforce-eager"} <= set(args) and args[-2:] == ("--seed", "3")
    router_argv = d.router.process_spec(Path("/r")).argv
    assert "--policy" in router_argv and "round_robin" in router_argv and "18503" in router_argv
    with pytest.raises(ConfigError, match="two cores"):
        plan(UpOptions(mode="round-robin", model="/m", cores=(0,)))


def test_a_mode_is_one_registered_function():
    @register("test-extra-env")
    def extra(options):
        """A test mode.

        Only the first docstring line is its description."""
        base = plain_instance(options, "p", options.port, (0,), role="prefill")
        return Deployment((replace(base, extra_args=("--kv-transfer-config", "{}"), extra_env={"X": "1"}),))

    try:
        d = plan(UpOptions(mode="test-extra-env", model="/m", port=18600))
        spec = d.instances[0].process_spec(Path("/r"))
        assert spec.argv[-2:] == ("--kv-transfer-config", "{}") and spec.env["X"] == "1"
        assert mode_descriptions()["test-extra-env"] == "A test mode."
    finally:
        del MODES["test-extra-env"]
    with pytest.raises(ConfigError, match="unknown mode 'nope'"):
        plan(UpOptions(mode="nope"))


def test_parse_bytes():
    assert parse_bytes("1GiB") == GIB and parse_bytes("512M") == 512 << 20 and parse_bytes("4096") == 4096
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def test_a_mode_without_a_description_is_refused():
    with pytest.raises(ValueError, match="needs a description"):
        register("test-undescribed")(lambda options: Deployment(()))
    assert "test-undescribed" not in MODES


def test_up_help_lists_every_mode_with_its_description():
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    text = subparsers.choices["up"].format_help()
    modes = mode_descriptions()
    assert {"collocated", "round-robin", "write", "read", "nixl"} <= set(modes) == set(known_modes())
    listing = text.split("\nmodes:\n", 1)[1].splitlines()
    assert len(listing) == len(modes)
    for line, (name, description) in zip(listing, modes.items()):
        assert line.split(None, 1) == [name, description]
        assert 10 < len(description) < 120


@pytest.mark.parametrize("mode", ["collocated", "round-robin", "write", "read"])
def test_every_mode_gets_a_front_on_the_client_port(mode):
    d = plan(UpOptions(mode=mode, model="/m", port=18500, cores=(0, 1), drain_timeout=7))
    assert d.endpoint == d.front.url == "http://127.0.0.1:18500" and d.front.drain_timeout == 7
    assert d.front.upstream == (d.backend.name, d.backend.url) and d.backend.port == max(d.ports[:-1])
    assert d.front.model_sources == tuple((i.name, i.url) for i in d.instances)
    assert d.front.direct_sources == tuple((i.name, i.url) for i in d.instances if i.role == "decode")
    assert len(set(d.ports)) == len(d.ports) and all(18500 <= p < 18516 for p in d.ports)
    argv = d.front.process_spec(Path("/r")).argv
    assert argv[1:3] == ("-m", "pdserve.front") and "--drain-timeout" in argv and d.backend.url in " ".join(argv)


def test_drain_timeout_is_checked():
    with pytest.raises(ConfigError, match="drain timeout"):
        UpOptions(drain_timeout=-1)


def test_adaptive_is_write_with_the_placement_bounds_given_to_pdserve_up():
    import json
    d = plan(UpOptions(mode="adaptive", model="/m", port=18500, cores=(0, 1), itl_target_ms=40, max_step_ms=80))
    configs = []
    for inst in d.instances:
        argv = inst.process_spec(Path("/r")).argv
        configs.append(json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"])
    assert [(c["placement"], c["itl_target_ms"], c["max_step_ms"]) for c in configs] == [("adaptive", 40, 80)] * 2
    prefill, decode = (" ".join(vllm_argv(i.process_spec(Path("/r")).argv)) for i in d.instances)
    assert "--max-num-batched-tokens 512" in prefill and "--long-prefill-token-threshold" not in prefill
    # D: its largest local chunk (default 512; the connector lowers it while D decodes) plus room
    # for its decodes and for new requests
    assert "--max-num-batched-tokens 576 --long-prefill-token-threshold 512" in decode
    chunk32 = plan(UpOptions(mode="adaptive", model="/m", port=18500, cores=(0, 1), decode_budget=32))
    assert "--max-num-batched-tokens 96 --long-prefill-token-threshold 32" in " ".join(
        chunk32.instances[1].process_spec(Path("/r")).argv)
    with pytest.raises(ConfigError, match="largest step -1 ms is not a positive number"):
        UpOptions(mode="adaptive", model="/m", max_step_ms=-1)
    args = build_parser().parse_args(["up", "--mode", "adaptive", "--max-step-ms", "70"])
    from pdserve.launch.cli import options_from
    assert options_from(args).max_step_ms == 70


def test_adaptive_read_is_read_with_room_on_p_for_the_legs_it_leaves_to_d():
    import json
    d = plan(UpOptions(mode="adaptive-read", model="/m", port=18500, cores=(0, 1), slo="ttft<1000,mean_itl<50"))
    for inst in d.instances:
        argv = inst.process_spec(Path("/r")).argv
        extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        assert (extra["placement"], extra["read_mode"], extra["slo"]) == ("adaptive", True, "ttft<1000,mean_itl<50")
    prefill, decode = (" ".join(vllm_argv(i.process_spec(Path("/r")).argv)) for i in d.instances)
    # P: one 512-token chunk a step and room beside it for one-token legs (placement/read_mode.py)
    assert "--max-num-batched-tokens 528 --long-prefill-token-threshold 512" in prefill
    assert "--max-num-batched-tokens 576 --long-prefill-token-threshold 512" in decode
    with pytest.raises(ConfigError, match="adaptive mode \\(WRITE\\), not adaptive-read"):
        UpOptions(mode="adaptive-read", serve_decode=True)


def test_adaptive_can_declare_the_slo_it_serves():
    import json

    from pdserve.launch.cli import options_from
    options = options_from(build_parser().parse_args(["up", "--mode", "adaptive", "--slo", "ttft<500,mean_itl<40"]))
    d = plan(replace(options, model="/m", port=18500, cores=(0, 1)))
    for inst in d.instances:
        argv = inst.process_spec(Path("/r")).argv
        extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        assert extra["slo"] == "ttft<500,mean_itl<40" and "max_step_ms" not in extra and "itl_target_ms" not in extra
    with pytest.raises(ConfigError, match="adaptive or adaptive-read mode only, not write"):
        UpOptions(mode="write", slo="ttft<500")
    with pytest.raises(ConfigError, match="give --slo or --itl-target-ms / --max-step-ms, not both"):
        UpOptions(mode="adaptive", slo="ttft<500", max_step_ms=50)
    with pytest.raises(ConfigError, match="not of the form metric<ms"):
        UpOptions(mode="adaptive", slo="ttft=500")


@pytest.mark.parametrize("mode", ["write", "read", "adaptive", "adaptive-read"])
def test_kv_verify_reaches_every_pd_instance_and_is_refused_elsewhere(mode):
    options = options_from(build_parser().parse_args(["up", "--mode", mode, "--kv-verify", "off"]))
    assert options.kv_verify == "off"
    for instance in plan(options).instances:
        config = json.loads(instance.extra_args[instance.extra_args.index("--kv-transfer-config") + 1])
        assert config["kv_connector_extra_config"]["kv_verify"] == "off"
    with pytest.raises(ConfigError, match="--kv-verify"):
        UpOptions(mode="collocated", model="/m", kv_verify="off")
    with pytest.raises(ConfigError, match="--kv-verify: digest or off"):
        UpOptions(mode=mode, model="/m", kv_verify="sha")
