"""Deploy a run: `python export_hf.py --run RUN_DIR --out OUT [--format hf|peft|gguf]` (slm/cli/export.py):
a transformers folder (default), a LoRA run's PEFT adapter folder, or one GGUF file for llama.cpp (docs/deploy.md)."""

import sys

from slm.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
