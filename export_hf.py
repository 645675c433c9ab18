"""Export a run as a Hugging Face folder: `python export_hf.py --run RUN_DIR --out DIR` (slm/cli/export.py)."""

import sys

from slm.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
