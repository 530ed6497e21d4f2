"""``python -m dpwa.cli ...`` is ``dpwa ...``."""

from dpwa.cli.app import main

main(prog_name="dpwa")
