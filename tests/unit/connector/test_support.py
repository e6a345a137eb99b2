"""PDConnector refuses at startup what it cannot serve (connector/support.py)."""

from types import SimpleNamespace

import pytest

from pdserve.connector.support import check_supported, unsupported
from pdserve.errors import ConfigError


def vllm_config(tp=1, pp=1, dp=1, hybrid=False, attention_free=False, mla=False):
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
    model = SimpleNamespace(model="models/m", is_hybrid=hybrid, is_attention_free=attention_free,
                            use_mla=mla)
    return SimpleNamespace(parallel_config=parallel, model_config=model)


def test_one_group_of_attention_layers_at_size_one_is_served():
    assert unsupported(vllm_config()) == []
    check_supported(vllm_config())


def test_tensor_parallel_instances_are_served_with_static_placement():
    assert unsupported(vllm_config(tp=2)) == []
    check_supported(vllm_config(tp=4))


def test_adaptive_placement_with_tensor_parallelism_is_refused_naming_both():
    with pytest.raises(ConfigError, match="tensor_parallel_size is 2; adaptive placement runs at tensor_parallel_size 1"):
        check_supported(vllm_config(tp=2), adaptive=True)
    check_supported(vllm_config(), adaptive=True)


@pytest.mark.parametrize("field, kwargs", [("pipeline_parallel_size is 2", dict(pp=2)),
                                           ("data_parallel_size is 4", dict(dp=4))])
def test_parallel_sizes_above_one_are_refused_by_name(field, kwargs):
    with pytest.raises(ConfigError, match=field):
        check_supported(vllm_config(**kwargs))


def test_hybrid_models_are_served_with_static_placement_only():
    assert unsupported(vllm_config(hybrid=True)) == []
    with pytest.raises(ConfigError, match="'models/m' has mamba or linear-attention layers; adaptive placement"):
        check_supported(vllm_config(hybrid=True), adaptive=True)


def test_models_without_attention_layers_are_refused_naming_the_model():
    with pytest.raises(ConfigError, match="'models/m' has no attention layer"):
        check_supported(vllm_config(attention_free=True))


def test_every_reason_is_named_at_once():
    reasons = unsupported(vllm_config(pp=2, attention_free=True))
    assert len(reasons) == 2


def test_vllm_asks_the_connector_class_before_it_groups_the_kv_cache():
    from pdserve.connector.connector import PDConnector

    assert PDConnector.get_required_kvcache_layout(vllm_config()) is None
    with pytest.raises(ConfigError, match="no attention layer"):
        PDConnector.get_required_kvcache_layout(vllm_config(attention_free=True))


def test_mla_models_are_served_on_cpu_with_the_rotary_patch_in_place(monkeypatch):
    from pdserve.vllm_patches import cpu_rope

    monkeypatch.setattr(cpu_rope, "applied", lambda: True)
    assert unsupported(vllm_config(mla=True)) == []
    check_supported(vllm_config(mla=True, tp=2))


def test_mla_models_are_refused_on_cpu_where_the_rotary_patch_did_not_apply(monkeypatch):
    from pdserve.vllm_patches import cpu_rope

    monkeypatch.setattr(cpu_rope, "applied", lambda: False)
    with pytest.raises(ConfigError, match="'models/m' uses multi-head latent attention .MLA., and vLLM's CPU rotary "
                                          "kernel.*is not patched"):
        check_supported(vllm_config(mla=True))


def test_mla_models_with_adaptive_placement_are_refused(monkeypatch):
    from pdserve.vllm_patches import cpu_rope

    monkeypatch.setattr(cpu_rope, "applied", lambda: True)
    with pytest.raises(ConfigError, match="'models/m' uses multi-head latent attention .MLA.; adaptive placement"):
        check_supported(vllm_config(mla=True), adaptive=True)


def test_an_mla_model_counts_one_kv_head_whatever_its_config_says():
    from pdserve.connector.connector import _tensor_parallel

    def config(mla: bool):
        model = SimpleNamespace(use_mla=mla, get_total_num_kv_heads=lambda: 4)
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1), model_config=model)

    assert _tensor_parallel(config(True)).total_heads == 1  # the latent every rank holds whole
    assert _tensor_parallel(config(False)).total_heads == 4
