"""podsim's Python side.

``import podsim.torch`` registers the ``podsim`` torch.distributed backend: under
``podsim run`` (or a ``kind = "torch"`` job) every rank is one emulated chip and its
collectives run on podsim's fabric, algorithms and virtual clock.
"""

__version__ = "0.1.0"
