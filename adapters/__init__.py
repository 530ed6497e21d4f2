"""Framework adapters, installed as ``dpwa.adapters`` (this folder is mapped there by setup.cfg).

``from dpwa.adapters.pytorch import DpwaPyTorchAdapter`` -- the PyTorch adapter: exchanges a
model's floating parameters (and buffers) in place through a :class:`dpwa.DpwaConnection`.
Importing this package does not import any framework; each adapter module imports its own.
"""

__all__: list[str] = []
