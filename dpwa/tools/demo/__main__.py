"""``python -m dpwa.tools.demo ...``: the demo's command line (:func:`dpwa.tools.demo.cli.main`), ended without the
interpreter's teardown once it returns (:func:`dpwa.utils.exiting.exit_now`)."""

from dpwa.tools.demo.cli import main
from dpwa.utils.exiting import exit_now

exit_now(main())
