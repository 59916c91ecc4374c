"""The benchmarks' shared harness (not a command): the run block, timers and JSON writer
(``bench_meta``), the broadcast methods ``bench_broadcast.py`` and ``bench_step.py`` compare
(``broadcast_methods``) and the end-to-end step strategies (``step_methods``)."""
