"""The line a launch reports for a process that died: pdserve's own refusal when vLLM carried one."""

from pdserve.launch.process import ManagedProcess, ProcessSpec

VLLM_TAIL = [
    "(EngineCore pid=1) ERROR 12-06 07:12:06 [core.py:1510]   File \"pdserve/connector/support.py\", line 40",
    "(EngineCore pid=1) ERROR 12-06 07:12:06 [core.py:1510] pdserve.errors.ConfigError: PDConnector cannot serve "
    "this configuration: tensor_parallel_size is 2",
    "(APIServer pid=2) ERROR 12-06 07:12:07 RuntimeError: Engine core initialization failed. See root cause above.",
    "(APIServer pid=2) INFO shutting down",
]


def process() -> ManagedProcess:
    return ManagedProcess(ProcessSpec("prefill", ("true",)))


def test_pdserve_refusal_inside_vllm_is_the_reported_line():
    assert process().last_error(VLLM_TAIL) == "PDConnector cannot serve this configuration: tensor_parallel_size is 2"


def test_otherwise_the_last_error_looking_line():
    tail = VLLM_TAIL[2:]
    assert process().last_error(tail).endswith("RuntimeError: Engine core initialization failed. See root cause above.")
    assert process().last_error([]) == "no output"
