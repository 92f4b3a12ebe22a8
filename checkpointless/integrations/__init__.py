"""Integrations with the training frameworks people already use: ``transformers`` (``Trainer``), ``lightning``
(``CheckpointlessStrategy``)."""
