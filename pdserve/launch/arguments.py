"""The command line's parser class, help format and argument types: every value checked as it is read.

An argument type returns the parsed value or raises ArgumentTypeError with the rule and the value;
the parser reports it as one line `pdserve COMMAND: error: --flag: rule (got value)`, exit status 2,
before anything starts. Light to import: the parsers of every command are built from it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import shlex
import stat
import sys
from pathlib import Path
from typing import NoReturn

from pdserve.errors import ConfigError
from pdserve.launch.options import MAX_INSTANCES_PER_ROLE, MAX_TP, parse_bytes
from pdserve.model.archs import builtin_models
from pdserve.slo import SLO

MIN_KV_CACHE_BYTES = 16 << 20
MAX_TOKENS = 1 << 20  # budgets and lengths: a token count in 16..MAX_TOKENS
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HOST_NAME = re.compile(r"^(?=.*[A-Za-z])[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line without the usage, and whose help shows defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.removeprefix('argument ')}\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends `(default: X)` to an option's help unless the help states its default or it is a switch."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings
                or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)"


def _rule(rule: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{rule} (got {text!r})")


def _integer(text: str, low: int, high: int, rule: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _rule(rule, text) from None
    if not low <= value <= high:
        raise _rule(rule, text)
    return value


def port(text: str) -> int:
    return _integer(text, 1, 65535, "a port number in 1..65535")


def positive_int(text: str) -> int:
    return _integer(text, 1, sys.maxsize, "a whole number >= 1")


def token_count(text: str) -> int:
    return _integer(text, 16, MAX_TOKENS, f"a token count in 16..{MAX_TOKENS}")


def instance_count(text: str) -> int:
    return _integer(text, 1, MAX_INSTANCES_PER_ROLE, f"a number of instances in 1..{MAX_INSTANCES_PER_ROLE}")


def tensor_parallel_size(text: str) -> int:
    return _integer(text, 1, MAX_TP, f"a tensor-parallel size in 1..{MAX_TP}")


def _number(text: str, positive: bool, rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _rule(rule, text) from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise _rule(rule, text)
    return value


def seconds(text: str) -> float:
    return _number(text, positive=True, rule="a number of seconds > 0")


def seconds_or_zero(text: str) -> float:
    return _number(text, positive=False, rule="a number of seconds >= 0")


def milliseconds(text: str) -> float:
    value = _number(text, positive=True, rule="a number of milliseconds in (0, 1e6)")
    if value >= 1e6:
        raise _rule("a number of milliseconds in (0, 1e6)", text)
    return value


def memory_size(text: str) -> int:
    """A size with a binary unit ('1GiB', '512MiB'), at least 16 MiB and at most this machine's memory."""
    try:
        value = parse_bytes(text)
    except ConfigError:
        raise _rule("a size such as 1GiB or 512MiB", text) from None
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if not MIN_KV_CACHE_BYTES <= value <= total:
        raise _rule(f"a size from 16MiB to this machine's memory ({total / (1 << 30):.1f}GiB)", text)
    return value


def shell_words(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise _rule(f"shell-quoted words ({exc})", text) from None


def slo(text: str) -> str:
    try:
        SLO.parse(text)
    except ConfigError as exc:
        raise _rule(f"an SLO such as 'ttft<500,mean_itl<40' ({exc})", text) from None
    return text


def ip_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise _rule("an IP address", text) from None


def host_and_port(text: str) -> tuple[str, int]:
    """HOST:PORT, HOST an IP address ([v6] bracketed or not) or a DNS name (e.g. a Kubernetes Service)."""
    host, sep, number = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    rule = "HOST:PORT with HOST an IP address or a DNS name and PORT in 1..65535"
    if not sep or not number.isdigit() or not 1 <= int(number) <= 65535 or not _is_host(host):
        raise _rule(rule, text)
    return host, int(number)


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(HOST_NAME.match(text))


def peer_list(text: str) -> tuple[str, ...]:
    """Comma-separated IP networks (CIDR), addresses or host names."""
    peers = tuple(p.strip() for p in text.split(",") if p.strip())
    for peer in peers:
        try:
            ipaddress.ip_network(peer, strict=False)
        except ValueError:
            if not HOST_NAME.match(peer):
                raise _rule(f"comma-separated IP networks or host names ({peer!r} is neither)", text) from None
    return peers


def cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6), every CPU one this process may run on; '' -> ()."""
    available = os.sched_getaffinity(0)
    rule = f"a list of CPUs this process may use, e.g. 0-1 (available: {_ranges(sorted(available))})"
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(low) > int(high or low):
            raise _rule(rule, text)
        cores.extend(range(int(low), int(high or low) + 1))
    if not set(cores) <= available or len(set(cores)) != len(cores):
        raise _rule(rule, text)
    return tuple(cores)


def _ranges(cores: list[int]) -> str:
    parts, start = [], None
    for i, core in enumerate(cores):
        start = core if start is None else start
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(str(core) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise _rule("a JSON object, e.g. '{\"key\": 1}'", text) from None
    if not isinstance(value, dict):
        raise _rule("a JSON object, e.g. '{\"key\": 1}'", text)
    return value


def secret_file(text: str) -> Path:
    """A regular, non-empty file that only its owner may read (the deployment's shared key)."""
    path = Path(text)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise _rule("an existing file (copy the deployment's secret here)", text) from None
    except OSError as exc:
        raise _rule(f"a readable file ({exc.strerror})", text) from None
    if stat.S_ISDIR(info.st_mode):
        raise _rule("a file, not a directory", text)
    if not stat.S_ISREG(info.st_mode):
        raise _rule("a regular file", text)
    if info.st_size == 0:
        raise _rule("a non-empty file", text)
    if info.st_mode & 0o077:
        raise _rule(f"a file only its owner may read or write (chmod 600; mode is {stat.S_IMODE(info.st_mode):o})",
                    text)
    return path


def output_directory(text: str) -> Path:
    """A directory to create or reuse: refused only if something else already has the name."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise _rule("a directory (this path is a file)", text)
    return path.resolve()


def model(text: str) -> str:
    """A built-in model's name (tiny, small, ARCH-tiny: built on first use), or what model_location accepts."""
    return text if text in builtin_models() else _model_location(text, "a built-in name (tiny, small, ARCH-tiny), ")


def model_location(text: str) -> str:
    """A model directory (config.json inside; made absolute) or a Hugging Face id `org/name` (as is)."""
    return _model_location(text, "")


def is_hub_id(model: str) -> bool:
    """Whether `model` names a Hugging Face model (org/name, no such local path) rather than a directory."""
    return bool(HF_ID.match(model)) and not Path(model).expanduser().exists()


def _model_location(text: str, built_in: str) -> str:
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise _rule("a model directory holds config.json", text)
        return str(path.resolve())
    if is_hub_id(text):
        return text
    raise _rule(f"{built_in}a model directory or a Hugging Face id such as org/name (no such directory)", text)
