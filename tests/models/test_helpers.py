"""The pieces the families share in models/_helpers.py: entry points from register_variants, the global_pool check."""
import sys

import pytest
import timm

import polaformer.models  # noqa: F401  (registers the families)
from polaformer.models._helpers import check_global_pool


@pytest.mark.parametrize("name", ["pola_deit_digits", "pola_pvt_tiny", "pola_pvt_v2_b0", "pola_swin_t", "POLA_b0",
                                  "pola_lm_tiny", "pola_dit_s_2", "pola_sr_light_x4"])
def test_register_variants_makes_module_level_entry_points(name):
    entry_point = timm.models.model_entrypoint(name)
    module = sys.modules[entry_point.__module__]
    assert entry_point.__name__ == name and getattr(module, name) is entry_point and name in module.__all__
    assert timm.models.get_pretrained_cfg(name).architecture == name


def test_deprecated_aliases_still_build_the_official_models():
    with pytest.warns(UserWarning, match="Mapping deprecated model name pola_b0 to current POLA_b0"):
        assert type(timm.create_model("pola_b0", device="meta")).__name__ == "PolaFormerPP"


def test_check_global_pool():
    assert check_global_pool("avg") == "avg"
    with pytest.raises(ValueError, match=r"global_pool must be 'avg' or '', got 'max'"):
        check_global_pool("max")
    with pytest.raises(ValueError, match=r"global_pool must be 'token', 'avg' or '', got 'cls'"):
        check_global_pool("cls", ("token", "avg", ""))
