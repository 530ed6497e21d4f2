"""The ``dpwa`` command line (the console script ``dpwa = dpwa.cli:main``).

* :mod:`~dpwa.cli.app` -- the group, ``dpwa validate`` and the table of the other commands;
* :mod:`~dpwa.cli.run` -- ``dpwa run`` (the run loop is :mod:`dpwa.launcher`);
* :mod:`~dpwa.cli.keys` -- ``dpwa keys generate`` (:mod:`dpwa.security.keys`);
* :mod:`~dpwa.cli.plot` -- ``dpwa plot`` (:mod:`dpwa.tools.plot`);
* :mod:`~dpwa.cli.bench` -- ``dpwa bench`` (:mod:`dpwa.tools.bench`);
* :mod:`~dpwa.cli.common` -- the one error path: ``error: ...`` on one line, exit status 2.

Nothing outside this package imports it: it is the top of the layers.
"""

from dpwa.cli.app import main

__all__ = ["main"]
