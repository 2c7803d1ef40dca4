"""`python -m specexec_cli` is the same as the `specx` console script."""

from specexec_cli.terminal.app import main

main()
