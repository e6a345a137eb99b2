"""pdserve's patch of vLLM's seeded sampling on CPU generators (pdserve.vllm_patches.seeded_sampling).

The steps run vLLM's own `GPUModelRunner._sample` and `_bookkeeping_sync` with vLLM's `InputBatch`
and `Sampler`; only the runner's glue around them is a stand-in. The patch is installed the way
every vLLM process gets it: through the plugin entry point.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from pdserve.connector.plugin import register

VOCAB = 512
SEED = 1234
PROMPT = list(range(1, 9))


def _runner(seed: int = SEED) -> SimpleNamespace:
    """The parts of a model runner that `_sample` and `_bookkeeping_sync` read, around one seeded
    request (temperature 1.0) whose prompt is PROMPT."""
    batch = InputBatch(
        max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
        vocab_size=VOCAB, block_sizes=[16], max_num_blocks_per_req=[4])
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    request = CachedRequestState(
        req_id="r0", prompt_token_ids=list(PROMPT), mm_features=[],
        sampling_params=SamplingParams(temperature=1.0, seed=seed), generator=generator,
        block_ids=([0],), num_computed_tokens=0, output_token_ids=[])
    batch.add_request(request)
    batch.refresh_metadata()
    return SimpleNamespace(
        input_batch=batch, sampler=Sampler(), requests={"r0": request}, max_model_len=64,
        use_async_scheduling=False, discard_request_mask=SimpleNamespace(np=np.zeros(4, dtype=bool)),
        _to_list=lambda tensor: tensor.tolist(), _get_prompt_logprobs_dict=lambda *args: {})


def _step(runner: SimpleNamespace, partial_prefill: bool, logits: torch.Tensor) -> list[int]:
    """One sampling step as vLLM's `sample_tokens` runs it; the tokens the request keeps."""
    runner.discard_request_mask.np[0] = partial_prefill
    sampler_output = GPUModelRunner._sample(runner, logits.clone(), None)
    scheduler_output = SimpleNamespace(num_scheduled_tokens={"r0": 4})
    kept = GPUModelRunner._bookkeeping_sync(
        runner, scheduler_output, sampler_output, logits, torch.zeros(4, 8), 4)[3]
    return kept[0]


@pytest.fixture(autouse=True)
def patched():
    register()


def test_a_partial_prefill_step_leaves_a_seeded_cpu_generator_as_it_was():
    runner = _runner()
    fresh = torch.Generator(device="cpu")
    fresh.manual_seed(SEED)

    assert _step(runner, partial_prefill=True, logits=torch.randn(1, VOCAB)) == []

    assert torch.equal(runner.input_batch.generators[0].get_state(), fresh.get_state())
    assert list(runner.input_batch.generators) == [0]


def test_chunked_and_unchunked_prefill_sample_the_same_seeded_tokens():
    logits = [torch.randn(1, VOCAB) for _ in range(4)]
    chunked, whole = _runner(), _runner()

    _step(chunked, partial_prefill=True, logits=torch.randn(1, VOCAB))
    _step(chunked, partial_prefill=True, logits=torch.randn(1, VOCAB))
    tokens_chunked = [_step(chunked, partial_prefill=False, logits=step) for step in logits]
    tokens_whole = [_step(whole, partial_prefill=False, logits=step) for step in logits]

    assert tokens_chunked == tokens_whole
    assert all(len(tokens) == 1 for tokens in tokens_chunked)


class _OffsetGenerator:
    """A generator that has an offset, as GPU (Philox) generators do."""

    def __init__(self) -> None:
        self.offset = 40

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def test_generators_with_an_offset_are_rewound_by_vllm_itself():
    runner = _runner()
    generator = _OffsetGenerator()
    runner.input_batch.generators[0] = generator
    runner.discard_request_mask.np[0] = True
    output = SimpleNamespace(sampled_token_ids=torch.tensor([[7]]), logprobs_tensors=None)

    GPUModelRunner._bookkeeping_sync(
        runner, SimpleNamespace(num_scheduled_tokens={"r0": 4}), output, None, torch.zeros(4, 8), 4)

    assert generator.offset == 36
    assert runner.input_batch.generators[0] is generator


def test_code_that_does_not_match_is_left_alone_with_a_warning(caplog):
    from pdserve.vllm_patches import seeded_sampling

    class OtherRunner:
        def _sample(self):
            return None

        def _bookkeeping_sync(self):
            return None

    with caplog.at_level(logging.WARNING, logger="pdserve"):
        assert seeded_sampling.patch_model_runner(OtherRunner) is False
    assert "left out" in caplog.text
    assert OtherRunner.__dict__["_sample"].__name__ == "_sample"
    assert not hasattr(OtherRunner, seeded_sampling.PATCHED_MARK)


def test_install_patches_the_runner_module_when_it_is_imported_later(tmp_path, monkeypatch):
    from pdserve import vllm_patches
    from pdserve.vllm_patches import seeded_sampling

    name = "pdserve_test_runner_module"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        class GPUModelRunner:
            def _sample(self, logits, spec_decode_metadata):
                return None

            def _bookkeeping_sync(self):
                for i in self.discard_request_mask.np:
                    gen = self.input_batch.generators.get(int(i))
                    gen.set_offset(gen.get_offset() - 4)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(seeded_sampling, "MODULE", name)
    monkeypatch.setattr(vllm_patches, "PATCHES", (seeded_sampling,))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, name, raising=False)

    vllm_patches.install()
    vllm_patches.install()
    module = __import__(name)

    assert getattr(module.GPUModelRunner, seeded_sampling.PATCHED_MARK) is True
    assert not any(isinstance(finder, vllm_patches._PatchOnImport) for finder in sys.meta_path)
    sys.modules.pop(name, None)
