"""The registry's Family records: every capability a family's module implements is declared
in its record (the loader, runner and engine read the record, never the module's attributes)."""

from __future__ import annotations

import pytest

from jaxllm.errors import ModelLoadError
from jaxllm.models import registry

from jaxllm.models.config import FamilyConfig

# Family field -> the module attribute that implements it.
CAPABILITIES = {"cache_kinds": "cache_kinds", "allocate_cache": "allocate_cache", "rope_tables": "rope_tables"}


@pytest.mark.parametrize("architecture", registry.supported_architectures())
def test_every_capability_of_the_module_is_declared(architecture):
    family = registry.get_family(architecture)
    for field, attr in CAPABILITIES.items():
        declared = getattr(family, field)
        implemented = getattr(family.module, attr, None)
        assert declared is implemented, f"{architecture}: Family.{field} is {declared}, the module has {implemented}"
    assert family.per_sequence_state == getattr(family.module, "PER_SEQUENCE_STATE", False)
    # The config type is the one the family's package exports, with both readers.
    assert issubclass(family.config, FamilyConfig) and getattr(family.module, family.config.__name__) is family.config
    assert family.config.__module__.startswith(family.module.__name__ + ".")
    assert registry.keeps_sequence_state(architecture) == family.per_sequence_state


@pytest.mark.parametrize("gguf_name", sorted(registry.GGUF_ARCHITECTURES))
def test_every_gguf_architecture_is_read_by_its_familys_config(gguf_name):
    """A GGUF architecture's metadata goes to the config type of the family the HF name maps to,
    which reads it (a family without a GGUF reader would refuse it by name)."""
    family = registry.get_family(registry.GGUF_ARCHITECTURES[gguf_name])
    assert family.config.from_gguf.__func__ is not FamilyConfig.from_gguf.__func__, gguf_name


def test_a_family_without_a_gguf_form_refuses_one_by_name():
    with pytest.raises(ModelLoadError, match="'deepseek2' has no reader in DeepseekConfig"):
        registry.get_family("DeepseekV2ForCausalLM").config.from_gguf({}, {}, "deepseek2", "f.gguf")


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="'NopeForCausalLM' is not supported"):
        registry.get_family("NopeForCausalLM")
