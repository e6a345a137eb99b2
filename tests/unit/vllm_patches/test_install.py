"""pdserve.vllm_patches.install: each patch reaches its module whether vLLM imported it before or after."""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

from pdserve import vllm_patches


def _patch(module_name: str, applied: list):
    return SimpleNamespace(MODULE=module_name, patch=lambda module: applied.append(module.__name__))


def test_install_patches_imported_modules_now_and_the_others_on_import(tmp_path, monkeypatch):
    early, late = "pdserve_test_patch_early", "pdserve_test_patch_late"
    for name in (early, late):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent("VALUE = 1\n"))
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    applied = []
    monkeypatch.setattr(vllm_patches, "PATCHES", (_patch(early, applied), _patch(late, applied)))
    __import__(early)

    vllm_patches.install()
    vllm_patches.install()  # idempotent: the waiting patch is not registered twice
    assert applied == [early, early]  # each install patches what is imported (the patches are idempotent)
    assert sum(isinstance(f, vllm_patches._PatchOnImport) for f in sys.meta_path) == 1

    module = __import__(late)
    assert module.VALUE == 1
    assert applied == [early, early, late]
    assert not any(isinstance(f, vllm_patches._PatchOnImport) for f in sys.meta_path)
    for name in (early, late):
        sys.modules.pop(name, None)
