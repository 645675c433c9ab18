"""Command-line entry points: flags and config files, train, generate and export."""
