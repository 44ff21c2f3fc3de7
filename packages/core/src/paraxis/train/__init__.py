"""Layer 6, ``paraxis train``: the training loop (``loop``), building the model
(``build``), the data it reads (``data``), the console summary (``summary``), the run's
lifecycle (locks, signals: ``lifecycle``) and starting the workers under torchrun
(``launcher``). Imports the engine and everything below it."""
