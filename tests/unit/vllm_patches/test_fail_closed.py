"""A patch that does not fit the vLLM it meets never crashes vLLM: pdserve refuses what the patch
protects (pdserve.vllm_patches.admission) and serves the rest.

The vLLM patched here is the installed one, with the patches' targets taken away or renamed the way
another vLLM release would have them (monkeypatched module attributes, or a stand-in module)."""

from __future__ import annotations

import logging
import re
import sys
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine import input_processor
from vllm.v1.worker import gpu_model_runner

from pdserve import vllm_patches
from pdserve.connector.support import unsupported
from pdserve.vllm_patches import admission, cpu_rope, seeded_sampling
from pdserve.vllm_patches.target import vllm_version

PROMPT_TOKENS = 600


def scheduler(max_num_seqs=8, budget=512, threshold=0, chunked=True):
    return SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=threshold, enable_chunked_prefill=chunked)


def config(use_mla=False, **scheduler_kwargs):
    return SimpleNamespace(model_config=SimpleNamespace(model="models/m", use_mla=use_mla),
                           scheduler_config=scheduler(**scheduler_kwargs))


@pytest.fixture
def without_runner(monkeypatch):
    """vLLM's model runner module without GPUModelRunner (renamed in another release)."""
    monkeypatch.delattr(gpu_model_runner, "GPUModelRunner")
    admission._seeded_sampling_problem.cache_clear()
    yield
    admission._seeded_sampling_problem.cache_clear()


@pytest.fixture
def seeded():
    return SamplingParams(temperature=1.0, seed=7)


