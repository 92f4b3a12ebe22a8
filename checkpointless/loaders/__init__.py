"""What ``session.loader`` and the integrations read: a dataset read as a function of the step.

``options.py`` holds ``LoaderOptions``, the loader's settings written once; ``from_dataloader.py``
reads them from a script's ``DataLoader`` and is the one factory of both loaders (``loader.py``'s
``StepLoader`` for a map-style dataset, ``iterable_loader.py``'s ``IterableStepLoader`` for a
stream). The recipes' corpus pipeline is ``checkpointless.corpus``, a layer above.
"""
