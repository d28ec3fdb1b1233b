"""The public API: one way to do each thing, `AccumulationNotExactError` exported, and every name removed from the
top level still importable for one release with a `FutureWarning` naming its replacement."""

import warnings

import pytest

import hf_gradaccum


def test_public_names_resolve_and_the_exactness_error_is_exported():
    from hf_gradaccum.adapters.accumulation_check import AccumulationNotExactError

    assert hf_gradaccum.AccumulationNotExactError is AccumulationNotExactError
    assert set(hf_gradaccum.__all__) == set(hf_gradaccum._EXPORTS)
    assert not set(hf_gradaccum._DEPRECATED) & set(hf_gradaccum._EXPORTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a public name never warns
        for name in hf_gradaccum.__all__:
            assert getattr(hf_gradaccum, name) is not None


@pytest.mark.parametrize("name", sorted(hf_gradaccum._DEPRECATED))
def test_removed_names_still_work_with_a_future_warning(name):
    module, _ = hf_gradaccum._DEPRECATED[name]
    import importlib

    with pytest.warns(FutureWarning, match=f"hf_gradaccum.{name}` is deprecated"):
        value = getattr(hf_gradaccum, name)
    assert value is getattr(importlib.import_module(module, "hf_gradaccum"), name)
    assert name not in hf_gradaccum.__all__
