"""`python -m hf_gradaccum ...` is the `hf-gradaccum` command, for environments where the package is importable but
its console script is not installed (a source tree on `PYTHONPATH`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
