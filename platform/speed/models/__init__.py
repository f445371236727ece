"""The model families: each model file holds its whole model (forward, exits, its group pass and its engine
``Stepper``); ``family.py`` is the one seam the rest of the library asks about a family (config, presets, the
model class, its stepper, how a task's examples become its inputs); checkpoints and converters beside them."""