def test_a_renamed_runner_class_is_left_out_with_a_warning_naming_the_version_and_the_patch(without_runner, caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        assert seeded_sampling.patch(gpu_model_runner) is False
    assert f"vLLM {vllm_version()}: patch seeded_sampling left out" in caplog.text
    assert "GPUModelRunner is missing" in caplog.text
    assert seeded_sampling.problem() == "vllm.v1.worker.gpu_model_runner.GPUModelRunner is missing"


def test_a_renamed_runner_class_met_on_import_does_not_crash_the_import(tmp_path, monkeypatch, caplog):
    name = "pdserve_test_renamed_runner"
    (tmp_path / f"{name}.py").write_text("class GPUModelRunnerV2:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(seeded_sampling, "MODULE", name)
    monkeypatch.setattr(vllm_patches, "PATCHES", (seeded_sampling,))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, name, raising=False)

    vllm_patches.install()
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        module = __import__(name)

    assert module.GPUModelRunnerV2
    assert "patch seeded_sampling left out" in caplog.text
    sys.modules.pop(name, None)


def test_a_missing_module_is_left_out_at_install_instead_of_waiting_for_an_import(monkeypatch, caplog):
    monkeypatch.setattr(seeded_sampling, "MODULE", "vllm.v1.worker.renamed_model_runner")
    monkeypatch.setattr(vllm_patches, "PATCHES", (seeded_sampling,))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        vllm_patches.install()
    assert "vLLM has no module vllm.v1.worker.renamed_model_runner" in caplog.text
    assert not any(isinstance(f, vllm_patches._PatchOnImport) for f in sys.meta_path)
    assert seeded_sampling.problem().startswith("module vllm.v1.worker.renamed_model_runner does not import")


def test_without_seeded_sampling_a_seeded_request_vllm_may_split_is_refused(without_runner, seeded):
    refusal = admission.seeded_refusal(config(max_num_seqs=8), seeded, PROMPT_TOKENS)
    assert refusal is not None
    assert f"vLLM {vllm_version()}" in refusal and "seeded_sampling does not apply" in refusal
    assert "GPUModelRunner is missing" in refusal and "without a seed" in refusal


def test_without_seeded_sampling_the_rest_is_served(without_runner, seeded):
    assert admission.seeded_refusal(config(), SamplingParams(temperature=1.0), PROMPT_TOKENS) is None  # no seed
    assert admission.seeded_refusal(config(), SamplingParams(temperature=0.0, seed=7), PROMPT_TOKENS) is None  # greedy
    assert admission.seeded_refusal(config(), seeded, 1) is None  # one token is never split
    # one sequence per step: only a prompt longer than the chunk is split
    assert admission.seeded_refusal(config(max_num_seqs=1, budget=512), seeded, 512) is None
    assert admission.seeded_refusal(config(max_num_seqs=1, budget=512), seeded, 513) is not None
    assert admission.seeded_refusal(config(max_num_seqs=1, budget=512, threshold=256), seeded, 257) is not None
    assert admission.seeded_refusal(config(chunked=False), seeded, PROMPT_TOKENS) is None


def test_with_seeded_sampling_in_place_nothing_is_refused(seeded):
    admission._seeded_sampling_problem.cache_clear()
    seeded_sampling.patch(gpu_model_runner)
    assert admission.seeded_refusal(config(), seeded, PROMPT_TOKENS) is None


def test_the_admission_wrap_answers_a_refused_request_with_vllms_validation_error(without_runner, seeded):
    """vLLM's API server answers its VLLMValidationError from process_inputs with HTTP 400 (a plain
    ValueError there becomes a 500)."""

    class Processor:
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config

        def process_inputs(self, request_id, prompt, params):
            return SimpleNamespace(sampling_params=params, prompt_token_ids=prompt)

    assert admission.patch_input_processor(Processor) is True
    processor = Processor(config())
    with pytest.raises(VLLMValidationError, match="pdserve refuses seeded sampling for this request"):
        processor.process_inputs("r0", list(range(PROMPT_TOKENS)), seeded)
    request = processor.process_inputs("r1", list(range(PROMPT_TOKENS)), SamplingParams(temperature=1.0))
    assert request.prompt_token_ids == list(range(PROMPT_TOKENS))


def test_vllms_own_input_processor_is_wrapped():
    assert admission.patch(input_processor) is True
    assert getattr(input_processor.InputProcessor, admission.PATCHED_MARK)


def test_without_the_admission_wrap_nor_seeded_sampling_the_instance_refuses_to_start(without_runner, monkeypatch):
    monkeypatch.delattr(input_processor, "InputProcessor")
    with pytest.raises(admission.PatchRefusal, match=f"refuses to start on vLLM {re.escape(vllm_version())}: its patch "
                                                     "seeded_sampling does not apply .*admission.*does not apply"):
        admission.patch(input_processor)


def test_without_the_admission_wrap_but_with_seeded_sampling_vllm_serves(monkeypatch, caplog):
    admission._seeded_sampling_problem.cache_clear()
    monkeypatch.delattr(input_processor, "InputProcessor")
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        assert admission.patch(input_processor) is False
    assert "patch admission left out" in caplog.text


def test_an_mla_model_on_cpu_is_refused_at_startup_without_cpu_rope(monkeypatch):
    monkeypatch.setattr(cpu_rope, "problem", lambda: "RotaryEmbedding is missing")
    with pytest.raises(admission.PatchRefusal, match="refuses model 'models/m'.*MLA.*cpu_rope does not apply"):
        admission.refuse_at_startup(config(use_mla=True))
    admission.refuse_at_startup(config(use_mla=False))  # the rest is served


def test_a_renamed_rope_class_is_refused_by_the_connector_not_crashed_on(monkeypatch):
    from vllm.model_executor.layers.rotary_embedding import base

    monkeypatch.delattr(base, "RotaryEmbedding")
    assert cpu_rope.applied() is False
    assert cpu_rope.problem() == f"{cpu_rope.MODULE}.RotaryEmbedding is missing"
    mla = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace(
        model="models/m", use_mla=True, is_attention_free=False))
    assert any("multi-head latent attention" in reason for reason in unsupported(mla))
