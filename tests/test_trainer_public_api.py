"""The public API: one way to do each thing, `AccumulationNotExactError` exported, and no public name warns."""

import warnings

import hf_gradaccum


def test_public_names_resolve_and_the_exactness_error_is_exported():
    from hf_gradaccum.losses.accumulation_check import AccumulationNotExactError

    assert hf_gradaccum.AccumulationNotExactError is AccumulationNotExactError
    assert set(hf_gradaccum.__all__) == set(hf_gradaccum._EXPORTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a public name never warns
        for name in hf_gradaccum.__all__:
            assert getattr(hf_gradaccum, name) is not None
