"""`pdserve up --config FILE.yaml`: a YAML mapping of `up`'s flags, read as the parser's defaults.

    mode: write                  # keys are flag names without --, with dashes or underscores
    host: 0.0.0.0
    kv-cache: 2GiB
    enforce_eager: true          # a switch: true or false
    vllm_args: [--max-num-seqs, "8"]   # vLLM's own flags, before those given after `--`

Values go through the same argument types as the flags (so the same checks), and flags given on
the command line override them. Unknown keys and malformed files are refused naming the key.
"""

from __future__ import annotations

import argparse
from pathlib import Path

VLLM_ARGS_KEY = "vllm-args"
NOT_IN_FILE = ("config", "help", "detach", "ready-file")


def apply(parser: argparse.ArgumentParser, path: Path) -> None:
    """Set `parser`'s defaults from the file; refuse what it cannot hold via parser.error (exit 2)."""
    import yaml  # only when a file is given: `--help` stays fast

    try:
        values = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config: a readable YAML file ({_first_line(exc)}) (got {str(path)!r})")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        parser.error(f"--config: a YAML mapping of flag names to values (got a {type(values).__name__} in {path})")
    actions = {option[2:]: action for action in parser._actions for option in action.option_strings
               if option.startswith("--") and option[2:] not in NOT_IN_FILE}
    defaults = {}
    for key, value in values.items():
        name = str(key).replace("_", "-")
        if name == VLLM_ARGS_KEY and isinstance(value, list):
            if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                parser.error(f"--config: {key}: a list of vLLM flags and values as strings (got {value!r})")
            defaults["config_vllm_args"] = tuple(str(v) for v in value)
        elif name not in actions:
            parser.error(f"--config: unknown key {key!r} in {path} (keys are {parser.prog}'s flags without --)")
        elif actions[name].nargs == 0:
            if not isinstance(value, bool):
                parser.error(f"--config: {key}: true or false (got {value!r})")
            defaults[actions[name].dest] = value
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            choices = actions[name].choices  # argparse checks a default's type, not its choices
            if choices is not None and str(value) not in choices:
                parser.error(f"--{name}: one of {', '.join(choices)} (got {str(value)!r})")
            defaults[actions[name].dest] = str(value)  # a string default goes through the argument's type
        else:
            parser.error(f"--config: {key}: a single value (got {value!r})")
    parser.set_defaults(**defaults)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
