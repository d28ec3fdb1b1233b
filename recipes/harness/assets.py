"""The offline assets (re-exported): they live in the installed package, `hf_gradaccum.assets`, because the
`hf-gradaccum verify` CLI defaults to them too."""

from hf_gradaccum.assets import ASSETS, Asset, MissingAssetError, locate_asset

__all__ = ["ASSETS", "Asset", "MissingAssetError", "locate_asset"]
