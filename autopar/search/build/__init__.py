"""The ILP build, one-way stages: flatten -> coarsen -> price -> memory.

Each stage is a module that hands a frozen record to the next:

* :mod:`~autopar.search.build.flatten`: ``Graph`` -> :class:`~.flatten.Flat` (ops);
* :mod:`~autopar.search.build.coarsen`: -> :class:`~.coarsen.Coarse` (groups, pins, families);
* :mod:`~autopar.search.build.price`: -> :class:`~.price.Priced` (costs and edges, from
  :mod:`autopar.search.pricing`, the one pricing door);
* :mod:`~autopar.search.build.memory`: persistent values and the live-value timeline,
  under a remat policy what :mod:`~autopar.search.build.residuals` stores for the
  backward pass (the minimum cut of what is stored versus recomputed).

:mod:`autopar.search.ilp` assembles them into a ``BuiltProblem``; the strategies every
stage asks about come from one :class:`~.catalog.StrategyCatalog`.
"""
