"""``python -m dpwa.tools.demo ...``: the demo's command line (:func:`dpwa.tools.demo.cli.main`)."""

import sys

from dpwa.tools.demo.cli import main

sys.exit(main())
