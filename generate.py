"""Sample from a trained run: `python generate.py --run RUN_DIR --prompt TEXT` (slm/cli/generate.py)."""

import sys

from slm.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
