"""Run timm's own ``tests/test_models.py`` against the PolaFormer models (see docs/timm.md).

Copy this file next to timm's ``test_models.py`` (of the installed timm version) and run pytest
there. Before the test module is imported, this conftest

1. imports :mod:`polaformer.models`, which registers the ``pola_*`` / ``POLA_*`` models with timm;
2. wraps ``timm.list_models`` so that every model list the test module builds is the list timm
   would build, restricted to our models. Two of timm's filters name timm module or model
   families, so they are mapped to ours:

   - ``filter``/``exclude_filters`` containing ``'deit*'`` (timm's ``NON_STD_FILTERS``: token-output
     transformers that get the non-spatial config test and no ``features_only`` hook test) also
     match ``pola_deit*``, which is such a ViT;
   - ``module=FEAT_INTER_FILTERS`` (timm modules whose models implement ``forward_intermediates``
     and the ``getter`` feature wrapper) selects every PolaFormer family, as all of them do;
3. deselects the tests that are not parametrised by one of our models (checks of specific timm
   models such as ``resnet18``);
4. skips the TorchScript tests (``test_model_forward_torchscript``,
   ``test_model_forward_fx_torchscript``): TorchScript is deprecated in current PyTorch and the
   PolaFormer models do not support it (scripting stops in the shared attention layers, which use
   Python-only constructs such as ``tuple(x.shape)``; past them the PVT families pick stage modules
   with ``getattr(self, f"block{i}")`` and PolaFormer++ caches RoPE tables in a dict);
   ``torch.compile``, ``torch.export`` and ONNX export are the supported ways to capture them.

Environment: ``POLA_TIMM_MODELS`` (comma-separated fnmatch patterns, default ``pola_*,POLA_*``)
narrows the models, e.g. ``POLA_TIMM_MODELS='pola_pvt_v2*'``.
"""
from __future__ import annotations

import fnmatch
import os

import pytest
import timm
import timm.models

import polaformer.models  # noqa: F401  (registers the models)

POLA_PATTERNS = [p.strip() for p in os.environ.get("POLA_TIMM_MODELS", "pola_*,POLA_*").split(",") if p.strip()]
TIMM_DEIT_FILTER = "deit*"  # how timm's lists name its DeiT family
POLA_DEIT_FILTER = "pola_deit*"
TORCHSCRIPT_SKIP = (
    "TorchScript is deprecated in PyTorch and not supported by the PolaFormer models; "
    "use torch.compile, torch.export or ONNX export (docs/timm.md)"
)

_timm_list_models = timm.list_models


def _as_list(value) -> list[str]:
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def is_pola(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in POLA_PATTERNS)


def pola_list_models(filter="", module="", pretrained=False, exclude_filters="", name_matches_cfg=False,
                     include_tags=None):
    """``timm.list_models`` restricted to the PolaFormer models (module docstring)."""
    filters, excludes = _as_list(filter), _as_list(exclude_filters)
    if TIMM_DEIT_FILTER in filters:
        filters.append(POLA_DEIT_FILTER)
    if TIMM_DEIT_FILTER in excludes:
        excludes.append(POLA_DEIT_FILTER)
    names = _timm_list_models(filters or "", module="", pretrained=pretrained, exclude_filters=excludes,
                              name_matches_cfg=name_matches_cfg, include_tags=include_tags)
    return [name for name in names if is_pola(name.split(".")[0])]


timm.list_models = pola_list_models
timm.models.list_models = pola_list_models


def pytest_report_header(config):
    import torch

    names = pola_list_models()
    return [f"timm {timm.__version__}, torch {torch.__version__}: timm's test_models.py against {len(names)} "
            f"PolaFormer models ({', '.join(POLA_PATTERNS)})"]


def pytest_configure(config):
    for marker in ("base", "forward", "backward", "cfg", "cfg_nonstd", "torchscript", "features", "fxforward",
                   "fxbackward", "timeout"):
        config.addinivalue_line("markers", f"{marker}: timm test_models.py marker")


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = params.get("model_name")
        (keep if isinstance(name, str) and is_pola(name) else drop).append(item)
        if "torchscript" in item.originalname:
            item.add_marker(pytest.mark.skip(reason=TORCHSCRIPT_SKIP))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
