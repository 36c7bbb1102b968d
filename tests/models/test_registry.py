"""The registry's Family records: every capability a family's module implements is declared
in its record (the loader, runner and engine read the record, never the module's attributes)."""

from __future__ import annotations

import pytest

from jaxllm.errors import ModelLoadError
from jaxllm.models import registry

# Family field -> the module attribute that implements it.
CAPABILITIES = {"read_config": "arch_config", "cache_kinds": "cache_kinds", "allocate_cache": "allocate_cache",
                "rope_tables": "rope_tables"}


@pytest.mark.parametrize("architecture", registry.supported_architectures())
def test_every_capability_of_the_module_is_declared(architecture):
    family = registry.get_family(architecture)
    for field, attr in CAPABILITIES.items():
        declared = getattr(family, field)
        implemented = getattr(family.module, attr, None)
        assert declared is implemented, f"{architecture}: Family.{field} is {declared}, the module has {implemented}"
    assert family.per_sequence_state == getattr(family.module, "PER_SEQUENCE_STATE", False)
    assert registry.keeps_sequence_state(architecture) == family.per_sequence_state


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="'NopeForCausalLM' is not supported"):
        registry.get_family("NopeForCausalLM")
