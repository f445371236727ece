"""Decoding built on the engine: ``generate`` (one batch to completion), the logit recorder and comparisons of
exactness, the worked schedule (``python -m speed.decode.schedule``)."""
