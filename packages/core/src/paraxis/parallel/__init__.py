"""Layer 3, the parallel contract: what an axis package implements and reads.

``strategy`` (a :class:`Strategy`, its phase, the :class:`ApplyContext` it reads and
writes, gradient synchronizers), ``hookspecs`` (the only coupling between packages),
``placement`` (how every parameter is laid out), ``model_plan`` (a model's tensor,
pipeline and expert plans as data), ``stages`` (pipeline stages that run the model's own
code), ``batch`` (one step's tokens and the auxiliary-loss channel), ``buckets``
(gradient buckets of the data axes), ``norms`` (the global gradient norm), ``recompute``
(activation checkpointing, core's own strategy), ``metric_names`` (the metric grammar),
``numerics`` (the derived fp32 tolerance). Imports only the runtime and config.
"""
