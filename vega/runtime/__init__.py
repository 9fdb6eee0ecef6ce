"""The runtime: the functional API and the ``torch.optim`` classes over compiled specs.

One concern a module: ``spec`` (``CompiledSpec``: init, step, the class, the sources) and
``engine`` (a step's programs, checks and kernels), ``optimizer`` (``SpecOptimizer``, the
machinery of ``vega.optim``'s classes), ``library`` (the shipped specs), ``tree`` (pytrees
and leaf names), ``loss_scale``, ``transforms`` (gradient transformations), ``io`` (state
files), ``lbfgs``, ``sharded`` (DTensor and process-group steps) and ``torch_names``
(torch.optim's names of hyperparameters and states). ``vega`` and ``vega.optim`` name
what is public.
"""
