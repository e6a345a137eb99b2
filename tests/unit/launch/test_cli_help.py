"""`--help`: every flag explained with its default, built without importing torch or vLLM."""

import argparse
import subprocess
import sys

import pytest

import pdserve
from pdserve.cli import build_parser, command_of

HEAVY = ("torch", "vllm", "transformers")
OWN_COMMANDS = ("up", "demo", "instance", "router")


def subparser(command: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser(command)._actions if a.dest == "command").choices[command]


@pytest.mark.parametrize("command", OWN_COMMANDS)
def test_every_flag_has_help_and_every_default_is_shown(command):
    parser = subparser(command)
    text = parser.format_help()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
        shown = parser._get_formatter()._get_help_string(action) % {"default": action.default}
        if action.option_strings and action.nargs != 0 and not action.required:
            assert "default" in shown, f"{command} {action.option_strings[0]}: no default in {shown!r}"
    assert "collocated is plain vLLM, no PD" in text if command in ("up", "demo") else True


def test_up_help_states_the_defaults_a_user_asks_about():
    text = " ".join(subparser("up").format_help().split())
    for shown in ("(default: collocated)", "(default: tiny)", "(default: 18000)", "(default: 1GiB)",
                  "(default: 4096)", "(default: 600.0)", "(default: 127.0.0.1)"):
        assert shown in text


@pytest.mark.parametrize("argv", [["up", "--help"], ["instance", "--help"], ["router", "--help"], ["--version"]])
def test_help_imports_neither_torch_nor_vllm(argv):
    code = ("import sys\nfrom pdserve.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print('imported:', *(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "imported:"


def test_a_command_imports_only_its_own_module():
    code = ("import sys\nfrom pdserve.cli import build_parser\nbuild_parser('up')\n"
            "print(' '.join(m for m in ('pdserve.model.cli', 'pdserve.bench.cli', 'pdserve.launch.per_host_cli') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == ""


def test_version():
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"pdserve {pdserve.__version__}"


@pytest.mark.parametrize("argv, command", [
    (["up", "--mode", "write"], "up"), (["--work-dir", "/w", "demo"], "demo"), (["--work-dir=/w", "bench"], "bench"),
    (["--version"], None), ([], None),
])
def test_command_of(argv, command):
    assert command_of(argv) == command
