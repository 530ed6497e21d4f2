"""Packages: every package under dpwa/, plus adapters/ installed as dpwa.adapters (setup.cfg's package_dir).

setup.cfg's ``packages = find:`` cannot see a package whose folder sits outside its parent's (adapters/
is top level because an unrelated PyPI package owns the name ``adapters``), so the list is found here:
a new subpackage of either tree is in the wheel without anyone listing it. Everything else is setup.cfg.
"""

from setuptools import find_packages, setup

ADAPTERS = "adapters"

setup(
    packages=[
        *find_packages(include=["dpwa", "dpwa.*"]),
        *(f"dpwa.{name}" for name in find_packages(include=[ADAPTERS, f"{ADAPTERS}.*"])),
    ]
)
