"""``python -m ops_transformer``: the command line, also under ``torchrun -m ops_transformer``."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
