"""Reading a source: storage (fsspec), tokenizers, images and the document pipeline.

What a Source Loader runs on its worker, free of Dask: open a source's files,
read a unit's records (through :mod:`msd_dask.formats`), preprocess and
tokenize them.
"""
