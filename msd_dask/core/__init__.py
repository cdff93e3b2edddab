"""The pure core: what the service decides, with no Dask, no storage and no I/O.

``config`` (the declarative config and its validation), ``units`` (the pieces of
files a loader reads), ``stream`` (each source's document order), ``mixing``
(which source the next token comes from), ``flops`` and ``cost`` (a document's
attention cost), ``balance`` (pieces to ranks), ``row_placement`` (a step's
pieces to rows, ranks and micro-batches), ``packing`` (pieces to rows of
tokens), ``plan`` (one step's decisions), ``gcpause`` (the collector paused
while a step is planned), ``mesh`` (what tp/cp/pp members receive),
``scaling`` (how many loaders each source needs) and ``figures`` (what the
dashboard and ``stats()`` report).  Every module here is importable and testable without a
cluster; ``tests/unit/test_architecture.py`` keeps Dask and fsspec out.
"""
